"""Encode kernels: pre-RoPE keys and values -> packed codes and fp16 scales in pool slots.

Three launches per call (see :func:`numba_kernels.ops.encode_kv`):

1. ``scale``: one block per token (and per head for scale="per_head"): RMS of the weighted
   key ``k * w`` over all KV heads and channels, clamped at 1e-6, rounded to fp16 and
   written to ``k_scale[loc[t]]`` (codec.key_tailor, paper sec. 4.2).
2. ``argmin``: group-major nearest codeword. Block (head h, group j, tile of NT tokens)
   stages chunks of the tailored codebook of (h, j) in shared memory; each thread owns one
   token, builds its tailored vector ``x = (k * w)[perm] / s`` and scans the codebook for
   the first minimum of ``||c||^2 - 2 x.c``. Codes go to an int32 scratch [T, H*G].
3. ``pack``: one block per token writes the little-endian bit streams of its key and value
   codes (packing.pack_codes on codes.view(T, H*G)) into ``k_codes[loc[t]]``/``v_codes[loc[t]]``.

Factories are cached per static shape and dtype; each returns a :class:`KernelSpec`.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from numba import cuda, float32, int32, uint8

from .devfns import KINDS, loader

NT = 128  # threads per block
STAGE_FLOATS = 4096  # f32 codebook floats staged per chunk (16 KB)
NRM = STAGE_FLOATS // 2  # norms of a chunk (g >= 2)
SCALE_MODES = ("shared", "per_head", "none")


@dataclass(frozen=True)
class KernelSpec:
    """A kernel's Python source function and its eager signature (for PTX tests)."""

    name: str
    fn: object
    sig: str
    hot: bool = True

    @functools.cached_property
    def kernel(self):
        return cuda.jit(self.sig)(self.fn)


def _scale_sig(scale_mode: str) -> str:
    return {"shared": "float16[::1]", "per_head": "float16[:, ::1]", "none": "float16[::1]"}[scale_mode]


@functools.lru_cache(maxsize=None)
def scale_kernel(H: int, d: int, kind: str, per_head: bool, loc_type: str) -> KernelSpec:
    """Grid (T, H if per_head else 1); k [T, H, d], w [H, d] f32, loc [T], k_scale fp16 [S] / [S, H]."""
    ld = loader(kind)
    N = d if per_head else H * d

    def kern(k, w, loc, k_scale):
        t = cuda.blockIdx.x
        hh = cuda.blockIdx.y
        tid = cuda.threadIdx.x
        red = cuda.shared.array(NT, float32)
        acc = float32(0.0)
        for i in range(tid, N, NT):
            if per_head:
                h = hh
                c = i
            else:
                h = i // d
                c = i - h * d
            x = ld(k[t, h, c]) * w[h, c]
            acc += x * x
        red[tid] = acc
        cuda.syncthreads()
        step = NT // 2
        while step > 0:
            if tid < step:
                red[tid] += red[tid + step]
            cuda.syncthreads()
            step //= 2
        if tid == 0:
            rms = math.sqrt(red[0] / float32(N))
            if rms < float32(1e-6):
                rms = float32(1e-6)
            if per_head:
                k_scale[loc[t], hh] = rms
            else:
                k_scale[loc[t]] = rms

    sc = "float16[:, ::1]" if per_head else "float16[::1]"
    sig = f"void({KINDS[kind]}[:, :, ::1], float32[:, ::1], {loc_type}[::1], {sc})"
    return KernelSpec(f"scale_d{d}_{kind}_{'head' if per_head else 'shared'}", kern, sig)


