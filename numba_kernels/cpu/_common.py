"""Shared pieces of the CPU kernels: the thread count, constants, LLVM intrinsics and bit
casts (fp16 / bf16 <-> float32, as torch rounds), and the numpy view helpers of the host-side
wrappers (:mod:`.ops`)."""
from __future__ import annotations

import math
import os
import types as pytypes

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

# Sentinel of the running minima / maxima: fastmath=True lets LLVM assume no infinities (ninf),
# so an inf sentinel would be undefined behaviour (free to differ by CPU and call); FLT_MAX is
# finite. Inputs are finite: the encoder checks them, the decode kernel gets model activations.
_BIG = np.float32(3.4028235e38)
_SERIAL_BELOW = 64  # tokens: below this, serial kernels (no thread launch for a decode step)
_NO_RING = (np.zeros((1, 1, 1, 1), np.uint16), np.full((1, 1), -1, np.int64))  # no window entries


def _wide_vectors() -> str | None:
    """On an AVX-512 host let LLVM vectorize with 512-bit registers: its x86 default prefers 256
    bits (``prefer-256-bit``, a guard against the clock drop of early AVX-512 parts), which halves
    the lanes of the kernels here (nearest-codeword lane kernel: 1.4-1.6x faster with 512, same
    codes). Set once, before the first kernel compiles; ``NUMBA_CPU_FEATURES`` given by the user
    wins. Numba keys its on-disk cache by the features, so no kernel compiled otherwise is
    reused. Returns the feature string set, or None."""
    from llvmlite import binding

    if os.environ.get("NUMBA_CPU_FEATURES") or numba.config.CPU_FEATURES is not None:
        return None
    feats = binding.get_host_cpu_features().flatten()
    if "+avx512f" not in feats.split(","):
        return None
    numba.config.CPU_FEATURES = feats + ",-prefer-256-bit"
    return numba.config.CPU_FEATURES


WIDE_VECTORS = _wide_vectors()


def njit_variants(py_func, **options):
    """(parallel, serial) compilations of ``py_func`` (cached, nogil, plus ``options``), each
    its own function for Numba's on-disk cache. The cache names its entry after the function's
    qualified name and line and keys it by signature, not by the ``parallel`` flag: two
    compilations of one Python function shared one entry, so whichever compiled first was
    loaded for both (a "serial" decode-step kernel ran a parallel region, ~60 us of thread
    wake-up per call after torch has run: 3 per layer)."""
    out = []
    for suffix, parallel in (("", True), ("_serial", False)):
        name = py_func.__name__.removesuffix("_py") + suffix
        f = pytypes.FunctionType(py_func.__code__, py_func.__globals__, name, py_func.__defaults__,
                                 py_func.__closure__)
        f.__qualname__, f.__doc__, f.__module__ = name, py_func.__doc__, py_func.__module__
        out.append(njit(parallel=parallel, cache=True, nogil=True, **options)(f))
    return tuple(out)


def set_threads(n: int | None = None) -> None:
    """Use ``n`` (default: torch's intra-op thread count) threads in the parallel kernels; torch
    keeps its own count. Numba's OpenMP layer sets the process's OpenMP thread count to
    ``NUMBA_NUM_THREADS`` (the cores) when it starts its pool, at the first parallel launch; torch
    shares that OpenMP runtime, so after a model had run, ``torch.set_num_threads(1)`` silently
    became one thread per core. The pool is started here (a no-op once started) and torch given its
    count back."""
    from numba.np.ufunc import parallel

    keep = torch.get_num_threads()
    parallel._launch_threads()
    if torch.get_num_threads() != keep:
        torch.set_num_threads(keep)
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


