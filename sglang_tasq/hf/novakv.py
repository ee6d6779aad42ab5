"""NovaKV (Fernandez-Menduina, Ziashahabi, Pavez, Ortega, Avestimehr, 2026: "Spend Bits Where
Queries Look: KV Cache Vector Quantization with Attention-Preserving Transforms";
github.com/Amir-zsh/nova-kv) as a method of the HF cache.

Keys: post-RoPE group VQ in a query-whitened KLT basis, from a ``python -m calibrate --method
novakv`` artifact (:class:`sglang_tasq.hf.cache.TaSQKeys` runs it; the map, mean and stratified
grouping are in :mod:`sglang_tasq.codec`, the fit in :mod:`calibrate.weights`).

Values (:class:`RotatedScalarValues`): NovaKV stores values in OSCAR's scalar tier: a rotation,
then asymmetric min/max integer codes per group of 128 channels with the range clipped to 0.92.
OSCAR's rotation is calibrated and its fit is not described in what we could read, so the
rotation here is the orthonormal Hadamard matrix (a departure, named in README); the group is
one head (``min(128, head_dim)`` channels: 64 on SmolLM2, so the fp16 step and minimum cost
0.5 bits an element where NovaKV's 128-channel groups cost 0.25).
"""
from __future__ import annotations

import torch

from ..codec import Codebooks
from ..packing import pack_codes, unpack_codes
from .baselines import KVMethod
from .cache import TaSQKeys, TaSQValues
from .nsnquant import hadamard

CLIP = 0.92
GROUP = 128


class RotatedScalarValues:
    """Values: v -> v @ Hd (orthonormal Hadamard), then per (token, head, group of ``group``
    channels) asymmetric min/max codes of ``bits`` bits over the clipped range
    ``[clip * min, clip * max]`` (values beyond it saturate). Payload: codes packed
    [T, H*d*bits/8] uint8, step and minimum fp16 [T, H, d/group]."""

    pre_rope, block, exact = False, 1, False

    def __init__(self, bits: int = 2, group: int = GROUP, clip: float = CLIP):
        if bits < 1 or bits > 8:
            raise ValueError(f"value bits {bits}: allowed 1..8")
        self.bits, self.group, self.clip = bits, group, clip
        self.name = f"oscar_int{bits}"
        self._h: dict = {}

    def _groups(self, d: int) -> int:
        g = min(self.group, d)
        if d % g:
            raise ValueError(f"value group {self.group} does not divide head_dim={d}")
        return g

    def _rot(self, d: int, device) -> torch.Tensor:
        key = (d, str(device))
        if key not in self._h:
            self._h[key] = hadamard(d).to(device)
        return self._h[key]

    def encode(self, x, layer, state):
        T, H, d = x.shape
        g = self._groups(d)
        y = (x.float() @ self._rot(d, x.device)).view(T, H, d // g, g)
        levels = (1 << self.bits) - 1
        lo = (self.clip * y.amin(-1, keepdim=True)).half()
        hi = self.clip * y.amax(-1, keepdim=True)
        step = ((hi - lo.float()) / levels).half()
        s = step.float()
        s = torch.where(s > 0, s, torch.ones_like(s))
        codes = torch.round((y - lo.float()) / s).clamp(0, levels).to(torch.int64)
        return {"codes": pack_codes(codes.reshape(T, H * d), self.bits), "step": step.squeeze(-1), "low": lo.squeeze(-1)}

    def decode(self, payload, layer, state):
        step, low = payload["step"].float(), payload["low"].float()
        T, H, ng = step.shape
        d = payload["codes"].shape[1] * 8 // (self.bits * H)
        codes = unpack_codes(payload["codes"], H * d, self.bits).view(T, H, ng, d // ng).float()
        y = (codes * step[..., None] + low[..., None]).reshape(T, H, d)
        return y @ self._rot(d, y.device).T

    def bits_per_element(self, num_kv_heads, head_dim):
        return self.bits + 32 / self._groups(head_dim)


def novakv(cb: Codebooks, value_bits: int | None = 2, name: str = "novakv") -> KVMethod:
    """NovaKV: keys from a post-RoPE (``key_rope == 'post'``) artifact, values in the rotated
    scalar format at ``value_bits`` bits, or (``None``) the artifact's VQ values (TaSQ's value
    path: at one bit the scalar format's two levels sit at the clipped extremes and lose the
    values, relative error > 1)."""
    if cb.config.key_rope != "post":
        raise ValueError(f"method {name}: the artifact codes keys before RoPE; make one with "
                         "python -m calibrate --method novakv")
    values = TaSQValues(cb, name) if value_bits is None else RotatedScalarValues(value_bits)
    return KVMethod(TaSQKeys(cb, name), values, name)
