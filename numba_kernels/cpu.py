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
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

_TOKEN_BLOCK = 16
_ARGMIN_CHUNK = 32
# Sentinel of the running minima / maxima: fastmath=True lets LLVM assume no infinities (ninf),
# so an inf sentinel would be undefined behaviour (free to differ by CPU and call); FLT_MAX is
# finite. Inputs are finite: the encoder checks them, the decode kernel gets model activations.
_BIG = np.float32(3.4028235e38)


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


_nearest = njit(parallel=True, cache=True, nogil=True, fastmath=True)(_nearest_py)
_nearest_serial = njit(cache=True, nogil=True, fastmath=True)(_nearest_py)  # small batches: no thread launch
_SERIAL_BELOW = 64  # tokens
_LANES = 64  # tokens per block of the lane kernel


@njit(parallel=True, cache=True, nogil=True, fastmath=True)
def _nearest_lanes(x, cbr, cn, out):
    """g == 8, many tokens: x [T, N, 8], cbr [N, K, 8] (codeword rows), cn [N, K] -> out [T, N].

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
        xt = np.zeros((8, _LANES), np.float32)  # -2 x, transposed; padding lanes stay 0
        for i in range(nt):
            for j in range(8):
                xt[j, i] = np.float32(-2.0) * x[t0 + i, n, j]
        best = np.full(_LANES, _BIG, np.float32)
        arg = np.zeros(_LANES, np.int32)
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
        if K % 2:
            k = K - 1
            for i in range(_LANES):
                dk = cn[n, k]
                for j in range(8):
                    dk += xt[j, i] * cbr[n, k, j]
                if dk < best[i]:
                    best[i] = dk
                    arg[i] = np.int32(k)
        for i in range(nt):
            out[t0 + i, n] = arg[i]


def _search(x: np.ndarray, prepared, out: np.ndarray) -> None:
    """out [T, N] int32 <- nearest codeword of each x [T, N, g] (finite float32): the lane
    kernel for g == 8 and >= 64 tokens, the codeword-vector kernel otherwise (serial below
    64 tokens: no thread launch for a decode step)."""
    cbt, cn, cbr = prepared
    T, g = x.shape[0], x.shape[2]
    if T >= _SERIAL_BELOW and g == 8:
        _nearest_lanes(x, cbr, cn, out)
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
    from sglang_tasq.packing import packed_row_bytes

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
    from sglang_tasq.packing import packed_row_bytes

    T, nbytes = packed.shape
    if nbytes != packed_row_bytes(n, bits):
        raise ValueError(f"packed rows have {nbytes} bytes, {n} codes of {bits} bits need {packed_row_bytes(n, bits)}")
    out = np.empty((T, n), np.int64)
    if T:
        _unpack(packed.detach().cpu().contiguous().numpy(), n, bits, out)
    return torch.from_numpy(out)


# ---- decode attention over the packed pool ------------------------------------------------
@intrinsic
def _half_bits_to_f32(typingctx, bits):
    """uint16 IEEE fp16 bits -> float32 (exact: LLVM fpext)."""
    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
    return types.float32(types.uint16), codegen


@intrinsic
def _f32_to_half_bits(typingctx, x):
    """float32 -> uint16 fp16 bits, round to nearest even (LLVM fptrunc, as torch's .half())."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))
    return types.uint16(types.float32), codegen


@intrinsic
def _bf16_bits_to_f32(typingctx, bits):
    """uint16 bfloat16 bits -> float32 (exact)."""
    def codegen(context, builder, signature, args):
        w = builder.shl(builder.zext(args[0], ir.IntType(32)), ir.Constant(ir.IntType(32), 16))
        return builder.bitcast(w, ir.FloatType())
    return types.float32(types.uint16), codegen


@intrinsic
def _f32_bits(typingctx, x):
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))
    return types.uint32(types.float32), codegen


@njit(cache=True, inline="always")
def _f32_to_bf16_bits(x):
    """float32 -> bfloat16 bits, round to nearest even (as torch's .to(bfloat16)); NaN stays NaN."""
    u = np.uint32(_f32_bits(x))
    if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
        return np.uint16((u >> np.uint32(16)) | np.uint32(0x40))
    return np.uint16((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))