@njit(cache=True)
def _f32_to_fp8_bits(y):
    """float32 with |y| <= 448 -> float8_e4m3fn bits, round to nearest even, subnormals included
    (as torch's .to(float8_e4m3fn) of a clamped value); the sign of a zero is kept. Integer
    arithmetic on the float's bits: no float op whose rounding fastmath could change."""
    u = np.int64(_f32_bits(y))
    sign = np.uint8((u >> 24) & 0x80)
    e = ((u >> 23) & 0xFF) - 127
    m = u & 0x7FFFFF
    if e < -6:  # below fp8's smallest normal (2^-6): a multiple of 2^-9 (0..8, 8 = 2^-6)
        s = 14 - e  # the full 24-bit mantissa times 2^(e - 23), in units of 2^-9
        if s > 25:  # < 2^-11 (zero and float32 subnormals included): rounds to zero
            return sign
        q = (m | 0x800000) >> s
        rem = (m | 0x800000) & ((np.int64(1) << s) - 1)
        half = np.int64(1) << (s - 1)
        if rem > half or (rem == half and (q & 1) == 1):
            q += 1
        return sign | np.uint8(q)
    q = m >> 20  # 3 mantissa bits
    rem = m & 0xFFFFF
    if rem > 0x80000 or (rem == 0x80000 and (q & 1) == 1):
        q += 1
    if q == 8:
        q = 0
        e += 1
    return sign | np.uint8(((e + 7) << 3) | q)


@njit(cache=True)
def _store_scale(absmax, top, sdst, r, h):
    """An exact entry's fp16 scale of one head, absmax / top (>= 2^-24), stored as bits at
    sdst[r, h]; returns it as float32 (what the row is divided by). Without fastmath: the
    division rounds as torch's."""
    sc = absmax / top
    if sc < np.float32(2.0 ** -24):
        sc = np.float32(2.0 ** -24)
    sb = _f32_to_half_bits(sc)
    sdst[r, h] = sb
    return _half_bits_to_f32(sb)

@njit(cache=True)
def _fp8_store_row(src, t, dst, r, wi, sdst):
    """src[t] [H, d] f32 -> fp8 e4m3 codes at dst[r, wi] [H, d] and one fp16 scale (absmax / 448,
    >= 2^-24) per head at sdst[r] [H] (bits): :func:`sglang_tasq.salient.fp8_encode`, bit for bit.
    Compiled without fastmath (the divisions round as torch's) and not inlined into a caller's
    fastmath code."""
    H, d = src.shape[1], src.shape[2]
    for h in range(H):
        a = np.float32(0.0)
        for c in range(d):
            a = max(a, abs(src[t, h, c]))
        sf = _store_scale(a, np.float32(448.0), sdst, r, h)
        for c in range(d):
            y = src[t, h, c] / sf
            y = min(max(y, np.float32(-448.0)), np.float32(448.0))
            dst[r, wi, h, c] = _f32_to_fp8_bits(y)


@njit(cache=True, inline="always")
def _key_reading(kcb, kperm, h, codes, row, first, s, out):
    """out[h] [d] = head h's key codes ``codes[row, first:first + Gk]`` as the reference decode
    reads them: the un-tailored codeword ``kcb[h, j, z]`` times the head's scale ``s``, element l
    at its native channel ``kperm[h, j * gk + l]`` (what a res4 entry completes)."""
    Gk, gk = kcb.shape[1], kcb.shape[3]
    for j in range(Gk):
        z = codes[row, first + j]
        for l in range(gk):
            out[h, kperm[h, j * gk + l]] = kcb[h, j, z, l] * s


