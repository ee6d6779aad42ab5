"""Query-guided weights: closed form = brute force; normalization; the pair shortcut differs."""
import torch

from calibrate import weights


def _inv_freq(d, theta=100.0):
    return 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))


def test_closed_form_equals_brute_force():
    torch.manual_seed(0)
    for W, Hq, H, d in [(1, 2, 2, 4), (23, 6, 2, 16), (40, 9, 3, 8)]:
        q = torch.randn(W, Hq, d)
        s, c = weights.causal_diag_sums(q, _inv_freq(d), H)
        bf = weights.brute_force_diag(q, _inv_freq(d), H)
        torch.testing.assert_close((s / c).float(), bf.float(), rtol=1e-5, atol=1e-5)


def test_weights_mean_square_is_one_and_floor():
    sums = torch.rand(2, 3, 16, dtype=torch.float64) * 10
    sums[0, 0, 3] = 0.0
    w = weights.diag_weights(sums, 7, floor=1e-3)
    torch.testing.assert_close(w.pow(2).mean(-1), torch.ones(2, 3), rtol=1e-5, atol=1e-5)
    assert (w > 0).all()


def test_pair_average_shortcut_is_not_the_causal_average():
    """Low-frequency pairs barely rotate over a window: averaging q_a^2 and q_b^2 is wrong there."""
    torch.manual_seed(1)
    W, d = 64, 8
    # the last pair (3, 7) has the lowest frequency; put unequal energy on its two channels
    q = torch.randn(W, 1, d) * torch.tensor([1.0, 1, 1, 3, 1, 1, 1, 0.2])
    s, c = weights.causal_diag_sums(q, _inv_freq(d, theta=1e6), 1)
    exact = s / c
    half = d // 2
    pair = (q[..., :half] ** 2 + q[..., half:] ** 2).mean(0) / 2
    shortcut = torch.cat([pair, pair], -1)[0]
    assert (exact[0, 3] - shortcut[3]).abs() / exact[0, 3] > 0.3
    assert (exact[0, 7] - shortcut[7]).abs() / exact[0, 7] > 10


def test_dense_moments_match_diag():
    torch.manual_seed(0)
    q = torch.randn(17, 4, 8)
    inv = _inv_freq(8)
    m, n = weights.dense_moments(q, inv, 2, 200000, torch.Generator().manual_seed(0))
    bf = weights.brute_force_diag(q, inv, 2)
    torch.testing.assert_close(torch.diagonal(m / n, dim1=-2, dim2=-1).float(), bf.float(), rtol=0.05, atol=0.05)
    mix, unmix = weights.dense_mix(m, n, 1e-6)
    torch.testing.assert_close(mix @ unmix, torch.eye(8).expand(2, 8, 8), rtol=1e-3, atol=1e-3)
