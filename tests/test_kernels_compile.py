"""Every kernel file of ops, ragged and transducer compiles to PTX, on a machine without a GPU.

At run time the kernels are compiled by NVRTC on first launch (ops.cuda.launch), so a kernel that
does not compile fails only on a GPU. Here nvcc compiles each .cu file for the oldest and newest
targets the project supports, with the launch's options (-std=c++17, -I<the folder holding the
packages>), and instantiates the template kernels of the table below, as ops.cuda.launch names
them (the pack kernels for every activation of transducer/joiner.py's table): a wrapper includes the
file and takes the address of each instantiation.

Skipped without nvcc on PATH.
"""

import os
import shutil
import subprocess

import pytest

import ops
from transducer.joiner import ACTIVATIONS

# Kernel files and the instantiations compiled for each: edit this table with the kernels.
KERNELS = {
    "ops/gather.cu": [
        "gather_kernel<1, int>",
        "gather_kernel<2, long long>",
        "gather_kernel<4, int>",
        "gather_kernel<8, long long>",
        "gather_kernel<16, int>",
        "gather_kernel<16, long long>",
        "gather_big_kernel<1, long long>",
        "gather_big_kernel<16, int>",
    ],
    "ops/reduce.cu": [
        f"{kernel}<{op}, {t}>"
        for op in ("ops::kSum", "ops::kMax", "ops::kLogSumExp")
        for kernel, types in (
            ("reduce_rows", ("ops::half_t", "ops::bf16_t", "float", "double")),
            ("reduce_mid", ("ops::half_t", "ops::bf16_t", "float", "double")),
            ("reduce_finalize", ("float", "double")),
        )
        for t in types
    ],
    "ragged/ragged.cu": [
        f"{kernel}<{s}, {o}>"
        for kernel in (
            "row_splits_to_row_ids_binary_search",
            "row_splits_to_row_ids_merge_path",
            "row_ids_to_row_splits",
        )
        for s in ("int", "long long")
        for o in ("int", "long long")
    ],
    "transducer/cuda/stages.cu": [
        "layout_kernel<int, long long, int, true>",
        "layout_kernel<long long, int, long long, false>",
        "log_probs_kernel<ops::half_t, int, 8, 32, true>",
        "log_probs_kernel<ops::bf16_t, long long, 8, 256, false>",
        "log_probs_kernel<float, int, 4, 32, false>",
        "log_probs_kernel<double, long long, 1, 256, true>",
        "log_probs_kernel<ops::bf16_t, int, 8, 16, false>",
        "log_probs_kernel<float, long long, 4, 8, true>",
        "alpha_beta_kernel<float, false>",
        "alpha_beta_kernel<double, true>",
        "gradient_kernel<ops::half_t, int, 8, 32, false, false, false, true, false, false>",
        "gradient_kernel<ops::bf16_t, long long, 8, 256, true, true, true, false, true, false>",
        "gradient_kernel<float, int, 4, 32, false, true, true, false, true, true>",
        "gradient_kernel<double, int, 2, 256, true, false, false, true, false, false>",
        "gradient_kernel<ops::bf16_t, int, 8, 256, false, false, false, true, false, true>",
        "gradient_kernel<ops::bf16_t, int, 8, 16, false, false, true, false, false, true>",
        "gradient_kernel<float, long long, 4, 8, false, true, false, true, false, true>",
        "row_labels_kernel<int>",
        "row_labels_kernel<long long>",
        "row_log_probs_kernel<long long>",
        "row_coefficients_kernel<int, false>",
        "row_coefficients_kernel<long long, true>",
    ],
    "transducer/cuda/pack.cu": [  # and every activation: PACK_ACTIVATIONS
        "pack_forward_kernel<ops::half_t, ops::half_t, ops::half_t, ops::half_t, 8, 0, false>",
        "pack_forward_kernel<float, float, float, float, 1, 2, false>",
        "pack_forward_kernel<float, ops::bf16_t, float, ops::bf16_t, 8, 3, false>",
        "pack_forward_kernel<ops::bf16_t, ops::bf16_t, ops::bf16_t, ops::bf16_t, 1, 1, false>",
        "pack_forward_kernel<ops::half_t, ops::half_t, ops::half_t, ops::half_t, 2, 1, false>",
        "pack_grad_kernel<ops::bf16_t, ops::bf16_t, ops::bf16_t, ops::bf16_t, ops::bf16_t, 8, 0, false>",
        "pack_grad_kernel<float, float, float, float, float, 4, 2, false>",
        "pack_grad_kernel<ops::bf16_t, float, ops::bf16_t, float, float, 8, 3, false>",
        "pack_grad_kernel<ops::bf16_t, float, float, float, float, 8, 1, false>",
        "pack_grad_kernel<ops::bf16_t, ops::bf16_t, ops::bf16_t, ops::bf16_t, float, 8, 0, true>",
        "pack_grad_kernel<ops::half_t, float, float, float, float, 4, 2, true>",
        "pack_grad_kernel<ops::bf16_t, ops::bf16_t, ops::bf16_t, ops::bf16_t, float, 8, 6, false>",
        "pack_grad_pred_kernel<ops::bf16_t, ops::bf16_t, ops::bf16_t, ops::bf16_t, float, 8>",
        "pack_grad_enc_kernel<ops::bf16_t, ops::bf16_t, ops::bf16_t, ops::bf16_t, float, 8>",
        "pack_grad_enc_kernel<float, float, float, float, float, 4>",
        "pack_grad_enc_kernel<double, double, double, double, double, 2>",
        "pack_grad_pred_kernel<ops::bf16_t, ops::bf16_t, ops::bf16_t, ops::bf16_t, ops::bf16_t, 8>",
        "pack_grad_pred_kernel<float, float, float, float, float, 4>",
        "pack_grad_pred_kernel<double, double, double, double, double, 2>",
    ],
    "transducer/cuda/tdt.cu": [
        "tdt_log_probs_kernel<ops::bf16_t, long long, 8, 32, true, 8>",
        "tdt_log_probs_kernel<float, int, 1, 256, true, 4>",
        "tdt_log_probs_kernel<double, long long, 2, 32, false, 8>",
        "tdt_log_probs_kernel<ops::half_t, int, 8, 256, false, 4>",
        "tdt_log_probs_kernel<float, long long, 4, 32, false, 8>",
        "tdt_alpha_beta_kernel<float, false>",
        "tdt_alpha_beta_kernel<double, true>",
        "tdt_walk_kernel<float, 5, 2, false>",
        "tdt_walk_kernel<double, 1, 4, false>",
        "tdt_walk_kernel<float, 8, 3, true>",
        "tdt_walk_kernel<float, 5, 2, true>",
        "tdt_gradient_kernel<ops::half_t, int, 8, 32, false, false, true, false>",
        "tdt_gradient_kernel<ops::bf16_t, long long, 8, 256, true, true, false, true>",
        "tdt_gradient_kernel<float, long long, 4, 32, true, false, false, true>",
        "tdt_gradient_kernel<double, int, 1, 256, false, true, true, false>",
        "tdt_row_log_probs_kernel<int>",
        "tdt_row_log_probs_kernel<long long>",
        "tdt_row_coefficients_kernel<ops::bf16_t, int, false>",
        "tdt_row_coefficients_kernel<ops::half_t, long long, true>",
    ],
}

