"""bench.layer_errors: the least-squares key scale is the error-minimizing one for fixed codes and
equals the codec's where the codewords are the key itself; the per-layer errors average to what
calibrate reports; the mix reading picks the layers with the largest gain."""
import pytest
import torch

from bench import layer_errors as LE
from calibrate import evaluate
from sglang_tasq.config import TaSQConfig
from sglang_tasq.testing import random_codebooks


def test_ls_scale_minimizes_the_token_error():
    gen = torch.Generator().manual_seed(0)
    kw = torch.randn(37, 3, 8, 8, generator=gen)
    c = kw + 0.3 * torch.randn(kw.shape, generator=gen)  # codewords near, not at, the key
    s = LE.ls_scale(kw, c).float()
    err = lambda t: ((kw - t[:, None, None, None] * c) ** 2).sum((1, 2, 3))  # noqa: E731
    for factor in (0.9, 0.99, 1.01, 1.1):
        assert bool((err(s) <= err(s * factor) + 1e-4).all())
    # exact codewords up to a factor: the LS scale recovers it
    assert torch.allclose(LE.ls_scale(kw, kw / 2.5).float(), torch.full((37,), 2.5), rtol=1e-3)


def test_ls_scale_nmse_does_not_lose_to_the_rms_scale():
    cb = random_codebooks(num_layers=1, num_kv_heads=2, head_dim=16, seed=3)
    gen = torch.Generator().manual_seed(1)
    keys = torch.randn(64, 2, 16, generator=gen) * torch.linspace(0.2, 3, 16)
    queries = torch.randn(64, 4, 16, generator=gen)
    base = evaluate.layer_errors(cb, 0, keys, keys, queries, 32, pairs=2048)["logit_nmse"]
    got = LE.ls_scale_nmse(cb, 0, keys, queries, 32, 0)
    assert set(got) == {"ls", "ls2"} and all(v > 0 for v in got.values())
    # same pairs (seed 0) as the RMS reading; the LS scale is closer in the tailored metric, so it
    # should not be far worse in logit NMSE on random data either
    assert got["ls"] <= base * 1.05


def test_ls_scale_refuses_other_key_paths():
    cfg = TaSQConfig(codebook_size_k=64, codebook_size_v=64, scale="per_head")
    cb = random_codebooks(num_layers=1, num_kv_heads=2, head_dim=16, config=cfg, seed=3)
    with pytest.raises(ValueError, match="shared scale"):
        LE.ls_scale_nmse(cb, 0, torch.randn(32, 2, 16), torch.randn(32, 4, 16), 32, 0)


def test_mix_curve_takes_the_largest_gains_first():
    first = [0.01, 0.03, 0.02, 0.01]
    second = [0.009, 0.01, 0.015, 0.002]  # gains .001 .02 .005 .008
    assert LE.mix_ranking(first, second) == [1, 3, 2, 0]
    curve = LE.mix_curve(first, second, [1.25] * 4, [2.0] * 4, 2)
    assert [r["layers"] for r in curve] == [[1], [1, 3]]
    assert curve[0]["logit_nmse"] == pytest.approx((0.01 + 0.01 + 0.02 + 0.01) / 4)
    assert curve[1]["bits_k"] == pytest.approx((1.25 * 2 + 2.0 * 2) / 4)
    assert LE.mix_ranking([0.01, 0.01], [0.0, 0.0]) == [0, 1]  # ties: the lower layer
