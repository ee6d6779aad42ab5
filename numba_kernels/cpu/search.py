"""Nearest-codeword kernels: argmin_k ``|c_k|^2 - 2 x.c_k`` (first index on ties) per
(token, codebook), the Numba twin of ``codec.nearest_codeword``.

``_nearest`` / ``_nearest_serial`` (codeword-vector kernel, parallel or not), ``_nearest_lanes``
and ``_nearest_lanes4`` (tokens across SIMD lanes, g == 8 or 4 and many tokens), ``_nearest_row`` (one row, inlined into the
fused encoder), the dispatcher ``_search``, and the host API :func:`prepare`, :func:`nearest`
(per-layer caching: ``codec.LayerNearest(make, prepare, nearest)``).
"""
from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange

from ._common import _BIG, _SERIAL_BELOW, njit_variants

_TOKEN_BLOCK = 16
_ARGMIN_CHUNK = 32
_LANES = 64  # tokens per block of the lane kernel


@njit(cache=True, inline="always", fastmath=True)
def _first_min(dist, lanes, lidx, K, chunk):
    """First index of the minimum of dist[0:K] (no NaN). Per lane i (entries c*chunk + i):
    the minimum and the first chunk c holding it, by selects (vectorizes; a scalar min chain
    would not), then the smallest index among the lanes holding the overall minimum."""
    nfull = K // chunk
    for i in range(chunk):
        lanes[i] = _BIG
        lidx[i] = np.int32(0)
    for c in range(nfull):
        base = c * chunk
        for i in range(chunk):
            v = dist[base + i]
            lt = v < lanes[i]
            lanes[i] = v if lt else lanes[i]
            lidx[i] = np.int32(c) if lt else lidx[i]
    best = _BIG
    arg = K
    for i in range(chunk if nfull else 0):
        k = lidx[i] * chunk + i
        if lanes[i] < best or (lanes[i] == best and k < arg):
            best = lanes[i]
            arg = k
    for k in range(nfull * chunk, K):
        if dist[k] < best:
            best = dist[k]
            arg = k
    return arg if arg < K else 0


def _nearest_py(x, cbt, cn, chunk, out):
    """x [T, N, g] f32 (finite), cbt [N, g, K] f32 (codewords transposed), cn [N, K] f32 ->
    out [T, N] int32: argmin_k ``cn - 2 x.c``, first index on ties.

    Parallel over blocks of tokens. For g == 8 (the default) four tokens share each codebook
    load (an unrolled outer-product loop over k that vectorizes); other g sum over j."""
    T, N, g = x.shape
    K = cbt.shape[2]
    nblocks = (T + _TOKEN_BLOCK - 1) // _TOKEN_BLOCK
    for blk in prange(nblocks):
        t0 = blk * _TOKEN_BLOCK
        t1 = min(T, t0 + _TOKEN_BLOCK)
        d4 = np.empty((4, K), np.float32)
        cmin = np.empty(chunk, np.float32)
        cidx = np.empty(chunk, np.int32)
        for n in range(N):
            t = t0
            if g == 8:
                while t + 4 <= t1:
                    a0, a1, a2, a3, a4, a5, a6, a7 = x[t, n, 0], x[t, n, 1], x[t, n, 2], x[t, n, 3], x[t, n, 4], x[t, n, 5], x[t, n, 6], x[t, n, 7]
                    b0, b1, b2, b3, b4, b5, b6, b7 = x[t + 1, n, 0], x[t + 1, n, 1], x[t + 1, n, 2], x[t + 1, n, 3], x[t + 1, n, 4], x[t + 1, n, 5], x[t + 1, n, 6], x[t + 1, n, 7]
                    e0, e1, e2, e3, e4, e5, e6, e7 = x[t + 2, n, 0], x[t + 2, n, 1], x[t + 2, n, 2], x[t + 2, n, 3], x[t + 2, n, 4], x[t + 2, n, 5], x[t + 2, n, 6], x[t + 2, n, 7]
                    f0, f1, f2, f3, f4, f5, f6, f7 = x[t + 3, n, 0], x[t + 3, n, 1], x[t + 3, n, 2], x[t + 3, n, 3], x[t + 3, n, 4], x[t + 3, n, 5], x[t + 3, n, 6], x[t + 3, n, 7]
                    for k in range(K):
                        c0, c1, c2, c3 = cbt[n, 0, k], cbt[n, 1, k], cbt[n, 2, k], cbt[n, 3, k]
                        c4, c5, c6, c7 = cbt[n, 4, k], cbt[n, 5, k], cbt[n, 6, k], cbt[n, 7, k]
                        cnk = cn[n, k]
                        d4[0, k] = cnk - np.float32(2.0) * (a0 * c0 + a1 * c1 + a2 * c2 + a3 * c3 + a4 * c4 + a5 * c5 + a6 * c6 + a7 * c7)
                        d4[1, k] = cnk - np.float32(2.0) * (b0 * c0 + b1 * c1 + b2 * c2 + b3 * c3 + b4 * c4 + b5 * c5 + b6 * c6 + b7 * c7)
                        d4[2, k] = cnk - np.float32(2.0) * (e0 * c0 + e1 * c1 + e2 * c2 + e3 * c3 + e4 * c4 + e5 * c5 + e6 * c6 + e7 * c7)
                        d4[3, k] = cnk - np.float32(2.0) * (f0 * c0 + f1 * c1 + f2 * c2 + f3 * c3 + f4 * c4 + f5 * c5 + f6 * c6 + f7 * c7)
                    for i in range(4):
                        out[t + i, n] = _first_min(d4[i], cmin, cidx, K, chunk)
                    t += 4
            while t < t1 and g == 8:  # one token (decode steps): the same loop, one row
                a0, a1, a2, a3, a4, a5, a6, a7 = x[t, n, 0], x[t, n, 1], x[t, n, 2], x[t, n, 3], x[t, n, 4], x[t, n, 5], x[t, n, 6], x[t, n, 7]
                for k in range(K):
                    d4[0, k] = cn[n, k] - np.float32(2.0) * (a0 * cbt[n, 0, k] + a1 * cbt[n, 1, k] + a2 * cbt[n, 2, k] + a3 * cbt[n, 3, k] + a4 * cbt[n, 4, k] + a5 * cbt[n, 5, k] + a6 * cbt[n, 6, k] + a7 * cbt[n, 7, k])
                out[t, n] = _first_min(d4[0], cmin, cidx, K, chunk)
                t += 1
            while t < t1:
                for k in range(K):
                    d4[0, k] = np.float32(0.0)
                for j in range(g):
                    xj = x[t, n, j]
                    for k in range(K):
                        d4[0, k] += xj * cbt[n, j, k]
                for k in range(K):
                    d4[0, k] = cn[n, k] - np.float32(2.0) * d4[0, k]
                out[t, n] = _first_min(d4[0], cmin, cidx, K, chunk)
                t += 1


