"""benchmarks/: what the step benchmarks compute without a GPU. common.interleaved's rounds (each batch shared,
contenders in turn, the mean over batches of each one's minimum, a failing contender dropped with its reason),
fused_step.py's figures (against the floor, as bench.py's section F reads them) and its --changing-shapes figures,
on steps that report made-up times; the GEMM floor's rows padded as the fused loss pads its projection; the
integrations' step scripts' batches on the CPU; sharded_step.py under torchrun on gloo; every step script's --help."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import common  # noqa: E402
import espnet_step  # noqa: E402
import fused_step  # noqa: E402
import nemo_step  # noqa: E402
import speechbrain_step  # noqa: E402

from transducer.fused.tiles import projection  # noqa: E402

SCRIPTS = ["speechbrain_step.py", "espnet_step.py", "nemo_step.py", "fused_step.py"]


def made_up_call(fn):
    """common.cuda_call on a step that returns its own time: (that time, 1 MiB)."""
    return fn(), 1.0


@pytest.fixture
def no_gpu(monkeypatch):
    """common.cuda_call and torch.cuda.synchronize stood in for: steps return their made-up times."""
    monkeypatch.setattr(common, "cuda_call", made_up_call)
    monkeypatch.setattr(fused_step, "cuda_call", made_up_call)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)


def test_interleaved_keeps_the_mean_of_the_minima_in_rotating_rounds(no_gpu):
    # each step's times on each batch: the untimed warm-up, then the three rounds
    times = {
        "a": {0: [1, 5, 3, 4], 1: [1, 7, 9, 8]},
        "b": {0: [1, 6, 6, 2], 1: [1, 4, 4, 4]},
        "oom": {0: [1, 2, 2, 2], 1: [1, 2]},
        "raises": {0: []},
    }
    calls = []

    def steps(batch):
        queues = {name: iter(t.get(batch, [])) for name, t in times.items()}

        def step(name):
            calls.append((batch, name))
            ms = next(queues[name], None)
            if ms is None:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory") if name == "oom" else RuntimeError("no GPU")
            return ms

        return {name: (lambda name=name: step(name)) for name in times}

    out = common.interleaved(range(2), steps, rounds=3)
    assert list(out) == ["a", "b", "oom", "raises"]
    assert out["a"].ms == pytest.approx((3 + 7) / 2) and out["b"].ms == pytest.approx((2 + 4) / 2)
    assert out["a"].batches == out["b"].batches == 2 and out["a"].failed is None and out["a"].peak_mib == 1.0
    assert out["oom"] == (None, 1.0, 1, out["oom"].first_s, "out of memory")
    assert out["raises"].ms is None and out["raises"].failed == "failed: RuntimeError: no GPU"
    # batch 0: warm-ups, then rounds whose first contender rotates; "raises" failed at its warm-up
    assert calls[:13] == [
        (0, "a"),
        (0, "b"),
        (0, "oom"),
        (0, "raises"),
        (0, "a"),
        (0, "b"),
        (0, "oom"),
        (0, "b"),
        (0, "oom"),
        (0, "a"),
        (0, "oom"),
        (0, "a"),
        (0, "b"),
    ]
    # batch 1: "oom" fails in the first round and runs no more
    assert calls[13:] == [
        (1, "a"),
        (1, "b"),
        (1, "oom"),
        (1, "a"),
        (1, "b"),
        (1, "oom"),
        (1, "b"),
        (1, "oom"),
        (1, "a"),
        (1, "a"),
        (1, "b"),
    ]


@pytest.mark.parametrize("rows", [7, 500, 1000, 1024, 1850, 5000, 8193 + 5])
def test_floor_pads_rows_as_the_fused_projection(rows):
    Wx, _ = projection(torch.zeros(rows, 16), None, torch.float32)
    assert common.padded_rows(rows) == Wx.size(0)


def test_step_scripts_batches_on_the_cpu():
    rows = np.loadtxt(
        common.HERE / "data" / "librispeech_train_clean_100_TU.csv", delimiter=",", skiprows=1, dtype=np.int64
    )
    sb = list(speechbrain_step.batches(2, 8, device="cpu"))
    es = list(espnet_step.batches(2, 1000, 8, device="cpu"))
    for i, (s, e) in enumerate(zip(sb, es)):
        T, U = rows[i * 8 : (i + 1) * 8].T
        assert s.rows == e.rows == int((T * (U + 1)).sum())
        assert s.x.shape == (8, T.max(), speechbrain_step.JOINT) and s.h.shape == (8, U.max() + 1, 640)
        assert torch.equal(e.T, torch.tensor(T, dtype=torch.int32)) and e.dec.shape == (8, U.max() + 1, 512)
        assert int(e.y.min()) >= 1 and int(e.y.max()) < 1000
    enc, dec, T, y, U = next(nemo_step.batches(1, 1024, device="cpu"))
    assert enc.dtype == torch.bfloat16 and enc.shape == (16, 1024, 375) and dec.shape == (16, 640, 101)
    assert int(T.max()) == 375 and int(T.min()) >= 225 and int(U.max()) == 100 and int(U.min()) >= 60


def test_changing_shapes_figures(no_gpu, monkeypatch):
    """fused_step.py --changing-shapes: a step's first time on a batch is its new-shape time, the least of the
    repeats its repeated-shape time; the means leave out the first ``skip`` steps; each contender has batches of
    its own."""
    shapes = fused_step.batches("protocol-a", 12)
    index = {int(T.sum()): i for i, (T, _) in enumerate(shapes)}
    seen = {"ours fused": set(), "fails": set()}

    def contenders(case, prec, flash):
        def steps(batch):
            i = index[int(batch[0].sum())]
            j = i % 6  # the step's place in its contender's batches
            queues = {
                "ours fused": iter([100.0 if j == 0 else 10.0 + j, 9.0 + j, 8.0 + j, 8.5 + j]),
                "fails": iter([20.0, 10.0, 10.0, 10.0] if j < 4 else []),
            }

            def step(name):
                seen[name].add(i)
                ms = next(queues[name], None)
                if ms is None:
                    raise torch.cuda.OutOfMemoryError("CUDA out of memory")
                return ms

            return {name: (lambda name=name: step(name)) for name in queues}

        return steps

    monkeypatch.setattr(fused_step, "contenders", contenders)
    out = fused_step.run_changing_shapes("protocol-a", "bf16", 6, skip=2, repeats=3, time_limit=60, flash=None)
    ours = out["contenders"]["ours fused"]
    assert ours["first_ms"] == [100.0, 11.0, 12.0] and ours["steps"] == 6 and ours["failed"] is None
    assert ours["new_shape_ms"] == pytest.approx(10 + (2 + 3 + 4 + 5) / 4)
    assert ours["repeated_shape_ms"] == pytest.approx(8 + (2 + 3 + 4 + 5) / 4)
    assert ours["ratio"] == pytest.approx(13.5 / 11.5)
    fails = out["contenders"]["fails"]
    assert fails["steps"] == 4 and fails["failed"] == "out of memory" and fails["new_shape_ms"] == 20.0
    assert seen == {"ours fused": set(range(6)), "fails": set(range(6, 11))}
    stopped = fused_step.run_changing_shapes("protocol-a", "bf16", 6, skip=2, repeats=3, time_limit=0, flash=None)
    assert stopped["contenders"]["ours fused"]["steps"] == 0
    assert stopped["contenders"]["ours fused"]["new_shape_ms"] is None


def test_fused_step_case_figures_as_bench_reads_them(no_gpu, monkeypatch):
    """fused_step.py's figures for bench.py's section F: each contender's mean over the batches of its minimum
    against the floor timed in the same rounds; a contender that fails is left out of them, with its reason."""
    import bench

    def contenders(case, prec, flash):
        def steps(batch):
            return {"ours fused": lambda: 6.0, "Flash RNN-T": lambda: 1 / 0}

        return steps

    floors = iter([3.0, 2.0, 2.0, 2.0, 4.0, 4.0, 4.0, 4.0])
    monkeypatch.setattr(fused_step, "contenders", contenders)
    monkeypatch.setattr(fused_step, "floor_gemms", lambda N, J, rows, dtype: lambda: next(floors))
    monkeypatch.setattr(fused_step, "ROUNDS", 3)
    out = fused_step.run_case("protocol-a", "bf16", 2, profile=False, flash=None)
    shapes = fused_step.batches("protocol-a", 2)
    assert out["rows"] == sum(int((T * (U + 1)).sum()) for T, U in shapes) // 2
    assert out["contenders"] == {
        "floor (4 GEMMs)": dict(time_ms=3.0, peak_mb=1.0),
        "ours fused": dict(time_ms=6.0, peak_mb=1.0),
    }
    assert out["failed"] == {"Flash RNN-T": "failed: ZeroDivisionError: division by zero"}
    assert [r["vs"] for r in bench.rows_f(dict(cases=[out]))] == ["1.00x floor", "2.00x floor"]


def test_fused_step_host_calls_times_each_call_and_restores_them():
    """fused_step.py --calls on a CPU step of the fused loss: each call's count a step (one backward, the hidden packed
    in forward and again in backward, one tile) and inclusive time (the backward's within autograd's), and every
    function as it was afterwards."""
    import transducer.cpu.stages as cpu_stages
    import transducer.fused.op as op
    from transducer import fused_joiner_loss

    enc, pred = torch.randn(2, 5, 8, requires_grad=True), torch.randn(2, 3, 8, requires_grad=True)
    linear = torch.nn.Linear(8, 6)
    targets, T, U = torch.randint(0, 5, (2, 2)), torch.tensor([5, 3]), torch.tensor([2, 1])

    def step():
        fused_joiner_loss(enc, pred, linear.weight, linear.bias, targets, T, U, blank=5, reduction="sum").backward()

    before = (op._backward, op.fused.eager.__dict__["forward"], cpu_stages.pack_forward, torch.Tensor.backward)
    rows = {r["call"]: r for r in fused_step.host_calls("toy", "fp32", "cpu", step, count=3, synchronize=lambda: None)}
    assert (op._backward, op.fused.eager.__dict__["forward"], cpu_stages.pack_forward, torch.Tensor.backward) == before
    assert rows["fused.op._backward"]["calls_a_step"] == 1 and rows["torch.Tensor.backward"]["calls_a_step"] == 1
    assert rows["cpu.stages.pack_forward"]["calls_a_step"] == 2
    assert rows["cpu.stages.pack_backward_add"]["calls_a_step"] == 1
    assert rows["fused.op.fused.eager.backward"]["us_a_step"] <= rows["torch.Tensor.backward"]["us_a_step"]
    assert rows["fused.op._backward"]["us_a_step"] <= rows["fused.op.fused.eager.backward"]["us_a_step"]
    assert all(r["us_a_call"] > 0 for r in rows.values())


@pytest.mark.parametrize("mode, case", [("fsdp", "protocol-a"), ("ddp", "parakeet-tdt")])
def test_sharded_step_on_gloo(tmp_path, mode, case):
    """sharded_step.py under torchrun, 2 processes on the CPU (gloo, tiny sizes): its table and its figures, each
    contender timed, the ratios of those times, the rank's parameters a half under FSDP2 and whole under DDP."""
    out = tmp_path / "sharded.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(ROOT / "benchmarks" / "sharded_step.py"),
        "--mode",
        mode,
        "--case",
        case,
        "--device",
        "cpu",
        "--batches",
        "2",
        "--rounds",
        "2",
        "--json",
        str(out),
    ]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert figures["commit"] and figures["date"] and len(figures["results"]) == 1
    r = figures["results"][0]
    wrapped = {"fsdp": "FSDP2", "ddp": "DDP"}[mode]
    assert (r["case"], r["mode"], r["world"], r["backend"], r["precision"]) == (case, mode, 2, "gloo", "fp32")
    assert r["batches"] == 2 and r["rounds"] == 2 and r["rows"] == 6 * 4 + 4 * 3
    assert list(r["contenders"]) == ["one GPU", wrapped, "collectives"]
    times = {name: c["time_ms"] for name, c in r["contenders"].items()}
    assert all(t > 0 for t in times.values()) and all(c["peak_mb"] is None for c in r["contenders"].values())
    assert r["vs_one"] == pytest.approx(times[wrapped] / times["one GPU"])
    assert r["collective_share"] == pytest.approx(times["collectives"] / times[wrapped])
    rows = r["V"] + len(r["durations"] or [])
    one = (rows * r["J"] + rows) * 4 / 2**20
    assert r["contenders"]["one GPU"]["params_mb"] == pytest.approx(one)
    assert r["contenders"][wrapped]["params_mb"] == pytest.approx(one / 2 if mode == "fsdp" else one)
    lines = p.stdout.splitlines()
    assert lines[0].startswith(f"{case}, {wrapped} on 2 processes on the CPU (gloo), fp32")
    assert [line.split()[0] for line in lines[2:5]] == ["one", wrapped, "collectives"]
    assert lines[5].startswith(f"  {wrapped} step / one GPU's: {r['vs_one']:.2f}x; the collectives alone: ")


