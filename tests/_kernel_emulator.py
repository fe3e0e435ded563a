"""CPU model of the CUDA kernels in ops/*.cu and ragged/ragged.cu, used by tests/test_ops.py
to exercise the CUDA launchers (grid sizes, argument order and exact scalar types) and
the kernels' per-thread logic (FastDivmod splits, online logsumexp states, warp/smem
merge trees, split-R partials) without a GPU. Keep it in step with the .cu files.

"""
import ctypes
import math
import re

import numpy as np
import torch

import ops._cuda as C

LOG = []


def view(ptr, dtype, count):
    dtype = np.dtype(dtype)
    if count == 0:
        return np.zeros(0, dtype)
    buf = (ctypes.c_byte * (count * dtype.itemsize)).from_address(int(ptr))
    return np.frombuffer(buf, dtype=dtype)


def fdm(s, n):
    d, m, l = int(s["d"]), int(s["m"]), int(s["l"])
    n = n.astype(np.uint64)
    q = (((np.uint64(m) * n) >> np.uint64(32)) + n) >> np.uint64(l)
    assert np.all(q < 2 ** 32)
    return q.astype(np.int64), (n - q * np.uint64(d)).astype(np.int64)


def check_types(args, types):
    assert len(args) == len(types), (len(args), len(types))
    for a, t in zip(args, types):
        if t == "ptr":
            assert type(a) is np.uint64, type(a)
        elif t == "fdm":
            assert isinstance(a, np.void) and a.dtype == ops_dtype(), a
        else:
            assert type(a) is t, (type(a), t)


def ops_dtype():
    import ops
    return ops.FAST_DIVMOD_DTYPE


IDX = {"i32": np.int32, "i64": np.int64}


def gather_small(name, grid, block, args):
    check_types(args, ["ptr", "ptr", "ptr", "fdm", "fdm", "fdm", np.int32, np.int32, np.int64, np.uint32,
                       np.int64, np.int64])
    m = re.match(r"gather_w(\d+)_(i\d+)", name)
    w, it = int(m.group(1)), IDX[m.group(2)]
    pp, ip, op, doik, dik, dk, O, I, G, total, wrap, offset = args
    O, I, G, total, wrap, offset = int(O), int(I), int(G), int(total), int(wrap), int(offset)
    Kv = int(dk["d"])
    assert int(doik["d"]) == O * I * Kv and int(dik["d"]) == I * Kv
    nthreads = grid[0] * block[0]
    assert nthreads >= total and (grid[0] - 1) * block[0] < total
    n = np.arange(total, dtype=np.int64)
    b, rest = fdm(doik, n)
    o, rest = fdm(dik, rest)
    i, k = fdm(dk, rest)
    B = total // (O * I * Kv)
    W = np.dtype(f"V{w}")
    params = view(pp, W, B * O * G * Kv)
    indices = view(ip, it, B * I)
    out = view(op, W, total)
    idx = indices[b * I + i].astype(np.int64)
    idx = np.where(idx < 0, idx + wrap, idx) - offset
    ok = (idx >= 0) & (idx < G)
    src = ((b * O + o) * G + np.where(ok, idx, 0)) * Kv + k
    vals = params[src].copy()
    vals[~ok] = np.zeros(1, W)[0]
    out[n] = vals


def gather_big(name, grid, block, args):
    check_types(args, ["ptr", "ptr", "ptr"] + [np.int64] * 7)
    m = re.match(r"gather_big_w(\d+)_(i\d+)", name)
    raise AssertionError("big path not expected in emulation")


def ragged_kernel(name, grid, block, args):
    check_types(args, ["ptr", np.int64, "ptr", np.int64])
    m = re.match(r"(row_splits_to_row_ids|row_ids_to_row_splits)_(i\d+)_(i\d+)", name)
    kind, s, o = m.group(1), IDX[m.group(2)], IDX[m.group(3)]
    a, na, b, nb = args
    assert grid[0] >= 1 and block[0] == 256
    if kind == "row_splits_to_row_ids":
        rs = view(a, s, int(na) + 1).astype(np.int64)
        out = view(b, o, int(nb))
        i = np.arange(int(nb))
        out[:] = np.searchsorted(rs[:-1], i, side="right") - 1
    else:
        ids = view(a, s, int(na)).astype(np.int64)
        out = view(b, o, int(nb) + 1)
        out[:] = np.searchsorted(ids, np.arange(int(nb) + 1), side="left")


# ---------------------------------------------------------------- reduce emulation
T = {"f16": np.float16, "bf16": "bf16", "f32": np.float32, "f64": np.float64}


def load(ptr, tname, count):
    if tname == "bf16":
        raw = view(ptr, np.uint16, count).astype(np.uint32) << 16
        return raw.view(np.float32)
    a = view(ptr, T[tname], count)
    return a.astype(np.float64 if tname == "f64" else np.float32)


def ref_of(m):
    return np.where(np.isinf(m), 0, m).astype(m.dtype)