_nearest, _nearest_serial = njit_variants(_nearest_py, fastmath=True)  # serial: small batches, no thread launch


@njit(cache=True, inline="always")
def _lanes_load(x, t0, nt, n, g):
    """The lane kernels' block: -2 x of tokens t0 .. t0 + nt - 1 of codebook n, transposed to
    [g, 64] (padding lanes stay 0), and each lane's running minimum and its index."""
    xt = np.zeros((g, _LANES), np.float32)
    for i in range(nt):
        for j in range(g):
            xt[j, i] = np.float32(-2.0) * x[t0 + i, n, j]
    return xt, np.full(_LANES, _BIG, np.float32), np.zeros(_LANES, np.int32)


@njit(cache=True, inline="always")
def _lanes_finish(xt, cbr, cn, n, k0, best, arg, t0, nt, out, best_out):
    """Codewords k0 .. K - 1 one at a time (the tail a kernel's step does not cover), then the
    block's codes and minima out."""
    g, K = xt.shape[0], cbr.shape[1]
    for k in range(k0, K):
        for i in range(_LANES):
            dk = cn[n, k]
            for j in range(g):
                dk += xt[j, i] * cbr[n, k, j]
            if dk < best[i]:
                best[i] = dk
                arg[i] = np.int32(k)
    for i in range(nt):
        out[t0 + i, n] = arg[i]
        best_out[t0 + i, n] = best[i]


