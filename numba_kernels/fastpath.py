"""Dispatch between the Numba CPU kernels and the plain-torch reference for the CPU hot paths
(nearest codeword, bit packing) of the SGLang pool and the HF cache.

``kernels=False`` (``SGLANG_TASQ_CPU_KERNELS=0``, read by :mod:`sglang_tasq.options`) selects the
torch implementations (:mod:`sglang_tasq.codec`, :mod:`sglang_tasq.packing`); otherwise
:mod:`numba_kernels.cpu` is used on CPU tensors. Both are tested against each other.
"""
from __future__ import annotations

from typing import Optional

import torch

from sglang_tasq import codec, packing
from sglang_tasq.options import ServeOptions


def kernels_default() -> bool:
    """The process's choice (``SGLANG_TASQ_CPU_KERNELS``, default on)."""
    return ServeOptions.from_env().cpu_kernels


def layer_nearest(make_codebook, kernels: Optional[bool] = None):
    """Per-layer nearest-codeword search: ``f(x [T, H, G, g], layer) -> codes [T, H, G]``."""
    if kernels_default() if kernels is None else kernels:
        from numba_kernels import cpu

        cpu.set_threads()
        return codec.LayerNearest(make_codebook, cpu.prepare, cpu.nearest)
    return codec.LayerNearest(make_codebook)


def packer(kernels: Optional[bool] = None):
    """``pack(codes [T, n], bits) -> [T, bytes] uint8`` (== :func:`packing.pack_codes`)."""
    if not (kernels_default() if kernels is None else kernels):
        return packing.pack_codes

    def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
        if codes.device.type == "cpu":
            from numba_kernels import cpu

            return cpu.pack(codes, bits)
        return packing.pack_codes(codes, bits)

    return pack


def unpacker(kernels: Optional[bool] = None):
    """``unpack(packed, n, bits) -> codes [T, n] int64`` (== :func:`packing.unpack_codes`): the
    Numba kernel for CPU tensors, else :class:`packing.Unpacker` (one gather per code)."""
    table = packing.Unpacker()
    if not (kernels_default() if kernels is None else kernels):
        return table

    def unpack(packed: torch.Tensor, n: int, bits: int) -> torch.Tensor:
        if packed.device.type == "cpu" and bits <= 56:
            from numba_kernels import cpu

            return cpu.unpack(packed, n, bits)
        return table(packed, n, bits)

    return unpack


def u16_view(t: torch.Tensor):
    """A contiguous 16-bit float tensor's bits as a uint16 numpy array sharing its memory."""
    if not t.is_contiguous() or t.element_size() != 2:
        raise ValueError("u16_view needs a contiguous 16-bit tensor")
    return t.view(torch.int16).numpy().view("uint16")
