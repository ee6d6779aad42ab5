"""Stage 6: folding (paper sec. 4.4). Weights and permutation go into the codebooks so that
runtime decode is ``s * C~[z]`` (native units, permuted order), then RoPE at the key's
position: ``C~[h, j, :, i] = C[h, j, :, i] / w[h, perm[j*g + i]]``.

The dense-weighting ablation cannot fold (its M^{-1} mixes groups): its codebooks stay in
the tailored space and the artifact carries ``k.mix`` / ``k.unmix``.
"""
from __future__ import annotations

import torch


def fold_key_codebooks(tailored: torch.Tensor, weight: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """tailored [L, H, G, K, g], weight [L, H, d], perm [L, H, d] -> folded codebooks, same shape."""
    L, H, G, K, g = tailored.shape
    w_perm = torch.gather(weight, 2, perm).view(L, H, G, 1, g)
    return tailored / w_perm