def push(op, M, S, x, valid):
    with np.errstate(all="ignore"):
        if op == "sum":
            M = np.where(valid, M + x, M)
        elif op == "max":
            M = np.where(valid & ((x > M) | np.isnan(x)), x, M)
        else:
            gt = valid & (x > M)
            rx = ref_of(x)
            s_gt = np.where(S == 0, 0, S * np.exp(ref_of(M) - rx)) + np.exp(x - rx)
            nan = valid & ~gt & np.isnan(x)
            other = valid & ~gt & ~np.isnan(x)
            s_o = S + np.exp(x - ref_of(M))
            S = np.where(gt, s_gt, np.where(nan, x, np.where(other, s_o, S))).astype(S.dtype)
            M = np.where(gt | nan, x, M).astype(M.dtype)
    return M.astype(M.dtype), S


def merge(op, Ma, Sa, Mb, Sb):
    with np.errstate(all="ignore"):
        if op == "sum":
            return (Ma + Mb).astype(Ma.dtype), Sa
        M = np.where((Mb > Ma) | np.isnan(Mb), Mb, Ma).astype(Ma.dtype)
        if op == "max":
            return M, Sa
        R = ref_of(M)
        ta = np.where(Sa == 0, 0, Sa * np.exp(ref_of(Ma) - R))
        tb = np.where(Sb == 0, 0, Sb * np.exp(ref_of(Mb) - R))
        S = (ta + tb).astype(Sa.dtype)
        S = np.where(np.isnan(M), M, S).astype(Sa.dtype)
        return M, S


def identity(op, shape, acc):
    M = np.full(shape, 0 if op == "sum" else -np.inf, dtype=acc)
    return M, np.zeros(shape, dtype=acc)


def finish(op, M, S):
    if op == "logsumexp":
        with np.errstate(all="ignore"):
            return (np.log(S) + ref_of(M)).astype(M.dtype)
    return M


def warp_merge(op, M, S):
    # M, S shape (..., 32) lanes; xor shuffle tree
    for off in (16, 8, 4, 2, 1):
        perm = np.arange(32) ^ off
        M, S = merge(op, M, S, M[..., perm], S[..., perm])
    return M, S


