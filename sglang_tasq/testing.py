"""Small valid random codebooks for unit tests of kernels, caches and backends.

Real quality claims use calibrated artifacts of the real model; these only exercise the
math and the plumbing on awkward shapes.
"""
from __future__ import annotations

import torch

from .codec import Codebooks, contiguous_pair_permutation, stratified_permutation
from .config import TaSQConfig


def random_pair_permutation(H: int, d: int, g: int, gen: torch.Generator) -> torch.Tensor:
    """[H, d] permutation keeping whole RoPE pairs in each group (canonical in-group layout)."""
    half, m = d // 2, g // 2
    out = []
    for _ in range(H):
        pairs = torch.randperm(half, generator=gen).view(-1, m)
        out.append(torch.cat([pairs, pairs + half], dim=1).reshape(-1))
    return torch.stack(out)


def random_codebooks(num_layers: int = 2, num_kv_heads: int = 2, head_dim: int = 16,
                     config: TaSQConfig | None = None, seed: int = 0,
                     rope_theta: float = 10000.0) -> Codebooks:
    cfg = config or TaSQConfig(codebook_size_k=64, codebook_size_v=64)
    cfg.check_head_dim(head_dim)
    gen = torch.Generator().manual_seed(seed)
    L, H, d = num_layers, num_kv_heads, head_dim
    gk, gv = cfg.group_size_k, cfg.group_size_v
    k_cb = torch.randn(L, H, d // gk, cfg.codebook_size_k, gk, generator=gen)
    v_cb = torch.randn(L, H, d // gv, cfg.codebook_size_v, gv, generator=gen)
    if cfg.weighting == "none":
        w = torch.ones(L, H, d)
    else:
        w = torch.rand(L, H, d, generator=gen) + 0.25
        w = w / w.pow(2).mean(-1, keepdim=True).sqrt()
    if cfg.grouping == "channels":
        perm = torch.arange(d).expand(L, H, d).clone()
    elif cfg.grouping == "contiguous":
        perm = contiguous_pair_permutation(d, gk).expand(L, H, d).clone()
    elif cfg.grouping == "stratified":
        perm = stratified_permutation(d, gk).expand(L, H, d).clone()
    else:
        perm = torch.stack([random_pair_permutation(H, d, gk, gen) for _ in range(L)])
    inv_freq = 1.0 / (rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    mix = unmix = mean = None
    if cfg.mixes_keys:  # a well-conditioned random map and its inverse
        w = torch.ones(L, H, d)
        mix = torch.eye(d) + 0.3 * torch.randn(L, H, d, d, generator=gen) / d ** 0.5
        unmix = torch.linalg.inv(mix)
    if cfg.weighting == "qpca":
        mean = torch.randn(L, H, d, generator=gen)
    if cfg.layer_mixed:  # a per-layer key rate: each listed layer's codebook and groups at the mix rate
        cfg.check_layers(L)
        gm, km = cfg.mix_group_size_k, cfg.mix_codebook_size_k
        k_cb = tuple(torch.randn(H, d // gm, km, gm, generator=gen) if l in cfg.mix_layers else k_cb[l]
                     for l in range(L))
        for l in cfg.mix_layers:
            perm[l] = (contiguous_pair_permutation(d, gm).expand(H, d) if cfg.grouping == "contiguous"
                       else random_pair_permutation(H, d, gm, gen))
    return Codebooks(config=cfg, k_codebook=k_cb, k_weight=w, k_perm=perm, v_codebook=v_cb,
                     inv_freq=inv_freq.float(), k_mix=mix, k_unmix=unmix, k_mean=mean)
