"""Numba CPU kernels (``njit``, parallel over tokens or (request, KV head)): the CPU serving
path's encode and decode attention, and the fast nearest-codeword search used by the HF cache.

Each kernel has a plain-torch twin in :mod:`sglang_tasq.codec`, and the tests hold them to it:

- :func:`nearest` == ``codec.nearest_codeword`` (argmin of ``|c|^2 - 2 x.c``, first index on
  ties). The products are summed in a fixed order, so on exact near-ties (distance gaps at
  float32 rounding) the chosen index can differ from torch's matmul; the chosen codeword's
  distance then equals the minimum up to rounding.
- :func:`pack` / :func:`unpack` == ``codec.pack_codes`` / ``codec.unpack_codes`` (bit-exact).
- :func:`decode_attention` == ``codec.attention_over_codes`` for one query per request at
  position ``S - 1`` (decode), with the pool's sink/recent window rule: a token reads its
  full-precision window entry when it lies in the window of ``S`` and the entry holds it.

Numba compiles each kernel on first use (cached on disk next to this module, ``cache=True``);
``set_threads`` matches Numba's thread count to torch's.
"""
from __future__ import annotations

import math

import numba
import numpy as np
import torch
from numba import njit, prange

_TOKEN_BLOCK = 16
_ARGMIN_CHUNK = 32


def set_threads(n: int | None = None) -> None:
    """Use ``n`` (default: torch's intra-op thread count) threads in the parallel kernels."""
    numba.set_num_threads(max(1, min(n or torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS)))


# ---- nearest codeword -----------------------------------------------------------------------
@njit(cache=True, inline="always", fastmath=True)
def _first_min(dist, lanes, lidx, K, chunk):
    """First index of the minimum of dist[0:K] (no NaN). Per lane i (entries c*chunk + i):
    the minimum and the first chunk c holding it, by selects (vectorizes; a scalar min chain
    would not), then the smallest index among the lanes holding the overall minimum."""
    nfull = K // chunk
    for i in range(chunk):
        lanes[i] = np.float32(np.inf)
        lidx[i] = np.int32(0)
    for c in range(nfull):
        base = c * chunk
        for i in range(chunk):
            v = dist[base + i]
            lt = v < lanes[i]
            lanes[i] = v if lt else lanes[i]
            lidx[i] = np.int32(c) if lt else lidx[i]
    best = np.float32(np.inf)
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


@njit(parallel=True, cache=True, nogil=True, fastmath=True)
def _nearest(x, cbt, cn, chunk, out):
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


def prepare(codebook: torch.Tensor):
    """codebook [H, G, K, g] -> (codewords^T [H*G, g, K], norms [H*G, K]) as float32 numpy."""
    cb = codebook.detach().float().cpu()
    H, G, K, g = cb.shape
    cbt = cb.reshape(H * G, K, g).transpose(1, 2).contiguous().numpy()
    cn = (cb * cb).sum(-1).reshape(H * G, K).contiguous().numpy()
    return cbt, cn


def nearest(x: torch.Tensor, prepared) -> torch.Tensor:
    """x [T, H, G, g] -> codes [T, H, G] int64; ``prepared`` from :func:`prepare`.

    Non-finite inputs fall back to the torch reference (its NaN semantics)."""
    cbt, cn = prepared
    T, H, G, g = x.shape
    xf = x.detach().float().cpu().reshape(T, H * G, g).contiguous()
    if T and not bool(torch.isfinite(xf).all()):
        from sglang_tasq.codec import nearest_codeword

        cb = torch.from_numpy(cbt).transpose(1, 2).reshape(H, G, -1, g)
        return nearest_codeword(x, cb)
    out = np.empty((T, H * G), np.int32)
    if T:
        _nearest(xf.numpy(), cbt, cn, _ARGMIN_CHUNK, out)  # chunk: a runtime value, so loops vectorize
    return torch.from_numpy(out).to(torch.int64).view(T, H, G)


