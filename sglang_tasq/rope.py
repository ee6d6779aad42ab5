"""Rotate-half RoPE (Llama/Mistral/Qwen layout) in plain torch, forward and inverse.

Channel ``c < d/2`` pairs with ``c + d/2`` and turns at angle ``pos * inv_freq[c]``:
``out_a = x_a cos - x_b sin``, ``out_b = x_b cos + x_a sin``. ``attention_scaling`` is the
factor some RoPE variants (YaRN, longrope) put on cos and sin; it is 1 for Llama.
"""
from __future__ import annotations

import torch


def cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, attention_scaling: float = 1.0):
    """positions [...] int -> cos, sin [..., d/2] float32 (angles computed in float64)."""
    ang = positions.to(torch.float64)[..., None] * inv_freq.to(torch.float64)
    return (torch.cos(ang) * attention_scaling).float(), (torch.sin(ang) * attention_scaling).float()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Apply RoPE to x [..., d] with cos/sin [..., d/2] broadcastable; inverse turns back.

    The inverse divides out ``attention_scaling**2`` so that ``rotate(rotate(x), inv=True) == x``.
    """
    half = x.shape[-1] // 2
    a, b = x[..., :half].float(), x[..., half:].float()
    if inverse:
        norm = cos * cos + sin * sin
        c, s = cos / norm, -sin / norm
    else:
        c, s = cos, sin
    return torch.cat([a * c - b * s, b * c + a * s], dim=-1)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
               attention_scaling: float = 1.0, inverse: bool = False) -> torch.Tensor:
    """x [T, ..., d], positions [T] -> x rotated (float32). Heads dims broadcast."""
    cos, sin = cos_sin(positions, inv_freq, attention_scaling)
    extra = x.dim() - 2
    cos = cos.reshape(cos.shape[0], *([1] * extra), cos.shape[-1])
    sin = sin.reshape(sin.shape[0], *([1] * extra), sin.shape[-1])
    return rotate(x, cos, sin, inverse=inverse)
