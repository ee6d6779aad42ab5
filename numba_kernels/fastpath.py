"""Dispatch between the Numba CPU kernels and the plain-torch codec for the CPU hot paths
(nearest codeword, bit packing) of the SGLang pool and the HF cache.

``SGLANG_TASQ_CPU_KERNELS=0`` selects the torch implementations (:mod:`sglang_tasq.codec`);
otherwise :mod:`numba_kernels.cpu` is used. Both are tested against each other.
"""
from __future__ import annotations

import os

import torch

from sglang_tasq import codec


def cpu_kernels_enabled() -> bool:
    """Numba CPU kernels on (env ``SGLANG_TASQ_CPU_KERNELS``, default 1)."""
    return os.environ.get("SGLANG_TASQ_CPU_KERNELS", "1") != "0"


def layer_nearest(make_codebook):
    """Per-layer nearest-codeword search: ``f(x [T, H, G, g], layer) -> codes [T, H, G]``."""
    if cpu_kernels_enabled():
        from numba_kernels import cpu

        cpu.set_threads()
        return cpu.LayerNearest(make_codebook)
    return codec.LayerNearest(make_codebook)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    if cpu_kernels_enabled() and codes.device.type == "cpu":
        from numba_kernels import cpu

        return cpu.pack(codes, bits)
    return codec.pack_codes(codes, bits)


def unpack(packed: torch.Tensor, n: int, bits: int) -> torch.Tensor:
    if cpu_kernels_enabled() and packed.device.type == "cpu":
        from numba_kernels import cpu

        return cpu.unpack(packed, n, bits)
    return codec.unpack_codes(packed, n, bits)


def u16_view(t: torch.Tensor):
    """A contiguous 16-bit float tensor's bits as a uint16 numpy array sharing its memory."""
    if not t.is_contiguous() or t.element_size() != 2:
        raise ValueError("u16_view needs a contiguous 16-bit tensor")
    return t.view(torch.int16).numpy().view("uint16")
