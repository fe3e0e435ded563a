"""The fused loss's logits GEMMs for Hopper (sm_90a), written in CuTe DSL: Z = H W^T + bias with one of two epilogues,

- statistics (forward): for each row r, a running max and sum of exp over the vocabulary tiles, and Z[r, blank] and
  Z[r, labels[r]] picked as their tiles pass, so that no tile of Z leaves the chip; with ``extra`` columns (TDT's
  duration scores past the softmax's columns, multi-blank's big blanks among them), their entries of (H W^T)[r]
  stored as their tile passes;
- gradient (backward): the tile of G = dL/dZ formed from each row's coefficients (transducer/cuda/stages.cu's
  gradient_kernel, elementwise the same) and written once in H's dtype, for cuBLAS's dH = G W and dW = G^T H:
  through shared-memory subtiles (stmatrix), each stored by TMA while the next is written, as CUTLASS's Hopper
  epilogue stores its output; the last subtile's store runs on into the next vocabulary tile's MMAs.

Imported by transducer.hopper only, when ``nvidia-cutlass-dsl`` is importable.

One CTA owns ``tile_m`` rows and walks every vocabulary tile of ``tile_n`` columns, as flash attention walks its key
tiles: the running statistics stay in registers and each row's results are written once. The main loop follows
CUTLASS's CuTe DSL Hopper GEMM (examples/python/CuTeDSL/cute/hopper/kernel/dense_gemm/dense_gemm.py): TMA loads of
H and W tiles into a ring of shared-memory stages (``PipelineTmaAsync``), issued by warp 0, a cluster along the rows
multicasting each W tile to its CTAs, WGMMA with the accumulators in registers, one MMA group in flight. The load
ring runs across the vocabulary tiles, so the next tile's loads overlap the epilogue of this one.

The epilogues read each accumulator with its (row, column) in the tile (an identity tensor partitioned like the
accumulators, the accumulators viewed as (rows, columns) as quack's ``layout_utils.make_acc_tensor_mn_view`` does);
the statistics' threads keep their own max and sum over the columns they hold, and the four threads holding a row
merge theirs once at the end. Columns past the softmax's get -inf from the column bias (``col_bias``: the bias, 0
without one, then -inf up to the padded width), so they add nothing to the sum, their gradient is 0, and the GEMM
needs no padded W (TMA fills the rows of W past its last with zeros).

``LogitsGemmPingpong`` runs the same epilogues on CUTLASS's ping-pong schedule (its sm90 warp-specialized ping-pong
GEMM; the warpgroup roles of examples/python/CuTeDSL/cute/hopper/kernel/dense_gemm/dense_gemm_persistent.py): a
producer warp issues the loads, two consumer warpgroups take turns, and one's epilogue runs while the other's MMAs
do. ``LogitsGemm`` stays for rows too wide for it (transducer.hopper.default_config picks). Both run one main loop
over a vocabulary tile (``LogitsGemm._mma_tile``) and the same epilogue functions (``_epilogue_tile``: the
statistics' ``_statistics_tile``, or the gradient's ``_gradient_tile`` then ``_store_gradient_tile``); their
arguments travel in small NamedTuples, as CUTLASS's Params do.
"""

import math
from typing import Any, NamedTuple

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.pipeline import pipeline_init_arrive, pipeline_init_wait

from .epilogue import ColumnFlags, RowTerms, token_gradient

LOG2E = math.log2(math.e)
# The running max starts here rather than at -inf: (max_old - max_new) * log2(e) stays finite (no inf - inf) while a
# thread has seen only masked columns, and no real logit is this small.
NO_MAX = -1.0e30
THREADS_PER_WARPGROUP = 128
# the gradient's tile leaves through shared memory in subtiles of (tile_m, G_SUBTILE_N) (CUTLASS's cooperative sm90
# epilogue tile), double-buffered so that one subtile's TMA store runs while the next is written
G_SUBTILE_N = 32
G_BUFFERS = 2
# the named barrier the epilogue's threads meet at between writing a subtile and storing it (0 is __syncthreads)
G_BARRIER = 1
# each row's values in registers: the statistics' running max and sum and picked logits; the gradient's den and
# coefficients (and extra columns' arcs), in the order of their (5 + E, N) array
ROW_MAX, ROW_SUM, PICK_BLANK, PICK_LABEL = range(4)
DEN, OCCUPANCY, BLANK_ARC, LABEL_ARC, SCALE, EXTRA_ARCS = range(6)


@cute.jit
def _select(condition, a, b):
    return a if condition else b


class CUTE_OPS:
    """epilogue.token_gradient's operations in the kernel: exp as exp2 of the scaled difference (the SFU's ex2,
    flushing denormals), a select, fmax and fmin."""

    @staticmethod
    def exp_minus(a, b):
        return cute.math.exp2(a * LOG2E - b * LOG2E, approx=True, ftz=True)

    where = staticmethod(_select)
    maximum = staticmethod(cute.arch.fmax)
    minimum = staticmethod(cute.arch.fmin)


class Epilogue(NamedTuple):
    """Which epilogue a kernel is compiled with: the gradient's (else the statistics), the gradient's clamp applied or
    not, and E extra columns (the statistics store their entries of H W^T; the gradient subtracts a term of each row
    on them)."""

    gradient: bool = False
    clamp: bool = False
    extra: int = 0


STATISTICS = Epilogue()  # the constructors' default epilogue


class Arguments(NamedTuple):
    """__call__'s arguments but the stream, as its docstring says."""

    h: Any
    w: Any
    col_bias: Any
    labels: Any
    row_values: Any
    g: Any
    n_rows: Any
    n_cols: Any
    h_stride: Any
    row_values_stride: Any
    g_stride: Any
    blank: Any
    clamp: Any
    extra_start: Any


class Operands(NamedTuple):
    """The GEMM's operands in the kernel: the TMA atoms of H and W and the tensors they load from."""

    tma_h: Any
    mH: Any
    tma_w: Any
    mW: Any


class EpilogueArguments(NamedTuple):
    """What the epilogues read and write in the kernel: the column bias, the labels, the rows' values (statistics
    written, or gradient coefficients read), G's TMA atom and tensor, and the blank, the clamp and the first extra
    column."""

    col_bias: Any
    labels: Any
    row_values: Any
    tma_g: Any
    mG: Any
    blank: Any
    clamp: Any
    extra_start: Any


class Layouts(NamedTuple):
    """The kernel's tiled MMA and the shared-memory layouts of H's, W's and G's tiles."""

    tiled_mma: Any
    h_smem: Any
    w_smem: Any
    g_smem: Any


class ThreadTile(NamedTuple):
    """A thread's part of a tile and its rows' registers: the accumulators and each one's (row, column) in the tile,
    both viewed as (rows, columns) of this thread (LogitsGemm._accumulators), each row's values (the statistics or
    the gradient's coefficients, LogitsGemm._init_rows) and its label."""

    acc_rc: Any
    coords_rc: Any
    values: Any
    label: Any


class GradientStore(NamedTuple):
    """The gradient's way out of a thread's accumulators (LogitsGemm._g_copy's tiled copy, its shared memory, the
    accumulators retiled, a subtile's registers), the subtile buffers, G's TMA atom and tensor, and the TMA stores'
    pipeline."""

    copy: Any
    copy_smem: Any
    copy_acc: Any
    copy_regs: Any
    sG: Any
    tma_g: Any
    mG: Any
    stores: Any


class StoreGroup(NamedTuple):
    """The threads holding a tile of G: whether this thread's warp issues the TMA stores, their first subtile
    buffer, their named barrier and their count."""

    storing: Any
    first_buffer: Any
    barrier_id: Any
    threads: Any


