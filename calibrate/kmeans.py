"""Stage 5: weighted k-means over many small codebooks at once (paper sec. 4.4).

Flat Lloyd over all K centroids of every codebook, as the paper: sample weights (the Fisher
of the tailored coordinates, or 1) enter the centroid update as weighted means, the seeding
is weighted k-means++ over all points, and the iterations stop when the weighted objective
changes by less than ``tol`` (relative, averaged over the codebooks) or after ``iters``.
Empty clusters are re-seeded at the points of largest weighted error.

Two backends give the same algorithm:

* ``numba`` (CPU, g dividing 8): the assignment is the serving encoder's nearest-codeword lane
  kernel (:func:`numba_kernels.cpu.search.nearest_sqdist`, exact float32, first index on
  ties) and the seeding a Numba k-means++ (:mod:`numba_kernels.cpu.seeding`). Both are
  written for g == 8; smaller groups (NovaKV's g = 4) are zero-padded to 8 channels, which
  leaves every distance, draw and mean as it is (the padded channels add exact zeros) and
  runs ~15x faster than the torch backend on this CPU (g = 4, K = 256, 48 codebooks of
  32,768 points: 1.1 s vs 17 s for 3 Lloyd iterations);
* ``torch`` (any device, any g): chunked ``|c|^2 - 2 x.c`` matmuls with argmin, and k-means++
  by cumulative sums; what ``--device cuda`` runs, and tested on CPU tensors.

Shapes: x [B, N, g] float32, w [B, N] >= 0, centroids [B, K, g].
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

BACKENDS = ("auto", "numba", "torch")


@dataclass
class KMeansResult:
    centroids: torch.Tensor  # [B, K, g] float32
    codes: torch.Tensor  # [B, N] int64, assignment to the returned centroids
    sse: torch.Tensor  # [B] float64 weighted sum of squared errors of that assignment
    iters: int  # Lloyd iterations run
    rel_change: float  # mean relative objective change of the last iteration
    empty_reseeded: int
    history: list  # weighted objective (summed over codebooks) after each assignment


def resolve_backend(backend: str, x: torch.Tensor) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"k-means backend {backend!r}: allowed {BACKENDS}")
    if backend == "auto":
        return "numba" if x.device.type == "cpu" and _pads_to_8(x.shape[-1]) else "torch"
    if backend == "numba" and (x.device.type != "cpu" or not _pads_to_8(x.shape[-1])):
        raise ValueError(f"the numba k-means backend runs on CPU tensors with g dividing 8, got g={x.shape[-1]}")
    return backend


def _pads_to_8(g: int) -> bool:
    return 1 <= g <= 8 and 8 % g == 0


def assign_torch(x: torch.Tensor, c: torch.Tensor, chunk: int = 4096):
    """Nearest centroid by float32 matmuls: x [B, N, g], c [B, K, g] -> (codes [B, N] int64,
    squared distance [B, N] float32). First index on ties (``argmin``)."""
    B, N, g = x.shape
    codes = torch.empty(B, N, dtype=torch.int64, device=x.device)
    dist = torch.empty(B, N, dtype=torch.float32, device=x.device)
    cn = (c * c).sum(-1)[:, None, :]
    ct = c.transpose(1, 2)
    xn = (x * x).sum(-1)
    for s in range(0, N, chunk):
        d = torch.baddbmm(cn, x[:, s:s + chunk], ct, alpha=-2.0)  # [B, n, K]
        v, i = d.min(-1)
        codes[:, s:s + chunk] = i
        dist[:, s:s + chunk] = (v + xn[:, s:s + chunk]).clamp_min(0)
    return codes, dist


class _Assigner:
    """Nearest-centroid search over fixed points x for changing centroids."""

    def __init__(self, x: torch.Tensor, backend: str):
        self.backend = backend
        self.x = x
        if backend == "numba":
            self.xt = x.transpose(0, 1).contiguous().numpy()  # [N, B, 8]: the lane kernel's layout

    def __call__(self, c: torch.Tensor):
        if self.backend == "torch":
            return assign_torch(self.x, c)
        from numba_kernels.cpu.search import nearest_sqdist

        cc = c.contiguous()
        codes, dist = nearest_sqdist(self.xt, cc.numpy(), (cc * cc).sum(-1).numpy())
        return torch.from_numpy(codes).T.to(torch.int64), torch.from_numpy(dist).T.contiguous()


def kmeanspp_torch(x: torch.Tensor, w: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Weighted k-means++ with the draws' uniforms u [B, K] float64: the first centroid with
    probability proportional to w, each next one proportional to w * D^2 (inverse CDF)."""
    B, N, g = x.shape
    K = u.shape[1]
    w = w.double()
    out = torch.empty(B, K, g, dtype=x.dtype, device=x.device)
    d2 = torch.ones(B, N, dtype=torch.float64, device=x.device)
    bidx = torch.arange(B, device=x.device)
    for k in range(K):
        cum = torch.cumsum(w * d2, 1)
        total = cum[:, -1]
        target = (u[:, k].to(x.device) * total)[:, None]
        idx = torch.searchsorted(cum, target, right=True)[:, 0].clamp_max(N - 1)
        uniform = (u[:, k].to(x.device) * N).long().clamp_max(N - 1)
        idx = torch.where(total > 0, idx, uniform)
        out[:, k] = x[bidx, idx]
        dk = (x - out[:, k, None, :]).pow(2).sum(-1).double()
        d2 = dk if k == 0 else torch.minimum(d2, dk)
    return out


