"""Query-guided channel weights (paper sec. 4.1), in closed form.

A key error ``delta`` (pre-RoPE, at position p) changes the logit of query t >= p by
``q_t . R_p delta`` with ``q_t = R_t q~_t`` post-RoPE, i.e. by ``u . delta`` with
``u = R_p^T R_t q~_t = R_{t-p} q~_t``. TaSQ weights channels by the diagonal of
``A_h = mean_{t>=p} u u^T`` over causal pairs of a window, averaged over the query heads that
share KV head h. For a rotate-half pair (a, b = a + d/2) at frequency theta and lag D = t-p:

    u_a = cos(D theta) q_a - sin(D theta) q_b,   u_b = sin(D theta) q_a + cos(D theta) q_b

so ``sum_{D=0..t} u_a^2 = Cc[t] q_a^2 + Ss[t] q_b^2 - X[t] q_a q_b`` (and the mirror for
u_b) with prefix sums ``Cc = sum cos^2``, ``Ss = sum sin^2``, ``X = sum sin(2 D theta)``.
That is exact and O(W d) per window. Low-frequency pairs barely rotate over a window, so the
shortcut ``(q_a^2 + q_b^2) / 2`` is wrong for them.

``brute_force_diag`` is the einsum definition, for tests on small data; ``dense_moments``
samples causal pairs for the dense-``A^{1/2}`` ablation.
"""
from __future__ import annotations

import torch

from sglang_tasq.rope import apply_rope


def lag_prefix_sums(window: int, inv_freq: torch.Tensor):
    """Cc, Ss, X [window, d/2] float64: sums over lags D = 0..t of cos^2, sin^2, sin(2 D theta)."""
    lag = torch.arange(window, dtype=torch.float64)[:, None]
    ang = lag * inv_freq.to(torch.float64)[None, :]
    return (torch.cos(ang) ** 2).cumsum(0), (torch.sin(ang) ** 2).cumsum(0), torch.sin(2 * ang).cumsum(0)


_LAG_CACHE: dict = {}


def _lag_sums_cached(window: int, inv_freq: torch.Tensor, device: torch.device):
    key = (window, tuple(inv_freq.tolist()), str(device))
    if key not in _LAG_CACHE:
        _LAG_CACHE.clear()
        _LAG_CACHE[key] = tuple(t.to(device) for t in lag_prefix_sums(window, inv_freq.cpu()))
    return _LAG_CACHE[key]


def causal_diag_sums(q: torch.Tensor, inv_freq: torch.Tensor, num_kv_heads: int):
    """Closed-form sums of diag(u u^T) over causal pairs of one window.

    q: [W, Hq, d] pre-RoPE queries at positions 0..W-1 (any device). Returns (sums [H, d]
    float64 on q's device, pair count) where count = (Hq / H) * W (W + 1) / 2 per KV head.
    """
    W, Hq, d = q.shape
    half = d // 2
    Cc, Ss, X = _lag_sums_cached(W, inv_freq, q.device)  # [W, half]
    q = q.to(torch.float64)
    qa, qb = q[..., :half], q[..., half:]
    Cc, Ss, X = Cc[:, None, :], Ss[:, None, :], X[:, None, :]
    da = Cc * qa * qa + Ss * qb * qb - X * qa * qb  # [W, Hq, half]
    db = Ss * qa * qa + Cc * qb * qb + X * qa * qb
    per_q_head = torch.cat([da, db], dim=-1).sum(0)  # [Hq, d]
    rep = Hq // num_kv_heads
    sums = per_q_head.view(num_kv_heads, rep, d).sum(1)
    return sums, rep * W * (W + 1) // 2