@njit(parallel=True, cache=True, nogil=True, fastmath=True)
def _nearest_lanes(x, cbr, cn, out, best_out):
    """g == 8, many tokens: x [T, N, 8], cbr [N, K, 8] (codeword rows), cn [N, K] -> out [T, N]
    and ``best_out`` [T, N] f32, the minimum of ``|c|^2 - 2 x.c`` (add ``|x|^2`` for the squared
    distance: what k-means needs for its objective).

    Tokens across SIMD lanes: each (block of 64 tokens, codebook) item keeps a running
    minimum and its index per token while it walks the codewords two at a time (broadcast
    codeword, 8 FMAs per lane and codeword, no distance row stored and re-read). Strict
    ``<`` in index order keeps the first index on exact ties, as the argmin does."""
    T, N, g = x.shape
    K = cbr.shape[1]
    nblocks = (T + _LANES - 1) // _LANES
    for item in prange(nblocks * N):
        blk = item // N
        n = item - blk * N
        t0 = blk * _LANES
        nt = min(T, t0 + _LANES) - t0
        xt, best, arg = _lanes_load(x, t0, nt, n, 8)
        for k in range(0, K - 1, 2):
            c0, c1, c2, c3 = cbr[n, k, 0], cbr[n, k, 1], cbr[n, k, 2], cbr[n, k, 3]
            c4, c5, c6, c7 = cbr[n, k, 4], cbr[n, k, 5], cbr[n, k, 6], cbr[n, k, 7]
            e0, e1, e2, e3 = cbr[n, k + 1, 0], cbr[n, k + 1, 1], cbr[n, k + 1, 2], cbr[n, k + 1, 3]
            e4, e5, e6, e7 = cbr[n, k + 1, 4], cbr[n, k + 1, 5], cbr[n, k + 1, 6], cbr[n, k + 1, 7]
            na, nb = cn[n, k], cn[n, k + 1]
            ka, kb = np.int32(k), np.int32(k + 1)
            for i in range(_LANES):
                a0, a1, a2, a3 = xt[0, i], xt[1, i], xt[2, i], xt[3, i]
                a4, a5, a6, a7 = xt[4, i], xt[5, i], xt[6, i], xt[7, i]
                da = na + a0 * c0 + a1 * c1 + a2 * c2 + a3 * c3 + a4 * c4 + a5 * c5 + a6 * c6 + a7 * c7
                db = nb + a0 * e0 + a1 * e1 + a2 * e2 + a3 * e3 + a4 * e4 + a5 * e5 + a6 * e6 + a7 * e7
                second = db < da
                m = db if second else da
                km = kb if second else ka
                lt = m < best[i]
                best[i] = m if lt else best[i]
                arg[i] = km if lt else arg[i]
        _lanes_finish(xt, cbr, cn, n, K - K % 2, best, arg, t0, nt, out, best_out)


@njit(parallel=True, cache=True, nogil=True, fastmath=True)
def _nearest_lanes4(x, cbr, cn, out, best_out):
    """g == 4 (the keys of ``--rate 1.7`` / ``2.1``), many tokens: :func:`_nearest_lanes` with
    4-dim codewords, four per step (16 FMAs per lane and step, as the g == 8 kernel's two), the
    winner of each step taken pairwise in index order so that the first index keeps exact ties."""
    T, N, g = x.shape
    K = cbr.shape[1]
    nblocks = (T + _LANES - 1) // _LANES
    for item in prange(nblocks * N):
        blk = item // N
        n = item - blk * N
        t0 = blk * _LANES
        nt = min(T, t0 + _LANES) - t0
        xt, best, arg = _lanes_load(x, t0, nt, n, 4)
        K4 = K - K % 4
        for k in range(0, K4, 4):
            c0, c1, c2, c3 = cbr[n, k, 0], cbr[n, k, 1], cbr[n, k, 2], cbr[n, k, 3]
            e0, e1, e2, e3 = cbr[n, k + 1, 0], cbr[n, k + 1, 1], cbr[n, k + 1, 2], cbr[n, k + 1, 3]
            f0, f1, f2, f3 = cbr[n, k + 2, 0], cbr[n, k + 2, 1], cbr[n, k + 2, 2], cbr[n, k + 2, 3]
            h0, h1, h2, h3 = cbr[n, k + 3, 0], cbr[n, k + 3, 1], cbr[n, k + 3, 2], cbr[n, k + 3, 3]
            na, nb, nc, nd = cn[n, k], cn[n, k + 1], cn[n, k + 2], cn[n, k + 3]
            ka, kb, kc, kd = np.int32(k), np.int32(k + 1), np.int32(k + 2), np.int32(k + 3)
            for i in range(_LANES):
                a0, a1, a2, a3 = xt[0, i], xt[1, i], xt[2, i], xt[3, i]
                da = na + a0 * c0 + a1 * c1 + a2 * c2 + a3 * c3
                db = nb + a0 * e0 + a1 * e1 + a2 * e2 + a3 * e3
                dc = nc + a0 * f0 + a1 * f1 + a2 * f2 + a3 * f3
                dd = nd + a0 * h0 + a1 * h1 + a2 * h2 + a3 * h3
                s1 = db < da
                m1 = db if s1 else da
                k1 = kb if s1 else ka
                s2 = dd < dc
                m2 = dd if s2 else dc
                k2 = kd if s2 else kc
                s3 = m2 < m1
                m = m2 if s3 else m1
                km = k2 if s3 else k1
                lt = m < best[i]
                best[i] = m if lt else best[i]
                arg[i] = km if lt else arg[i]
        _lanes_finish(xt, cbr, cn, n, K4, best, arg, t0, nt, out, best_out)


