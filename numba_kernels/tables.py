"""Kernel-ready tensors of one layer of a TaSQ artifact (:class:`LayerTables`).

The decode kernels read folded codebooks as fp16 (a 1024 x 8 codebook is 16 KB of shared
memory); the encoder searches the tailored codebook ``k_cb.float() * w[perm]`` built from
the SAME fp16-rounded codewords, so encode and decode agree. :meth:`LayerTables.codebooks`
turns the tables back into a one-layer :class:`sglang_tasq.codec.Codebooks` holding exactly
these rounded values: the plain-torch references run the codec on it.

Shapes: H KV heads, d head_dim, Gk = d/gk key groups, Kk key codebook size (same for v).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_tasq.codec import Codebooks
from sglang_tasq.config import TaSQConfig
from sglang_tasq.packing import packed_row_bytes


@dataclass(frozen=True)
class LayerTables:
    """One layer's codebooks and key-space transforms, on one device.

    k_cb:      [H, Gk, Kk, gk] fp16 folded decode codewords (native units, permuted order)
    v_cb:      [H, Gv, Kv, gv] fp16 value codewords
    k_tcb:     [H, Gk, Kk, gk] f32 tailored codewords ``k_cb * w[perm]`` (encoder search)
    k_tnorm:   [H, Gk, Kk] f32 squared norms of ``k_tcb``
    v_tcb:     [H, Gv, Kv, gv] f32 ``v_cb.float()``;  v_tnorm: [H, Gv, Kv] f32
    k_weight:  [H, d] f32 channel weights w (native order)
    k_perm:    [H, d] int32, permuted channel i holds native channel k_perm[h, i]
    rope_freq: [H, Gk, gk/2] f32 inv_freq of each pair in the permuted in-group layout
    inv_freq:  [d/2] f32 native RoPE frequencies
    """

    config: TaSQConfig
    k_cb: torch.Tensor
    v_cb: torch.Tensor
    k_tcb: torch.Tensor
    k_tnorm: torch.Tensor
    v_tcb: torch.Tensor
    v_tnorm: torch.Tensor
    k_weight: torch.Tensor
    k_perm: torch.Tensor
    rope_freq: torch.Tensor
    inv_freq: torch.Tensor
    attention_scaling: float = 1.0

    @classmethod
    def from_codebooks(cls, cb: Codebooks, layer: int, device="cpu") -> "LayerTables":
        """Tables of ``layer`` of ``cb`` (diagonal or no weighting only). With a per-layer key rate
        (``config.mix_layers``) the tables' ``config`` is the layer's one-rate config
        (:meth:`TaSQConfig.for_layer`), so every kernel launch reads this layer's key rate."""
        if cb.k_mix is not None:
            raise ValueError("dense key weighting (k_mix) has no kernel; use weighting='diag' or 'none'")
        cfg = cb.config.for_layer(layer)
        if cfg.code_bits_k > 16 or cfg.code_bits_v > 16:
            raise ValueError(f"code bits {cfg.code_bits_k}/{cfg.code_bits_v}: kernels support <= 16")
        if cfg.scale == "shared" and cfg.scale_groups > 1:  # (one group per head arrives as "per_head")
            raise ValueError(f"scale_groups={cfg.scale_groups}: the CUDA kernels read one key scale per token or "
                             "one per head (sglang_tasq.sharding.shard gives each TP rank one of those)")
        one = Codebooks(config=cfg, k_codebook=cb.k_codebook[layer][None].half().float(),
                        k_weight=cb.k_weight[layer : layer + 1].float(), k_perm=cb.k_perm[layer : layer + 1],
                        v_codebook=cb.v_codebook[layer : layer + 1].half().float(),
                        inv_freq=cb.inv_freq.float(), attention_scaling=cb.attention_scaling)
        k_tcb = one.tailored_k_codebook(0).float()
        v_tcb = one.v_codebook[0].float()
        dev = torch.device(device)
        return cls(
            config=cfg,
            k_cb=cb.k_codebook[layer].half().contiguous().to(dev),
            v_cb=cb.v_codebook[layer].half().contiguous().to(dev),
            k_tcb=k_tcb.contiguous().to(dev),
            k_tnorm=(k_tcb * k_tcb).sum(-1).contiguous().to(dev),
            v_tcb=v_tcb.contiguous().to(dev),
            v_tnorm=(v_tcb * v_tcb).sum(-1).contiguous().to(dev),
            k_weight=one.k_weight[0].contiguous().to(dev),
            k_perm=cb.k_perm[layer].to(torch.int32).contiguous().to(dev),
            rope_freq=one.rope_freq_perm(0).float().contiguous().to(dev),
            inv_freq=cb.inv_freq.float().contiguous().to(dev),
            attention_scaling=float(cb.attention_scaling),
        )

    # ---- sizes ----------------------------------------------------------------------
    @property
    def num_kv_heads(self) -> int:
        return self.k_cb.shape[0]

    @property
    def head_dim(self) -> int:
        return self.k_weight.shape[1]

    @property
    def k_groups(self) -> int:
        return self.k_cb.shape[1]

    @property
    def v_groups(self) -> int:
        return self.v_cb.shape[1]

    @property
    def k_row_bytes(self) -> int:
        """Bytes of one packed key row (all heads of one token)."""
        return packed_row_bytes(self.num_kv_heads * self.k_groups, self.config.code_bits_k)

    @property
    def v_row_bytes(self) -> int:
        return packed_row_bytes(self.num_kv_heads * self.v_groups, self.config.code_bits_v)

    def codebooks(self) -> Codebooks:
        """A one-layer Codebooks (layer 0) with exactly these fp16-rounded codewords, on CPU."""
        return Codebooks(config=self.config, k_codebook=self.k_cb.float().cpu()[None],
                         k_weight=self.k_weight.cpu()[None], k_perm=self.k_perm.long().cpu()[None],
                         v_codebook=self.v_cb.float().cpu()[None], inv_freq=self.inv_freq.cpu(),
                         attention_scaling=self.attention_scaling)

    def allocate_pool(self, num_slots: int, device=None) -> dict:
        """Zeroed per-layer pool: k_codes/v_codes uint8 [S, row bytes], k_scale fp16 [S] / [S, H]."""
        dev = device or self.k_cb.device
        scale_shape = {"shared": (num_slots,), "per_head": (num_slots, self.num_kv_heads), "none": (1,)}
        return {
            "k_codes": torch.zeros(num_slots, self.k_row_bytes, dtype=torch.uint8, device=dev),
            "v_codes": torch.zeros(num_slots, self.v_row_bytes, dtype=torch.uint8, device=dev),
            "k_scale": torch.ones(scale_shape[self.config.scale], dtype=torch.float16, device=dev),
        }
