"""Bit packing in Numba, bit-identical to :func:`sglang_tasq.packing.pack_codes` /
:func:`~sglang_tasq.packing.unpack_codes` (the one definition of the layout: code ``i`` at bits
``[i*bits, (i+1)*bits)`` of a little-endian row bit stream).

``_pack_row`` is the one packing loop: :func:`pack` runs it per token, the fused encoder's row
writer (:mod:`.encode`) per pool row. ``_codes_row`` is the decode kernel's one-pass reader of
a run of codes of a packed row.
"""
from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange

from sglang_tasq.packing import packed_row_bytes

from ._common import _SERIAL_BELOW, _load_u64


@njit(cache=True, inline="always")
def _pack_row(codes, t, n, bits, buf, slot, nbytes):
    """buf[slot, :nbytes] = codes[t, :n] packed (little-endian bit stream, packing.pack_codes)."""
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


@njit(parallel=True, cache=True, nogil=True)
def _pack(codes, bits, out):
    T, n = codes.shape
    nbytes = out.shape[1]
    for t in prange(T):
        _pack_row(codes, t, n, bits, out, t, nbytes)


@njit(cache=True, nogil=True)
def _pack_serial(codes, bits, out):
    """:func:`_pack` on the calling thread (a few rows: a parallel region's start costs more)."""
    T, n = codes.shape
    nbytes = out.shape[1]
    for t in range(T):
        _pack_row(codes, t, n, bits, out, t, nbytes)


@njit(parallel=True, cache=True, nogil=True)
def _unpack(packed, n, bits, out):
    """Every row's n codes (:func:`_codes_row`: one unaligned 8-byte load per code where the
    row allows it)."""
    for t in prange(packed.shape[0]):
        _codes_row(packed, t, 0, n, bits, out, t)


@njit(cache=True, nogil=True)
def _unpack_serial(packed, n, bits, out):
    """:func:`_unpack` on the calling thread."""
    for t in range(packed.shape[0]):
        _codes_row(packed, t, 0, n, bits, out, t)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes [T, n] -> packed [T, ceil(n*bits/8)] uint8, == packing.pack_codes (range-checked)."""
    T, n = codes.shape
    if not 1 <= bits <= 32:
        raise ValueError(f"code width {bits} bits is outside 1..32")
    if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= (1 << bits)):
        raise ValueError(f"codes out of range for {bits}-bit packing")
    out = np.empty((T, packed_row_bytes(n, bits)), np.uint8)
    if T:
        (_pack_serial if T < _SERIAL_BELOW else _pack)(codes.detach().cpu().to(torch.int64).contiguous().numpy(),
                                                      bits, out)
    return torch.from_numpy(out)


def unpack(packed: torch.Tensor, n: int, bits: int) -> torch.Tensor:
    """packed [T, nbytes] uint8 -> codes [T, n] int64, == packing.unpack_codes."""
    T, nbytes = packed.shape
    if nbytes != packed_row_bytes(n, bits):
        raise ValueError(f"packed rows have {nbytes} bytes, {n} codes of {bits} bits need {packed_row_bytes(n, bits)}")
    out = np.empty((T, n), np.int64)
    if T:
        (_unpack_serial if T < _SERIAL_BELOW else _unpack)(packed.detach().cpu().contiguous().numpy(), n, bits, out)
    return torch.from_numpy(out)


@njit(cache=True, inline="always")
def _codes_row(buf2d, slot, first, n, bits, out, i):
    """out[i, :n] = codes first..first+n-1 of packed row ``slot`` (bits <= 56). In a C-contiguous
    buffer, where the 8 bytes from the last code's first byte on lie inside it (every row but
    the last few bytes of the buffer), each code is one unaligned 8-byte load, a shift and a
    mask (no loop over bytes, no branches); otherwise each byte is read once, in order, never
    past the byte holding the last code's top bit."""
    pos = first * bits
    mask = (np.int64(1) << bits) - 1
    row = buf2d.shape[1]
    if (buf2d.strides[1] == 1 and buf2d.strides[0] == row
            and slot * row + ((pos + (n - 1) * bits) >> 3) + 8 <= buf2d.shape[0] * row):
        for j in range(n):
            p = pos + j * bits
            out[i, j] = (_load_u64(buf2d, slot, p >> 3) >> (p & 7)) & mask
        return
    byte = pos >> 3
    acc = np.int64(buf2d[slot, byte]) >> (pos & 7)
    nacc = 8 - (pos & 7)
    byte += 1
    for j in range(n):
        while nacc < bits:
            acc |= np.int64(buf2d[slot, byte]) << nacc
            byte += 1
            nacc += 8
        out[i, j] = acc & mask
        acc >>= bits
        nacc -= bits