@njit(cache=True)
def _res4_store_row(src, t, coded, dst, r, wi, sdst):
    """The residual src[t] - coded [H, d] f32 -> 4-bit steps at dst[r, wi] [H, d / 2] (two a
    byte, channel 2i low) and one fp16 scale (absmax / 7, >= 2^-24) per head at sdst[r] [H]
    (bits): :func:`sglang_tasq.salient.res4_encode`, bit for bit (round half to even, as
    torch.round). Compiled without fastmath (the divisions round as torch's)."""
    H, d = src.shape[1], src.shape[2]
    q = np.empty(d, np.int32)
    for h in range(H):
        a = np.float32(0.0)
        for c in range(d):
            a = max(a, abs(src[t, h, c] - coded[h, c]))
        sf = _store_scale(a, np.float32(7.0), sdst, r, h)
        for c in range(d):
            y = (src[t, h, c] - coded[h, c]) / sf
            f = np.float32(math.floor(y))
            e = y - f
            if e > np.float32(0.5) or (e == np.float32(0.5) and int(f) % 2 != 0):
                f += np.float32(1.0)
            q[c] = min(max(int(f), -7), 7) + 8
        for i in range(d // 2):
            dst[r, wi, h, i] = np.uint8(q[2 * i] | (q[2 * i + 1] << 4))

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


@intrinsic
def _f32_from_bits(typingctx, bits):
    """int32 bits -> float32 (bit cast: the 2**n of the decode kernel's vectorized exp)."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.int32), codegen


@intrinsic
def _prefetch(typingctx, arr, idx):
    """Prefetch the cache line of ``arr[idx]`` (idx a tuple of intp, one per dimension) for
    reading (``llvm.prefetch``; a hint: no fault, no effect on results)."""
    if not isinstance(arr, types.Array) or not isinstance(idx, types.UniTuple) or idx.count != arr.ndim:
        return None

    def codegen(context, builder, signature, args):
        aryty = signature.args[0]
        ary = context.make_array(aryty)(context, builder, args[0])
        inds = cgutils.unpack_tuple(builder, args[1], aryty.ndim)
        ptr = cgutils.get_item_pointer(context, builder, aryty, ary, inds, wraparound=False, boundscheck=False)
        i8p = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
                                            "llvm.prefetch.p0")
        builder.call(fn, [builder.bitcast(ptr, i8p), ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()
    return types.void(arr, idx), codegen


@intrinsic
def _load_u64(typingctx, arr, row, byte):
    """The 8 bytes of the 2-d uint8 array ``arr`` from ``arr[row, byte]`` on, as a little-endian
    int64: one unaligned load. The caller keeps all 8 bytes inside one contiguous buffer (no
    bounds checks here)."""
    if not (isinstance(arr, types.Array) and arr.dtype == types.uint8 and arr.ndim == 2):
        return None

    def codegen(context, builder, signature, args):
        aryty = signature.args[0]
        ary = context.make_array(aryty)(context, builder, args[0])
        inds = [context.cast(builder, a, t, types.intp) for a, t in zip(args[1:], signature.args[1:])]
        ptr = cgutils.get_item_pointer(context, builder, aryty, ary, inds, wraparound=False, boundscheck=False)
        return builder.load(builder.bitcast(ptr, ir.IntType(64).as_pointer()), align=1)
    return types.int64(arr, row, byte), codegen


def _make_copy(width: int):
    """An intrinsic ``copy(dst, didx, src, sidx)``: the ``width`` float32 elements from
    ``src[sidx]`` on (along its last, contiguous dimension) to ``dst[didx]`` on, as one LLVM
    vector load and store (Numba leaves the SLP vectorizer off, so short contiguous copies in
    loops otherwise stay scalar). idx: tuples of intp, one per dimension; no bounds checks."""
    @intrinsic
    def copy(typingctx, dst, didx, src, sidx):
        for a, i in ((dst, didx), (src, sidx)):
            if (not isinstance(a, types.Array) or a.dtype != types.float32 or not isinstance(i, types.UniTuple)
                    or i.count != a.ndim):
                return None

        def codegen(context, builder, signature, args):
            ptrs = []
            for aty, a, ity, i in zip(signature.args[::2], args[::2], signature.args[1::2], args[1::2]):
                ary = context.make_array(aty)(context, builder, a)
                inds = cgutils.unpack_tuple(builder, i, aty.ndim)
                ptrs.append(cgutils.get_item_pointer(context, builder, aty, ary, inds, wraparound=False,
                                                     boundscheck=False))
            vty = ir.VectorType(ir.FloatType(), width)
            v = builder.load(builder.bitcast(ptrs[1], vty.as_pointer()), align=4)
            builder.store(v, builder.bitcast(ptrs[0], vty.as_pointer()), align=4)
            return context.get_dummy_value()
        return types.void(dst, didx, src, sidx), codegen
    return copy


_copy4 = _make_copy(4)
_copy8 = _make_copy(8)