# The pack kernels for each activation of transducer/joiner.py's table, by its code (pack.cu's enum Activation, which
# tests/test_kernel_params.py checks against the table): a code without its case in activate or activation_slope
# does not compile. The types cover the packed 16-bit path (sm_80 and later), the fp32 path with tanh.approx
# (16-bit outputs), float64, and dropout.
PACK_ACTIVATIONS = [
    f"{kernel}<{types}, {code}, {dropout}>"
    for code in sorted(a.code for a in ACTIVATIONS.values())
    for kernel, types, dropout in (
        ("pack_forward_kernel", "ops::bf16_t, ops::bf16_t, ops::bf16_t, ops::bf16_t, 8", "true"),
        ("pack_forward_kernel", "float, float, float, ops::half_t, 4", "true"),
        ("pack_forward_kernel", "double, double, double, double, 2", "true"),
        ("pack_grad_kernel", "ops::half_t, ops::half_t, ops::half_t, ops::half_t, float, 8", "true"),
        ("pack_grad_kernel", "ops::bf16_t, ops::bf16_t, ops::bf16_t, ops::bf16_t, float, 2", "true"),
        ("pack_grad_kernel", "double, double, double, double, double, 1", "true"),
    )
]
KERNELS["transducer/cuda/pack.cu"] += PACK_ACTIVATIONS

# Files whose instantiations above write bfloat16 (ops::from_acc<ops::bf16_t>, ops/numeric.cuh): from
# compute_80 on it rounds with cvt.rn.bf16.f32; before, in integer arithmetic. No PTX for an
# older target may hold that instruction (the driver would refuse the module on such a GPU).
WRITES_BF16 = {"transducer/cuda/stages.cu", "transducer/cuda/pack.cu", "transducer/cuda/tdt.cu"}
ARCHS = ("compute_75", "compute_90")
BF16_CVT = "cvt.rn.bf16.f32"

ROOT = ops.cuda_include_dir()
NVCC = shutil.which("nvcc")

needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH (the CUDA toolkit compiles the kernels)")


def test_table_lists_every_kernel_file():
    found = {
        f"{pkg}/{name}"
        for pkg in ("ops", "ragged", "transducer/cuda")
        for name in os.listdir(os.path.join(ROOT, pkg))
        if name.endswith(".cu")
    }
    assert found == set(KERNELS)


@needs_nvcc
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("path", sorted(KERNELS))
def test_kernels_compile_to_ptx(path, arch, tmp_path):
    wrapper = tmp_path / "wrapper.cu"
    addresses = ",\n    ".join(f"(void*)&{name}" for name in KERNELS[path])
    wrapper.write_text(
        f'#include "{os.path.join(ROOT, path)}"\n\n'
        f"extern void* const kernel_compile_test_instantiations[] = {{\n    {addresses}}};\n"
    )
    ptx = tmp_path / "wrapper.ptx"
    cmd = [NVCC, "-std=c++17", "--ptx", f"-arch={arch}", f"-I{ROOT}", "-o", str(ptx), str(wrapper)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, f"{' '.join(cmd)}\nexit {res.returncode}\n{res.stderr}{res.stdout}"
    text = ptx.read_text()
    assert text.count(".entry ") == len(KERNELS[path]), "one PTX entry per instantiation"
    if int(arch.split("_")[1]) < 80:
        assert BF16_CVT not in text, f"{path}: {BF16_CVT} in PTX for {arch}"
    elif path in WRITES_BF16:
        assert BF16_CVT in text, f"{path}: no {BF16_CVT} in PTX for {arch}"