@njit(cache=True, inline="always", fastmath=True)
def _nearest_row(x, t, n, cbr, cn, chunk, dist, lanes, lidx):
    """Nearest codeword of the one row x[t, n] over codeword rows cbr [N, K, g] (the layout the
    decode kernel reads: a decode step's encode warms the cache for its attention)."""
    g, K = x.shape[2], cbr.shape[1]
    if g == 8:
        a0, a1, a2, a3, a4, a5, a6, a7 = x[t, n, 0], x[t, n, 1], x[t, n, 2], x[t, n, 3], x[t, n, 4], x[t, n, 5], x[t, n, 6], x[t, n, 7]
        for k in range(K):
            dist[k] = cn[n, k] - np.float32(2.0) * (a0 * cbr[n, k, 0] + a1 * cbr[n, k, 1] + a2 * cbr[n, k, 2] + a3 * cbr[n, k, 3] + a4 * cbr[n, k, 4] + a5 * cbr[n, k, 5] + a6 * cbr[n, k, 6] + a7 * cbr[n, k, 7])
    else:
        for k in range(K):
            acc = np.float32(0.0)
            for j in range(g):
                acc += x[t, n, j] * cbr[n, k, j]
            dist[k] = cn[n, k] - np.float32(2.0) * acc
    return _first_min(dist, lanes, lidx, K, chunk)


def _search(x: np.ndarray, prepared, out: np.ndarray) -> None:
    """out [T, N] int32 <- nearest codeword of each x [T, N, g] (finite float32): the lane
    kernels for g == 8 or 4 and >= 64 tokens, the codeword-vector kernel otherwise (serial below
    64 tokens: no thread launch for a decode step)."""
    cbt, cn, cbr = prepared
    T, g = x.shape[0], x.shape[2]
    if T >= _SERIAL_BELOW and g in (4, 8):
        (_nearest_lanes if g == 8 else _nearest_lanes4)(x, cbr, cn, out, np.empty(out.shape, np.float32))
    else:
        (_nearest if T >= _SERIAL_BELOW else _nearest_serial)(x, cbt, cn, _ARGMIN_CHUNK, out)  # chunk: runtime


def prepare(codebook: torch.Tensor):
    """codebook [H, G, K, g] -> (codewords^T [H*G, g, K], norms [H*G, K], codewords
    [H*G, K, g]) as float32 numpy (both layouts: one kernel reads columns, the other rows)."""
    cb = codebook.detach().float().cpu()
    H, G, K, g = cb.shape
    cbr = cb.reshape(H * G, K, g).contiguous()
    cn = (cb * cb).sum(-1).reshape(H * G, K).contiguous().numpy()
    return cbr.transpose(1, 2).contiguous().numpy(), cn, cbr.numpy()


def nearest(x: torch.Tensor, prepared) -> torch.Tensor:
    """x [T, H, G, g] -> codes [T, H, G] int64; ``prepared`` from :func:`prepare`.

    Non-finite inputs fall back to the torch reference (its NaN semantics)."""
    cbt = prepared[0]
    T, H, G, g = x.shape
    xf = x.detach().float().cpu().reshape(T, H * G, g).contiguous()
    if T and not bool(torch.isfinite(xf).all()):
        from sglang_tasq.codec import nearest_codeword

        cb = torch.from_numpy(cbt).transpose(1, 2).reshape(H, G, -1, g)
        return nearest_codeword(x, cb)
    out = np.empty((T, H * G), np.int32)
    if T:
        _search(xf.numpy(), prepared, out)
    return torch.from_numpy(out).to(torch.int64).view(T, H, G)


def nearest_sqdist(x: np.ndarray, cbr: np.ndarray, cn: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Nearest codeword and its squared distance, for k-means: x [T, N, 8] float32 (finite),
    codeword rows cbr [N, K, 8], norms cn [N, K] -> (codes [T, N] int32, ``|x - c|^2`` [T, N]
    float32, clamped at 0). The lane kernel the serving encoder runs for prefills, so the
    calibration assigns points exactly as serving will encode them."""
    T, N, g = x.shape
    if g != 8:
        raise ValueError(f"nearest_sqdist is the g == 8 lane kernel; got g={g}")
    codes = np.empty((T, N), np.int32)
    best = np.empty((T, N), np.float32)
    _nearest_lanes(x, cbr, cn, codes, best)
    best += np.einsum("tng,tng->tn", x, x)
    np.maximum(best, 0, out=best)
    return codes, best
