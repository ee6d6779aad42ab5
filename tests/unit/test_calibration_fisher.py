"""The calibration's k-means points and weights: the Fisher is taken in the tailored space
(with the s_p^2 factor of the shared scale), and a subset keeps its weights."""
from types import SimpleNamespace

import torch

from calibrate import pipeline
from sglang_tasq import codec
from sglang_tasq.config import TaSQConfig


def _setup(scale: str):
    L, N, H, d, g, K = 1, 300, 2, 16, 8, 4
    cfg = TaSQConfig(group_size_k=g, group_size_v=g, codebook_size_k=K, codebook_size_v=K, scale=scale,
                     max_kmeans_samples=10_000)
    gen = torch.Generator().manual_seed(0)
    keys = (torch.randn(L, N, H, d, generator=gen) * (1 + torch.arange(N)[None, :, None, None] / 50)).half()
    fisher = torch.rand(L, N, H, d, generator=gen).bfloat16()
    cap = SimpleNamespace(keys=keys, values=keys.clone(), fisher_k=fisher, fisher_v=fisher.clone())
    w = torch.rand(L, H, d, generator=gen) + 0.5
    w = w / w.pow(2).mean(-1, keepdim=True).sqrt()
    perm = torch.stack([codec.contiguous_pair_permutation(d, g), codec.contiguous_pair_permutation(d, g).flip(0)])[None]
    cb = codec.Codebooks(cfg, torch.zeros(L, H, d // g, K, g), w, perm, torch.zeros(L, H, d // g, K, g),
                         1.0 / (10000 ** (torch.arange(0, d, 2).float() / d)), 1.0)
    return cfg, cap, cb


def test_key_fisher_includes_the_squared_scale():
    for scale in ("shared", "per_head", "none"):
        cfg, cap, cb = _setup(scale)
        x, wts = pipeline._key_points(cap, cb, 0, torch.Generator().manual_seed(0))
        _, s = codec.key_tailor(cap.keys[0].float(), cb, 0)
        N, H, d = cap.keys.shape[1:]
        s2 = torch.ones(N, H) if s is None else (s.float()[:, None] if s.dim() == 1 else s.float()).expand(N, H) ** 2
        f = cap.fisher_k[0].float() * s2[..., None] / cb.k_weight[0].pow(2)
        f = torch.gather(f, 2, cb.k_perm[0].expand(N, H, d))
        expect = f.view(N, H * d // 8, 8).sum(-1).T
        torch.testing.assert_close(wts, expect)
        if scale != "none":  # the factor matters: tokens' scales differ by ~7x here
            plain = (torch.gather(cap.fisher_k[0].float() / cb.k_weight[0].pow(2), 2, cb.k_perm[0].expand(N, H, d))
                     .view(N, H * d // 8, 8).sum(-1).T)
            assert not torch.allclose(wts, plain, rtol=0.1)


def test_subset_is_uniform_and_keeps_weights():
    x = torch.arange(2 * 1000 * 8, dtype=torch.float32).view(2, 1000, 8)
    w = torch.rand(2, 1000)
    xs, ws = pipeline._subset(x, w, 100, torch.Generator().manual_seed(0))
    assert xs.shape == (2, 100, 8) and ws.shape == (2, 100)
    idx = (xs[0, :, 0] / 8).long()
    assert torch.equal(xs[1], x[1, idx]) and torch.equal(ws, w[:, idx])  # the same tokens for every codebook
    assert pipeline._subset(x, w, 5000, torch.Generator())[1] is w