@pytest.mark.parametrize("script", SCRIPTS)
def test_help(script):
    p = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), "--help"], capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 0, p.stderr[-2000:]
    assert "--json" in p.stdout


def test_profile_groups_the_kernels_of_a_step():
    """fused_step.py --profile: each kernel of a step in the group of what it does (its name's first match in
    KERNEL_GROUPS, the row kernels before the log-probs and gradient stages whose names they contain), the groups'
    times and launches summed in KERNEL_GROUPS's order, the unmatched kernels last."""
    events = [
        ("kernel_cutlass_kernel_transducerhopperkernelsLogitsGemmPingpong_object_at__x", 120.0, 1),
        ("void pack_forward_kernel<ops::bf16_t, ops::bf16_t, ops::bf16_t, ops::bf16_t, 8, 1, false>(P)", 40.0, 1),
        ("void pack_grad_kernel<ops::bf16_t, ops::bf16_t>(P)", 75.0, 1),
        ("void pack_grad_pred_kernel<ops::bf16_t>(P)", 15.0, 1),
        ("void row_log_probs_kernel<long long>(RowLogProbsParams<long long>)", 5.0, 1),
        ("void tdt_row_coefficients_kernel<long long>(P)", 4.0, 1),
        (
            "void log_probs_kernel<ops::bf16_t, long long, 8, 1, false>(LogProbsParams<ops::bf16_t, long long>)",
            100.0,
            1,
        ),
        ("void gradient_kernel<ops::bf16_t, long long, 8, 1, false, false, false, false, false, false>(P)", 101.0, 1),
        ("void alpha_beta_kernel<float, false>(AlphaBetaParams<float>)", 259.0, 1),
        ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT", 107.0, 1),
        ("void cublasLt::splitKreduce_kernel<32, 16, int, float, float, float>(x)", 6.0, 1),
        ("Memset (Device)", 1.0, 1),
        ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>(x)", 3.0, 1),
        ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT", 93.0, 1),
    ]
    groups = fused_step.grouped_kernels(events)
    names = [g for g, _, _ in groups]
    assert names == [g for g, _ in fused_step.KERNEL_GROUPS] + [fused_step.OTHER_KERNELS]
    by = {g: (ms, n) for g, ms, n in groups}
    assert by[names[0]] == (0.120, 1)
    assert by[names[2]] == (pytest.approx(0.090), 2)  # pack's backward: both of its kernels
    assert by[names[3]] == (pytest.approx(0.009), 2)  # the row kernels, the TDT one too
    assert by[names[4]] == (pytest.approx(0.100), 1) and by[names[5]] == (pytest.approx(0.101), 1)
    assert by[names[7]] == (pytest.approx(0.206), 3)  # cuBLAS: both GEMMs and split-K's reduction
    assert by[fused_step.OTHER_KERNELS] == (pytest.approx(0.004), 2)
    assert fused_step.grouped_kernels(events[:1]) == [(names[0], 0.120, 1)]


def test_fused_step_gaps_sum_the_idle_time():
    """fused_step.py --gaps: the idle time after the marker, between events (an event inside another's span adds
    none), named by the events either side."""
    work = [(0, 5, "x"), (10, 12, "spin_kernel"), (20, 30, "a"), (22, 25, "b"), (31, 40, "c"), (50, 51, "d")]
    span, gaps, count = fused_step.step_gaps(work)
    assert span == 51 - 12 and count == 4
    assert gaps == [(8, "the step's call", "a"), (1, "a", "c"), (10, "c", "d")]
    with pytest.raises(RuntimeError, match="spin_kernel"):
        fused_step.step_gaps(work[:1])