@njit(cache=True, inline="always")
def _codes_of(buf2d, slot, first, n, bits, out):
    """out[:n] = codes first..first+n-1 of packed row ``slot`` (bits <= 56), each byte read
    once, in order; never reads past the byte holding the last code's top bit."""
    pos = first * bits
    byte = pos >> 3
    acc = np.int64(buf2d[slot, byte]) >> (pos & 7)
    nacc = 8 - (pos & 7)
    byte += 1
    mask = (np.int64(1) << bits) - 1
    for j in range(n):
        while nacc < bits:
            acc |= np.int64(buf2d[slot, byte]) << nacc
            byte += 1
            nacc += 8
        out[j] = acc & mask
        acc >>= bits
        nacc -= bits


@njit(cache=True, inline="always")
def _window_entry(entry_of, slot, t, S, sink, recent):
    """Exact-store entry read for position t of a request of length S (the window rule of
    ``sglang_tasq.windows``: t < sink or t >= S - recent) held in ``slot``, or -1 (codes)."""
    if entry_of.shape[0] > 0 and (t < sink or t >= S - recent):
        e = entry_of[slot]
        if e > 0:
            return e
    return -1


@njit(parallel=True, cache=True, nogil=True, fastmath=True)
def _decode_attention(q, kbuf, vbuf, indptr, indices, kcb, kperm, kw, vcb, bits_k, bits_v, code_bytes_k,
                      scale_mode, cos_t, sin_t, entry_of, win_k, win_v, sink, recent, sm_scale,
                      chunk, nsplit, part_m, part_l, part_o, out):
    """One (request, KV head, token split) per parallel item (split-K: a request's tokens in
    ranges of ``chunk`` positions, ``nsplit`` slots for the longest request; a split past a
    request's end is empty), so a batch of one still fills every thread, and a request's
    answer depends on its own tokens only, not on the batch it runs in (batch invariance).
    Keys are decoded in the permuted in-group layout from the tailored codebook ``kcb`` (the
    encoder's own array, so a decode step reads each codebook once; ``kw`` [H, d] the weight of
    each permuted element, divided out through the query) as the
    first and second elements of each RoPE pair, and the rotation at the token's position is
    folded into the dot with every query head of the GQA group (one flat loop over pairs),
    then scaled; fp32 softmax; values decoded and accumulated per group. Each split leaves its
    max logit, exp-sum and unnormalized output in part_m/part_l/part_o; a second pass merges
    the splits. Each token's codes are unpacked in one pass over its bytes. A token inside the
    window of S is read from its slot's bf16 exact-store entry (``entry_of[slot]``, 0 = none;
    ``win_k``/``win_v`` [E + 1, 1, H, d]) in native pair order (no permutation to gather). fastmath: sums are reassociated (vectorized)."""
    B, Hq, d = q.shape
    H, Gk, _, gk = kcb.shape
    Gv, gv = vcb.shape[1], vcb.shape[3]
    rep = Hq // H
    hg = gk // 2
    for item in prange(B * H * nsplit):
        bh = item // nsplit
        b = bh // H
        h = bh - b * H
        beg = indptr[b]
        S = indptr[b + 1] - beg
        t_lo = min(S, (item - bh * nsplit) * chunk)
        t_hi = min(S, t_lo + chunk)
        P = d // 2  # RoPE pairs, in permuted order (group j holds pairs j*hg .. j*hg+hg-1)
        # the query's first / second element of each permuted pair, over the codeword weight of
        # the first (qa, qb2) or second (qb, qa2) element: codewords are read in the tailored
        # space (key element = codeword / weight, the division folded into the query)
        qa = np.empty((rep, P), np.float32)
        qb = np.empty((rep, P), np.float32)
        qa2 = np.empty((rep, P), np.float32)
        qb2 = np.empty((rep, P), np.float32)
        pidx = np.empty(P, np.int64)  # native RoPE pair of each permuted pair
        for j in range(Gk):
            for l in range(hg):
                p = j * hg + l
                pidx[p] = kperm[h, j * gk + l]
                wa = kw[h, j * gk + l]
                wb = kw[h, j * gk + hg + l]
                for r in range(rep):
                    xa = q[b, h * rep + r, kperm[h, j * gk + l]]
                    xb = q[b, h * rep + r, kperm[h, j * gk + hg + l]]
                    qa[r, p] = xa / wa
                    qb[r, p] = xb / wb
                    qa2[r, p] = xa / wb
                    qb2[r, p] = xb / wa
        logits = np.empty((rep, max(t_hi - t_lo, 1)), np.float32)
        na = np.empty((rep, P), np.float32)  # the same in native pair order (window entries)
        nb = np.empty((rep, P), np.float32)
        for r in range(rep):
            for p in range(P):
                na[r, p] = q[b, h * rep + r, p]
                nb[r, p] = q[b, h * rep + r, P + p]
        zs = np.empty(max(Gk, Gv), np.int64)
        ka = np.empty(P, np.float32)
        kb_ = np.empty(P, np.float32)
        cs = np.empty(P, np.float32)
        sn_ = np.empty(P, np.float32)
        for t in range(t_lo, t_hi):
            slot = indices[beg + t]
            widx = _window_entry(entry_of, slot, t, S, sink, recent)
            s = np.float32(1.0)
            if widx >= 0:  # bf16 window entry: native pair order (contiguous halves and RoPE rows)
                for p in range(P):
                    ka[p] = _bf16_bits_to_f32(win_k[widx, 0, h, p])
                    kb_[p] = _bf16_bits_to_f32(win_k[widx, 0, h, P + p])
                for r in range(rep):
                    acc = np.float32(0.0)
                    for p in range(P):
                        acc += cos_t[t, p] * (na[r, p] * ka[p] + nb[r, p] * kb_[p]) + sin_t[t, p] * (nb[r, p] * ka[p] - na[r, p] * kb_[p])
                    logits[r, t - t_lo] = acc * sm_scale
                continue
            else:
                if scale_mode == 1:
                    s = _half_bits_to_f32(np.uint16(kbuf[slot, code_bytes_k]) | (np.uint16(kbuf[slot, code_bytes_k + 1]) << 8))
                elif scale_mode == 2:
                    o = code_bytes_k + 2 * h
                    s = _half_bits_to_f32(np.uint16(kbuf[slot, o]) | (np.uint16(kbuf[slot, o + 1]) << 8))
                _codes_of(kbuf, slot, h * Gk, Gk, bits_k, zs)
                for j in range(Gk):
                    z = zs[j]
                    for l in range(hg):
                        ka[j * hg + l] = kcb[h, j, z, l]
                        kb_[j * hg + l] = kcb[h, j, z, hg + l]
            for p in range(P):
                cs[p] = cos_t[t, pidx[p]]
                sn_[p] = sin_t[t, pidx[p]]
            s *= sm_scale
            for r in range(rep):  # q . RoPE_t(k) = sum_p cos (qa ka + qb kb) + sin (qb ka - qa kb): flat, vectorizes
                acc = np.float32(0.0)
                for p in range(P):
                    acc += cs[p] * (qa[r, p] * ka[p] + qb[r, p] * kb_[p]) + sn_[p] * (qb2[r, p] * ka[p] - qa2[r, p] * kb_[p])
                logits[r, t - t_lo] = acc * s
        for r in range(rep):
            m = -_BIG
            for i in range(t_hi - t_lo):
                m = max(m, logits[r, i])
            tot = np.float32(0.0)
            for i in range(t_hi - t_lo):
                e = np.float32(math.exp(logits[r, i] - m))
                logits[r, i] = e
                tot += e
            part_m[item, r] = m
            part_l[item, r] = tot
        acc_o = np.zeros((rep, d), np.float32)
        vt = np.empty(d, np.float32)
        for t in range(t_lo, t_hi):
            slot = indices[beg + t]
            widx = _window_entry(entry_of, slot, t, S, sink, recent)
            if widx >= 0:
                for r in range(rep):
                    p = logits[r, t - t_lo]
                    for c in range(d):
                        acc_o[r, c] += p * _bf16_bits_to_f32(win_v[widx, 0, h, c])
            else:  # decode the value row, then one d-long axpy per query head (vectorizes)
                _codes_of(vbuf, slot, h * Gv, Gv, bits_v, zs)
                for j in range(Gv):
                    z = zs[j]
                    for l in range(gv):
                        vt[j * gv + l] = vcb[h, j, z, l]
                for r in range(rep):
                    p = logits[r, t - t_lo]
                    for c in range(d):
                        acc_o[r, c] += p * vt[c]
        for r in range(rep):
            for c in range(d):
                part_o[item, r, c] = acc_o[r, c]
    for bh in prange(B * H):  # merge the splits: rescale each to the common max
        b = bh // H
        h = bh - b * H
        for r in range(rep):
            mx = -_BIG
            for sp in range(nsplit):
                if part_l[bh * nsplit + sp, r] > 0:
                    mx = max(mx, part_m[bh * nsplit + sp, r])
            tot = np.float32(0.0)
            o = np.zeros(d, np.float32)
            for sp in range(nsplit):
                it = bh * nsplit + sp
                if part_l[it, r] > 0:
                    w = np.float32(math.exp(part_m[it, r] - mx))
                    tot += w * part_l[it, r]
                    for c in range(d):
                        o[c] += w * part_o[it, r, c]
            inv = np.float32(1.0) / tot if tot > 0 else np.float32(0.0)
            for c in range(d):
                out[b, h * rep + r, c] = o[c] * inv


