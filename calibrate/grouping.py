"""Stage 4: covariance-aware grouping of RoPE pairs (paper sec. 4.3, Alg. 1).

High-rate theory gives a group's VQ distortion ~ K^(-2/|G|) det(Sigma[G,G])^(1/|G|), so
channels that are correlated (small determinant for their variance) should share a group.
Starting from the d/2 RoPE pairs (a, a + d/2) as atoms, ``log2(g/2)`` rounds of
minimum-weight perfect matching on the complete graph of current units merge units two by
two; the edge cost of merging U and V is ``det(Sigma[idx, idx] + eps I)^(1/|idx|)`` with
idx = U u V and eps = 1e-4 * mean(diag Sigma). Matching is networkx's blossom algorithm
(``min_weight_matching``, perfect on a complete graph with an even number of units).
A heuristic, as in the paper, not an exact partition search.

One objective throughout: the high-rate distortion of a head, ``sum_G det(Sigma[G,G] + eps
I)^(1/|G|)`` (:func:`group_cost`). Its last matching round minimizes it exactly over pairings
of the current units (the edge cost is the merged group's term); earlier rounds apply the same
function to half-groups. (The paper writes a group's cost as log det, which ranks one group's
candidates the same way but sums differently across groups; the matching it describes
minimizes the det root, so that is the objective here, reported and tested.)

``Sigma`` is the centred covariance of the weighted, normalized keys (:func:`covariance`).

Output: a permutation per head in the canonical in-group layout of
:mod:`sglang_tasq.codec` (group j = pairs a_1..a_m then partners a_1+d/2..a_m+d/2); for
mode ``channels`` (CQ) the identity; for ``stratified`` (NovaKV's KLT coefficients) a fixed map.
"""
from __future__ import annotations

import networkx as nx
import torch

from sglang_tasq.codec import contiguous_pair_permutation, stratified_permutation


def _channels(unit: tuple[int, ...], half: int) -> list[int]:
    return list(unit) + [a + half for a in unit]


def _edge_cost(sigma: torch.Tensor, idx: list[int], eps: float) -> float:
    sub = sigma[idx][:, idx] + eps * torch.eye(len(idx), dtype=sigma.dtype)
    sign, logdet = torch.linalg.slogdet(sub)
    if sign <= 0:
        return float("inf")
    return float(torch.exp(logdet / len(idx)))


def covariance(x: torch.Tensor) -> torch.Tensor:
    """Centred covariance per head: x [N, H, d] -> [H, d, d] float64."""
    x = x.double()
    mean = x.mean(0)
    return torch.einsum("nhi,nhj->hij", x, x) / x.shape[0] - torch.einsum("hi,hj->hij", mean, mean)


def group_cost(sigma: torch.Tensor, perm: torch.Tensor, g: int) -> float:
    """``sum_G det(Sigma[G, G] + eps I)^(1/g)`` over the groups of ``perm``: the objective the
    matching minimizes (its edge cost, summed over the final groups)."""
    sigma = sigma.double()
    eps = 1e-4 * float(torch.diagonal(sigma).mean())
    return sum(_edge_cost(sigma, perm[j * g:(j + 1) * g].tolist(), eps) for j in range(perm.numel() // g))


def match_pairs(sigma: torch.Tensor, g: int) -> torch.Tensor:
    """sigma [d, d] (one head) -> permutation [d] grouping whole RoPE pairs into groups of g."""
    d = sigma.shape[0]
    half = d // 2
    sigma = sigma.double()
    eps = 1e-4 * float(torch.diagonal(sigma).mean())
    units: list[tuple[int, ...]] = [(a,) for a in range(half)]
    while 2 * len(units[0]) <= g // 2:
        graph = nx.Graph()
        for i in range(len(units)):
            for j in range(i + 1, len(units)):
                idx = _channels(units[i] + units[j], half)
                graph.add_edge(i, j, weight=_edge_cost(sigma, idx, eps))
        matching = nx.min_weight_matching(graph)
        if 2 * len(matching) != len(units):
            raise RuntimeError("matching is not perfect; group size does not tile the head")
        units = sorted(tuple(sorted(units[i] + units[j])) for i, j in matching)
    return torch.tensor([c for u in units for c in _channels(u, half)], dtype=torch.int64)


def grouping(sigmas: torch.Tensor, g: int, mode: str) -> torch.Tensor:
    """sigmas [L, H, d, d] -> permutations [L, H, d]. mode 'covariance', 'contiguous' (whole
    RoPE pairs in index order), 'channels' (native channel order: the identity) or
    'stratified' (NovaKV: coefficient i*G + j at permuted channel j*g + i)."""
    L, H, d, _ = sigmas.shape
    if mode == "channels":
        return torch.arange(d).expand(L, H, d).clone()
    if mode == "contiguous":
        return contiguous_pair_permutation(d, g).expand(L, H, d).clone()
    if mode == "stratified":
        return stratified_permutation(d, g).expand(L, H, d).clone()
    return torch.stack([torch.stack([match_pairs(sigmas[l, h], g) for h in range(H)]) for l in range(L)])
