"""Calibration-free "universal" codebooks for NSNQuant (:mod:`sglang_tasq.hf.nsnquant`).

NSNQuant normalizes, shifts and re-normalizes each token and turns it with a Hadamard matrix so
that its coordinates look like draws of a standard normal; one codebook fitted to N(0, I) then
serves every model, layer and head. This module fits it: our flat Lloyd k-means
(:func:`calibrate.kmeans.kmeans`, k-means++ seeding, no weights) on ``samples`` draws of
N(0, I_dim) from a ``torch.Generator`` seeded by ``seed``, or on their absolute values
(``orthant=True``: the positive-orthant codebook of the 2-bit setting, decoded with stored signs).

The codebook is a pure function of the arguments, so it is made once per process and kept in
:data:`_CACHE`; callers get a copy.
"""
from __future__ import annotations

import torch

from .kmeans import kmeans

#: Lloyd iterations at most (the run stops earlier when the objective settles)
ITERS = 25

_CACHE: dict[tuple, torch.Tensor] = {}


def gaussian_codebook(size: int = 256, dim: int = 8, samples: int = 65536, seed: int = 0,
                      orthant: bool = False) -> torch.Tensor:
    """[size, dim] float32 k-means codebook of N(0, I_dim) (of |N(0, I_dim)| with ``orthant``).

    Deterministic: the same arguments give the same bytes (within one machine and build).
    """
    if size < 1 or dim < 1 or samples < size:
        raise ValueError(f"gaussian_codebook: need size >= 1, dim >= 1, samples >= size; "
                         f"got size={size} dim={dim} samples={samples}")
    key = (int(size), int(dim), int(samples), int(seed), bool(orthant))
    cb = _CACHE.get(key)
    if cb is None:
        gen = torch.Generator().manual_seed(int(seed))
        z = torch.randn(samples, dim, generator=gen, dtype=torch.float32)
        if orthant:
            z = z.abs()
        res = kmeans(z[None], None, size, ITERS, seed=int(seed), tol=1e-4)
        cb = _CACHE[key] = res.centroids[0].contiguous()
    return cb.clone()
