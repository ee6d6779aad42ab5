"""Stage 5: (Fisher-)weighted k-means over many small codebooks at once (paper sec. 4.4).

All codebooks of a layer (KV heads x groups) are fitted together as one batch ``B``:
distances ``||c||^2 - 2 x.c`` come from one batched matmul per chunk of points (bf16 inputs
on CPUs with bf16 matrix units, fp32 otherwise), argmin per point, then the weighted
centroid update by ``index_add``. Sample weights enter the update; Fisher weighting can also
be applied by importance sampling (:func:`importance_sample`), which keeps the per-iteration
cost at the sample size. Initialization: weighted k-means++ on a subsample. Empty clusters
are re-seeded at the points with the largest weighted error.

Shapes: x [B, N, g] float32, w [B, N] >= 0, centroids [B, K, g].
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class KMeansResult:
    centroids: torch.Tensor  # [B, K, g] float32
    codes: torch.Tensor  # [B, N] int64 final assignment
    sse: torch.Tensor  # [B] weighted sum of squared errors (final assignment)
    iters: int
    empty_reseeded: int


def _mm_dtype() -> torch.dtype:
    return torch.bfloat16 if torch.backends.mkldnn.is_available() and _has_bf16_units() else torch.float32


def _has_bf16_units() -> bool:
    try:
        return "amx_bf16" in open("/proc/cpuinfo").read() or "avx512_bf16" in open("/proc/cpuinfo").read()
    except OSError:
        return False


def assign(x: torch.Tensor, c: torch.Tensor, chunk: int = 4096, mm_dtype=torch.float32):
    """Nearest centroid. x [B, N, g], c [B, K, g] -> (codes [B, N] int64, sq. distance [B, N])."""
    B, N, g = x.shape
    codes = torch.empty(B, N, dtype=torch.int64)
    dist = torch.empty(B, N, dtype=torch.float32)
    cn = (c * c).sum(-1)  # [B, K]
    ct = (-2.0 * c).transpose(1, 2).to(mm_dtype)  # [B, g, K]
    cn_m = cn.to(mm_dtype)[:, None, :]
    xn = (x * x).sum(-1)
    for s in range(0, N, chunk):
        d = torch.baddbmm(cn_m, x[:, s:s + chunk].to(mm_dtype), ct)  # [B, n, K]
        v, i = d.min(-1)
        codes[:, s:s + chunk] = i
        dist[:, s:s + chunk] = (v.float() + xn[:, s:s + chunk]).clamp_min(0)
    return codes, dist


def assign_candidates(x: torch.Tensor, c: torch.Tensor, prev: torch.Tensor, m: int, chunk: int = 8192):
    """Approximate nearest centroid among the ``m`` nearest centroids of each point's previous
    centroid (which is one of them). Between Lloyd iterations centroids move little, so this
    finds the exact nearest centroid for almost every point at ~m/K of the cost.
    x [B, N, g], c [B, K, g], prev [B, N] -> (codes [B, N], squared distance [B, N])."""
    B, N, g = x.shape
    K = c.shape[1]
    nbr = torch.cdist(c, c).topk(min(m, K), dim=-1, largest=False).indices  # [B, K, m]
    codes = torch.empty(B, N, dtype=torch.int64)
    dist = torch.empty(B, N, dtype=torch.float32)
    bidx = torch.arange(B)[:, None, None]
    for s in range(0, N, chunk):
        cand = torch.gather(nbr, 1, prev[:, s:s + chunk, None].expand(-1, -1, nbr.shape[-1]))  # [B, n, m]
        cc = c[bidx, cand]  # [B, n, m, g]
        d = (x[:, s:s + chunk, None, :] - cc).pow(2).sum(-1)
        v, i = d.min(-1)
        codes[:, s:s + chunk] = torch.gather(cand, 2, i[..., None])[..., 0]
        dist[:, s:s + chunk] = v
    return codes, dist


def importance_sample(w: torch.Tensor, n: int, gen: torch.Generator) -> torch.Tensor:
    """Indices [B, n] drawn with probability proportional to w [B, N] (with replacement when
    n >= N or weights are degenerate). Weighted k-means on all points ~= plain k-means on them."""
    B, N = w.shape
    if n >= N:
        return torch.arange(N).expand(B, N).clone()
    p = w.double().clamp_min(0) + 1e-30
    return torch.multinomial(p, n, replacement=False, generator=gen)


def _sqdist_min(x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """min_k ||x - c_k||^2: x [B, N, g], c [B, m, g] -> [B, N] float64."""
    d = torch.baddbmm((c * c).sum(-1)[:, None, :], x, c.transpose(1, 2), alpha=-2.0)
    return (d.min(-1).values + (x * x).sum(-1)).clamp_min(0).double()


def kmeans_pp_init(x: torch.Tensor, w: torch.Tensor, K: int, gen: torch.Generator, sub: int = 8192,
                   rounds: int = 32):
    """Weighted k-means++ seeding, batched: ``rounds`` rounds each draw K/rounds new centroids
    with probability proportional to w * D^2 (D: distance to the nearest centroid so far), on a
    random subsample of ``sub`` points per codebook. One round per centroid is classic
    k-means++; drawing several per round keeps the seeding cost at ~sub*K distance evaluations."""
    B, N, g = x.shape
    if N > sub:
        idx = torch.stack([torch.randperm(N, generator=gen)[:sub] for _ in range(B)])
        x = torch.gather(x, 1, idx[..., None].expand(B, sub, g))
        w = torch.gather(w, 1, idx)
        N = sub
    w = w.double() + 1e-12
    bidx = torch.arange(B)[:, None]
    per = max(1, -(-K // rounds))
    chosen = [x[bidx, torch.multinomial(w, min(per, N), generator=gen)]]
    d2 = _sqdist_min(x, chosen[0])
    have = chosen[0].shape[1]
    while have < K:
        m = min(per, K - have)
        p = w * d2
        p = torch.where(p.sum(1, keepdim=True) > 0, p, w)
        pick = torch.multinomial(p, m, replacement=N < m, generator=gen)
        new = x[bidx, pick]
        chosen.append(new)
        d2 = torch.minimum(d2, _sqdist_min(x, new))
        have += m
    return torch.cat(chosen, 1)[:, :K].contiguous()


def kmeans(x: torch.Tensor, w: torch.Tensor | None, K: int, iters: int, seed: int = 0,
           chunk: int = 4096, tol: float = 1e-5, candidates: int = 32, exhaustive_every: int = 8) -> KMeansResult:
    """Weighted Lloyd iterations for B codebooks at once (see module docstring).

    Iteration 1 and every ``exhaustive_every``-th assign exhaustively; the others search the
    ``candidates`` nearest centroids of each point's previous centroid (``candidates >= K``
    makes every iteration exhaustive). The returned assignment is exhaustive."""
    B, N, g = x.shape
    x = x.float().contiguous()
    w = torch.ones(B, N) if w is None else w.float()
    gen = torch.Generator().manual_seed(seed)
    mm = _mm_dtype()
    c = kmeans_pp_init(x, w, K, gen, rounds=min(32, max(1, K // 8)))
    flat = (torch.arange(B)[:, None] * K)
    prev = None
    reseeded = 0
    it = 0
    mm = mm if K > 64 else torch.float32
    codes = None
    for it in range(1, iters + 1):
        if codes is None or candidates >= K or (it - 1) % exhaustive_every == 0:
            codes, dist = assign(x, c, chunk, mm)
        else:
            codes, dist = assign_candidates(x, c, codes, candidates)
        idx = (codes + flat).reshape(-1)
        wsum = torch.zeros(B * K).index_add_(0, idx, w.reshape(-1))
        csum = torch.zeros(B * K, g).index_add_(0, idx, (x * w[..., None]).reshape(-1, g))
        empty = wsum <= 0
        c = torch.where(empty[:, None], c.reshape(-1, g), csum / wsum.clamp_min(1e-30)[:, None]).view(B, K, g)
        n_empty = int(empty.sum())
        if n_empty:
            reseeded += n_empty
            c = _reseed(c, empty.view(B, K), x, w * dist)
        sse = float((w * dist).sum())
        if prev is not None and abs(prev - sse) <= tol * max(prev, 1e-30):
            break
        prev = sse
    codes, dist = assign(x, c, chunk, torch.float32)
    return KMeansResult(c, codes, (w * dist).sum(1), it, reseeded)


def _reseed(c, empty, x, err):
    """Move each empty centroid onto a distinct point of largest weighted error."""
    for b in torch.nonzero(empty.any(1))[:, 0].tolist():
        ks = torch.nonzero(empty[b])[:, 0]
        top = torch.topk(err[b], min(len(ks), err.shape[1])).indices
        c[b, ks[: len(top)]] = x[b, top]
    return c


def kmeans_tree(x: torch.Tensor, w: torch.Tensor | None, K: int, iters: int, seed: int = 0,
                coarse: int | None = None, cap: float = 3.0) -> torch.Tensor:
    """Two-level k-means: ``coarse`` cells by k-means, then ``K / coarse`` centroids per cell by
    k-means on the cell's points; the union is a flat codebook of K centroids [B, K, g].

    Each level costs N x sqrt(K) distance evaluations per iteration instead of N x K, which is
    what makes 1,440 codebooks of 1,024 centroids affordable on a CPU. Cells hold at most
    ``cap`` times the mean cell size (a uniform random subset of a larger cell is kept).
    Encoding still searches all K centroids exhaustively.
    """
    B, N, g = x.shape
    k1 = coarse or 1 << (max(K.bit_length() - 1, 0) // 2)
    if K % k1:
        raise ValueError(f"codebook size {K} is not a multiple of the coarse size {k1}")
    k2 = K // k1
    w = torch.ones(B, N) if w is None else w.float()
    top = kmeans(x, w, k1, iters, seed=seed, candidates=k1)
    cell = top.codes  # [B, N]
    gen = torch.Generator().manual_seed(seed + 1)
    # order points by (cell, random key) so that truncation keeps a random subset
    key = cell.double() + torch.rand(B, N, generator=gen, dtype=torch.float64)
    order = torch.argsort(key, dim=1)
    cell_sorted = torch.gather(cell, 1, order)
    counts = torch.zeros(B, k1, dtype=torch.int64).scatter_add_(1, cell, torch.ones_like(cell))
    start = torch.cumsum(counts, 1) - counts
    pos = torch.arange(N).expand(B, N) - torch.gather(start, 1, cell_sorted)
    P = int(min(int(counts.max()), max(k2, int(cap * N / k1))))
    keep = pos < P
    slot = torch.full((B, k1, P), -1, dtype=torch.int64)
    b_idx = torch.arange(B)[:, None].expand(B, N)
    slot[b_idx[keep], cell_sorted[keep], pos[keep]] = order[keep]
    valid = slot >= 0
    src = slot.clamp_min(0).view(B, k1 * P)
    xs = torch.gather(x, 1, src[..., None].expand(B, k1 * P, g)).view(B * k1, P, g)
    ws = (torch.gather(w, 1, src) * valid.view(B, k1 * P)).view(B * k1, P)
    sub = kmeans(xs, ws, k2, iters, seed=seed + 2, candidates=k2)
    return sub.centroids.view(B, K, g)