def brute_force_diag(q: torch.Tensor, inv_freq: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """Definition by einsum (O(W^2 d)): mean over t >= p of (R_p^T q_t)^2, GQA-averaged. [H, d]."""
    W, Hq, d = q.shape
    pos = torch.arange(W)
    q_post = apply_rope(q.double(), pos, inv_freq.double())  # q_t = R_t q~_t
    rows = []
    for p in range(W):
        back = apply_rope(q_post[p:], torch.full((W - p,), p), inv_freq.double(), inverse=True)
        rows.append(back.pow(2).sum(0))  # [Hq, d] summed over t >= p
    total = torch.stack(rows).sum(0)
    rep = Hq // num_kv_heads
    return total.view(num_kv_heads, rep, d).sum(1) / (rep * W * (W + 1) / 2)


def dense_moments(q: torch.Tensor, inv_freq: torch.Tensor, num_kv_heads: int, pairs: int,
                  gen: torch.Generator):
    """Monte-Carlo sums of u u^T [H, d, d] over ``pairs`` random causal (t, p) pairs, and the count."""
    W, Hq, d = q.shape
    # uniform over causal pairs: P(t) proportional to t + 1, then p uniform in [0, t]
    t = torch.multinomial(torch.arange(1, W + 1, dtype=torch.float64), pairs, replacement=True, generator=gen)
    p = (torch.rand(pairs, generator=gen) * (t + 1).double()).long().clamp_max(t)
    u = apply_rope(q[t].double(), (t - p), inv_freq.double())  # R_{t-p} q~_t  [pairs, Hq, d]
    rep = Hq // num_kv_heads
    u = u.view(pairs, num_kv_heads, rep, d)
    return torch.einsum("nhri,nhrj->hij", u, u), pairs * rep


def diag_weights(sums: torch.Tensor, count: float, floor: float) -> torch.Tensor:
    """diag A sums [..., d] -> w = sqrt(max(diag/mean, floor)), renormalized so mean(w^2) = 1."""
    a = sums / count
    rel = (a / a.mean(-1, keepdim=True)).clamp_min(floor)
    w2 = rel / rel.mean(-1, keepdim=True)
    return w2.sqrt().float()


def dense_mix(moments: torch.Tensor, count: float, floor: float):
    """Dense ablation: (M = A^{1/2}, M^{-1}) per head from u u^T sums [..., d, d], scaled so
    that mean(diag(M^T M)) = 1 like the diagonal weights."""
    a = moments / count
    a = a / torch.diagonal(a, dim1=-2, dim2=-1).mean(-1)[..., None, None]
    evals, evecs = torch.linalg.eigh(a)
    evals = evals.clamp_min(floor)
    mix = evecs @ torch.diag_embed(evals.sqrt()) @ evecs.transpose(-1, -2)
    unmix = evecs @ torch.diag_embed(evals.rsqrt()) @ evecs.transpose(-1, -2)
    return mix.float(), unmix.float()


def qpca_map(keys: torch.Tensor, q_sums: torch.Tensor, q_count: int, floor: float):
    """NovaKV's key map for one layer, fitted on post-RoPE keys.

    The logit error of a key error e is ``q . e``; its mean square over the queries is
    ``e^T S e`` with S the post-RoPE query second moment. With F = S^(1/2) (eigenvalues
    floored at ``floor`` times their mean) the map r = U^T F (k - m) makes plain squared error
    in r equal that logit error; U, the eigenvectors of the covariance of F (k - m) sorted by
    decreasing variance, decorrelates the coefficients (a KLT), so coefficient i is the i-th
    most energetic. keys [N, H, d] post-RoPE, q_sums [H, d, d] -> (mix [H, d, d] = U^T F,
    unmix [H, d, d] = F^-1 U, mean [H, d]) float32, S scaled to mean eigenvalue 1.
    """
    k = keys.double()
    mean = k.mean(0)  # [H, d]
    s = q_sums.double() / q_count
    s = s / torch.diagonal(s, dim1=-2, dim2=-1).mean(-1)[..., None, None]
    ev, V = torch.linalg.eigh(s)
    ev = ev.clamp_min(floor * ev.mean(-1, keepdim=True))
    F = V @ torch.diag_embed(ev.sqrt()) @ V.transpose(-1, -2)
    F_inv = V @ torch.diag_embed(ev.rsqrt()) @ V.transpose(-1, -2)
    y = torch.einsum("hij,nhj->nhi", F, k - mean)
    cov = torch.einsum("nhi,nhj->hij", y, y) / y.shape[0]
    _, U = torch.linalg.eigh(cov)  # ascending
    U = U.flip(-1)  # decreasing variance
    mix = U.transpose(-1, -2) @ F
    unmix = F_inv @ U
    return mix.float(), unmix.float(), mean.float()
