"""Fused pool encode kernels: post-RoPE keys un-rotated and tailored (``_tailor_keys``), codes
packed into pool rows with the key scales and window tokens copied to their exact entries (bf16,
fp8 with a scale per head, or res4: what their codes miss in 4-bit steps)
(``_write_rows``), and a decode step's few tokens in one call (``_encode_small``). Launched
through :class:`~numba_kernels.cpu.ops.PoolEncoder`; the nearest-codeword search is
:mod:`.search`'s, the packing loop :mod:`.bitpack`'s.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from ._common import (_f32_to_bf16_bits, _f32_to_half_bits, _fp8_store_row, _half_bits_to_f32, _key_reading,
                      _res4_store_row, njit_variants)
from .bitpack import _pack_row
from .search import _nearest_row


def _tailor_keys_py(k, pos, cos_t, sin_t, w, kperm, scale_mode, gk, kpre, x, scale_bits):
    """Post-RoPE keys k [T, H, d] f32 at positions pos -> pre-RoPE keys kpre [T, H, d] (the
    inverse rotation of ``rope.rotate``, same float ops), tailored keys x [T, H*Gk, gk] in the
    permuted group layout (weights w, fp16 RMS scale, as ``codec.key_tailor``) and the scale
    bits scale_bits [T, Hs] (uint16 fp16; Hs scale groups of H/Hs heads for shared, H per-head,
    unused for none)."""
    T, H, d = k.shape
    hps = H // scale_bits.shape[1] if scale_mode == 1 else 1
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
            if scale_mode == 1 and (h + 1) % hps == 0:  # the last head of a scale group
                sb = _f32_to_half_bits(max(np.float32(math.sqrt(tot / (hps * d))), np.float32(1e-6)))
                scale_bits[t, h // hps] = sb
                sf = _half_bits_to_f32(sb)
                for hh in range(h + 1 - hps, h + 1):
                    for c in range(d):
                        kw[hh, c] = kw[hh, c] / sf
                tot = 0.0
        for h in range(H):
            for j in range(Gk):
                for l in range(gk):
                    x[t, h * Gk + j, l] = kw[h, kperm[h, j * gk + l]]


_tailor_keys, _tailor_keys_serial = njit_variants(_tailor_keys_py)


def _write_rows_py(kcodes, scale_bits, vcodes, bits_k, bits_v, code_bytes_k, loc, kbuf, vbuf,
                   kpre, v, wring, widx, win_k, win_v, wfmt, win_ks, win_vs, kcb, kperm, vcb):
    """Pack codes [T, n] into pool rows ``loc`` (key row: codes ++ fp16 scale bytes, little
    endian), and store the window tokens (wring[t] > 0) at [wring[t], widx[t]]: as bf16
    (``wfmt`` 0), as fp8 e4m3 codes with an fp16 scale per head in win_ks/win_vs [E + 1, H]
    (``wfmt`` 1), or (``wfmt`` 2, res4) as what the token's codes miss, in 4-bit steps with an
    fp16 scale per head (win_k/win_v [E + 1, 1, H, d / 2]): the codes read back as the
    reference decode reads them (key codeword of the un-tailored codebook ``kcb`` [H, Gk, K, gk]
    times the head's scale, at its native channel ``kperm[h, j * gk + l]``; value codeword of
    ``vcb`` [H, Gv, K, gv]), then :func:`._common._res4_store_row`."""
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
        if r > 0 and wfmt == 2:
            Gk = kcb.shape[1]
            Gv, gv = vcb.shape[1], vcb.shape[3]
            ck = np.empty((H, d), np.float32)
            cv = np.empty((H, d), np.float32)
            for h in range(H):
                s = np.float32(1.0)
                if Hs > 0:
                    s = _half_bits_to_f32(scale_bits[t, h // (H // Hs)])
                _key_reading(kcb, kperm, h, kcodes, t, h * Gk, s, ck)
                for j in range(Gv):
                    z = vcodes[t, h * Gv + j]
                    for l in range(gv):
                        cv[h, j * gv + l] = vcb[h, j, z, l]
            _res4_store_row(kpre, t, ck, win_k, r, widx[t], win_ks)
            _res4_store_row(v, t, cv, win_v, r, widx[t], win_vs)
        elif r > 0 and wfmt == 1:
            _fp8_store_row(kpre, t, win_k, r, widx[t], win_ks)
            _fp8_store_row(v, t, win_v, r, widx[t], win_vs)
        elif r > 0:
            wi = widx[t]
            for h in range(H):
                for c in range(d):
                    win_k[r, wi, h, c] = _f32_to_bf16_bits(kpre[t, h, c])
                    win_v[r, wi, h, c] = _f32_to_bf16_bits(v[t, h, c])


_write_rows, _write_rows_serial = njit_variants(_write_rows_py)


@njit(parallel=True, cache=True, nogil=True, fastmath={"nsz", "arcp", "contract", "afn", "reassoc"})
def _encode_small(k, v, pos, cos_t, sin_t, w, kperm, scale_mode, gk, gv, kcbr, kcn, vcbr, vcn, chunk,
                  bits_k, bits_v, code_bytes_k, hs, loc, kbuf, vbuf, wring, widx, win_k, win_v, wfmt, win_ks, win_vs,
                  kcb, vcb):
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
                       wring, widx, win_k, win_v, wfmt, win_ks, win_vs, kcb, kperm, vcb)
    return True
