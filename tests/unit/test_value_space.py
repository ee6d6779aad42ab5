"""bench.value_space: the output-side value metric, its per-group square root, and a fit in that
space beating the plain fit on the error it targets when the metric is anisotropic."""
import torch

from bench import value_space as vs


def test_output_metric_sums_each_kv_heads_query_heads():
    gen = torch.Generator().manual_seed(0)
    Hq, H, d, hidden = 6, 2, 4, 10
    W = torch.randn(hidden, Hq * d, generator=gen)
    M = vs.output_metric(W, Hq, H)
    for h in range(H):
        want = sum(W[:, q * d:(q + 1) * d].double().T @ W[:, q * d:(q + 1) * d].double() for q in range(h * 3, h * 3 + 3))
        torch.testing.assert_close(M[h], want)


def test_group_maps_are_square_roots_and_inverses():
    gen = torch.Generator().manual_seed(1)
    A = torch.randn(2, 8, 8, generator=gen, dtype=torch.float64)
    M = A @ A.transpose(1, 2) + 0.1 * torch.eye(8, dtype=torch.float64)
    T, Ti = vs.group_maps(M, 4)
    for j in range(2):
        B = M[:, j * 4:(j + 1) * 4, j * 4:(j + 1) * 4]
        B = B / torch.linalg.eigvalsh(B).mean(-1)[:, None, None]
        torch.testing.assert_close((T[:, j] @ T[:, j]).double(), B, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(T[:, j] @ Ti[:, j], torch.eye(4).expand(2, 4, 4), rtol=1e-4, atol=1e-4)
    assert abs(vs.high_rate_gain(torch.eye(8, dtype=torch.float64).expand(2, 8, 8), 4) - 1) < 1e-9
    assert vs.high_rate_gain(M, 4) > 1.01


def test_the_metric_fit_wins_on_the_output_error_only_when_the_metric_is_anisotropic():
    gen = torch.Generator().manual_seed(2)
    H, d, g = 1, 4, 2
    train = torch.randn(4096, H, d, generator=gen)
    held = torch.randn(2048, H, d, generator=gen)
    skewed = torch.diag(torch.tensor([25.0, 1.0, 1.0, 25.0], dtype=torch.float64))[None]
    r = vs.layer_errors(train, held, skewed, g, K=8, iters=20, tol=0.0, seed=0)
    assert r["output"]["output_nmse"] < 0.8 * r["plain"]["output_nmse"]
    assert r["output"]["value_mse"] > r["plain"]["value_mse"]  # it spends precision where M is large
    iso = vs.layer_errors(train, held, torch.eye(d, dtype=torch.float64)[None], g, K=8, iters=20, tol=0.0, seed=0)
    assert abs(iso["output_gain"] - 1) < 0.02
