"""Closed-form KV quantizers (bf16, fp8 e4m3, KIVI-2) and the small protocol they share
with TaSQ, so that one HF cache (:mod:`sglang_tasq.hf.cache`) runs any of them.

A :class:`KVMethod` is a pair of :class:`SideQuantizer` objects, one for keys and one for
values. A side quantizer turns full-precision tokens ``x [T, H, d]`` into a *payload*
(a dict of tensors whose leading dimension counts blocks of ``block`` tokens) and back.
The cache owns the bookkeeping: windows, the residual of a partial block (kept at full
precision until the block fills, as KIVI does), positions and RoPE.

Bits per element include metadata (scales, zero points); per-layer constants (fp8's
tensor scale) are O(1) and left out of the per-element figure but counted in bytes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from ..packing import pack_codes, unpack_codes
from ..salient import FP8_MAX  # noqa: F401 (re-exported: largest finite float8_e4m3fn)


@runtime_checkable
class SideQuantizer(Protocol):
    """One side (keys or values) of a KV quantization method.

    name:     short label used in tables
    pre_rope: keys only: the quantizer works on pre-RoPE keys (the cache un-rotates them
              before ``encode`` and rotates ``decode``'s output); then ``inv_freq`` [d/2]
              and ``attention_scaling`` must be set. False: post-RoPE keys as cached.
    block:    tokens coded together along the token axis (1 = each token on its own)
    exact:    True when decode(encode(x)) == x (no full-precision windows are needed)

    A quantizer whose code depends on the token's position (NSNQuant's keys: statistics
    taken before RoPE, the residual coded after it) also sets ``positional = True``; the
    cache then passes ``positions=`` [T] (the tokens' cache indices) to ``encode`` and
    ``decode``.
    """

    name: str
    pre_rope: bool
    block: int
    exact: bool

    def encode(self, x: torch.Tensor, layer: int, state: dict) -> dict[str, torch.Tensor]:
        """x [T, H, d] (T a multiple of ``block``) -> payload, leading dim T // block.

        ``state`` is a per-(cache, layer, side) dict the method may fill on first use
        (static calibration such as fp8's prefill scale); its tensors count as stored bytes.
        """
        ...

    def decode(self, payload: dict[str, torch.Tensor], layer: int, state: dict) -> torch.Tensor:
        """payload with leading dim n -> x_hat [n * block, H, d] float32."""
        ...

    def bits_per_element(self, num_kv_heads: int, head_dim: int) -> float:
        ...


@dataclass(frozen=True)
class KVMethod:
    """What the HF cache runs: a key quantizer and a value quantizer."""

    keys: SideQuantizer
    values: SideQuantizer
    name: str = ""

    def bits(self, num_kv_heads: int, head_dim: int) -> tuple[float, float]:
        """(bits per key element, bits per value element), metadata included."""
        return (self.keys.bits_per_element(num_kv_heads, head_dim),
                self.values.bits_per_element(num_kv_heads, head_dim))


# ---- bf16 (identity) ----------------------------------------------------------------------
class Identity:
    """Stores tokens unchanged in the model dtype (bf16 for served models): 16 bits."""

    name, pre_rope, block, exact = "bf16", False, 1, True

    def encode(self, x, layer, state):
        return {"x": x.clone()}

    def decode(self, payload, layer, state):
        return payload["x"].float()

    def bits_per_element(self, num_kv_heads, head_dim):
        return 16.0


# ---- fp8 e4m3 -----------------------------------------------------------------------------
class FP8E4M3:
    """fp8 e4m3 with one static fp32 scale per layer and side: ``amax / 448`` of the first
    (prefill) call, kept fixed afterwards; later values beyond the range saturate.
    Keys post-RoPE (as SGLang's ``--kv-cache-dtype fp8_e4m3`` stores them). 8 bits.
    """

    name, pre_rope, block, exact = "fp8_e4m3", False, 1, False

    def encode(self, x, layer, state):
        if "scale" not in state:
            state["scale"] = (x.float().abs().amax() / FP8_MAX).clamp_min(1e-12).reshape(1)
        q = (x.float() / state["scale"]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return {"codes": q}

    def decode(self, payload, layer, state):
        return payload["codes"].float() * state["scale"]

    def bits_per_element(self, num_kv_heads, head_dim):
        return 8.0


# ---- KIVI 2-bit ---------------------------------------------------------------------------
def _asym_quant(x: torch.Tensor, dim: int, bits: int):
    """Asymmetric min/max quantization of x along ``dim`` -> (codes int64, scale fp16, zero fp16).

    Scale and zero are rounded to fp16 first and the codes computed against the rounded
    values, so that decode(codes, scale, zero) is what is stored.
    """
    levels = (1 << bits) - 1
    mn = x.amin(dim=dim, keepdim=True)
    mx = x.amax(dim=dim, keepdim=True)
    zero = mn.half()
    scale = ((mx - mn) / levels).half()
    s = scale.float()
    s = torch.where(s > 0, s, torch.ones_like(s))
    codes = torch.round((x - zero.float()) / s).clamp(0, levels).to(torch.int64)
    return codes, scale, zero


class KIVIKeys:
    """KIVI keys: per-channel asymmetric quantization over groups of ``block`` tokens
    (post-RoPE). Payload per block: codes [n, block*H*d*bits/8] uint8, scale/zero [n, H, d]
    fp16. Bits: ``bits + 32 / block``.
    """

    pre_rope, exact = False, False

    def __init__(self, bits: int = 2, block: int = 32):
        self.bits, self.block = bits, block
        self.name = f"kivi{bits}"

    def encode(self, x, layer, state):
        T, H, d = x.shape
        n = T // self.block
        xb = x.float().reshape(n, self.block, H, d)
        codes, scale, zero = _asym_quant(xb, dim=1, bits=self.bits)
        packed = pack_codes(codes.reshape(n, self.block * H * d), self.bits)
        return {"codes": packed, "scale": scale.squeeze(1), "zero": zero.squeeze(1)}

    def decode(self, payload, layer, state):
        scale, zero = payload["scale"], payload["zero"]
        n, H, d = scale.shape
        codes = unpack_codes(payload["codes"], self.block * H * d, self.bits).view(n, self.block, H, d)
        x = codes.float() * scale.float().unsqueeze(1) + zero.float().unsqueeze(1)
        return x.reshape(n * self.block, H, d)

    def bits_per_element(self, num_kv_heads, head_dim):
        return self.bits + 32 / self.block


class KIVIValues:
    """KIVI values: per-token asymmetric quantization over groups of ``group`` channels.
    Tokens are coded in blocks of ``block`` (the full-precision residual of KIVI's stream).
    Payload per block: codes [n, block*H*d*bits/8] uint8, scale/zero [n, block, H, d/group]
    fp16. Bits: ``bits + 32 / group`` (group capped at head_dim).
    """

    pre_rope, exact = False, False

    def __init__(self, bits: int = 2, group: int = 32, block: int = 32):
        if (block * bits) % 8:
            raise ValueError(f"KIVI block*bits must be a multiple of 8, got block={block} bits={bits}")
        self.bits, self.group, self.block = bits, group, block
        self.name = f"kivi{bits}"

    def _group(self, head_dim: int) -> int:
        g = min(self.group, head_dim)
        if head_dim % g:
            raise ValueError(f"KIVI value group {self.group} does not divide head_dim={head_dim}")
        return g

    def encode(self, x, layer, state):
        T, H, d = x.shape
        n, g = T // self.block, self._group(d)
        xg = x.float().reshape(n, self.block, H, d // g, g)
        codes, scale, zero = _asym_quant(xg, dim=-1, bits=self.bits)
        packed = pack_codes(codes.reshape(n, self.block * H * d), self.bits)
        return {"codes": packed, "scale": scale.squeeze(-1), "zero": zero.squeeze(-1)}

    def decode(self, payload, layer, state):
        scale, zero = payload["scale"], payload["zero"]
        n, blk, H, ng = scale.shape
        d = payload["codes"].shape[1] * 8 // (self.bits * blk * H)  # block*bits is a multiple of 8
        codes = unpack_codes(payload["codes"], blk * H * d, self.bits).view(n, blk, H, ng, d // ng)
        x = codes.float() * scale.float().unsqueeze(-1) + zero.float().unsqueeze(-1)
        return x.reshape(n * blk, H, d)

    def bits_per_element(self, num_kv_heads, head_dim):
        return self.bits + 32 / self._group(head_dim)


BASELINES = ("bf16", "fp8_e4m3", "kivi2")


def baseline(name: str) -> KVMethod:
    """A closed-form method by name: 'bf16', 'fp8_e4m3' or 'kivi2'."""
    if name == "bf16":
        return KVMethod(Identity(), Identity(), name)
    if name == "fp8_e4m3":
        return KVMethod(FP8E4M3(), FP8E4M3(), name)
    if name == "kivi2":
        return KVMethod(KIVIKeys(2, 32), KIVIValues(2, 32, 32), name)
    raise ValueError(f"baseline {name!r}: allowed {BASELINES}")
