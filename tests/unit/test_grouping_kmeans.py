"""Grouping keeps whole RoPE pairs and minimizes the objective it reports; weighted k-means
(both backends) is sound."""
import itertools

import numpy as np
import pytest
import torch

from calibrate import fold, grouping, kmeans
from sglang_tasq.artifact import check_permutation
from sglang_tasq.codec import contiguous_pair_permutation


@pytest.mark.parametrize("d,g", [(16, 4), (64, 8), (32, 16), (16, 2)])
def test_every_group_holds_whole_rope_pairs(d, g):
    torch.manual_seed(d + g)
    a = torch.randn(d, d) * 0.4
    sigma = a @ a.T + torch.diag(torch.rand(d) + 0.1)
    perm = grouping.match_pairs(sigma, g)
    check_permutation(perm.view(1, 1, d), g)
    assert grouping.group_cost(sigma, perm, g) <= grouping.group_cost(sigma, contiguous_pair_permutation(d, g), g) + 1e-9


def test_grouping_pairs_correlated_channels():
    """Pairs 0 and 3 are strongly correlated: matching must put them together."""
    d, half = 16, 8
    torch.manual_seed(0)
    z = torch.randn(20000, d)
    z[:, 3] = z[:, 0] + 0.05 * z[:, 3]
    z[:, 3 + half] = z[:, half] + 0.05 * z[:, 3 + half]
    sigma = z.T @ z / z.shape[0]
    perm = grouping.match_pairs(sigma, 4).view(-1, 4)
    assert any({0, 3} <= set(row.tolist()) for row in perm)


def _pairings(units):
    """All perfect matchings of a list of units."""
    if not units:
        yield []
        return
    first, rest = units[0], units[1:]
    for i, other in enumerate(rest):
        for tail in _pairings(rest[:i] + rest[i + 1:]):
            yield [(first, other)] + tail


@pytest.mark.parametrize("seed", range(6))
def test_one_round_matching_attains_the_reported_objective_minimum(seed):
    """g = 4 on d = 12: one matching round, which is exact; brute force over every way to put
    the 6 RoPE pairs into 3 groups must not beat it under the reported objective."""
    d, g, half = 12, 4, 6
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(d, d, generator=gen, dtype=torch.float64)
    sigma = a @ a.T * torch.rand(d, generator=gen, dtype=torch.float64) + torch.eye(d, dtype=torch.float64) * 0.05
    perm = grouping.match_pairs(sigma, g)
    best = min(grouping.group_cost(sigma, torch.tensor([c for u, v in m for c in (u, v, u + half, v + half)]), g)
               for m in _pairings(list(range(half))))
    assert grouping.group_cost(sigma, perm, g) == pytest.approx(best, rel=1e-12)


def test_covariance_is_centred():
    """Adding a constant to every key must not change the covariance the grouping sees."""
    torch.manual_seed(0)
    x = torch.randn(5000, 2, 8)
    shifted = x + torch.tensor([5.0, -3, 0, 1, 2, 8, -7, 4])
    torch.testing.assert_close(grouping.covariance(shifted), grouping.covariance(x), rtol=1e-6, atol=1e-6)
    ref = torch.stack([torch.cov(x[:, h].double().T, correction=0) for h in range(2)])
    torch.testing.assert_close(grouping.covariance(x), ref)


def test_channels_grouping_is_the_identity():
    perm = grouping.grouping(torch.eye(16).expand(2, 3, 16, 16), 8, "channels")
    assert torch.equal(perm, torch.arange(16).expand(2, 3, 16))