def kmeanspp(x: torch.Tensor, w: torch.Tensor, K: int, gen: torch.Generator, backend: str) -> torch.Tensor:
    """Weighted k-means++ seeding of B codebooks, [B, K, g]."""
    u = torch.rand(x.shape[0], K, generator=gen, dtype=torch.float64)
    if backend == "torch":
        return kmeanspp_torch(x, w, u)
    from numba_kernels.cpu.seeding import kmeanspp as kpp

    return torch.from_numpy(kpp(x.numpy(), w.float().numpy(), u.numpy()))


def kmeans(x: torch.Tensor, w: torch.Tensor | None, K: int, iters: int, seed: int = 0,
           tol: float = 1e-3, backend: str = "auto") -> KMeansResult:
    """Weighted Lloyd iterations for B codebooks at once (see the module docstring)."""
    B, N, g = x.shape
    x = x.float().contiguous()
    dev = x.device
    w = torch.ones(B, N, device=dev) if w is None else w.float().to(dev).contiguous()
    if bool((w < 0).any()) or not bool(torch.isfinite(w).all()):
        raise ValueError("k-means weights must be finite and >= 0")
    backend = resolve_backend(backend, x)
    if backend == "numba" and g < 8:  # zero channels: same distances, draws and means
        r = kmeans(torch.nn.functional.pad(x, (0, 8 - g)), w, K, iters, seed, tol, backend)
        r.centroids = r.centroids[..., :g].contiguous()
        return r
    gen = torch.Generator().manual_seed(seed)
    c = kmeanspp(x, w, K, gen, backend)
    search = _Assigner(x, backend)
    flat = (torch.arange(B, device=dev)[:, None] * K)
    codes, dist = search(c)
    sse = (w * dist).double().sum(1)
    history = [float(sse.sum())]
    reseeded, done, rel = 0, 0, float("inf")
    wf, xw = w.reshape(-1), (x * w[..., None]).reshape(-1, g)
    while done < iters:
        idx = (codes + flat).reshape(-1)
        wsum = torch.zeros(B * K, device=dev).index_add_(0, idx, wf)
        csum = torch.zeros(B * K, g, device=dev).index_add_(0, idx, xw)
        empty = wsum <= 0
        c = torch.where(empty[:, None], c.reshape(-1, g), csum / wsum.clamp_min(1e-30)[:, None]).view(B, K, g)
        n_empty = int(empty.sum())
        if n_empty:
            reseeded += n_empty
            c = _reseed(c, empty.view(B, K), x, w * dist)
        done += 1
        codes, dist = search(c)
        new = (w * dist).double().sum(1)
        history.append(float(new.sum()))
        rel = float(((sse - new).abs() / sse.clamp_min(1e-30)).mean())
        sse = new
        if rel < tol:
            break
    return KMeansResult(c, codes, sse, done, rel, reseeded, history)


def _reseed(c, empty, x, err):
    """Move each empty centroid onto a distinct point of largest weighted error."""
    for b in torch.nonzero(empty.any(1))[:, 0].tolist():
        ks = torch.nonzero(empty[b])[:, 0]
        top = torch.topk(err[b], min(len(ks), err.shape[1])).indices
        c[b, ks[: len(top)]] = x[b, top]
    return c