SPLIT_TOKENS = 256  # positions per split-K range of the decode kernel


class DecodeTables:
    """One layer's codebooks as the decode kernel reads them (float32 numpy): the tailored key
    codebook (codewords times the diagonal weights, :meth:`Codebooks.tailored_k_codebook`)
    with the weights in the permuted layout, and the value codebook.

    ``prepared``: the :class:`PoolEncoder`'s ``(keys, values)`` :func:`prepare` output of this
    layer; the tables then are views of the encoder's codeword rows, so a decode step's encode
    and attention read one copy of each codebook (on a CPU the codebooks of 30 layers do not
    stay in cache, and the decode kernel is bound by those reads). Zero weights (never from
    calibration) fall back to the raw key codebook with unit weights."""

    def __init__(self, cb, layer: int, prepared=None):
        if cb.k_unmix is not None:
            raise NotImplementedError("the CPU decode kernel serves diagonal (or no) key weighting; "
                                      "the dense-weighting ablation uses the reference path")
        H, G, K, g = cb.k_codebook[layer].shape
        self.kperm = cb.k_perm[layer].detach().to(torch.int64).contiguous().numpy()
        w = torch.gather(cb.k_weight[layer].detach().float(), 1, cb.k_perm[layer].detach().to(torch.int64))
        if bool((w != 0).all()):
            if prepared is None:
                prepared = (prepare(cb.tailored_k_codebook(layer)), prepare(cb.v_codebook[layer]))
            self.kcb = prepared[0][2].reshape(H, G, K, g)
            self.kw = w.contiguous().numpy()
        else:
            self.kcb = cb.k_codebook[layer].detach().float().contiguous().numpy()
            self.kw = np.ones((H, G * g), np.float32)
        v = cb.v_codebook[layer]
        self.vcb = (prepared[1][2].reshape(tuple(v.shape)) if prepared is not None
                    else v.detach().float().contiguous().numpy())