class TmaLoads(NamedTuple):
    """LogitsGemm's loads: their pipeline, the TMA atoms of H and W with their partitions of global and shared
    memory, W's multicast mask and the k tiles a vocabulary tile."""

    pipeline: Any
    tma_h: Any
    tHgH: Any
    tHsH: Any
    tma_w: Any
    tWgW: Any
    tWsW: Any
    mcast_mask: Any
    k_tiles: Any
    total: Any
    warp_idx: Any


class Mma(NamedTuple):
    """A warpgroup's MMAs of a tile: the tiled MMA, the accumulators, the fragments of H's and W's stages, the loads'
    pipeline and the k tiles a vocabulary tile."""

    tiled_mma: Any
    acc: Any
    tCrH: Any
    tCrW: Any
    loads: Any
    k_tiles: Any


class Stages(NamedTuple):
    """The load pipeline's states: the stage read next, the stage released next, and (LogitsGemm, whose warp 0 also
    loads) the stage loaded next; None where a producer warp loads."""

    read: Any
    release: Any
    produced: Any = None


class LogitsGemm:
    """The kernel for one configuration: rows of J entries, ``warpgroups`` consumer warpgroups of 64 rows each
    (tile_m = 64 * warpgroups), vocabulary tiles of ``tile_n`` columns, ``n_tiles`` of them, clusters of ``cluster_m``
    CTAs along the rows (W's tiles multicast among them), ``occupancy`` CTAs per SM sizing the shared-memory stages,
    and the ``epilogue`` (its extra columns from ``extra_start`` on)."""

    def __init__(
        self,
        J: int,
        n_tiles: int,
        tile_n: int = 256,
        warpgroups: int = 2,
        cluster_m: int = 1,
        occupancy: int = 1,
        epilogue: Epilogue = STATISTICS,
    ):
        if tile_n not in (64, 128, 256):
            raise ValueError(f"tile_n: expected 64, 128 or 256, got {tile_n}")
        if warpgroups not in (1, 2):
            raise ValueError(f"warpgroups: expected 1 or 2, got {warpgroups}")
        if cluster_m not in (1, 2):
            raise ValueError(f"cluster_m: expected 1 or 2, got {cluster_m}")
        self.J = J
        self.n_tiles = n_tiles
        self.tile_n = tile_n
        self.warpgroups = warpgroups
        self.tile_m = 64 * warpgroups
        self.cluster_m = cluster_m
        self.occupancy = occupancy
        self.gradient, self.clamp, self.extra = epilogue
        self.threads = THREADS_PER_WARPGROUP * warpgroups
        self.acc_dtype = cutlass.Float32
        self.g_buffers = G_BUFFERS
        self.resident = False  # H's tiles stream through the load stages

    def _setup_mma(self, h: cute.Tensor, w: cute.Tensor, warpgroups: int):
        """The operands' dtype and layouts, the tiled MMA of ``warpgroups`` warpgroups along the rows, and the tile
        (tile_m, tile_n, tile_k) of a k step."""
        self.ab_dtype = h.element_type
        self.h_layout = utils.LayoutEnum.from_tensor(h)
        self.w_layout = utils.LayoutEnum.from_tensor(w)
        self.tiled_mma = sm90_utils.make_trivial_tiled_mma(
            self.ab_dtype,
            self.ab_dtype,
            self.h_layout.sm90_mma_major_mode(),
            self.w_layout.sm90_mma_major_mode(),
            self.acc_dtype,
            (warpgroups, 1, 1),
            tiler_mn=(64, self.tile_n),
        )
        tile_k = cute.size(self.tiled_mma.shape_mnk, mode=[2]) * 4  # 64 bf16: one 128-byte swizzle row
        self.tile_mnk = (self.tile_m, self.tile_n, tile_k)

    def _setup(self, h: cute.Tensor, w: cute.Tensor, g: cute.Tensor):
        """The tiled MMA, the number of load stages and the shared-memory layouts."""
        self._setup_mma(h, w, self.warpgroups)
        tile_k = self.tile_mnk[2]
        stage_bytes = (self.tile_m + self.tile_n) * tile_k * self.ab_dtype.width // 8
        capacity = utils.get_smem_capacity_in_bytes("sm_90") // self.occupancy - 1024  # 1024: the barriers
        self.g_subtile = (self.tile_m, min(G_SUBTILE_N, self.tile_n))
        if (self.tile_n // self.g_subtile[1]) % G_BUFFERS:  # _store_gradient_tile's buffers alternate across tiles
            raise ValueError(f"tile_n: expected a multiple of {G_BUFFERS * self.g_subtile[1]}, got {self.tile_n}")
        self.g_smem_layout = sm90_utils.make_smem_layout_epi(
            self.ab_dtype, utils.LayoutEnum.from_tensor(g), self.g_subtile, G_BUFFERS
        )
        if self.gradient:
            capacity -= cute.cosize(self.g_smem_layout) * self.ab_dtype.width // 8
        # Two CTAs a SM (V <= 1024: 128 x 128 tiles) fill sm_90's shared memory to the byte with three stages and the
        # gradient's two subtile buffers: anything more would leave one CTA a SM.
        self.stages = min(8, capacity // stage_bytes)
        self.h_smem_layout = sm90_utils.make_smem_layout_a(self.h_layout, self.tile_mnk, self.ab_dtype, self.stages)
        self.w_smem_layout = sm90_utils.make_smem_layout_b(self.w_layout, self.tile_mnk, self.ab_dtype, self.stages)

    @cute.jit
    def __call__(
        self,
        h_ptr: cute.Pointer,
        w_ptr: cute.Pointer,
        col_bias_ptr: cute.Pointer,
        labels_ptr: cute.Pointer,
        row_values_ptr: cute.Pointer,
        g_ptr: cute.Pointer,
        n_rows: cutlass.Int32,
        n_cols: cutlass.Int32,
        h_stride: cutlass.Int64,
        row_values_stride: cutlass.Int64,
        g_stride: cutlass.Int64,
        blank: cutlass.Int32,
        clamp: cutlass.Float32,
        extra_start: cutlass.Int32,
        stream: cuda.CUstream,
    ):
        """The tensors from their pointers (pointers and sizes cost the host less to pass than tensors): h (n_rows,
        J) of row stride ``h_stride`` (a multiple of 8) and w (n_cols, J), both K-major; col_bias (n_tiles *
        tile_n,) fp32; labels (n_rows,) int32; row_values (3 + extra, n_rows) fp32: the statistics den, z_blank,
        z_label and (H W^T)[r, extra_start + i] for i < extra (written), or (5 + extra, n_rows): the gradient's den,
        occupancy, blank arc, label arc and scale of each row and the arc subtracted on column extra_start + i
        (read);
        g (n_rows rounded up to whole row tiles, n_tiles * tile_n) of h's dtype, row stride ``g_stride`` (a
        multiple of 8): the gradient (written; the statistics never touch it)."""
        # TVM FFI's calling convention passes each pointer and number as an argument of its own: this one boundary is
        # flat, its arguments gathered into Arguments once
        args = Arguments(
            h_ptr,
            w_ptr,
            col_bias_ptr,
            labels_ptr,
            row_values_ptr,
            g_ptr,
            n_rows,
            n_cols,
            h_stride,
            row_values_stride,
            g_stride,
            blank,
            clamp,
            extra_start,
        )
        h, w, col_bias, labels, row_values, g = self._tensors(args)
        self._setup(h, w, g)
        tma_h, tma_h_tensor = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(),
            h,
            cute.slice_(self.h_smem_layout, (None, None, 0)),
            (self.tile_m, self.tile_mnk[2]),
        )
        w_op = (
            cute.nvgpu.cpasync.CopyBulkTensorTileG2SMulticastOp()
            if self.cluster_m > 1
            else cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp()
        )
        tma_w, tma_w_tensor = cute.nvgpu.cpasync.make_tiled_tma_atom(
            w_op,
            w,
            cute.slice_(self.w_smem_layout, (None, None, 0)),
            (self.tile_n, self.tile_mnk[2]),
            num_multicast=self.cluster_m,
        )

        # the gradient's subtiles are stored by TMA from shared memory (the statistics never store G: their atom is
        # built and left unused, so that both epilogues take the same arguments)
        tma_g, tma_g_tensor = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileS2GOp(),
            g,
            cute.slice_(self.g_smem_layout, (None, None, 0)),
            self.g_subtile,
        )
        self.shared_storage = self._shared_storage()
        self.kernel(
            Operands(tma_h, tma_h_tensor, tma_w, tma_w_tensor),
            EpilogueArguments(col_bias, labels, row_values, tma_g, tma_g_tensor, blank, clamp, extra_start),
            Layouts(self.tiled_mma, self.h_smem_layout, self.w_smem_layout, self.g_smem_layout),
        ).launch(
            grid=[self._ctas(h.shape[0]), 1, 1],
            block=[self.threads, 1, 1],
            cluster=[self.cluster_m, 1, 1],
            stream=stream,
        )

    def _shared_storage(self):
        """The kernel's shared memory: the load ring's barriers, then the fields _storage_fields adds, then the tiles
        of H, W and G (8 elements where the statistics never use it), each 1024-byte aligned (TMA's swizzle)."""
        g_elements = cute.cosize(self.g_smem_layout) if self.gradient else 8
        fields = {
            "barriers": cute.struct.MemRange[cutlass.Int64, self.stages * 2],
            **self._storage_fields(),
            "sH": cute.struct.Align[cute.struct.MemRange[self.ab_dtype, cute.cosize(self.h_smem_layout)], 1024],
            "sW": cute.struct.Align[cute.struct.MemRange[self.ab_dtype, cute.cosize(self.w_smem_layout)], 1024],
            "sG": cute.struct.Align[cute.struct.MemRange[self.ab_dtype, g_elements], 1024],
        }
        return cute.struct(type("SharedStorage", (), {"__annotations__": fields}))

    def _storage_fields(self):
        """The shared memory's fields between the barriers and the tiles: none."""
        return {}

    def _ctas(self, n_rows):
        """The grid: a CTA per row tile, in whole clusters."""
        m_blocks = (n_rows + self.tile_m - 1) // self.tile_m
        clusters = (m_blocks + self.cluster_m - 1) // self.cluster_m
        return clusters * self.cluster_m

    def _tensors(self, args: Arguments):
        """(h, w, col_bias, labels, row_values, g): the tensors of __call__'s pointers, as its docstring says."""
        J, width = self.J, self.n_tiles * self.tile_n
        n_rows, h_stride, g_stride = args.n_rows, args.h_stride, args.g_stride
        h = cute.make_tensor(args.h, cute.make_layout((n_rows, J), stride=(cute.assume(h_stride, divby=8), 1)))
        w = cute.make_tensor(args.w, cute.make_layout((args.n_cols, J), stride=(J, 1)))
        col_bias = cute.make_tensor(args.col_bias, cute.make_layout(width))
        labels = cute.make_tensor(args.labels, cute.make_layout(n_rows))
        row_values = cute.make_tensor(
            args.row_values,
            cute.make_layout(((5 if self.gradient else 3) + self.extra, n_rows), stride=(args.row_values_stride, 1)),
        )
        if self.gradient:
            g_rows = (n_rows + self.tile_m - 1) // self.tile_m * self.tile_m
            g = cute.make_tensor(args.g, cute.make_layout((g_rows, width), stride=(cute.assume(g_stride, divby=8), 1)))
        else:  # never written: one tile, so that the store's TMA descriptor describes memory of a plausible shape
            g = cute.make_tensor(args.g, cute.make_layout((self.tile_m, self.tile_n), stride=(self.tile_n, 1)))
        return h, w, col_bias, labels, row_values, g

    @cute.kernel
    def kernel(self, operands: Operands, epilogue: EpilogueArguments, layouts: Layouts):
        tidx, bidx, warp_idx, storage, sH, sW = self._start(operands, layouts)
        tma_h, mH, tma_w, mW = operands
        row_values, tma_g, mG = epilogue.row_values, epilogue.tma_g, epilogue.mG
        tiled_mma, h_smem_layout, w_smem_layout, g_smem_layout = layouts
        n_rows = mH.shape[0]
        m_block = bidx
        rank_in_cluster = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())

        stage_bytes = cute.size_in_bytes(
            self.ab_dtype, cute.slice_(h_smem_layout, (None, None, 0))
        ) + cute.size_in_bytes(self.ab_dtype, cute.slice_(w_smem_layout, (None, None, 0)))
        # a stage is free once every warp of every CTA that W's multicast writes into has released it
        consumers = pipeline.CooperativeGroup(pipeline.Agent.Thread, self.cluster_m * self.threads // 32)
        loads = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.barriers.data_ptr(),
            num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=consumers,
            tx_count=stage_bytes,
            cta_layout_vmnk=cute.make_layout((1, self.cluster_m, 1, 1)),
            defer_sync=True,
        )
        pipeline_init_arrive(cluster_shape_mn=(self.cluster_m, 1), is_relaxed=True)

        # (tile_m, tile_k, k_tiles) of H; (tile_n, tile_k, n_tiles, k_tiles) of W
        gH = cute.local_tile(mH, (self.tile_m, self.tile_mnk[2]), (m_block, None))
        gW = cute.local_tile(mW, (self.tile_n, self.tile_mnk[2]), (None, None))
        tHsH, tHgH = cute.nvgpu.cpasync.tma_partition(
            tma_h, 0, cute.make_layout(1), cute.group_modes(sH, 0, 2), cute.group_modes(gH, 0, 2)
        )
        tWsW, tWgW = cute.nvgpu.cpasync.tma_partition(
            tma_w,
            rank_in_cluster,
            cute.make_layout(self.cluster_m),
            cute.group_modes(sW, 0, 2),
            cute.group_modes(gW, 0, 2),
        )
        w_mcast_mask = 0
        if cutlass.const_expr(self.cluster_m > 1):
            w_mcast_mask = cutlass.Int16((1 << self.cluster_m) - 1)  # every CTA of the cluster

        # the MMA's operands are sliced per warpgroup, its accumulators per thread
        warpgroup = cute.arch.make_warp_uniform(tidx // THREADS_PER_WARPGROUP)
        wg_mma = tiled_mma.get_slice(warpgroup * THREADS_PER_WARPGROUP)
        tCrH = tiled_mma.make_fragment_A(wg_mma.partition_A(sH))
        tCrW = tiled_mma.make_fragment_B(wg_mma.partition_B(sW))
        # the accumulators and each one's (row, column) in the tile, viewed as (rows, columns) of this thread
        acc, acc_rc, coords_rc = self._accumulators(tiled_mma, tidx)
        rows = cute.size(acc_rc, mode=[0])

        # the gradient's way out (_g_copy), then TMA stores from a pipeline of G_BUFFERS subtile buffers kept across
        # the tiles
        if cutlass.const_expr(self.gradient):
            sG = storage.sG.get_tensor(g_smem_layout.outer, swizzle=g_smem_layout.inner)
            g_stores = pipeline.PipelineTmaStore.create(
                num_stages=G_BUFFERS, producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.threads)
            )
            g_store = GradientStore(*self._g_copy(tiled_mma, tidx, sG, acc), sG, tma_g, mG, g_stores)

        # each of the thread's rows' values and label in registers (_init_rows)
        values = cute.make_rmem_tensor((self._row_value_count(), rows), cutlass.Float32)
        label = cute.make_rmem_tensor((rows,), cutlass.Int32)
        tile = ThreadTile(acc_rc, coords_rc, values, label)
        self._init_rows(tile, epilogue, m_block, n_rows)

        k_tiles = cute.size(gH, mode=[2])
        total = self.n_tiles * k_tiles
        tma_loads = TmaLoads(loads, tma_h, tHgH, tHsH, tma_w, tWgW, tWsW, w_mcast_mask, k_tiles, total, warp_idx)
        produced = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        pipeline_init_wait(cluster_shape_mn=(self.cluster_m, 1))

        if warp_idx == 0:
            for _ in cutlass.range(cutlass.min(self.stages, total), unroll=1):
                self._load(tma_loads, produced)
                produced.advance()

        tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
        mma = Mma(tiled_mma, acc, tCrH, tCrW, loads, k_tiles)
        for n_tile in cutlass.range(self.n_tiles, unroll=1):
            read, release, produced = self._mma_tile(mma, Stages(read, release, produced), tma_loads)
            cute.nvgpu.warpgroup.wait_group(0)
            loads.consumer_release(release)
            release.advance()
            produced = self._load_next(tma_loads, produced)

            self._epilogue_tile(tile, epilogue, m_block, n_rows, n_tile)
            if cutlass.const_expr(self.gradient):
                self._store_gradient_tile(
                    g_store, StoreGroup(warp_idx == 0, 0, G_BARRIER, self.threads), m_block, n_tile
                )

        if cutlass.const_expr(not self.gradient):
            self._merge_quad_statistics(values)
            self._write_statistics(tile, row_values, m_block, n_rows)
        else:
            if warp_idx == 0:
                g_stores.producer_tail()  # the last subtiles' stores are done before the CTA leaves

        # a CTA of a cluster leaves only once its peers no longer multicast into its shared memory
        if cutlass.const_expr(self.cluster_m > 1):
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()

    @cute.jit
    def _start(self, operands: Operands, layouts: Layouts):
        """Both kernels' start: the TMA descriptors prefetched by warp 0; (the thread's, the block's and the warp's
        index, the shared storage, its tiles of H and W)."""
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            cute.nvgpu.cpasync.prefetch_descriptor(operands.tma_h)
            cute.nvgpu.cpasync.prefetch_descriptor(operands.tma_w)
        storage = utils.SmemAllocator().allocate(self.shared_storage)
        sH = storage.sH.get_tensor(layouts.h_smem.outer, swizzle=layouts.h_smem.inner)
        sW = storage.sW.get_tensor(layouts.w_smem.outer, swizzle=layouts.w_smem.inner)
        return tidx, bidx, warp_idx, storage, sH, sW

    @cute.jit
    def _mma_tile(self, mma: Mma, stages: Stages, refill=None):
        """The main loop of both kernels over one vocabulary tile: the MMAs into mma.acc, k tile after k tile, each
        from its stage once the stage's loads have landed, one MMA group in flight; each stage but the last released
        once its MMAs are done (the last is the caller's, after warpgroup.wait_group(0)), and then with ``refill``
        (LogitsGemm's TmaLoads: its warp 0 loads as well) the next load issued (_load_next). H's k tile is the
        stage's, or with a resident H its k_tile'th. Returns the Stages past the tile."""
        tiled_mma, acc, tCrH, tCrW, loads, k_tiles = mma
        read, release, produced = stages
        k_blocks = cute.size(tCrH, mode=[2])
        acc.fill(0.0)
        for k_tile in cutlass.range(k_tiles, unroll=1):
            loads.consumer_wait(read)
            cute.nvgpu.warpgroup.fence()
            h_index = read.index
            if cutlass.const_expr(self.resident):
                h_index = k_tile
            for k_block in cutlass.range_constexpr(k_blocks):
                cute.gemm(
                    tiled_mma, acc, tCrH[(None, None, k_block, h_index)], tCrW[(None, None, k_block, read.index)], acc
                )
            cute.nvgpu.warpgroup.commit_group()
            cute.nvgpu.warpgroup.wait_group(1)  # the previous k tile's MMAs are done: its stage is free
            if k_tile > 0:
                loads.consumer_release(release)
                release.advance()
                if cutlass.const_expr(refill is not None):
                    produced = self._load_next(refill, produced)
            read.advance()
        return Stages(read, release, produced)

    @cute.jit
    def _load_next(self, tma_loads: TmaLoads, produced: pipeline.PipelineState):
        """Warp 0: the next load (_load) while any is left; returns the producer's state past it."""
        if tma_loads.warp_idx == 0 and produced.count < tma_loads.total:
            self._load(tma_loads, produced)
            produced.advance()
        return produced

    def _accumulators(self, tiled_mma: cute.TiledMma, tidx):
        """The thread's accumulators of a tile, and they and each one's (row, column) in the tile viewed as (rows,
        columns) of this thread: (acc, acc_rc, coords_rc)."""
        thread_mma = tiled_mma.get_slice(tidx)
        tCcC = thread_mma.partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n)))
        acc = cute.make_rmem_tensor(tCcC.shape, self.acc_dtype)
        return (
            acc,
            cute.make_tensor(acc.iterator, _rows_by_columns(acc.layout)),
            cute.make_tensor(tCcC.iterator, _rows_by_columns(tCcC.layout)),
        )

    def _g_copy(self, tiled_mma: cute.TiledMma, tidx, sG: cute.Tensor, acc: cute.Tensor):
        """The gradient's way out of a thread's accumulators: registers of G's dtype, then shared memory by stmatrix
        (CUTLASS's Hopper dense_gemm epilogue); (the tiled copy, its shared memory, the accumulators retiled, the
        layout of a subtile's registers)."""
        g_copy = cute.make_tiled_copy_S(
            sm90_utils.sm90_get_smem_store_op(
                utils.LayoutEnum.ROW_MAJOR, elem_ty_d=self.ab_dtype, elem_ty_acc=self.acc_dtype
            ),
            cute.make_tiled_copy_C_atom(
                cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(False, 4), self.ab_dtype), tiled_mma
            ),
        )
        thread_g_copy = g_copy.get_slice(tidx)
        return (
            g_copy,
            thread_g_copy.partition_D(sG),
            g_copy.retile(acc),
            cute.make_layout(cute.shape(thread_g_copy.partition_S(sG))[:3]),
        )

    def _row_value_count(self):
        """The values a row keeps in registers: the statistics' running max and sum and two picks; the gradient's
        coefficients and its extra columns' arcs."""
        return EXTRA_ARCS + self.extra if self.gradient else 4

    @cute.jit
    def _init_rows(self, tile: ThreadTile, epilogue: EpilogueArguments, m_block: cutlass.Int32, n_rows: cutlass.Int32):
        """Each of the thread's rows' values before the tiles: the statistics' running max, sum and picks start
        empty; the gradient's coefficients are read once (rows past N: den = +inf and the rest 0, so that their
        gradient is 0); and its label (-1 past N)."""
        _, coords_rc, values, label = tile
        row_values, labels = epilogue.row_values, epilogue.labels
        rows = cute.size(coords_rc, mode=[0])
        n_values = cute.size(values, mode=[0])
        for r in cutlass.range_constexpr(rows):
            row = m_block * self.tile_m + coords_rc[r, 0][0]
            label[r] = -1
            if cutlass.const_expr(self.gradient):
                values[0, r] = float("inf")
                for i in cutlass.range_constexpr(1, n_values):
                    values[i, r] = 0.0
                if row < n_rows:
                    for i in cutlass.range_constexpr(n_values):
                        values[i, r] = row_values[i, row]
            else:
                values[ROW_MAX, r] = NO_MAX
                for i in cutlass.range_constexpr(1, n_values):
                    values[i, r] = 0.0
            if row < n_rows:
                label[r] = labels[row]

    @cute.jit
    def _epilogue_tile(
        self,
        tile: ThreadTile,
        epilogue: EpilogueArguments,
        m_block: cutlass.Int32,
        n_rows: cutlass.Int32,
        n_tile: cutlass.Int32,
    ):
        """The epilogue of vocabulary tile ``n_tile`` in the accumulators: the statistics first store the extra
        columns' raw entries (the bias added next is -inf past the softmax's columns), then the bias is added, then
        the statistics or the gradient are formed (the gradient in the accumulators; _store_gradient_tile stores it).
        The loops over the accumulators are unrolled at trace time, so that every register index is a constant (a
        run-time index would move the accumulators to local memory)."""
        acc_rc, coords_rc = tile.acc_rc, tile.coords_rc
        col_bias, extra_start = epilogue.col_bias, epilogue.extra_start
        rows = cute.size(acc_rc, mode=[0])
        cols = cute.size(acc_rc, mode=[1])
        first_col = n_tile * self.tile_n
        if cutlass.const_expr(self.extra > 0 and not self.gradient):
            if first_col + self.tile_n > extra_start and first_col < extra_start + self.extra:
                self._store_extra(tile, epilogue.row_values, m_block, n_rows, extra_start - first_col)
        for c in cutlass.range_constexpr(cols):
            b = col_bias[first_col + coords_rc[0, c][1]]
            for r in cutlass.range_constexpr(rows):
                acc_rc[r, c] = acc_rc[r, c] + b
        if cutlass.const_expr(self.gradient):
            self._gradient_tile(tile, epilogue.blank, epilogue.clamp, first_col, extra_start)
        else:
            self._statistics_tile(tile, epilogue.blank, first_col)

    @cute.jit
    def _statistics_tile(self, tile: ThreadTile, blank: cutlass.Int32, first_col: cutlass.Int32):
        """The running max and sum of each row over one more vocabulary tile, and the blank and label logits if
        they lie in it."""
        acc_rc, coords_rc, values, label = tile
        rows = cute.size(acc_rc, mode=[0])
        cols = cute.size(acc_rc, mode=[1])
        for r in cutlass.range_constexpr(rows):
            tile_max = acc_rc[r, 0]
            for c in cutlass.range_constexpr(1, cols):
                tile_max = cute.arch.fmax(tile_max, acc_rc[r, c])
            new_max = cute.arch.fmax(values[ROW_MAX, r], tile_max)
            scaled_max = new_max * LOG2E
            tile_sum = cutlass.Float32(0.0)
            for c in cutlass.range_constexpr(cols):
                tile_sum += cute.math.exp2(acc_rc[r, c] * LOG2E - scaled_max, approx=True, ftz=True)
            # the difference of the maxima first: as old * LOG2E - scaled_max, ptxas's multiply-add leaves the
            # rounding residual of NO_MAX * LOG2E (+6.4e21: an infinite rescale of an empty sum, NaN) while a
            # thread's tiles so far hold none of its softmax columns
            rescale = cute.math.exp2((values[ROW_MAX, r] - new_max) * LOG2E, approx=True, ftz=True)
            values[ROW_SUM, r] = values[ROW_SUM, r] * rescale + tile_sum
            values[ROW_MAX, r] = new_max
            label_at = label[r] - first_col
            blank_at = blank - first_col
            for c in cutlass.range_constexpr(cols):
                col = coords_rc[r, c][1]
                values[PICK_LABEL, r] = acc_rc[r, c] if col == label_at else values[PICK_LABEL, r]
                values[PICK_BLANK, r] = acc_rc[r, c] if col == blank_at else values[PICK_BLANK, r]

    @cute.jit
    def _store_extra(
        self,
        tile: ThreadTile,
        row_values: cute.Tensor,
        m_block: cutlass.Int32,
        n_rows: cutlass.Int32,
        extra_at: cutlass.Int32,
    ):
        """The entries of the extra columns in this tile (from its column ``extra_at`` on) into row_values[3 + i],
        each by the one thread holding it (the caller runs it on the tiles holding any)."""
        acc_rc, coords_rc = tile.acc_rc, tile.coords_rc
        rows = cute.size(acc_rc, mode=[0])
        cols = cute.size(acc_rc, mode=[1])
        for r in cutlass.range_constexpr(rows):
            row = m_block * self.tile_m + coords_rc[r, 0][0]
            for c in cutlass.range_constexpr(cols):
                i = coords_rc[r, c][1] - extra_at
                if i >= 0 and i < self.extra and row < n_rows:
                    row_values[3 + i, row] = acc_rc[r, c]

    @cute.jit
    def _merge_quad_statistics(self, values: cute.Tensor):
        """The four threads of a quad hold a row's columns between them: each ends with the row's max, sum and
        picks over the quad's columns."""
        rows = cute.size(values, mode=[1])
        for r in cutlass.range_constexpr(rows):
            quad_max = values[ROW_MAX, r]
            for offset in cutlass.range_constexpr(2):
                quad_max = cute.arch.fmax(quad_max, cute.arch.shuffle_sync_bfly(quad_max, offset=1 << offset))
            total_sum = values[ROW_SUM, r] * cute.math.exp2(
                (values[ROW_MAX, r] - quad_max) * LOG2E, approx=True, ftz=True
            )
            z_b = values[PICK_BLANK, r]
            z_l = values[PICK_LABEL, r]
            for offset in cutlass.range_constexpr(2):
                total_sum += cute.arch.shuffle_sync_bfly(total_sum, offset=1 << offset)
                z_b += cute.arch.shuffle_sync_bfly(z_b, offset=1 << offset)
                z_l += cute.arch.shuffle_sync_bfly(z_l, offset=1 << offset)
            values[ROW_MAX, r] = quad_max
            values[ROW_SUM, r] = total_sum
            values[PICK_BLANK, r] = z_b
            values[PICK_LABEL, r] = z_l

    @cute.jit
    def _write_statistics(
        self, tile: ThreadTile, row_values: cute.Tensor, m_block: cutlass.Int32, n_rows: cutlass.Int32
    ):
        """Each row's den, z_blank and z_label from its quad-merged statistics (_merge_quad_statistics), written by
        the quad's first thread."""
        coords_rc, values = tile.coords_rc, tile.values
        rows = cute.size(coords_rc, mode=[0])
        lane = cute.arch.lane_idx()
        for r in cutlass.range_constexpr(rows):
            row = m_block * self.tile_m + coords_rc[r, 0][0]
            if lane % 4 == 0:
                if row < n_rows:
                    row_values[0, row] = values[ROW_MAX, r] + cute.math.log(values[ROW_SUM, r])
                    row_values[1, row] = values[PICK_BLANK, r]
                    row_values[2, row] = values[PICK_LABEL, r]

    @cute.jit
    def _gradient_tile(
        self,
        tile: ThreadTile,
        blank: cutlass.Int32,
        clamp: cutlass.Float32,
        first_col: cutlass.Int32,
        extra_start: cutlass.Int32,
    ):
        """G = scale * clamp(exp(z - den) * occupancy - [v == blank] blank_arc - [v == label] label_arc) over one
        vocabulary tile (epilogue.token_gradient, which the CPU tests evaluate with torch), in place of the tile's
        logits in the accumulators; with extra columns, less each row's term i on column extra_start + i too
        (multi-blank's big blank arcs)."""
        acc_rc, coords_rc, values, label = tile
        rows = cute.size(acc_rc, mode=[0])
        cols = cute.size(acc_rc, mode=[1])
        clamp_to = clamp if self.clamp else None
        for r in cutlass.range_constexpr(rows):
            terms = self._row_terms(values, r)
            label_at = label[r] - first_col
            blank_at = blank - first_col
            extra_at = extra_start - first_col
            for c in cutlass.range_constexpr(cols):
                col = coords_rc[r, c][1]
                flags = self._column_flags(col, blank_at, label_at, extra_at)
                acc_rc[r, c] = token_gradient(acc_rc[r, c], terms, flags, clamp_to, CUTE_OPS)

    def _row_terms(self, values, r):
        """Row r's RowTerms from the thread's registers (_init_rows)."""
        return RowTerms(
            values[DEN, r],
            values[OCCUPANCY, r],
            values[BLANK_ARC, r],
            values[LABEL_ARC, r],
            values[SCALE, r],
            tuple(values[EXTRA_ARCS + i, r] for i in range(self.extra)),
        )

    def _column_flags(self, col, blank_at, label_at, extra_at):
        """The ColumnFlags of column ``col`` of the tile, the blank's, the label's and the first extra column's
        columns being at blank_at, label_at and extra_at in it."""
        return ColumnFlags(col == blank_at, col == label_at, tuple(col == extra_at + i for i in range(self.extra)))

    @cute.jit
    def _store_gradient_tile(
        self, store: GradientStore, group: StoreGroup, m_block: cutlass.Int32, n_tile: cutlass.Int32
    ):
        """The tile of G in the accumulators to its place in mG, subtile by subtile: each written to a shared-memory
        buffer in mG's dtype by the ``group.threads`` threads holding the tile, then stored by TMA from the warp
        where ``group.storing`` is true while the next subtile is written; a buffer is written again only once its
        previous store has read it (``store.stores``); the last subtile's store runs on into the next tile's MMAs.
        The threads use the g_buffers buffers from ``group.first_buffer`` on, and meet at named barrier
        ``group.barrier_id``."""
        g_copy, g_copy_smem, g_copy_acc, g_copy_regs, sG, tma_g, mG, g_stores = store
        storing, first_buffer, barrier_id, threads = group
        gG = cute.zipped_divide(cute.local_tile(mG, (self.tile_m, self.tile_n), (m_block, n_tile)), self.g_subtile)
        smem_subtiles, gmem_subtiles = cute.nvgpu.cpasync.tma_partition(
            tma_g, 0, cute.make_layout(1), cute.group_modes(sG, 0, 2), gG
        )
        subtiles = cute.size(gG, mode=[1])
        subtile_grid = cute.make_layout(gG.shape[1], stride=(gG.shape[1][1], 1))
        # a subtile's registers (values, row blocks, column groups): of each row block, the values of the
        # accumulators' copy (values, row blocks, 1) after s subtiles' worth
        values, row_blocks, groups = (cute.size(g_copy_regs, mode=[i]) for i in range(3))
        for s in cutlass.range_constexpr(subtiles):
            regs = cute.make_rmem_tensor(g_copy_regs, self.acc_dtype)
            for m in cutlass.range_constexpr(row_blocks):
                for n in cutlass.range_constexpr(groups):
                    for i in cutlass.range_constexpr(values):
                        regs[i, m, n] = g_copy_acc[(s * groups + n) * values + i, m, 0]
            out = cute.make_rmem_tensor(g_copy_regs, self.ab_dtype)
            out.store(regs.load().to(self.ab_dtype))
            # subtiles is a multiple of g_buffers: the buffers alternate across tiles
            buffer = first_buffer + s % self.g_buffers
            cute.copy(g_copy, out, g_copy_smem[(None, None, None, buffer)])
            cute.arch.fence_proxy("async.shared", space="cta")  # the writes, seen by the TMA unit
            cute.arch.barrier(barrier_id=barrier_id, number_of_threads=threads)
            if storing:
                cute.copy(tma_g, smem_subtiles[(None, buffer)], gmem_subtiles[(None, subtile_grid.get_hier_coord(s))])
                g_stores.producer_commit()
                g_stores.producer_acquire()  # the other buffer's store has read it
            cute.arch.barrier(barrier_id=barrier_id, number_of_threads=threads)

    def _load(self, tma_loads: TmaLoads, state: pipeline.PipelineState):
        """Warp 0: the TMA loads of load number ``state.count`` (vocabulary tile count // k_tiles, k tile count %
        k_tiles) into stage ``state.index``."""
        loads, tma_h, tHgH, tHsH, tma_w, tWgW, tWsW, w_mcast_mask, k_tiles, _, _ = tma_loads
        loads.producer_acquire(state)
        n_tile = state.count // k_tiles
        k_tile = state.count % k_tiles
        barrier = loads.producer_get_barrier(state)
        cute.copy(tma_h, tHgH[(None, k_tile)], tHsH[(None, state.index)], tma_bar_ptr=barrier)
        cute.copy(
            tma_w, tWgW[(None, n_tile, k_tile)], tWsW[(None, state.index)], tma_bar_ptr=barrier, mcast_mask=w_mcast_mask
        )
        loads.producer_commit(state)


