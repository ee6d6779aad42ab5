"""Grouping keeps whole RoPE pairs and lowers the log-det cost; k-means is sound."""
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


def test_kmeans_weighted_update_and_empty_clusters():
    torch.manual_seed(0)
    x = torch.cat([torch.randn(1, 500, 2) * 0.05 + 3, torch.randn(1, 500, 2) * 0.05 - 3], 1)
    w = torch.cat([torch.full((1, 500), 1.0), torch.full((1, 500), 3.0)], 1)
    r = kmeans.kmeans(x, w, K=2, iters=10, seed=0)
    c = r.centroids[0].sort(0).values
    assert torch.allclose(c, torch.tensor([[-3.0, -3.0], [3.0, 3.0]]), atol=0.05)
    # more centroids than distinct points: empty clusters are re-seeded, nothing is NaN
    r = kmeans.kmeans(torch.zeros(2, 5, 4), None, K=8, iters=3)
    assert torch.isfinite(r.centroids).all()


def test_assign_matches_brute_force():
    torch.manual_seed(0)
    x, c = torch.randn(3, 777, 8), torch.randn(3, 64, 8)
    codes, dist = kmeans.assign(x, c, chunk=100)
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


def test_tree_kmeans_beats_random_codebook_and_is_finite():
    torch.manual_seed(0)
    x = torch.randn(2, 6000, 4) ** 3
    held = torch.randn(2, 2000, 4) ** 3
    c = kmeans.kmeans_tree(x, None, K=64, iters=8)
    assert c.shape == (2, 64, 4) and torch.isfinite(c).all()
    _, d_tree = kmeans.assign(held, c)
    _, d_rand = kmeans.assign(held, x[:, torch.randperm(6000)[:64]])
    assert d_tree.mean() < 0.8 * d_rand.mean()
    # weighted: points with zero weight do not pull centroids
    w = torch.ones(2, 6000)
    w[:, :3000] = 0
    cw = kmeans.kmeans_tree(x, w, K=16, iters=8)
    _, dw = kmeans.assign(x[:, 3000:], cw)
    _, du = kmeans.assign(x[:, 3000:], kmeans.kmeans_tree(x[:, :3000], None, K=16, iters=8))
    assert dw.mean() < du.mean()
