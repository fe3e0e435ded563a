"""The fused loss's tiles on torch's GEMMs (cuBLAS on CUDA) and the stages of the inputs' device (every device):
forward packs a tile's hidden, runs the logits GEMM and keeps only the tile's log-probs (the log-probs stage);
backward recomputes the tile's logits and turns them into their gradient in place (the gradient stage). The logits
are rounded to the GEMMs' dtype, as in the unfused composition.
"""

import torch.nn.functional as F

from .tiles import Step, TilePathBase, first_tile, gemm_rows, hidden, hidden_buffer, projection, tiles, tiles_after

__all__ = ["CublasTiles"]


class CublasTiles(TilePathBase):
    """transducer/fused/tiles.py's TilePath on torch's GEMMs and the stages."""

    def __init__(self, step: Step, weight, bias, compute_dtype):
        self.step = step
        self.Wx, _ = projection(weight, bias, compute_dtype)
        self.rows = weight.size(0)  # the projection's real rows (V + D)

    def _gemm_rows(self, rows):
        return gemm_rows(rows, self.step.encoder_out.device.type)

    def _tiles(self, num_rows, max_rows):
        """The tiles' bounds and their hidden's memory."""
        bounds = list(tiles(num_rows, max_rows))
        rows = max((self._gemm_rows(end - start) for start, end in bounds), default=0)
        return bounds, hidden_buffer(self.step, self.Wx, rows)

    def begin_forward(self, max_rows, bound):
        """The first tile's hidden and logits GEMM (first_tile), launched before the row count is known: pack_forward
        leaves the rows past the layout's zeros."""
        s = self.step
        first = first_tile(max_rows, bound, s.encoder_out.device.type)
        if first:
            buffer = hidden_buffer(s, self.Wx, self._gemm_rows(max_rows))  # no tile has more rows
            hx = hidden(s, self.Wx, 0, first, self._gemm_rows(first), buffer)
            self.begun = first, buffer, F.linear(hx, self.Wx)

    def forward(self, num_rows, max_rows, arrays):
        s, V, D = self.step, self.step.V, self.step.D
        begun, self.begun = self.begun, None  # the logits' one name: freed once their tile is done
        if begun is None:
            bounds, buffer = self._tiles(num_rows, max_rows)
            logits = None
        else:
            rows, buffer, logits = begun
            del begun
            bounds = tiles_after(rows, num_rows, max_rows)
        for start, end in bounds:
            rows = end - start
            if start == 0 and logits is not None:  # begin_forward's
                z, logits = logits[:rows], None
            else:
                hx = hidden(s, self.Wx, start, end, self._gemm_rows(rows), buffer)
                z = F.linear(hx, self.Wx)[:rows]
            s.kind.log_probs(
                s.stages, z[:, :V], z[:, V : V + D] if D else None, s.targets, s.layout, s.options, start, arrays
            )
            del z

    def gradient_tiles(self, num_rows, max_rows, lattice, scale):
        bounds, buffer = self._tiles(num_rows, max_rows)
        for start, end in bounds:
            # no name here holds the tile's tensors while the caller has them: it frees dz before pack's backward
            yield (start, end, *self._gradient_tile(start, end, lattice, scale, buffer))

    def _gradient_tile(self, start, end, lattice, scale, buffer):
        s, V, D = self.step, self.step.V, self.step.D
        rows = end - start
        hx = hidden(s, self.Wx, start, end, self._gemm_rows(rows), buffer)
        dz = F.linear(hx, self.Wx)  # the tile's logits, turned into their gradient in place; zeros past rows
        tokens, extra = dz[:rows, :V], dz[:rows, V : V + D] if D else None
        s.kind.gradient(s.stages, (tokens, extra), s.targets, lattice, scale, s.options, (tokens, extra), start)
        del tokens, extra  # views of dz: a view left alive kept a third tile buffer
        if self.Wx.size(0) > self.rows:  # the padding columns: no gradient (and no NaN from a non-finite h)
            dz[:, self.rows :] = 0
        return hx, dz