class LayerNearest:
    """Per-layer prepared :func:`nearest` (``make_codebook(layer) -> [H, G, K, g]``); the
    same interface as ``codec.LayerNearest``."""

    def __init__(self, make_codebook):
        self.make, self.cache = make_codebook, {}

    def __call__(self, x: torch.Tensor, layer: int) -> torch.Tensor:
        prep = self.cache.get(layer)
        if prep is None:
            prep = self.cache[layer] = prepare(self.make(layer))
        return nearest(x, prep)


# ---- packing --------------------------------------------------------------------------------
@njit(parallel=True, cache=True, nogil=True)
def _pack(codes, bits, out):
    T, n = codes.shape
    nbytes = out.shape[1]
    for t in prange(T):
        for b in range(nbytes):
            out[t, b] = 0
        for i in range(n):
            c = np.int64(codes[t, i])
            start = i * bits
            byte = start >> 3
            sh = start & 7
            word = c << sh
            k = 0
            while sh + bits > 8 * k:
                out[t, byte + k] |= np.uint8((word >> (8 * k)) & 0xFF)
                k += 1


@njit(parallel=True, cache=True, nogil=True)
def _unpack(packed, n, bits, out):
    T, nbytes = packed.shape
    mask = (np.int64(1) << bits) - 1
    for t in prange(T):
        for i in range(n):
            start = i * bits
            byte = start >> 3
            sh = start & 7
            word = np.int64(0)
            k = 0
            while sh + bits > 8 * k:
                word |= np.int64(packed[t, byte + k]) << (8 * k)
                k += 1
            out[t, i] = (word >> sh) & mask


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes [T, n] -> packed [T, ceil(n*bits/8)] uint8, == codec.pack_codes (range-checked)."""
    from sglang_tasq.codec import packed_row_bytes

    T, n = codes.shape
    if not 1 <= bits <= 32:
        raise ValueError(f"code width {bits} bits is outside 1..32")
    if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= (1 << bits)):
        raise ValueError(f"codes out of range for {bits}-bit packing")
    out = np.empty((T, packed_row_bytes(n, bits)), np.uint8)
    if T:
        _pack(codes.detach().cpu().to(torch.int64).contiguous().numpy(), bits, out)
    return torch.from_numpy(out)


def unpack(packed: torch.Tensor, n: int, bits: int) -> torch.Tensor:
    """packed [T, nbytes] uint8 -> codes [T, n] int64, == codec.unpack_codes."""
    from sglang_tasq.codec import packed_row_bytes

    T, nbytes = packed.shape
    if nbytes != packed_row_bytes(n, bits):
        raise ValueError(f"packed rows have {nbytes} bytes, {n} codes of {bits} bits need {packed_row_bytes(n, bits)}")
    out = np.empty((T, n), np.int64)
    if T:
        _unpack(packed.detach().cpu().contiguous().numpy(), n, bits, out)
    return torch.from_numpy(out)


# ---- decode attention over the packed pool ------------------------------------------------
@njit(cache=True, inline="always")
def _half_to_float(lo, hi):
    """IEEE fp16 from its two little-endian bytes -> float32 (exact)."""
    h = np.int64(lo) | (np.int64(hi) << 8)
    e = (h >> 10) & 0x1F
    m = h & 0x3FF
    if e == 0:
        v = math.ldexp(np.float64(m), -24)
    elif e == 31:
        v = np.inf if m == 0 else np.nan
    else:
        v = math.ldexp(np.float64(m + 1024), e - 25)
    return np.float32(-v if h & 0x8000 else v)


@njit(cache=True, inline="always")
def _unpack_run(buf2d, slot, first, count, bits, dst):
    """dst[0:count] = codes first..first+count-1 of packed row ``slot`` (little-endian bit
    stream, each byte read once; no row view is made: views cost reference counting)."""
    mask = (np.int64(1) << bits) - 1
    start = first * bits
    byte = start >> 3
    buf = np.int64(buf2d[slot, byte]) >> (start & 7)
    nbuf = 8 - (start & 7)
    byte += 1
    for j in range(count):
        while nbuf < bits:
            buf |= np.int64(buf2d[slot, byte]) << nbuf
            byte += 1
            nbuf += 8
        dst[j] = buf & mask
        buf >>= bits
        nbuf -= bits


@njit(parallel=True, cache=True, nogil=True, fastmath=True)
def _decode_attention(q, kbuf, vbuf, indptr, indices, kcb, kperm, vcb, bits_k, bits_v, code_bytes_k,
                      scale_mode, cos_t, sin_t, win_k, win_v, win_pos, sink, recent, sm_scale, out):
    """One (request, KV head) per parallel item. Keys are decoded in the permuted in-group
    layout (folded codewords; the query is permuted instead), rotated there at the token's
    position, dotted with every query head of the GQA group, then scaled; fp32 softmax;
    values decoded and accumulated per group. fastmath: sums are reassociated (vectorized)."""
    B, Hq, d = q.shape
    H, Gk, _, gk = kcb.shape
    Gv, gv = vcb.shape[1], vcb.shape[3]
    rep = Hq // H
    hg = gk // 2
    has_win = win_pos.shape[1] > 0
    for item in prange(B * H):
        b = item // H
        h = item - b * H
        beg = indptr[b]
        S = indptr[b + 1] - beg
        qp = np.empty((rep, d), np.float32)
        for r in range(rep):
            for c in range(d):
                qp[r, c] = q[b, h * rep + r, kperm[h, c]]
        pidx = np.empty(d // 2, np.int64)  # native RoPE pair of each permuted pair
        for j in range(Gk):
            for l in range(hg):
                pidx[j * hg + l] = kperm[h, j * gk + l]
        logits = np.empty((rep, max(S, 1)), np.float32)
        kp = np.empty(d, np.float32)
        kr = np.empty(d, np.float32)
        zk = np.empty(Gk, np.int64)
        zv = np.empty(Gv, np.int64)
        for t in range(S):
            widx = -1
            if has_win and (t < sink or t >= S - recent):
                wi = t if t < sink else sink + t % recent
                if win_pos[b, wi] == t:
                    widx = wi
            s = np.float32(1.0)
            if widx >= 0:
                for c in range(d):
                    kp[c] = win_k[b, widx, h, kperm[h, c]]
            else:
                slot = indices[beg + t]
                if scale_mode == 1:
                    s = _half_to_float(kbuf[slot, code_bytes_k], kbuf[slot, code_bytes_k + 1])
                elif scale_mode == 2:
                    s = _half_to_float(kbuf[slot, code_bytes_k + 2 * h], kbuf[slot, code_bytes_k + 2 * h + 1])
                _unpack_run(kbuf, slot, h * Gk, Gk, bits_k, zk)
                for j in range(Gk):
                    z = zk[j]
                    for l in range(gk):
                        kp[j * gk + l] = kcb[h, j, z, l]
            for j in range(Gk):
                for l in range(hg):
                    c = cos_t[t, pidx[j * hg + l]]
                    sn = sin_t[t, pidx[j * hg + l]]
                    a = kp[j * gk + l]
                    bb = kp[j * gk + hg + l]
                    kr[j * gk + l] = a * c - bb * sn
                    kr[j * gk + hg + l] = bb * c + a * sn
            s *= sm_scale
            for r in range(rep):
                acc = np.float32(0.0)
                for c in range(d):
                    acc += qp[r, c] * kr[c]
                logits[r, t] = acc * s
        for r in range(rep):
            m = np.float32(-np.inf)
            for t in range(S):
                m = max(m, logits[r, t])
            tot = np.float32(0.0)
            for t in range(S):
                e = np.float32(math.exp(logits[r, t] - m))
                logits[r, t] = e
                tot += e
            inv = np.float32(1.0) / tot if S > 0 else np.float32(0.0)
            for t in range(S):
                logits[r, t] *= inv
        acc_o = np.zeros((rep, d), np.float32)
        for t in range(S):
            widx = -1
            if has_win and (t < sink or t >= S - recent):
                wi = t if t < sink else sink + t % recent
                if win_pos[b, wi] == t:
                    widx = wi
            if widx >= 0:
                for r in range(rep):
                    p = logits[r, t]
                    for c in range(d):
                        acc_o[r, c] += p * win_v[b, widx, h, c]
            else:
                _unpack_run(vbuf, indices[beg + t], h * Gv, Gv, bits_v, zv)
                for j in range(Gv):
                    z = zv[j]
                    for r in range(rep):
                        p = logits[r, t]
                        for l in range(gv):
                            acc_o[r, j * gv + l] += p * vcb[h, j, z, l]
        for r in range(rep):
            for c in range(d):
                out[b, h * rep + r, c] = acc_o[r, c]


class DecodeTables:
    """One layer's codebooks as the decode kernel reads them (float32 numpy)."""

    def __init__(self, cb, layer: int):
        if cb.k_unmix is not None:
            raise NotImplementedError("the CPU decode kernel serves diagonal (or no) key weighting; "
                                      "the dense-weighting ablation uses the reference path")
        self.kcb = cb.k_codebook[layer].detach().float().contiguous().numpy()
        self.kperm = cb.k_perm[layer].detach().to(torch.int64).contiguous().numpy()
        self.vcb = cb.v_codebook[layer].detach().float().contiguous().numpy()