BACKENDS = ["torch", "numba"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_weights_change_the_answer(backend):
    """Three tight clusters, two centroids: unweighted, the two close clusters share a centroid
    only if the far one is heavier; weighting the middle cluster moves the shared centroid."""
    torch.manual_seed(0)
    g = 8
    centers = torch.zeros(3, g)
    centers[0, 0], centers[1, 0], centers[2, 0] = -10.0, 0.0, 2.0
    x = (centers.repeat_interleave(400, 0) + 0.01 * torch.randn(1200, g))[None]
    light = torch.ones(1, 1200)
    heavy = light.clone()
    heavy[0, 400:800] = 9.0  # the cluster at 0 weighs 9x the one at 2
    cu = kmeans.kmeans(x, light, K=2, iters=50, seed=0, backend=backend).centroids[0, :, 0].sort().values
    cw = kmeans.kmeans(x, heavy, K=2, iters=50, seed=0, backend=backend).centroids[0, :, 0].sort().values
    assert cu[0] == pytest.approx(-10.0, abs=0.01) and cu[1] == pytest.approx(1.0, abs=0.01)  # plain mean of 0 and 2
    assert cw[0] == pytest.approx(-10.0, abs=0.01) and cw[1] == pytest.approx(0.2, abs=0.01)  # (9*0 + 1*2) / 10


@pytest.mark.parametrize("backend", BACKENDS)
def test_kmeans_converges_to_tol_and_reseeds_empty_clusters(backend):
    torch.manual_seed(0)
    x = torch.randn(2, 3000, 8) ** 3
    w = torch.rand(2, 3000)
    r = kmeans.kmeans(x, w, K=32, iters=200, seed=0, tol=1e-3, backend=backend)
    assert r.iters < 200 and r.rel_change < 1e-3
    assert all(b <= a * (1 + 1e-6) for a, b in zip(r.history, r.history[1:]))  # Lloyd never increases the objective
    codes, dist = kmeans.assign_torch(x, r.centroids)
    assert torch.equal(codes, r.codes)
    torch.testing.assert_close(r.sse, (w * dist).double().sum(1), rtol=1e-4, atol=0)
    # more centroids than distinct points: empty clusters are re-seeded, nothing is NaN
    r = kmeans.kmeans(torch.zeros(2, 64, 8), None, K=8, iters=3, backend=backend)
    assert torch.isfinite(r.centroids).all()


def test_backends_agree():
    """The Numba and torch backends run the same algorithm: same seeding draws, same Lloyd."""
    torch.manual_seed(1)
    x = torch.randn(3, 2000, 8) * torch.rand(3, 1, 8)
    w = torch.rand(3, 2000)
    a = kmeans.kmeans(x, w, K=16, iters=5, seed=3, tol=0, backend="torch")
    b = kmeans.kmeans(x, w, K=16, iters=5, seed=3, tol=0, backend="numba")
    torch.testing.assert_close(a.centroids, b.centroids, rtol=1e-4, atol=1e-5)
    assert (a.codes == b.codes).float().mean() > 0.999


@pytest.mark.parametrize("g", [2, 4])
def test_small_groups_run_padded_on_the_numba_backend(g):
    """g < 8 (NovaKV's 4-dim key groups) is zero-padded into the g == 8 Numba kernels: the same
    fit as the torch backend, centroids of g channels."""
    torch.manual_seed(4)
    x = torch.randn(3, 1500, g) * torch.rand(3, 1, g)
    w = torch.rand(3, 1500)
    assert kmeans.resolve_backend("auto", x) == "numba"
    a = kmeans.kmeans(x, w, K=16, iters=5, seed=3, tol=0, backend="torch")
    b = kmeans.kmeans(x, w, K=16, iters=5, seed=3, tol=0, backend="numba")
    assert b.centroids.shape == (3, 16, g)
    torch.testing.assert_close(a.centroids, b.centroids, rtol=1e-4, atol=1e-5)
    assert (a.codes == b.codes).float().mean() > 0.999
    with pytest.raises(ValueError, match="dividing 8"):
        kmeans.resolve_backend("numba", torch.zeros(1, 4, 16))


def test_kmeanspp_seeding_matches_torch_and_never_draws_weightless_points():
    from numba_kernels.cpu.seeding import kmeanspp

    torch.manual_seed(2)
    x = torch.randn(2, 700, 8)  # 700: not a multiple of the kernel's block of points
    w = torch.rand(2, 700)
    w[:, ::3] = 0
    u = torch.rand(2, 40, dtype=torch.float64)
    ref = kmeans.kmeanspp_torch(x, w, u)
    got = torch.from_numpy(kmeanspp(x.numpy(), w.numpy(), u.numpy()))
    torch.testing.assert_close(got, ref)
    allowed = x[:, 1::3].reshape(-1, 8).tolist() + x[:, 2::3].reshape(-1, 8).tolist()
    assert all(row in allowed for row in got.reshape(-1, 8).tolist())


def test_assign_torch_matches_brute_force():
    torch.manual_seed(0)
    x, c = torch.randn(3, 777, 8), torch.randn(3, 64, 8)
    codes, dist = kmeans.assign_torch(x, c, chunk=100)
    d = ((x[:, :, None] - c[:, None]) ** 2).sum(-1)
    assert torch.equal(codes, d.argmin(-1))
    torch.testing.assert_close(dist, d.min(-1).values, rtol=1e-4, atol=1e-4)


def test_fold_then_decode_equals_unfolded_decode():
    torch.manual_seed(0)
    L, H, d, g, K = 1, 2, 16, 4, 8
    tail = torch.randn(L, H, d // g, K, g)
    w = torch.rand(L, H, d) + 0.5
    perm = torch.stack([grouping.match_pairs(torch.eye(d) + 0.1, g) for _ in range(H)])[None]
    folded = fold.fold_key_codebooks(tail, w, perm)
    codes = torch.randint(0, K, (5, H, d // g))
    s = torch.rand(5) + 0.5
    for h in range(H):
        x = tail[0, h][torch.arange(d // g), codes[:, h]].reshape(5, d) * s[:, None]  # tailored, permuted
        native_unfolded = torch.empty(5, d)
        native_unfolded[:, perm[0, h]] = x / w[0, h, perm[0, h]]
        y = folded[0, h][torch.arange(d // g), codes[:, h]].reshape(5, d) * s[:, None]
        native_folded = torch.empty(5, d)
        native_folded[:, perm[0, h]] = y
        torch.testing.assert_close(native_folded, native_unfolded)
