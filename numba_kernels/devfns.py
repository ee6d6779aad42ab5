"""Device helpers shared by the TaSQ kernels, picked at import time for GPU or simulator.

The CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``) runs kernels as Python and has no libdevice
(``fmaf``, ``int_as_float``, ``__sinf`` return NaN there) and no warp shuffles, so every
helper that needs them has a plain-Python twin chosen by :data:`SIM`. All float constants
are ``float32`` so that no ``.f64`` instruction reaches the hot kernels.

Angles: RoPE angles ``p * f`` reach 1e5 rad at long contexts. ``precise_sincos`` keeps the
product exact as ``hi + lo`` (an FMA), reduces it by 2*pi in three float32 parts
(Cody-Waite) and evaluates the fast hardware sine/cosine on ``[-pi, pi]``; libdevice's
accurate ``sinf`` would fall back to a float64 Payne-Hanek path for large arguments.
"""
from __future__ import annotations

import math
import sys

import numpy as np
from numba import config, cuda, float32, int32

SIM = bool(config.ENABLE_CUDASIM)

# Element kinds of input tensors: bf16 travels as an int16 view.
KINDS = {"f32": "float32", "f16": "float16", "bf16": "int16"}

_TWO_PI_1 = float32(6.28125)  # 2*pi split in three float32 parts (first has 9 bits)
_TWO_PI_2 = float32(1.9353071795864769253e-3)
_TWO_PI_3 = float32(2.0 * math.pi - 6.28125 - float(np.float32(1.9353071795864769253e-3)))
_INV_TWO_PI = float32(1.0 / (2.0 * math.pi))

if SIM:
    # The simulator runs each block's threads as Python threads while the launching thread
    # busy-polls them (numba_cuda's BlockManager.run); under the default 5 ms GIL switch
    # interval the poller holds the GIL for most of each block. 0.5 ms hands it to the block's
    # threads sooner: test_serve_cuda's child 76 s -> 34 s here, results unchanged (a runtime
    # setting of the test-only simulator process, no change to what a kernel computes).
    sys.setswitchinterval(5e-4)

    def fma32(a, b, c):
        return np.float32(np.float64(a) * np.float64(b) + np.float64(c))

    def fast_sin(x):
        return np.float32(math.sin(float(x)))

    def fast_cos(x):
        return np.float32(math.cos(float(x)))

    def rint32(x):
        return np.float32(np.rint(np.float32(x)))

    def bf16_bits_to_f32(v):
        return np.array([int(v) & 0xFFFF], dtype=np.uint32).__lshift__(16).view(np.float32)[0]

    def exp32(x):
        return np.float32(math.exp(float(x))) if x > -88.0 else np.float32(0.0)
else:
    from numba.cuda import libdevice

    @cuda.jit(device=True, inline=True)
    def fma32(a, b, c):
        return libdevice.fmaf(a, b, c)

    @cuda.jit(device=True, inline=True)
    def fast_sin(x):
        return libdevice.fast_sinf(x)

    @cuda.jit(device=True, inline=True)
    def fast_cos(x):
        return libdevice.fast_cosf(x)

    @cuda.jit(device=True, inline=True)
    def rint32(x):
        return libdevice.rintf(x)

    @cuda.jit(device=True, inline=True)
    def bf16_bits_to_f32(v):
        return libdevice.int_as_float(int32(v) << 16)

    @cuda.jit(device=True, inline=True)
    def exp32(x):
        return libdevice.fast_expf(x)


def _dev(fn):
    return fn if SIM else cuda.jit(device=True, inline=True)(fn)


@_dev
def precise_sincos(p, f):
    """(cos, sin) of the angle ``p * f`` (p: integer-valued float32 < 2**24, f: float32)."""
    hi = p * f
    lo = fma32(p, f, -hi)
    k = rint32(hi * _INV_TWO_PI)
    r = fma32(-k, _TWO_PI_1, hi)
    r = fma32(-k, _TWO_PI_2, r)
    r = fma32(-k, _TWO_PI_3, r)
    r = r + lo
    return fast_cos(r), fast_sin(r)


@_dev
def to_f32_plain(v):
    return float32(v)


def loader(kind: str):
    """Device function converting one stored element of ``kind`` to float32."""
    if kind == "bf16":
        return bf16_bits_to_f32
    if kind in ("f32", "f16"):
        return to_f32_plain
    raise ValueError(f"element kind {kind!r}: allowed {tuple(KINDS)}")


@_dev
def unpack(codes, slot, n, bits):
    """Code ``n`` of the packed little-endian row ``codes[slot]`` (uint8 [S, nbytes]), bits <= 16."""
    bit = n * bits
    byte = bit >> 3
    shift = bit & 7
    nb = (shift + bits + 7) >> 3
    v = int32(0)
    for i in range(nb):
        v |= int32(codes[slot, byte + i]) << int32(8 * i)
    return (v >> shift) & ((int32(1) << bits) - int32(1))
