"""Weighted k-means++ seeding (Arthur & Vassilvitskii 2007), one codebook per thread.

Classic k-means++: the first centroid is drawn with probability proportional to the point
weight ``w``, every next one with probability proportional to ``w * D^2`` (D: distance to the
nearest centroid chosen so far), one centroid per draw, over all points. The uniform numbers
of the draws come from the caller (a seeded torch generator), so the result does not depend
on the thread count. g == 8 (the unrolled update). Points are read transposed and padded to
whole blocks with zero-weight points (``[B, 8, Np]``: points across SIMD lanes, constant trip
counts so the update vectorizes); the sum of ``w * D^2`` is kept per block, so a draw scans
blocks, then one block.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from ._common import _BIG

_BLOCK = 256


@njit(cache=True, inline="always")
def _draw(w, d2, bsum, nblk, N, u):
    """Index drawn with probability proportional to w * d2 (uniform when all are zero)."""
    total = 0.0
    for b in range(nblk):
        total += bsum[b]
    if not total > 0.0:
        return min(N - 1, int(u * N))
    target = u * total
    acc = 0.0
    b = 0
    while b < nblk - 1 and acc + bsum[b] <= target:
        acc += bsum[b]
        b += 1
    last = -1
    for i in range(b * _BLOCK, min(N, (b + 1) * _BLOCK)):
        p = np.float64(w[i]) * d2[i]
        if p > 0.0:
            last = i
            acc += p
            if acc > target:
                return i
    if last >= 0:  # rounding: the target fell past the block's last positive term
        return last
    for i in range(N - 1, -1, -1):  # the block sum was stale by rounding: any positive term
        if np.float64(w[i]) * d2[i] > 0.0:
            return i
    return min(N - 1, int(u * N))


@njit(cache=True, nogil=True, fastmath=True)
def _seed_one(xt, w, u, n, out):
    """One codebook: xt [8, Np] f32 points (transposed, padded to whole blocks with
    zero-weight points), w [Np] f32 >= 0, u [K] f64 uniforms in [0, 1), n the real point
    count -> out [K, 8] f32 centroids (copies of drawn points)."""
    Np = xt.shape[1]
    nblk = Np // _BLOCK
    d2 = np.ones(Np, np.float32)  # the first draw: probability proportional to w
    bsum = np.zeros(nblk, np.float64)
    for blk in range(nblk):
        s = 0.0
        for i in range(blk * _BLOCK, blk * _BLOCK + _BLOCK):
            s += w[i]
        bsum[blk] = s
    x0, x1, x2, x3, x4, x5, x6, x7 = xt[0], xt[1], xt[2], xt[3], xt[4], xt[5], xt[6], xt[7]
    for k in range(out.shape[0]):
        idx = _draw(w, d2, bsum, nblk, n, u[k])
        c0, c1, c2, c3 = x0[idx], x1[idx], x2[idx], x3[idx]
        c4, c5, c6, c7 = x4[idx], x5[idx], x6[idx], x7[idx]
        out[k, 0], out[k, 1], out[k, 2], out[k, 3] = c0, c1, c2, c3
        out[k, 4], out[k, 5], out[k, 6], out[k, 7] = c4, c5, c6, c7
        if k == 0:
            d2[:] = _BIG
        for blk in range(nblk):  # d2 <- min(d2, |x - c|^2), block sums of w * d2 (vectorized)
            s = np.float32(0.0)
            for i in range(blk * _BLOCK, blk * _BLOCK + _BLOCK):
                e0, e1, e2, e3 = x0[i] - c0, x1[i] - c1, x2[i] - c2, x3[i] - c3
                e4, e5, e6, e7 = x4[i] - c4, x5[i] - c5, x6[i] - c6, x7[i] - c7
                v = min(e0 * e0 + e1 * e1 + e2 * e2 + e3 * e3 + e4 * e4 + e5 * e5 + e6 * e6 + e7 * e7, d2[i])
                d2[i] = v
                s += w[i] * v
            bsum[blk] = s


@njit(parallel=True, cache=True, nogil=True)
def _kmeanspp(xt, w, u, n, out):
    """B codebooks, one per thread: xt [B, 8, Np], w [B, Np], u [B, K] -> out [B, K, 8]."""
    for b in prange(xt.shape[0]):
        _seed_one(xt[b], w[b], u[b], n, out[b])


def kmeanspp(x: np.ndarray, w: np.ndarray, u: np.ndarray) -> np.ndarray:
    """x [B, N, g] float32, w [B, N] float32 >= 0, u [B, K] float64 in [0, 1) -> centroids
    [B, K, g] float32 by weighted k-means++."""
    B, N, g = x.shape
    if g != 8:
        raise ValueError(f"the Numba k-means++ seeds g == 8 codebooks; got g={g}")
    Np = -(-N // _BLOCK) * _BLOCK
    xt = np.zeros((B, g, Np), np.float32)
    xt[:, :, :N] = x.transpose(0, 2, 1)
    wp = np.zeros((B, Np), np.float32)
    wp[:, :N] = w
    out = np.empty((B, u.shape[1], g), np.float32)
    _kmeanspp(xt, wp, np.ascontiguousarray(u, np.float64), N, out)
    return out
