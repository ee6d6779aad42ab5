"""Shared pieces of the CPU kernels: the thread count, constants, LLVM intrinsics and bit
casts (fp16 / bf16 <-> float32, as torch rounds), and the numpy view helpers of the host-side
wrappers (:mod:`.ops`)."""
from __future__ import annotations

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

# Sentinel of the running minima / maxima: fastmath=True lets LLVM assume no infinities (ninf),
# so an inf sentinel would be undefined behaviour (free to differ by CPU and call); FLT_MAX is
# finite. Inputs are finite: the encoder checks them, the decode kernel gets model activations.
_BIG = np.float32(3.4028235e38)
_SERIAL_BELOW = 64  # tokens: below this, serial kernels (no thread launch for a decode step)
_NO_RING = (np.zeros((1, 1, 1, 1), np.uint16), np.full((1, 1), -1, np.int64))  # no window entries


def set_threads(n: int | None = None) -> None:
    """Use ``n`` (default: torch's intra-op thread count) threads in the parallel kernels."""
    numba.set_num_threads(max(1, min(n or torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS)))


# ---- intrinsics and bit casts ----------------------------------------------------------------
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


# ---- numpy views of the host wrappers' arguments ---------------------------------------------
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


def _u16(t: torch.Tensor) -> np.ndarray:
    """A 16-bit float tensor's bits as a uint16 numpy array (no copy when contiguous)."""
    return t.contiguous().view(torch.int16).numpy().view(np.uint16)