def _rows_by_columns(acc_layout):
    """The WGMMA accumulators' layout ((2, 2, V), MMA_M, MMA_N) viewed as ((2, MMA_M), (2, V, MMA_N)): rows by
    columns of one thread's part of the tile (quack's layout_utils.convert_layout_acc_mn)."""
    plain = cute.make_layout(acc_layout.shape)
    shape = ((plain.shape[0][1], plain.shape[1]), (plain.shape[0][0], *plain.shape[0][2:], plain.shape[2]))
    stride = ((plain.stride[0][1], plain.stride[1]), (plain.stride[0][0], *plain.stride[0][2:], plain.stride[2]))
    return cute.composition(acc_layout, cute.make_layout(shape, stride=stride))


# the ping-pong kernel's warpgroups: a producer (its first warp issues the loads) and two consumers; registers moved
# from the producer to the consumers (CUTLASS's Hopper warp-specialized GEMMs: 40 and 232)
PRODUCER_REGISTERS = 40
CONSUMER_REGISTERS = 232
# named barriers: each consumer's gradient subtiles (1 + consumer) and the turns of their main loops
# (ORDER_BARRIER + consumer: the other consumer's turn is over)
ORDER_BARRIER = 4


class LogitsGemmPingpong(LogitsGemm):
    """The same GEMM and epilogues with the epilogue of one consumer's turn run while the MMAs of the other's do (the
    schedule of CUTLASS's ping-pong Hopper GEMM): a producer warp fills a ring of stages, and two consumer warpgroups,
    each with its own accumulators for 128 x ``tile_n``, take turns, their main loops ordered by two named barriers.
    With ``resident``, a CTA owns 128 rows whose tile of H is loaded once and kept in shared memory for every
    vocabulary tile, the stages hold W's k tiles, and the consumers take the vocabulary tiles in turns (their
    statistics of each row merged through shared memory at the end); it fits where the tile of H (128 x J) leaves
    room for ``MIN_STAGES`` stages. Else a CTA owns two row blocks of 128, one a consumer, each walking every
    vocabulary tile, and the stages hold H's k tiles beside W's; the gradient's with ``vocab_groups`` G > 1 splits a
    row-block pair's vocabulary tiles among G CTAs launched one after the other (tiles floor(g n_tiles / G) up to
    floor((g + 1) n_tiles / G) of CTA g),
    so that the CTAs running at once share rows of H and their loads hit L2. Each consumer stores its own tiles of
    G."""

    MIN_STAGES = 3

    def __init__(
        self,
        J: int,
        n_tiles: int,
        tile_n: int = 128,
        epilogue: Epilogue = STATISTICS,
        g_subtile_n: int = 16,
        resident: bool = True,
        vocab_groups: int = 1,
    ):
        if tile_n not in (64, 128):
            raise ValueError(f"tile_n: expected 64 or 128, got {tile_n}")
        if vocab_groups < 1 or vocab_groups > 1 and (resident or not epilogue.gradient or vocab_groups > n_tiles):
            raise ValueError(
                f"vocab_groups: expected 1, or at most n_tiles = {n_tiles} for the gradient over two row "
                f"blocks a CTA, got {vocab_groups}"
            )
        super().__init__(J, n_tiles, tile_n, 2, 1, 1, epilogue)
        self.vocab_groups = vocab_groups
        self.tile_m = 128
        self.threads = 3 * THREADS_PER_WARPGROUP
        self.g_subtile_n = g_subtile_n
        self.resident = resident

    def _setup(self, h: cute.Tensor, w: cute.Tensor, g: cute.Tensor):
        self._setup_mma(h, w, 1)  # each consumer's MMAs: one warpgroup's
        tile_k = self.tile_mnk[2]
        self.k_tiles = -(-self.J // tile_k)
        element = self.ab_dtype.width // 8
        self.g_subtile = (self.tile_m, min(self.g_subtile_n, self.tile_n))
        h_bytes = self.tile_m * tile_k * self.k_tiles * element if self.resident else 0
        stage_bytes = (self.tile_n + (0 if self.resident else self.tile_m)) * tile_k * element
        # the barriers (at most 8 stages) and the statistics' merge buffer before the 1024-byte aligned tiles, and
        # the statistics' unused 1024-byte slot of G
        merge = 4 * self.tile_m * 4 if self.resident and not self.gradient else 0
        fixed = -(-((2 * 8 + 3) * 8 + merge) // 1024) * 1024
        fixed += 0 if self.gradient else 1024
        # four subtile buffers a consumer where they leave MIN_STAGES stages of W (a subtile's store then waits for
        # the one three subtiles before it), else two
        for buffers in (4, 2):
            if (self.tile_n // self.g_subtile[1]) % buffers:
                continue
            g_bytes = 2 * buffers * self.g_subtile[0] * self.g_subtile[1] * element if self.gradient else 0
            self.g_buffers = buffers
            self.stages = min(8, (utils.get_smem_capacity_in_bytes("sm_90") - fixed - h_bytes - g_bytes) // stage_bytes)
            if self.stages >= self.MIN_STAGES:
                break
        if self.stages < self.MIN_STAGES:
            raise ValueError(
                f"J: the tile of H (128 x {self.J}) leaves room for {self.stages} stages of W, "
                f"expected at least {self.MIN_STAGES}"
            )
        self.g_smem_layout = sm90_utils.make_smem_layout_epi(
            self.ab_dtype, utils.LayoutEnum.from_tensor(g), self.g_subtile, 2 * self.g_buffers
        )
        self.h_smem_layout = sm90_utils.make_smem_layout_a(
            self.h_layout, self.tile_mnk, self.ab_dtype, self.k_tiles if self.resident else self.stages
        )
        self.w_smem_layout = sm90_utils.make_smem_layout_b(self.w_layout, self.tile_mnk, self.ab_dtype, self.stages)

    def _storage_fields(self):
        """The resident H's load barrier, and the statistics' merge of the consumers (its barrier and buffer)."""
        merge_values = 4 * self.tile_m if self.resident and not self.gradient else 4
        return {
            "h_barriers": cute.struct.MemRange[cutlass.Int64, 2],
            "merge_barrier": cute.struct.MemRange[cutlass.Int64, 1],
            "merge": cute.struct.MemRange[cutlass.Float32, merge_values],
        }

    def _ctas(self, n_rows):
        """The grid: a CTA per row tile, or per two of them where H is not resident, times the vocabulary groups."""
        m_blocks = (n_rows + self.tile_m - 1) // self.tile_m
        return (m_blocks if self.resident else (m_blocks + 1) // 2) * self.vocab_groups

    @cute.kernel
    def kernel(self, operands: Operands, epilogue: EpilogueArguments, layouts: Layouts):
        tma_h, mH, tma_w, mW = operands
        row_values, tma_g, mG = epilogue.row_values, epilogue.tma_g, epilogue.mG
        tiled_mma, h_smem_layout, w_smem_layout, g_smem_layout = layouts
        tidx, bidx, warp_idx, storage, sH, sW = self._start(operands, layouts)
        warpgroup = cute.arch.make_warp_uniform(warp_idx // 4)
        n_rows = mH.shape[0]
        m_block = bidx
        first_tile = 0  # the CTA's vocabulary tiles: [first_tile, first_tile + tiles)
        tiles = self.n_tiles
        if cutlass.const_expr(self.vocab_groups > 1):
            m_block = bidx // self.vocab_groups
            group = bidx % self.vocab_groups
            if cutlass.const_expr(self.n_tiles % self.vocab_groups == 0):
                tiles = self.n_tiles // self.vocab_groups
                first_tile = group * tiles
            else:  # the groups' counts differ by one
                first_tile = group * self.n_tiles // self.vocab_groups
                tiles = (group + 1) * self.n_tiles // self.vocab_groups - first_tile
        k_tiles = self.k_tiles

        h_bytes = cute.size_in_bytes(self.ab_dtype, h_smem_layout)
        stage_bytes = cute.size_in_bytes(self.ab_dtype, cute.slice_(w_smem_layout, (None, None, 0)))
        if cutlass.const_expr(not self.resident):  # a stage holds a k tile of H beside W's
            stage_bytes += cute.size_in_bytes(self.ab_dtype, cute.slice_(h_smem_layout, (None, None, 0)))
        cta = cute.make_layout((1, 1, 1, 1))
        h_load = None
        if cutlass.const_expr(self.resident):  # the tile of H: loaded once, waited for by both consumers, kept
            h_load = pipeline.PipelineTmaAsync.create(
                barrier_storage=storage.h_barriers.data_ptr(),
                num_stages=1,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 8),
                tx_count=h_bytes,
                cta_layout_vmnk=cta,
                defer_sync=True,
            )
        # the turns' stages (W's k tiles, and H's unless resident), each read by the consumer whose turn it is
        loads = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.barriers.data_ptr(),
            num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 4),
            tx_count=stage_bytes,
            cta_layout_vmnk=cta,
            defer_sync=True,
        )
        # the second consumer's statistics in ``merge``: its threads arrive once they have written them
        merge_barrier = storage.merge_barrier.data_ptr()
        if cutlass.const_expr(self.resident and not self.gradient):
            if warp_idx == 0:
                with cute.arch.elect_one():
                    cute.arch.mbarrier_init(merge_barrier, THREADS_PER_WARPGROUP)
        pipeline_init_arrive(cluster_shape_mn=(1, 1), is_relaxed=True)

        gH = cute.local_tile(mH, (self.tile_m, self.tile_mnk[2]), (None, None))  # (rows, k, row blocks, k tiles)
        m_blocks = cute.size(gH, mode=[2])
        gW = cute.local_tile(mW, (self.tile_n, self.tile_mnk[2]), (None, None))
        tHsH, tHgH = cute.nvgpu.cpasync.tma_partition(
            tma_h, 0, cute.make_layout(1), cute.group_modes(sH, 0, 2), cute.group_modes(gH, 0, 2)
        )
        tWsW, tWgW = cute.nvgpu.cpasync.tma_partition(
            tma_w, 0, cute.make_layout(1), cute.group_modes(sW, 0, 2), cute.group_modes(gW, 0, 2)
        )
        pipeline_init_wait(cluster_shape_mn=(1, 1))

        if warpgroup == 0:
            cute.arch.setmaxregister_decrease(PRODUCER_REGISTERS)
            if warp_idx == 0:
                if cutlass.const_expr(self.resident):
                    h_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
                    h_load.producer_acquire(h_state)
                    for k_tile in cutlass.range(k_tiles, unroll=1):
                        cute.copy(
                            tma_h,
                            tHgH[(None, m_block, k_tile)],
                            tHsH[(None, k_tile)],
                            tma_bar_ptr=h_load.producer_get_barrier(h_state),
                        )
                    h_load.producer_commit(h_state)
                produced = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
                # the turns' loads in order: resident, W's k tiles of each vocabulary tile; else those of each of
                # the CTA's vocabulary tiles twice, with the k tiles of H of each of its two row blocks (the second
                # one past the last is the last again: its rows are never written)
                turns = self.n_tiles if self.resident else 2 * tiles
                for i in cutlass.range(turns * k_tiles, unroll=1):
                    turn, k_tile = i // k_tiles, i % k_tiles
                    n_tile = turn if self.resident else first_tile + turn // 2
                    loads.producer_acquire(produced)
                    barrier = loads.producer_get_barrier(produced)
                    if cutlass.const_expr(not self.resident):
                        block = cutlass.min(2 * m_block + turn % 2, m_blocks - 1)
                        cute.copy(tma_h, tHgH[(None, block, k_tile)], tHsH[(None, produced.index)], tma_bar_ptr=barrier)
                    cute.copy(tma_w, tWgW[(None, n_tile, k_tile)], tWsW[(None, produced.index)], tma_bar_ptr=barrier)
                    loads.producer_commit(produced)
                    produced.advance()
                loads.producer_tail(produced)
        else:
            cute.arch.setmaxregister_increase(CONSUMER_REGISTERS)
            # resident, consumer 0 or 1 takes the vocabulary tiles consumer, consumer + 2, ... of the CTA's rows;
            # else each of the CTA's vocabulary tiles of its row block 2 * m_block + consumer; the consumers' turns
            # alternate: the MMAs of one's turn run beside the epilogue of the other's
            consumer = warpgroup - 1
            tidx = tidx % THREADS_PER_WARPGROUP
            row_block = m_block
            if cutlass.const_expr(not self.resident):
                row_block = 2 * m_block + consumer
            k_tiles = self.k_tiles
            thread_mma = tiled_mma.get_slice(tidx)
            tCrH = tiled_mma.make_fragment_A(thread_mma.partition_A(sH))
            tCrW = tiled_mma.make_fragment_B(thread_mma.partition_B(sW))
            acc, acc_rc, coords_rc = self._accumulators(tiled_mma, tidx)
            rows = cute.size(acc_rc, mode=[0])

            if cutlass.const_expr(self.gradient):
                sG = storage.sG.get_tensor(g_smem_layout.outer, swizzle=g_smem_layout.inner)  # g_buffers each
                g_stores = pipeline.PipelineTmaStore.create(
                    num_stages=self.g_buffers,
                    producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, THREADS_PER_WARPGROUP),
                )
                g_store = GradientStore(*self._g_copy(tiled_mma, tidx, sG, acc), sG, tma_g, mG, g_stores)

            values = cute.make_rmem_tensor((self._row_value_count(), rows), cutlass.Float32)  # as LogitsGemm's
            label = cute.make_rmem_tensor((rows,), cutlass.Int32)
            tile = ThreadTile(acc_rc, coords_rc, values, label)
            self._init_rows(tile, epilogue, row_block, n_rows)

            if cutlass.const_expr(self.resident):
                h_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
                h_load.consumer_wait(h_state)
            read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
            release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
            for _ in cutlass.range(consumer * k_tiles, unroll=1):  # the other consumer's first tile
                read.advance()
                release.advance()
            tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
            mma = Mma(tiled_mma, acc, tCrH, tCrW, loads, k_tiles)
            turns = self.n_tiles if self.resident else 2 * tiles
            for n_tile in cutlass.range(
                consumer if self.resident else first_tile,
                self.n_tiles if self.resident else first_tile + tiles,
                2 if self.resident else 1,
                unroll=1,
            ):
                turn = n_tile
                if cutlass.const_expr(not self.resident):
                    turn = 2 * (n_tile - first_tile) + consumer
                # the consumers' main loops in turns (CUTLASS's ordered math warpgroups): the other has waited for
                # every load of the tile before this one, so that a wait on a stage's barrier is never more than one
                # phase ahead of it (an mbarrier's parity tells only the current phase from the one before)
                if turn > 0:
                    cute.arch.barrier(barrier_id=ORDER_BARRIER + consumer, number_of_threads=2 * THREADS_PER_WARPGROUP)
                read, release, _ = self._mma_tile(mma, Stages(read, release))
                if turn + 1 < turns:  # the other consumer's turn
                    cute.arch.barrier_arrive(
                        barrier_id=ORDER_BARRIER + 1 - consumer, number_of_threads=2 * THREADS_PER_WARPGROUP
                    )
                cute.nvgpu.warpgroup.wait_group(0)
                loads.consumer_release(release)
                release.advance()
                for _ in cutlass.range(k_tiles, unroll=1):  # the other consumer's next tile
                    read.advance()
                    release.advance()

                self._epilogue_tile(tile, epilogue, row_block, n_rows, n_tile)
                if cutlass.const_expr(self.gradient):
                    stored_by = StoreGroup(
                        warp_idx % 4 == 0, self.g_buffers * consumer, 1 + consumer, THREADS_PER_WARPGROUP
                    )
                    self._store_gradient_tile(g_store, stored_by, row_block, n_tile)

            if cutlass.const_expr(not self.gradient and not self.resident):
                self._merge_quad_statistics(values)
                self._write_statistics(tile, row_values, row_block, n_rows)
            elif cutlass.const_expr(not self.gradient):
                # the second consumer's statistics of each row through shared memory, merged into the first's
                self._merge_quad_statistics(values)
                merge = storage.merge.get_tensor(cute.make_layout((4, self.tile_m), stride=(self.tile_m, 1)))
                lane = cute.arch.lane_idx()
                if consumer == 1:
                    if lane % 4 == 0:
                        for r in cutlass.range_constexpr(rows):
                            for i in cutlass.range_constexpr(4):
                                merge[i, coords_rc[r, 0][0]] = values[i, r]
                    cute.arch.mbarrier_arrive(merge_barrier)
                else:
                    cute.arch.mbarrier_wait(merge_barrier, 0)
                    for r in cutlass.range_constexpr(rows):
                        other_max = merge[ROW_MAX, coords_rc[r, 0][0]]
                        new_max = cute.arch.fmax(values[ROW_MAX, r], other_max)
                        values[ROW_SUM, r] = values[ROW_SUM, r] * cute.math.exp2(
                            (values[ROW_MAX, r] - new_max) * LOG2E, approx=True, ftz=True
                        ) + merge[ROW_SUM, coords_rc[r, 0][0]] * cute.math.exp2(
                            (other_max - new_max) * LOG2E, approx=True, ftz=True
                        )
                        values[ROW_MAX, r] = new_max
                        values[PICK_BLANK, r] = values[PICK_BLANK, r] + merge[PICK_BLANK, coords_rc[r, 0][0]]
                        values[PICK_LABEL, r] = values[PICK_LABEL, r] + merge[PICK_LABEL, coords_rc[r, 0][0]]
                    self._write_statistics(tile, row_values, row_block, n_rows)
            else:
                if warp_idx % 4 == 0:
                    g_stores.producer_tail()