_SCALE_MODE = {"none": 0, "shared": 1, "per_head": 2}
_EMPTY_WIN = (np.zeros((0, 0, 0, 0), np.float32), np.zeros((0, 0, 0, 0), np.float32), np.zeros((0, 0), np.int64))


def decode_attention(q: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, kv_indptr: torch.Tensor,
                     kv_indices: torch.Tensor, tables: DecodeTables, cfg, code_bytes_k: int,
                     cos: torch.Tensor, sin: torch.Tensor, sm_scale: float,
                     win_k: torch.Tensor | None = None, win_v: torch.Tensor | None = None,
                     win_pos: torch.Tensor | None = None) -> torch.Tensor:
    """Decode attention of one layer over packed codes, all requests in one call.

    q [B, Hq, d] post-RoPE queries (request b at position ``S_b - 1``); k_rows [rows, Bk+Bs]
    and v_rows [rows, Bv] uint8 pool buffers; request b's tokens (positions 0..S_b-1) sit at
    slots ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]``; cos/sin [>= max S, d/2] float32 RoPE
    tables (attention scaling included); optional windows: win_k/win_v [B, W, H, d] pre-RoPE
    (any float dtype), win_pos [B, W] int64 (-1 empty), with ``cfg.sink_window`` /
    ``cfg.recent_window``. Returns [B, Hq, d] float32.
    """
    B, Hq, d = q.shape
    out = np.empty((B, Hq, d), np.float32)
    if win_pos is None:
        wk, wv, wp = _EMPTY_WIN
    else:
        wk = win_k.detach().float().contiguous().numpy()
        wv = win_v.detach().float().contiguous().numpy()
        wp = win_pos.detach().to(torch.int64).contiguous().numpy()
    _decode_attention(q.detach().float().contiguous().numpy(), k_rows.numpy(), v_rows.numpy(),
                      kv_indptr.to(torch.int64).numpy(), kv_indices.to(torch.int64).numpy(),
                      tables.kcb, tables.kperm, tables.vcb, cfg.code_bits_k, cfg.code_bits_v, code_bytes_k,
                      _SCALE_MODE[cfg.scale], cos.float().contiguous().numpy(), sin.float().contiguous().numpy(),
                      wk, wv, wp, cfg.sink_window, cfg.recent_window, np.float32(sm_scale), out)
    return torch.from_numpy(out)