@functools.lru_cache(maxsize=None)
def argmin_kernel(H: int, d: int, g: int, K: int, kind: str, is_key: bool, scale_mode: str,
                  loc_type: str) -> KernelSpec:
    """Grid (H * G, ceil(T / NT)), block NT.

    x_in [T, H, d] (kind), w [H, d] f32, perm [H, d] int32, loc [T], k_scale (fp16, see
    scale kernel), tcb [H, G, K, g] f32, tnorm [H, G, K] f32 -> codes [T, H * G] int32.
    Values ignore w, perm and the scale (contiguous groups, native order).
    """
    G = d // g
    ld = loader(kind)
    CH = min(K, STAGE_FLOATS // g)
    use_scale = is_key and scale_mode != "none"
    per_head = scale_mode == "per_head"

    def kern(x_in, w, perm, loc, k_scale, tcb, tnorm, codes):
        T = x_in.shape[0]
        hj = cuda.blockIdx.x
        h = hj // G
        j = hj - h * G
        tid = cuda.threadIdx.x
        t = cuda.blockIdx.y * NT + tid
        cbs = cuda.shared.array(STAGE_FLOATS, float32)
        nrm = cuda.shared.array(NRM, float32)
        x = cuda.local.array(g, float32)
        valid = t < T
        if valid:
            s = float32(1.0)
            if use_scale:
                if per_head:
                    s = float32(k_scale[loc[t], h])
                else:
                    s = float32(k_scale[loc[t]])
            for l in range(g):
                if is_key:
                    c = perm[h, j * g + l]
                    kw = ld(x_in[t, h, c]) * w[h, c]
                    x[l] = kw / s if use_scale else kw
                else:
                    x[l] = ld(x_in[t, h, j * g + l])
        best = float32(math.inf)
        bi = int32(0)
        for c0 in range(0, K, CH):
            n = min(CH, K - c0)
            cuda.syncthreads()
            for i in range(tid, n * g, NT):
                cbs[i] = tcb[h, j, c0 + i // g, i % g]
            for i in range(tid, n, NT):
                nrm[i] = tnorm[h, j, c0 + i]
            cuda.syncthreads()
            if valid:
                for c in range(n):
                    dot = float32(0.0)
                    for l in range(g):
                        dot += x[l] * cbs[c * g + l]
                    dist = nrm[c] - float32(2.0) * dot
                    if dist < best:
                        best = dist
                        bi = int32(c0 + c)
        if valid:
            codes[t, hj] = bi

    sig = (f"void({KINDS[kind]}[:, :, ::1], float32[:, ::1], int32[:, ::1], {loc_type}[::1], "
           f"{_scale_sig(scale_mode)}, float32[:, :, :, ::1], float32[:, :, ::1], int32[:, ::1])")
    return KernelSpec(f"argmin_{'k' if is_key else 'v'}_d{d}_{kind}_g{g}_K{K}_{scale_mode}", kern, sig)


@functools.lru_cache(maxsize=None)
def pack_kernel(nk: int, kbits: int, nv: int, vbits: int, loc_type: str) -> KernelSpec:
    """Grid (T,), block NT: kcodes [T, nk] / vcodes [T, nv] int32 -> pool rows k_pool[loc[t]], v_pool[loc[t]] uint8."""
    kb = (nk * kbits + 7) // 8
    vb = (nv * vbits + 7) // 8

    def kern(kcodes, vcodes, loc, k_pool, v_pool):
        t = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        slot = loc[t]
        for b in range(tid, kb + vb, NT):
            is_v = b >= kb
            bb = b - kb if is_v else b
            bits = vbits if is_v else kbits
            ncode = nv if is_v else nk
            byte = int32(0)
            for i in range(8):
                gb = 8 * bb + i
                n = gb // bits
                if n < ncode:
                    code = vcodes[t, n] if is_v else kcodes[t, n]
                    byte |= ((code >> (gb - n * bits)) & 1) << i
            if is_v:
                v_pool[slot, bb] = uint8(byte)
            else:
                k_pool[slot, bb] = uint8(byte)

    sig = f"void(int32[:, ::1], int32[:, ::1], {loc_type}[::1], uint8[:, ::1], uint8[:, ::1])"
    return KernelSpec(f"pack_k{kbits}_v{vbits}", kern, sig, hot=False)