def reduce_rows(name, grid, block, args, shared_mem=0):
    check_types(args, ["ptr", "ptr", "ptr", np.int64, np.int64, np.int32, np.int32, np.int64])
    m = re.match(r"reduce_rows_(sum|max|logsumexp)_(f16|bf16|f32|f64)", name)
    op, tn = m.group(1), m.group(2)
    acc = np.float64 if tn == "f64" else np.float32
    xp, outp, wsp, rows, R, tpr, splits, chunk = args
    rows, R, tpr, splits, chunk = map(int, (rows, R, tpr, splits, chunk))
    assert block[0] == 256 and block[0] % tpr == 0 and tpr % 32 == 0
    rpb = block[0] // tpr
    G = grid[0]
    assert G * rpb >= rows * splits and (G - 1) * rpb < rows * splits, (G, rpb, rows, splits)
    assert splits * chunk >= R and (splits - 1) * chunk < R
    x = load(xp, tn, rows * R).astype(acc)
    nt = G * block[0]
    t = np.arange(nt)
    v = (t // block[0]) * rpb + (t % block[0]) // tpr
    lane = t % tpr
    active = v < rows * splits
    row = np.where(active, v // splits, 0)
    part = np.where(active, v - row * splits, 0)
    start = part * chunk
    end = np.minimum(R, start + chunk)
    M, S = identity(op, nt, acc)
    it = 0
    while True:
        j = start + lane + it * tpr
        valid = active & (j < end)
        if not valid.any():
            break
        xv = x[np.where(valid, row * R + j, 0)]
        M, S = push(op, M, S, xv, valid)
        it += 1
    M, S = warp_merge(op, M.reshape(-1, 32), S.reshape(-1, 32))
    M, S = M[:, 0], S[:, 0]  # lane-0 value of each warp (all lanes equal after xor tree)
    nw = block[0] // 32
    if tpr > 32:
        Mb = M.reshape(G, nw)
        Sb = S.reshape(G, nw)
        pad = 32 - nw
        Mi, Si = identity(op, (G, pad), acc)
        M2, S2 = warp_merge(op, np.concatenate([Mb, Mi], 1), np.concatenate([Sb, Si], 1))
        Mf, Sf, vf, pf, rf, af = M2[:, 0], S2[:, 0], v[:: block[0]], part[:: block[0]], row[:: block[0]], active[:: block[0]]
    else:
        Mf, Sf = M, S
        sel = slice(None, None, 32)
        vf, pf, rf, af = v[sel], part[sel], row[sel], active[sel]
    store(op, Mf[af], Sf[af], (pf * rows + rf)[af], outp, wsp, splits, acc, rows * splits)


def store(op, M, S, pos, outp, wsp, splits, acc, nslots):
    out = view(outp, acc, nslots)
    assert len(np.unique(pos)) == len(pos)
    assert np.array_equal(np.sort(pos), np.arange(nslots)), "outputs not fully covered"
    if splits == 1:
        out[pos] = finish(op, M, S)
    else:
        out[pos] = M
        if op == "logsumexp":
            view(wsp, acc, nslots)[pos] = S


def reduce_mid(name, grid, block, args, shared_mem=0):
    import ops
    check_types(args, ["ptr", "ptr", "ptr", np.int64, np.int64, np.int64, "fdm", np.int32, np.int64])
    m = re.match(r"reduce_mid_(sum|max|logsumexp)_(f16|bf16|f32|f64)", name)
    op, tn = m.group(1), m.group(2)
    acc = np.float64 if tn == "f64" else np.float32
    xp, outp, wsp, outer, R, inner, dt, splits, chunk = args
    outer, R, inner, splits, chunk = map(int, (outer, R, inner, splits, chunk))
    bx, by = block[0], block[1]
    assert bx * by == 256 and by & (by - 1) == 0
    assert shared_mem == bx * by * (16 if acc == np.float64 else 8)
    tiles = int(dt["d"])
    assert tiles * bx >= inner and (tiles - 1) * bx < inner
    assert grid[0] == outer * tiles and grid[1] == splits
    assert splits * chunk >= R and (splits - 1) * chunk < R
    x = load(xp, tn, outer * R * inner).astype(acc)
    # threads: (gy, gx, ty, tx)
    gy, gx, ty, tx = np.meshgrid(np.arange(splits), np.arange(grid[0]), np.arange(by), np.arange(bx), indexing="ij")
    o, tile = fdm(dt, gx.reshape(-1))
    o, tile = o.reshape(gx.shape), tile.reshape(gx.shape)
    col = tile * bx + tx
    start = gy * chunk
    end = np.minimum(R, start + chunk)
    M, S = identity(op, gx.shape, acc)
    it = 0
    while True:
        r = start + ty + it * by
        valid = (col < inner) & (r < end)
        if not valid.any():
            break
        xv = x[np.where(valid, (o * R + r) * inner + col, 0)]
        M, S = push(op, M, S, xv, valid)
        it += 1
    h = by // 2
    while h > 0:  # smem tree over ty (axis 2)
        Mn, Sn = merge(op, M[:, :, :h], S[:, :, :h], M[:, :, h:2 * h], S[:, :, h:2 * h])
        M = M.copy(); S = S.copy()
        M[:, :, :h], S[:, :, :h] = Mn, Sn
        h //= 2
    M0, S0 = M[:, :, 0], S[:, :, 0]
    c0, o0, p0 = col[:, :, 0], o[:, :, 0], gy[:, :, 0]
    keep = c0 < inner
    pos = p0 * (outer * inner) + o0 * inner + c0
    store(op, M0[keep], S0[keep], pos[keep], outp, wsp, splits, acc, splits * outer * inner)


def reduce_finalize(name, grid, block, args, shared_mem=0):
    check_types(args, ["ptr", "ptr", "ptr", np.int64, np.int32])
    m = re.match(r"reduce_finalize_(sum|max|logsumexp)_(f32|f64)", name)
    op, an = m.group(1), m.group(2)
    acc = np.float64 if an == "f64" else np.float32
    wm, ws, outp, n, splits = args
    n, splits = int(n), int(splits)
    Mw = view(wm, acc, n * splits).reshape(splits, n)
    Sw = view(ws, acc, n * splits).reshape(splits, n) if op == "logsumexp" else np.zeros((splits, n), acc)
    M, S = identity(op, n, acc)
    for p in range(splits):
        M, S = merge(op, M, S, Mw[p], Sw[p])
    view(outp, acc, n)[:] = finish(op, M, S)


class FakeModule:
    def get_function(self, name):
        if name.startswith("gather_big"):
            f = gather_big
        elif name.startswith("gather_"):
            f = gather_small
        elif name.startswith("row_"):
            f = ragged_kernel
        elif name.startswith("reduce_rows"):
            f = reduce_rows
        elif name.startswith("reduce_mid"):
            f = reduce_mid
        elif name.startswith("reduce_finalize"):
            f = reduce_finalize
        else:
            raise KeyError(name)

        def call(grid, block, args, shared_mem=0):
            assert all(isinstance(g, int) and g >= 1 for g in grid), grid
            assert all(isinstance(b, int) and b >= 1 for b in block), block
            assert math.prod(block) <= 1024
            LOG.append(name)
            if f in (reduce_rows, reduce_mid, reduce_finalize):
                f(name, grid, block, args, shared_mem)
            else:
                assert shared_mem == 0
                f(name, grid, block, args)
        return call


def install(monkeypatch):
    """Route ops._cuda's launches and SM queries to this model (pytest monkeypatch)."""
    def launch(path, name, t, grid, block, args, shared_mem=0, include_dirs=()):
        FakeModule().get_function(name)(grid, block, args, shared_mem)
    monkeypatch.setattr(C, "launch", launch)
    monkeypatch.setattr(C, "num_sms", lambda t: 132)