_SCALE_MODE = {"none": 0, "shared": 1, "per_head": 2}
_NO_RING = (np.zeros((1, 1, 1, 1), np.uint16), np.full((1, 1), -1, np.int64))


def _u16(t: torch.Tensor) -> np.ndarray:
    """A 16-bit float tensor's bits as a uint16 numpy array (no copy when contiguous)."""
    return t.contiguous().view(torch.int16).numpy().view(np.uint16)


class DecodePlan:
    """The per-forward arguments of :func:`decode_attention` (request layout, windows, RoPE
    tables, split-K buffers), converted once and reused by every layer of a decode step.

    kv_indptr [B+1] / kv_indices: request b's tokens (positions 0..S_b-1) sit at slots
    ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]``; cos/sin [>= max S, d/2] float32 RoPE tables
    (attention scaling included); entry_of [slots] int64: each slot's exact-store entry (0 =
    none; read through a view, so entries assigned after the plan is built are seen), None
    without windows. split_tokens: positions per split-K range (default
    :data:`SPLIT_TOKENS`); fixed, not chosen from the batch, so every request gets the same
    floating-point answer alone or in any batch.
    """

    def __init__(self, kv_indptr: torch.Tensor, kv_indices: torch.Tensor, cfg, code_bytes_k: int,
                 num_q_heads: int, num_kv_heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor,
                 entry_of: torch.Tensor | None = None, split_tokens: int | None = None):
        self.cfg, self.code_bytes_k = cfg, code_bytes_k
        self.indptr = kv_indptr.to(torch.int64).contiguous().numpy()
        self.indices = kv_indices.to(torch.int64).contiguous().numpy()
        B = self.B = len(self.indptr) - 1
        Hq, H, d = self.shape = num_q_heads, num_kv_heads, head_dim
        self.cos = cos.float().contiguous().numpy()
        self.sin = sin.float().contiguous().numpy()
        if entry_of is None:
            self.entry_of = np.zeros(0, np.int64)
        else:
            if entry_of.dtype != torch.int64 or not entry_of.is_contiguous():
                raise TypeError("entry_of must be a contiguous int64 tensor (it is read through a view)")
            self.entry_of = entry_of.numpy()
        max_len = int((self.indptr[1:] - self.indptr[:-1]).max()) if B else 0
        self.chunk = int(split_tokens or SPLIT_TOKENS)
        if self.chunk < 1:
            raise ValueError(f"split_tokens must be >= 1, got {split_tokens}")
        ns = self.nsplit = max(1, -(-max_len // self.chunk))
        rep = Hq // H
        self.part_m = np.empty((B * H * ns, rep), np.float32)
        self.part_l = np.empty((B * H * ns, rep), np.float32)
        self.part_o = np.empty((B * H * ns, rep, d), np.float32)
        self.scale_mode = _SCALE_MODE[cfg.scale]

    def __call__(self, q: torch.Tensor, k_rows, v_rows, tables: DecodeTables, sm_scale: float,
                 win_k=None, win_v=None) -> torch.Tensor:
        """One layer: q [B, Hq, d] post-RoPE queries (request b at position ``S_b - 1``);
        k_rows [rows, Bk+Bs] and v_rows [rows, Bv] uint8 pool buffers; win_k/win_v [E + 1, 1, H, d]
        bfloat16 pre-RoPE exact entries (tensors, or their uint16 numpy views). -> [B, Hq, d] f32."""
        B, (Hq, H, d) = self.B, self.shape
        if tuple(q.shape) != (B, Hq, d):
            raise ValueError(f"decode plan: q has shape {tuple(q.shape)}, planned for {(B, Hq, d)}")
        out = np.empty((B, Hq, d), np.float32)
        if not B:
            return torch.from_numpy(out)
        if win_k is None or not self.entry_of.shape[0]:
            wk = wv = _NO_RING[0]
        else:
            for w in (win_k, win_v):
                if isinstance(w, torch.Tensor) and w.dtype != torch.bfloat16:
                    raise TypeError(f"window entries must be bfloat16, got {w.dtype}")
            wk, wv = _arr(win_k, _u16), _arr(win_v, _u16)
        cfg = self.cfg
        _decode_attention(q.detach().float().contiguous().numpy(), _arr(k_rows, torch.Tensor.numpy),
                          _arr(v_rows, torch.Tensor.numpy), self.indptr, self.indices, tables.kcb, tables.kperm,
                          tables.kw, tables.vcb, cfg.code_bits_k, cfg.code_bits_v, self.code_bytes_k, self.scale_mode,
                          self.cos, self.sin, self.entry_of, wk, wv, cfg.sink_window, cfg.recent_window,
                          np.float32(sm_scale), self.chunk, self.nsplit, self.part_m, self.part_l, self.part_o, out)
        return torch.from_numpy(out)


def decode_attention(q: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, kv_indptr: torch.Tensor,
                     kv_indices: torch.Tensor, tables: DecodeTables, cfg, code_bytes_k: int,
                     cos: torch.Tensor, sin: torch.Tensor, sm_scale: float,
                     entry_of: torch.Tensor | None = None, win_k: torch.Tensor | None = None,
                     win_v: torch.Tensor | None = None, split_tokens: int | None = None) -> torch.Tensor:
    """Decode attention of one layer over packed codes, all requests in one call (a one-layer
    :class:`DecodePlan`; see it for the arguments; win_k/win_v [E + 1, H, d] or [E + 1, 1, H, d]).
    Returns [B, Hq, d] f32."""
    B, Hq, d = q.shape
    plan = DecodePlan(kv_indptr, kv_indices, cfg, code_bytes_k, Hq, tables.kcb.shape[0], d, cos, sin,
                      entry_of.to(torch.int64).contiguous() if entry_of is not None else None, split_tokens)
    if win_k is not None and win_k.dim() == 3:
        win_k, win_v = win_k.unsqueeze(1), win_v.unsqueeze(1)
    return plan(q, k_rows, v_rows, tables, sm_scale, win_k if entry_of is not None else None,
                win_v if entry_of is not None else None)


# ---- fused pool encode ----------------------------------------------------------------------
def _tailor_keys_py(k, pos, cos_t, sin_t, w, kperm, scale_mode, gk, kpre, x, scale_bits):
    """Post-RoPE keys k [T, H, d] f32 at positions pos -> pre-RoPE keys kpre [T, H, d] (the
    inverse rotation of ``rope.rotate``, same float ops), tailored keys x [T, H*Gk, gk] in the
    permuted group layout (weights w, fp16 RMS scale, as ``codec.key_tailor``) and the scale
    bits scale_bits [T, Hs] (uint16 fp16; Hs = 1 shared, H per-head, unused for none)."""
    T, H, d = k.shape
    half = d // 2
    Gk = d // gk
    for t in prange(T):
        p = pos[t]
        for h in range(H):
            for i in range(half):
                c = cos_t[p, i]
                sn = sin_t[p, i]
                norm = c * c + sn * sn
                ci = c / norm
                si = -sn / norm
                a = k[t, h, i]
                b = k[t, h, i + half]
                kpre[t, h, i] = a * ci - b * si
                kpre[t, h, i + half] = b * ci + a * si
        kw = np.empty((H, d), np.float32)
        tot = 0.0
        for h in range(H):
            acc = 0.0
            for c in range(d):
                v = kpre[t, h, c] * w[h, c]
                kw[h, c] = v
                acc += np.float64(v) * np.float64(v)
            if scale_mode == 2:
                sb = _f32_to_half_bits(max(np.float32(math.sqrt(acc / d)), np.float32(1e-6)))
                scale_bits[t, h] = sb
                sf = _half_bits_to_f32(sb)
                for c in range(d):
                    kw[h, c] = kw[h, c] / sf
            tot += acc
        if scale_mode == 1:
            sb = _f32_to_half_bits(max(np.float32(math.sqrt(tot / (H * d))), np.float32(1e-6)))
            scale_bits[t, 0] = sb
            sf = _half_bits_to_f32(sb)
            for h in range(H):
                for c in range(d):
                    kw[h, c] = kw[h, c] / sf
        for h in range(H):
            for j in range(Gk):
                for l in range(gk):
                    x[t, h * Gk + j, l] = kw[h, kperm[h, j * gk + l]]


_tailor_keys = njit(parallel=True, cache=True, nogil=True)(_tailor_keys_py)
_tailor_keys_serial = njit(cache=True, nogil=True)(_tailor_keys_py)


@njit(cache=True, inline="always")
def _pack_row(codes, t, n, bits, buf, slot, nbytes):
    """buf[slot, :nbytes] = codes[t, :n] packed (little-endian bit stream, codec.pack_codes)."""
    for b in range(nbytes):
        buf[slot, b] = 0
    for i in range(n):
        start = i * bits
        word = np.int64(codes[t, i]) << (start & 7)
        byte = start >> 3
        k = 0
        while (start & 7) + bits > 8 * k:
            buf[slot, byte + k] |= np.uint8((word >> (8 * k)) & 0xFF)
            k += 1


def _write_rows_py(kcodes, scale_bits, vcodes, bits_k, bits_v, code_bytes_k, loc, kbuf, vbuf,
                   kpre, v, wring, widx, win_k, win_v):
    """Pack codes [T, n] into pool rows ``loc`` (key row: codes ++ fp16 scale bytes, little
    endian), and store the window tokens (wring[t] > 0) as bf16 at [wring[t], widx[t]]."""
    T, nk = kcodes.shape
    nv = vcodes.shape[1]
    Hs = scale_bits.shape[1]
    H, d = kpre.shape[1], kpre.shape[2]
    for t in prange(T):
        slot = loc[t]
        _pack_row(kcodes, t, nk, bits_k, kbuf, slot, code_bytes_k)
        for hs in range(Hs):
            kbuf[slot, code_bytes_k + 2 * hs] = np.uint8(scale_bits[t, hs] & 0xFF)
            kbuf[slot, code_bytes_k + 2 * hs + 1] = np.uint8(scale_bits[t, hs] >> 8)
        _pack_row(vcodes, t, nv, bits_v, vbuf, slot, vbuf.shape[1])
        r = wring[t]
        if r > 0:
            wi = widx[t]
            for h in range(H):
                for c in range(d):
                    win_k[r, wi, h, c] = _f32_to_bf16_bits(kpre[t, h, c])
                    win_v[r, wi, h, c] = _f32_to_bf16_bits(v[t, h, c])


_write_rows = njit(parallel=True, cache=True, nogil=True)(_write_rows_py)
_write_rows_serial = njit(cache=True, nogil=True)(_write_rows_py)


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


@njit(parallel=True, cache=True, nogil=True, fastmath={"nsz", "arcp", "contract", "afn", "reassoc"})
def _encode_small(k, v, pos, cos_t, sin_t, w, kperm, scale_mode, gk, gv, kcbr, kcn, vcbr, vcn, chunk,
                  bits_k, bits_v, code_bytes_k, hs, loc, kbuf, vbuf, wring, widx, win_k, win_v):
    """A decode step's few tokens in one call (one dispatch instead of five): the serial
    :func:`_tailor_keys_serial`, the finiteness check, the nearest codeword of every (token,
    key group) and (token, value group) row spread over the threads, the serial
    :func:`_write_rows_serial`. Returns False, having written nothing, on a non-finite
    tailored key or value (the caller then takes the reference path). fastmath without the
    no-NaN/no-inf flags, which would fold the finiteness check away."""
    T, H, d = k.shape
    kpre = np.empty((T, H, d), np.float32)
    x = np.empty((T, H * (d // gk), gk), np.float32)
    sbits = np.zeros((T, hs), np.uint16)
    _tailor_keys_serial(k, pos, cos_t, sin_t, w, kperm, scale_mode, gk, kpre, x, sbits)
    for e in x.ravel():
        if not np.isfinite(e):
            return False
    for e in v.ravel():
        if not np.isfinite(e):
            return False
    Nk, Nv = x.shape[1], H * (d // gv)
    vx = v.reshape(T, Nv, gv)
    kcodes = np.empty((T, Nk), np.int32)
    vcodes = np.empty((T, Nv), np.int32)
    Kmax = max(kcbr.shape[1], vcbr.shape[1])
    for item in prange(T * (Nk + Nv)):
        t = item // (Nk + Nv)
        n = item - t * (Nk + Nv)
        dist = np.empty(Kmax, np.float32)
        lanes = np.empty(chunk, np.float32)
        lidx = np.empty(chunk, np.int32)
        if n < Nk:
            kcodes[t, n] = _nearest_row(x, t, n, kcbr, kcn, chunk, dist, lanes, lidx)
        else:
            vcodes[t, n - Nk] = _nearest_row(vx, t, n - Nk, vcbr, vcn, chunk, dist, lanes, lidx)
    _write_rows_serial(kcodes, sbits, vcodes, bits_k, bits_v, code_bytes_k, loc, kbuf, vbuf, kpre, v,
                       wring, widx, win_k, win_v)
    return True


def _as_f32(t: torch.Tensor) -> np.ndarray:
    return _np(t, torch.float32)


def _arr(t, make) -> np.ndarray:
    """A numpy array as is (the caller's long-lived view), a tensor through ``make``."""
    return t if isinstance(t, np.ndarray) else make(t)


def _np(t: torch.Tensor, dtype: torch.dtype) -> np.ndarray:
    """``t`` as a contiguous numpy array of ``dtype`` (no copy when it already is one)."""
    if t.dtype != dtype or not t.is_contiguous():
        t = t.detach().to(dtype).contiguous()
    return t.numpy()


class PoolEncoder:
    """Encode one layer's new tokens straight into a TaSQ pool (keys un-rotated, tailored,
    coded, packed; values coded, packed; window tokens copied to their bf16 exact entries).

    Equals the pool's reference path (``rope.apply_rope(inverse) -> codec.key_tailor ->
    codec.nearest_codeword -> codec.pack_codes``) up to float rounding: the shared scale's
    mean is summed in float64 (fp16 result equal but for rare rounding-boundary cases) and
    the argmin has :func:`nearest`'s tie caveat."""

    def __init__(self, cb):
        if cb.k_mix is not None:
            raise NotImplementedError("the CPU pool encoder serves diagonal (or no) key weighting; "
                                      "the dense-weighting ablation uses the reference path")
        self.cb, self.cfg, self.layers = cb, cb.config, {}

    def _layer(self, layer: int):
        tab = self.layers.get(layer)
        if tab is None:
            cb = self.cb
            tab = self.layers[layer] = (
                cb.k_weight[layer].detach().float().contiguous().numpy(),
                cb.k_perm[layer].detach().to(torch.int64).contiguous().numpy(),
                prepare(cb.tailored_k_codebook(layer)), prepare(cb.v_codebook[layer]))
        return tab

    def prepared(self, layer: int):
        """(keys, values) :func:`prepare` output of ``layer`` (for :class:`DecodeTables`)."""
        _, _, kprep, vprep = self._layer(layer)
        return kprep, vprep

    def encode_into(self, layer: int, k_post: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                    cos: torch.Tensor, sin: torch.Tensor, loc: torch.Tensor, k_rows: torch.Tensor,
                    v_rows: torch.Tensor, code_bytes_k: int, wring: torch.Tensor | None = None,
                    widx: torch.Tensor | None = None, win_k: torch.Tensor | None = None,
                    win_v: torch.Tensor | None = None) -> bool:
        """k_post/v [T, H, d] (any float dtype), positions [T] (< len(cos)), loc [T] slots of
        k_rows/v_rows (uint8 pool buffers, written in place); optional window targets wring [T]
        (exact-store entry, 0 = none) and widx [T] (0) into bf16 entries win_k/win_v [E + 1, 1, H, d]
        (tensors or uint16 numpy views; the pool passes views made once).

        Returns False, having written nothing, when a tailored key or a value is not finite
        (the caller then uses the reference path, whose argmin defines that case)."""
        cfg = self.cfg
        T, H, d = k_post.shape
        if T == 0:
            return True
        for buf in (k_rows, v_rows, win_k, win_v):
            if buf is not None and not (buf.flags.c_contiguous if isinstance(buf, np.ndarray) else buf.is_contiguous()):
                raise ValueError("PoolEncoder writes in place: pool buffers must be contiguous")
        w, kperm, kprep, vprep = self._layer(layer)
        gk, gv = cfg.group_size_k, cfg.group_size_v
        kf, vf = _np(k_post, torch.float32), _np(v, torch.float32)
        pos, locn = _np(positions, torch.int64), _np(loc, torch.int64)
        cosn, sinn = _arr(cos, _as_f32), _arr(sin, _as_f32)
        kb, vb = _arr(k_rows, torch.Tensor.numpy), _arr(v_rows, torch.Tensor.numpy)
        Hs = {"shared": 1, "per_head": H, "none": 0}[cfg.scale]
        if wring is None:
            wr, wi = np.zeros(T, np.int64), np.zeros(T, np.int64)
            wk = wv = _NO_RING[0]
        else:
            wr, wi = _np(wring, torch.int64), _np(widx, torch.int64)
            wk, wv = _arr(win_k, _u16), _arr(win_v, _u16)
        if T < _SERIAL_BELOW:  # a decode step: one call
            return _encode_small(kf, vf, pos, cosn, sinn, w, kperm, _SCALE_MODE[cfg.scale], gk, gv,
                                  kprep[2], kprep[1], vprep[2], vprep[1], _ARGMIN_CHUNK, cfg.code_bits_k,
                                  cfg.code_bits_v, code_bytes_k, Hs, locn, kb, vb, wr, wi, wk, wv)
        kpre = np.empty((T, H, d), np.float32)
        x = np.empty((T, H * (d // gk), gk), np.float32)
        sbits = np.zeros((T, Hs), np.uint16)
        _tailor_keys(kf, pos, cosn, sinn, w, kperm, _SCALE_MODE[cfg.scale], gk, kpre, x, sbits)
        if not (np.isfinite(x).all() and np.isfinite(vf).all()):
            return False
        kcodes = np.empty((T, x.shape[1]), np.int32)
        vcodes = np.empty((T, H * (d // gv)), np.int32)
        _search(x, kprep, kcodes)
        _search(vf.reshape(T, H * (d // gv), gv), vprep, vcodes)
        _write_rows(kcodes, sbits, vcodes, cfg.code_bits_k, cfg.code_bits_v, code_bytes_k,
                    locn, kb, vb, kpre, vf, wr, wi, wk, wv)
        return True
