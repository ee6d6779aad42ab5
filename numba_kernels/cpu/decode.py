"""Decode attention over the packed pool: the split-K kernel ``_decode_attention`` (one query
per request at position ``S - 1``; keys and values decoded from their codes, or read from the
slot's bf16 exact-store entry), ``_window_entry``, the exact-read rule in Numba, and the
kernel's vectorizable float32 exp ``_exp_le0``.

The rule: position t of a request of length S, held in ``slot``, is read exactly iff it is in
the window (``t < sink or t >= S - recent``) or its slot is kept (``kept[slot] != 0``: a
salient token, kept per slot and per call), and the slot has an entry (``entry_of[slot] > 0``);
everything else is read from codes. No windows (empty ``entry_of``) reads codes everywhere, kept
or not; no kept tokens (empty ``kept``) is the window rule alone.
Launched through :class:`~numba_kernels.cpu.ops.DecodePlan`.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from ._common import _BIG, _bf16_bits_to_f32, _copy4, _copy8, _f32_from_bits, _half_bits_to_f32, _key_reading, _prefetch
from .bitpack import _codes_row


@njit(cache=True, inline="always")
def _window_entry(entry_of, kept, slot, t, S, sink, recent):
    """Exact-store entry read for position t of a request of length S held in ``slot``, or -1
    (codes): the entry where t is in the window or the slot is kept (``kept[slot] != 0``), and
    the slot has one (``entry_of[slot] > 0``).

    The window test ``t < sink or t >= S - recent`` is the Numba twin of
    :func:`sglang_tasq.windows.in_window` (the one definition of the rule; Numba cannot call
    torch); with ``kept`` the rule is ``in_window(...) | kept[slot]``, held equal to it by
    ``tests/kernels/test_cpu_window_twin.py``. ``kept``: uint8 [>= slots] (non-zero = kept), or
    empty (no kept tokens: the window rule alone, one length test more than it). An empty
    ``entry_of`` (no windows) reads codes everywhere, kept or not."""
    if entry_of.shape[0] > 0 and ((t < sink or t >= S - recent) or (kept.shape[0] > 0 and kept[slot] != 0)):
        e = entry_of[slot]
        if e > 0:
            return e
    return -1


_KEY_BLOCK = 64  # tokens whose key codewords are staged before they are read (16 KB at d = 64)
_LOG2E = np.float32(1.4426950408889634)
_LN2_HI = np.float32(0.693359375)
_LN2_LO = np.float32(-2.12194440e-4)


@njit(cache=True, inline="always", fastmath=True)
def _exp_le0(x):
    """exp(x) for x <= 0 in float32 (about 1 ulp; exp(-87) for x below -87, negligible next to
    the softmax's largest term 1): Cody-Waite reduction, a degree-6 polynomial and the power of
    two through the exponent bits. Branch-free, so a loop over it vectorizes (no SVML)."""
    x = max(x, np.float32(-87.0))
    n = np.float32(math.floor(x * _LOG2E + np.float32(0.5)))
    r = x - n * _LN2_HI
    r = r - n * _LN2_LO
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    p = p * r * r + r + np.float32(1.0)
    return p * _f32_from_bits((np.int32(n) + np.int32(127)) << np.int32(23))


@njit(cache=True, inline="always")
def _splits_max(part_m, part_l, first, nsplit, r):
    """The largest max logit of query head r over the splits ``first .. first + nsplit - 1`` that
    hold any weight (``part_l > 0``), -_BIG if none: where a split-K merge rescales from."""
    mx = -_BIG
    for sp in range(nsplit):
        if part_l[first + sp, r] > 0:
            mx = max(mx, part_m[first + sp, r])
    return mx


@njit(parallel=True, cache=True, nogil=True, fastmath=True)
def _decode_attention(q, kbuf, vbuf, indptr, indices, kcb, kperm, kw, vcb, bits_k, bits_v, code_bytes_k,
                      scale_mode, cos_t, sin_t, composed, entry_of, kept, win_k, win_v, win_ks, win_vs, fp8_lut,
                      sink, recent, sm_scale, chunk, nsplit, part_m, part_l, part_o, out,
                      echo_lo, echo_hi, part_wm, part_wl, part_wn, echo_miss, echo):
    """One (request, KV head, token split) per parallel item (split-K: a request's tokens in
    ranges of ``chunk`` positions, ``nsplit`` slots for the longest request; a split past a
    request's end is empty), so a batch of one still fills every thread, and a request's
    answer depends on its own tokens only, not on the batch it runs in (batch invariance).

    Three passes per item. (1) Per token: the window rule, the key scale, the key and value
    codes (unpacked once with 8-byte loads, kept for the passes below) and a prefetch of every codeword the
    token reads: a layer's codebooks are not in cache when its step starts, and issuing all
    of a split's codeword loads up front lets them overlap instead of stalling one token at a
    time. (2) Keys decoded in the permuted in-group layout from the tailored codebook ``kcb``
    (the encoder's own array, so a decode step reads each codebook once; ``kw`` [H, d] the
    weight of each permuted element) as the first and second elements of each RoPE pair
    (vector copies of the codeword halves when g = 8, staged for blocks of ``_KEY_BLOCK``
    tokens), divided by their weights and rotated once for the GQA group (by R_(t - t0), the
    query turned back by the split's R_t0, where the RoPE table composes: see
    :func:`~numba_kernels.cpu.ops.rope_composes`; else by R_t gathered through the
    permutation), then one flat dot per query head, then scaled; fp32 softmax (a branch-free exp that vectorizes).
    (3) Values decoded (vector copies of the codewords when g = 8) and accumulated, one
    d-long axpy per query head. Each split leaves its max logit, exp-sum and unnormalized
    output in part_m/part_l/part_o; a serial merge after the parallel loop combines them (no
    second thread launch). A token inside the window of S, or in a kept slot (``kept[slot] !=
    0``; ``kept`` uint8 [>= slots], or empty: none kept), is read from its slot's bf16
    exact-store entry where it has one (``entry_of[slot]``, 0 = none; ``win_k``/``win_v``
    [E + 1, 1, H, d]; :func:`_window_entry`) in native pair order (no permutation to
    gather): bf16 bits (uint16), or with a non-empty ``fp8_lut`` (float8_e4m3fn code -> f32,
    256 entries) fp8 codes (uint8) times the entry's fp16 scale per head (``win_ks``/``win_vs``
    [E + 1, H], their bits), or with a 16-entry ``fp8_lut`` (nibble -> nibble - 8) a res4 entry:
    the slot's own codes (read as outside the windows: the key's logit through the permuted,
    vectorized path) plus the residual, two nibbles a byte (channel ``2i`` low; ``win_k``/``win_v``
    [E + 1, 1, H, d / 2]) times the entry's scale (:func:`sglang_tasq.salient.res4_encode`), whose
    logit is added in native pair order (q . R_t (codes + residual) = q . R_t codes + q . R_t residual). The key row's scales follow its codes: head h reads scale ``h // (H / n_scales)``.
    fastmath: sums are reassociated (vectorized).

    Salient echo (``echo`` [B, H], empty: off): each request's window echo
    (:func:`sglang_tasq.salient.query_echo` of its query at ``S - 1``), from the logits this
    kernel computes anyway: each query head's softmax over the window positions only (``t <
    sink``, then ``max(sink, S - recent) <= t < S``; kept slots outside are not part of it),
    its mass on ``echo_lo <= t < echo_hi``, summed over the GQA group. Per split: the window's
    max logit, exp-sum and span sum (``part_wm/part_wl/part_wn``), merged as the output is; a
    window position without an exact entry (read from codes) is counted in ``echo_miss``
    [items] (the caller refuses it)."""
    B, Hq, d = q.shape
    H, Gk, _, gk = kcb.shape
    Gv, gv = vcb.shape[1], vcb.shape[3]
    rep = Hq // H
    hg = gk // 2
    n_scales = (kbuf.shape[1] - code_bytes_k) // 2  # a key row is codes ++ its fp16 scales
    hps = H // n_scales if n_scales > 0 else 1  # heads per scale (1 for per_head)
    P = d // 2
    fp8 = fp8_lut.shape[0] == 256
    res4 = fp8_lut.shape[0] == 16
    # composed RoPE (the plan checked the table is one: cos_t[t] = m cos(t theta), sin_t[0] = 0):
    # position t of a split starting at t0 rotates by R_t = R_t0 R_(t - t0) / m, so the query
    # is turned back by R_t0 once per split and each key is rotated by a row of the first
    # ``chunk`` positions, gathered into the permuted pair order here once per layer
    # (contiguous loads per token instead of a gather through the permutation)
    R = min(chunk, cos_t.shape[0]) if composed else 0
    rc = np.empty((H, R, P), np.float32)
    rs = np.empty((H, R, P), np.float32)
    for h in range(H):
        for j in range(Gk):
            for l in range(hg):
                n = kperm[h, j * gk + l]
                for i in range(R):
                    rc[h, i, j * hg + l] = cos_t[i, n]
                    rs[h, i, j * hg + l] = sin_t[i, n]
    for item in prange(B * H * nsplit):
        bh = item // nsplit
        b = bh // H
        h = bh - b * H
        beg = indptr[b]
        S = indptr[b + 1] - beg
        t_lo = min(S, (item - bh * nsplit) * chunk)
        t_hi = min(S, t_lo + chunk)
        nt = t_hi - t_lo
        na = max(nt, 1)
        # the query's first / second element of each permuted pair (group j holds pairs
        # j*hg .. j*hg+hg-1), and 1 / the weight of each: codewords are read in the tailored
        # space (key element = codeword / weight)
        xa = np.empty((rep, P), np.float32)
        xb = np.empty((rep, P), np.float32)
        iwa = np.empty(P, np.float32)
        iwb = np.empty(P, np.float32)
        pidx = np.empty(P, np.int64)  # native RoPE pair of each permuted pair
        for j in range(Gk):
            for l in range(hg):
                p = j * hg + l
                pidx[p] = kperm[h, j * gk + l]
                iwa[p] = np.float32(1.0) / kw[h, j * gk + l]
                iwb[p] = np.float32(1.0) / kw[h, j * gk + hg + l]
                c0 = np.float32(1.0)
                s0 = np.float32(0.0)
                if composed and nt > 0:  # R_t0^T / m, folded into the query
                    n = pidx[p]
                    c0 = cos_t[t_lo, n] / cos_t[0, n]
                    s0 = sin_t[t_lo, n] / cos_t[0, n]
                for r in range(rep):
                    ya = q[b, h * rep + r, kperm[h, j * gk + l]]
                    yb = q[b, h * rep + r, kperm[h, j * gk + hg + l]]
                    xa[r, p] = c0 * ya + s0 * yb
                    xb[r, p] = c0 * yb - s0 * ya
        na_ = np.empty((rep, P), np.float32)  # the same in native pair order (window entries)
        nb_ = np.empty((rep, P), np.float32)
        for r in range(rep):
            for p in range(P):
                na_[r, p] = q[b, h * rep + r, p]
                nb_[r, p] = q[b, h * rep + r, P + p]
        # pass 1: each token's exact entry (window or kept), key scale and codes, its codewords
        # prefetched (a layer's codebooks are not in cache: the loads of the passes below overlap)
        wid = np.empty(na, np.int64)
        sc = np.empty(na, np.float32)
        zk = np.empty((na, Gk), np.int64)
        zv = np.empty((na, Gv), np.int64)
        for i in range(nt):
            slot = indices[beg + t_lo + i]
            w = _window_entry(entry_of, kept, slot, t_lo + i, S, sink, recent)
            wid[i] = w
            if w < 0 or res4:  # (a res4 entry completes its codes)
                s = np.float32(1.0)
                if scale_mode != 0:  # shared: head h reads its group's scale; per_head: its own
                    o = code_bytes_k + 2 * (h // hps)
                    s = _half_bits_to_f32(np.uint16(kbuf[slot, o]) | (np.uint16(kbuf[slot, o + 1]) << 8))
                sc[i] = s * sm_scale
                _codes_row(kbuf, slot, h * Gk, Gk, bits_k, zk, i)
                _codes_row(vbuf, slot, h * Gv, Gv, bits_v, zv, i)
                for j in range(Gk):
                    _prefetch(kcb, (h, j, zk[i, j], 0))
                for j in range(Gv):
                    _prefetch(vcb, (h, j, zv[i, j], 0))
        logits = np.empty((rep, na), np.float32)
        ka = np.empty(P, np.float32)
        kb_ = np.empty(P, np.float32)
        ra = np.empty(P, np.float32)
        rb = np.empty(P, np.float32)
        # the codeword halves of a block of tokens staged first (vector copies when g = 8), read
        # after: a 4-float copy read back at once by a 16-float load stalls (no store forwarding)
        KA = np.empty((_KEY_BLOCK, P), np.float32)
        KB = np.empty((_KEY_BLOCK, P), np.float32)
        for i0 in range(0, nt, _KEY_BLOCK):
            i1 = min(nt, i0 + _KEY_BLOCK)
            for i in range(i0, i1):
                if wid[i] >= 0 and not res4:
                    continue
                if hg == 4:
                    for j in range(Gk):
                        z = zk[i, j]
                        _copy4(KA, (i - i0, j * 4), kcb, (h, j, z, 0))
                        _copy4(KB, (i - i0, j * 4), kcb, (h, j, z, 4))
                else:
                    for j in range(Gk):
                        z = zk[i, j]
                        for l in range(hg):
                            KA[i - i0, j * hg + l] = kcb[h, j, z, l]
                            KB[i - i0, j * hg + l] = kcb[h, j, z, hg + l]
            for i in range(i0, i1):
                t = t_lo + i
                widx = wid[i]
                if widx >= 0 and not res4:  # exact entry: native pair order (contiguous halves and RoPE rows)
                    if fp8:
                        s8 = _half_bits_to_f32(win_ks[widx, h])
                        for p in range(P):
                            ka[p] = fp8_lut[win_k[widx, 0, h, p]] * s8
                            kb_[p] = fp8_lut[win_k[widx, 0, h, P + p]] * s8
                    else:
                        for p in range(P):
                            ka[p] = _bf16_bits_to_f32(np.uint16(win_k[widx, 0, h, p]))
                            kb_[p] = _bf16_bits_to_f32(np.uint16(win_k[widx, 0, h, P + p]))
                    for r in range(rep):
                        acc = np.float32(0.0)
                        for p in range(P):
                            acc += cos_t[t, p] * (na_[r, p] * ka[p] + nb_[r, p] * kb_[p]) + sin_t[t, p] * (nb_[r, p] * ka[p] - na_[r, p] * kb_[p])
                        logits[r, i] = acc * sm_scale
                    continue
                u = i - i0
                if composed:  # the key pair in native units, rotated (once for the GQA group) by R_(t - t0)
                    for p in range(P):
                        c = rc[h, i, p]
                        sn = rs[h, i, p]
                        a = KA[u, p] * iwa[p]
                        bb = KB[u, p] * iwb[p]
                        ra[p] = c * a - sn * bb
                        rb[p] = sn * a + c * bb
                else:  # ... by R_t, gathered through the permutation
                    for p in range(P):
                        c = cos_t[t, pidx[p]]
                        sn = sin_t[t, pidx[p]]
                        a = KA[u, p] * iwa[p]
                        bb = KB[u, p] * iwb[p]
                        ra[p] = c * a - sn * bb
                        rb[p] = sn * a + c * bb
                s = sc[i]
                for r in range(rep):  # q . RoPE_t(k): one flat dot per query head (vectorizes)
                    acc = np.float32(0.0)
                    for p in range(P):
                        acc += xa[r, p] * ra[p] + xb[r, p] * rb[p]
                    logits[r, i] = acc * s
                if widx >= 0:  # a res4 entry: its codes (above) + the residual, in native pair order
                    s8 = _half_bits_to_f32(win_ks[widx, h])
                    for c in range(P // 2):  # byte c: channels 2c (low nibble), 2c + 1
                        y0 = win_k[widx, 0, h, c]  # channels 2c, 2c + 1 (first halves of pairs)
                        y1 = win_k[widx, 0, h, P // 2 + c]  # channels P + 2c, P + 2c + 1 (second halves)
                        ka[2 * c] = fp8_lut[y0 & 15] * s8
                        ka[2 * c + 1] = fp8_lut[y0 >> 4] * s8
                        kb_[2 * c] = fp8_lut[y1 & 15] * s8
                        kb_[2 * c + 1] = fp8_lut[y1 >> 4] * s8
                    for r in range(rep):
                        acc = np.float32(0.0)
                        for p in range(P):
                            acc += cos_t[t, p] * (na_[r, p] * ka[p] + nb_[r, p] * kb_[p]) + sin_t[t, p] * (nb_[r, p] * ka[p] - na_[r, p] * kb_[p])
                        logits[r, i] += acc * sm_scale
        if echo.shape[0] > 0:  # the window's softmax (before the logits turn into exps below)
            a1 = max(0, min(nt, sink - t_lo))  # [0, a1): sink positions; [a2, nt): the recent window past the sink
            a2 = min(nt, max(0, max(sink, S - recent) - t_lo))
            miss = 0
            for i in range(a1):
                if wid[i] < 0:
                    miss += 1
            for i in range(a2, nt):
                if wid[i] < 0:
                    miss += 1
            echo_miss[item] = miss
            for r in range(rep):
                mw = -_BIG
                for i in range(a1):
                    mw = max(mw, logits[r, i])
                for i in range(a2, nt):
                    mw = max(mw, logits[r, i])
                lw = np.float32(0.0)
                nw = np.float32(0.0)
                for i in range(a1):
                    e = _exp_le0(logits[r, i] - mw)
                    lw += e
                    if t_lo + i >= echo_lo and t_lo + i < echo_hi:
                        nw += e
                for i in range(a2, nt):
                    lw += _exp_le0(logits[r, i] - mw)
                part_wm[item, r] = mw
                part_wl[item, r] = lw
                part_wn[item, r] = nw
        for r in range(rep):
            m = -_BIG
            for i in range(nt):
                m = max(m, logits[r, i])
            tot = np.float32(0.0)
            for i in range(nt):
                e = _exp_le0(logits[r, i] - m)
                logits[r, i] = e
                tot += e
            part_m[item, r] = m
            part_l[item, r] = tot
        acc_o = np.zeros((rep, d), np.float32)
        vt = np.empty(d, np.float32)
        for i in range(nt):
            widx = wid[i]
            if widx >= 0 and not res4:
                if fp8:
                    s8 = _half_bits_to_f32(win_vs[widx, h])
                    for c in range(d):
                        vt[c] = fp8_lut[win_v[widx, 0, h, c]] * s8
                else:
                    for c in range(d):
                        vt[c] = _bf16_bits_to_f32(np.uint16(win_v[widx, 0, h, c]))
            else:  # decode the value row, then one d-long axpy per query head (vectorizes)
                if gv == 8:
                    for j in range(Gv):
                        _copy8(vt, (j * 8,), vcb, (h, j, zv[i, j], 0))
                else:
                    for j in range(Gv):
                        z = zv[i, j]
                        for l in range(gv):
                            vt[j * gv + l] = vcb[h, j, z, l]
                if widx >= 0:  # a res4 entry: the codewords plus the residual
                    s8 = _half_bits_to_f32(win_vs[widx, h])
                    for c in range(d // 2):
                        bt = win_v[widx, 0, h, c]
                        vt[2 * c] += fp8_lut[bt & 15] * s8
                        vt[2 * c + 1] += fp8_lut[bt >> 4] * s8
            for r in range(rep):
                p = logits[r, i]
                for c in range(d):
                    acc_o[r, c] += p * vt[c]
        for r in range(rep):
            for c in range(d):
                part_o[item, r, c] = acc_o[r, c]
    for bh in range(B * H):  # merge the splits (serial: small; no second thread launch)
        b = bh // H
        h = bh - b * H
        for r in range(rep):
            mx = _splits_max(part_m, part_l, bh * nsplit, nsplit, r)
            tot = np.float32(0.0)
            o = np.empty(d, np.float32)  # (np.zeros outside a prange would be a parallel loop of its own)
            for c in range(d):
                o[c] = np.float32(0.0)
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
        if echo.shape[0] > 0:  # the window echo: the splits' window softmax merged, summed over the group
            ech = np.float32(0.0)
            for r in range(rep):
                mx = _splits_max(part_wm, part_wl, bh * nsplit, nsplit, r)
                lw = np.float32(0.0)
                nw = np.float32(0.0)
                for sp in range(nsplit):
                    it = bh * nsplit + sp
                    if part_wl[it, r] > 0:
                        w = np.float32(math.exp(part_wm[it, r] - mx))
                        lw += w * part_wl[it, r]
                        nw += w * part_wn[it, r]
                if lw > 0:
                    ech += nw / lw
            echo[b, h] = ech


@njit(cache=True, nogil=True)
def _res4_keys(ent, owner, kbuf, code_bytes_k, bits_k, kcb, kperm, win_k, win_ks, out):
    """Pre-RoPE keys of res4 exact entries ``ent`` [n] -> out [n, H, d] f32: each entry's slot's
    (``owner[e]``) key codes read as the reference decode reads them (codeword of the
    un-tailored codebook ``kcb`` [H, Gk, K, gk] times the head's fp16 scale, at its native channel
    ``kperm[h, j * gk + l]``), plus the residual's steps times the entry's scale (``win_k``
    [E + 1, 1, H, d / 2] nibbles, ``win_ks`` [E + 1, H] fp16 bits): ``ExactStore.read_k`` of a res4
    store (:func:`sglang_tasq.salient.res4_decode` over ``pool.read_codes``), bit for bit. Without
    fastmath: the products and sums round as torch's."""
    H, Gk = kcb.shape[0], kcb.shape[1]
    n_scales = (kbuf.shape[1] - code_bytes_k) // 2
    hps = H // n_scales if n_scales > 0 else 1
    half = win_k.shape[3]
    z = np.empty((1, Gk), np.int64)
    for i in range(ent.shape[0]):
        e = ent[i]
        slot = owner[e]
        for h in range(H):
            s = np.float32(1.0)
            if n_scales > 0:
                o = code_bytes_k + 2 * (h // hps)
                s = _half_bits_to_f32(np.uint16(kbuf[slot, o]) | (np.uint16(kbuf[slot, o + 1]) << 8))
            _codes_row(kbuf, slot, h * Gk, Gk, bits_k, z, 0)
            _key_reading(kcb, kperm, h, z, 0, 0, s, out[i])
            sc = _half_bits_to_f32(win_ks[e, h])
            for c in range(half):
                b = np.int32(win_k[e, 0, h, c])
                out[i, h, 2 * c] += np.float32((b & 15) - 8) * sc
                out[i, h, 2 * c + 1] += np.float32((b >> 4) - 8) * sc
