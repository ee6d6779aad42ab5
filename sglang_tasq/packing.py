"""How codes and scales are laid out in bytes: the one definition every path follows.

A token's codes ``[n]`` (each ``< 2**bits``) are one little-endian bit stream: code ``i``
occupies bits ``[i*bits, (i+1)*bits)`` of the row, and bit ``b`` of the row is bit ``b % 8`` of
byte ``b // 8``. A pool key row is the packed key codes of all heads (code ``h*G + j``) followed
by the token's fp16 scales: ``scale_groups`` of them for scale "shared" (one per contiguous group
of KV heads; 1 by default, all heads), one per head for "per_head", or none.

The Numba CPU twins (``numba_kernels.cpu.pack``) and the CUDA kernels write the same bytes and
are tested equal to :func:`pack_codes` / :func:`unpack_codes`.
"""
from __future__ import annotations

import torch

#: integer id of each scale mode, as the Numba kernels take it
SCALE_MODE_ID = {"none": 0, "shared": 1, "per_head": 2}


def scale_count(mode: str, num_kv_heads: int, groups: int = 1) -> int:
    """fp16 scales stored per token: one per group of heads (shared), one per KV head, or 0."""
    try:
        return {"shared": groups, "per_head": num_kv_heads, "none": 0}[mode]
    except KeyError:
        raise ValueError(f"unknown scale mode {mode!r}; expected one of {sorted(SCALE_MODE_ID)}") from None


def scales_per_token(cfg, num_kv_heads: int) -> int:
    """fp16 key scales per token of config ``cfg`` for ``num_kv_heads`` heads."""
    return scale_count(cfg.scale, num_kv_heads, getattr(cfg, "scale_groups", 1))


def packed_row_bytes(num_codes: int, bits: int) -> int:
    return (num_codes * bits + 7) // 8


def row_bytes(cfg, num_kv_heads: int, head_dim: int, layer: int | None = None) -> tuple[int, int, int]:
    """(key code bytes, key scale bytes, value code bytes) of one token in one layer (``layer``
    names it where the keys' rate is per layer, ``cfg.mix_layers``; None: the main rate)."""
    gk, gv = head_dim // cfg.key_rate(layer)[0], head_dim // cfg.group_size_v
    return (packed_row_bytes(num_kv_heads * gk, cfg.code_bits_k_at(layer)), 2 * scales_per_token(cfg, num_kv_heads),
            packed_row_bytes(num_kv_heads * gv, cfg.code_bits_v))


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes [T, n] int (< 2**bits) -> packed [T, ceil(n*bits/8)] uint8 (on codes' device)."""
    T, n = codes.shape
    if codes.numel() and (codes.min() < 0 or codes.max() >= (1 << bits)):
        raise ValueError(f"codes out of range for {bits}-bit packing")
    dev = codes.device
    shifts = torch.arange(bits, dtype=torch.int64, device=dev)
    bitstream = ((codes.to(torch.int64).unsqueeze(-1) >> shifts) & 1).reshape(T, n * bits)
    nbytes = packed_row_bytes(n, bits)
    pad = nbytes * 8 - n * bits
    if pad:
        bitstream = torch.nn.functional.pad(bitstream, (0, pad))
    weights = (1 << torch.arange(8, dtype=torch.int64, device=dev))
    return (bitstream.view(T, nbytes, 8) * weights).sum(-1).to(torch.uint8)


def unpack_codes(packed: torch.Tensor, n: int, bits: int) -> torch.Tensor:
    """packed [T, nbytes] uint8 -> codes [T, n] int64 (inverse of :func:`pack_codes`)."""
    T, nbytes = packed.shape
    if nbytes != packed_row_bytes(n, bits):
        raise ValueError(f"packed rows have {nbytes} bytes, {n} codes of {bits} bits need {packed_row_bytes(n, bits)}")
    dev = packed.device
    bitstream = ((packed.to(torch.int64).unsqueeze(-1) >> torch.arange(8, device=dev)) & 1).reshape(T, nbytes * 8)
    bitstream = bitstream[:, : n * bits].view(T, n, bits)
    return (bitstream << torch.arange(bits, dtype=torch.int64, device=dev)).sum(-1)


class Unpacker:
    """:func:`unpack_codes` as one gather: each code read from the (at most 3) bytes it spans,
    with the byte-index tables made once per (n, bits, device). Equal to the reference."""

    def __init__(self):
        self._tables = {}

    def __call__(self, packed: torch.Tensor, n: int, bits: int) -> torch.Tensor:
        if bits > 17 or packed.shape[1] != packed_row_bytes(n, bits):
            return unpack_codes(packed, n, bits)  # the reference (and its error)
        key = (n, bits, packed.device)
        tab = self._tables.get(key)
        if tab is None:
            start = torch.arange(n, dtype=torch.int64) * bits
            nb = packed.shape[1]
            idx = (start // 8).unsqueeze(1) + torch.arange(3)
            tab = self._tables[key] = (idx.clamp(max=nb - 1).reshape(-1).to(packed.device),
                                       (idx < nb).to(torch.int32).to(packed.device),
                                       (start % 8).to(torch.int32).to(packed.device))
        idx, ok, shift = tab
        b = packed.index_select(1, idx).view(packed.shape[0], n, 3).to(torch.int32) * ok
        word = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16)
        return ((word >> shift) & ((1 << bits) - 1)).to(torch.int64)


def bytes_per_token(cfg, num_kv_heads: int, head_dim: int, num_layers: int) -> int:
    """A pool token slot's codes + scales over all layers (the exact window store is extra)."""
    return sum(sum(row_bytes(cfg, num_kv_heads, head_dim, layer)) for layer in range(num_layers))
