"""NSNQuant (arXiv 2505.18231, NeurIPS 2025) as a KV method of the HF cache, implemented from
the method as described in the paper's abstract and third-party descriptions (the paper's
method section was not available to us; details below are our reading, not the authors' code).

Idea: a calibration-free vector quantizer. Each token is brought close to a standard normal
(Normalize -> Shift -> Normalize, then a Hadamard turn), so that one *universal* codebook fitted
to N(0, I) (:func:`calibrate.universal.gaussian_codebook`, passed in: this module does not
import ``calibrate``) serves every model, layer and head.

Per layer and KV head, tokens are coded in windows of ``block = 64`` consecutive tokens.
For one window ``x [64, H, d]`` (keys: pre-RoPE, un-rotated here from the post-RoPE keys the
cache hands over, at ``positions``):

1. Normalize-1: ``s1 = ||x|| / sqrt(d)`` per token and head, 4-bit asymmetric min/max over the
   window (fp16 min and step per head); ``x1 = x / s1_hat``.
2. Shift: ``mu`` = the window's mean of ``x1`` per channel and head, 4-bit asymmetric min/max
   in groups of ``min(32, d)`` channels; ``x2 = x1 - mu_hat``.
3. Keys only: ``x2`` is turned by RoPE at the tokens' positions (the residual is coded
   post-RoPE, ``mu`` stays pre-RoPE and is turned at decode).
4. Normalize-2: ``s2 = ||x2|| / sqrt(d)``; ``x3 = x2 / s2`` (``||x3|| = sqrt(d)``).
5. Hadamard: ``y = x3 @ Hd`` (orthonormal Sylvester Hadamard, its own inverse).
6. VQ of each 8-channel sub-vector of ``y``. 1 bit: the index of the nearest codeword of a
   universal codebook ``C [256, 8]``. 2 bits (the layout a third-party survey describes,
   unconfirmed against the paper): 8 sign bits and the index of the nearest codeword of
   ``|y_sub|`` in a positive-orthant codebook ``P [256, 8]``, decoded as ``sign * P[idx]``,
   which is the exact nearest word of the sign-symmetric product codebook.
7. Scale adjust: ``s2' = s2 * <y, y> / <y, c>`` (``c`` the decoded codewords; kept at ``s2``
   when ``<y, c>`` is not positive), stored in fp16; it keeps the reconstruction's component
   along ``y`` equal to ``y``'s.

Decode: ``r = (c * s2') @ Hd``; keys ``s1_hat * (r + RoPE_pos(mu_hat))`` (post-RoPE, as the
cache expects with ``pre_rope = False``), values ``s1_hat * (r + mu_hat)``.

Payload per window (leading dim n = windows): ``idx`` uint8 [n, 64, H, d/8], ``signs``
(2 bits only) 1-bit packed [n, 64*H*d/8], ``s2`` fp16 [n, 64, H], ``s1_codes`` 4-bit packed
[n, 64*H/2], ``s1_min``/``s1_step`` fp16 [n, H], ``mu_codes`` 4-bit packed [n, H*d/2],
``mu_min``/``mu_step`` fp16 [n, H, d/group]. The codebook is shared method state (O(1)),
not stored per token and not in the cache's byte count.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .. import codec
from ..packing import pack_codes, unpack_codes
from ..rope import apply_rope
from .baselines import KVMethod, _asym_quant

WINDOW = 64  # tokens per window (the cache's block)
SCALE_BITS = 4  # s1 and mu codes
MU_GROUP = 32  # channels per mu quantization group (capped at d)
_EPS = 1e-12


def hadamard(d: int) -> torch.Tensor:
    """Orthonormal Sylvester Hadamard matrix [d, d] float32 (d a power of two): entries
    +-1/sqrt(d), symmetric, ``H @ H == I``."""
    if d < 1 or d & (d - 1):
        raise ValueError(f"hadamard: d must be a power of two, got {d}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(d)).float()


def _dequant(codes: torch.Tensor, step: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    return codes.float() * step.float() + low.float()


def _rms(x: torch.Tensor) -> torch.Tensor:
    """||x|| / sqrt(d) over the last dim (no keepdim)."""
    return x.norm(dim=-1) / math.sqrt(x.shape[-1])


def _safe(s: torch.Tensor) -> torch.Tensor:
    """A divisor: s where s > 0, else 1 (a zero vector stays zero)."""
    return torch.where(s > _EPS, s, torch.ones_like(s))


@dataclass
class NSNParts:
    """What :func:`nsn_normalize` computes for windows ``x [n, W, H, d]``.

    ``s1_hat`` [n, W, H] and ``mu_hat`` [n, H, d] are what decode uses (the stored values when
    quantized, the exact ones otherwise); the ``*_codes``/``*_min``/``*_step`` fields are None
    when ``quantize=False``.
    """

    s1: torch.Tensor
    s1_hat: torch.Tensor
    x1: torch.Tensor
    mu: torch.Tensor
    mu_hat: torch.Tensor
    x2: torch.Tensor  # after Shift (and RoPE for keys)
    s2: torch.Tensor  # [n, W, H]
    x3: torch.Tensor  # unit RMS per token and head
    s1_codes: torch.Tensor | None = None  # [n, W, H] int64
    s1_min: torch.Tensor | None = None  # [n, H] fp16
    s1_step: torch.Tensor | None = None
    mu_codes: torch.Tensor | None = None  # [n, H, d] int64
    mu_min: torch.Tensor | None = None  # [n, H, d/group] fp16
    mu_step: torch.Tensor | None = None


def mu_group(d: int) -> int:
    return min(MU_GROUP, d)


def nsn_normalize(x: torch.Tensor, positions: torch.Tensor | None = None, inv_freq: torch.Tensor | None = None,
                  attention_scaling: float = 1.0, quantize: bool = True) -> NSNParts:
    """Steps 1-4 on windows ``x [n, W, H, d]`` (keys pre-RoPE). With ``positions`` [n*W] (and
    ``inv_freq``) the shifted residual is turned by RoPE (keys); without, it is not (values)."""
    x = x.float()
    n, W, H, d = x.shape
    s1 = _rms(x)  # [n, W, H]
    q = {}
    if quantize:
        c, step, low = _asym_quant(s1, dim=1, bits=SCALE_BITS)  # over the window, per head
        s1_hat = _dequant(c, step, low)
        q.update(s1_codes=c, s1_min=low.squeeze(1), s1_step=step.squeeze(1))
    else:
        s1_hat = s1
    x1 = x / _safe(s1_hat)[..., None]
    mu = x1.mean(dim=1)  # [n, H, d]
    if quantize:
        g = mu_group(d)
        c, step, low = _asym_quant(mu.reshape(n, H, d // g, g), dim=-1, bits=SCALE_BITS)
        mu_hat = _dequant(c, step, low).reshape(n, H, d)
        q.update(mu_codes=c.reshape(n, H, d), mu_min=low.squeeze(-1), mu_step=step.squeeze(-1))
    else:
        mu_hat = mu
    x2 = x1 - mu_hat[:, None]
    if positions is not None:
        x2 = apply_rope(x2.reshape(n * W, H, d), positions, inv_freq, attention_scaling).view(n, W, H, d)
    s2 = _rms(x2)
    x3 = x2 / _safe(s2)[..., None]
    return NSNParts(s1, s1_hat, x1, mu, mu_hat, x2, s2, x3, **q)


def nearest(y: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """Index of the nearest codeword (Euclidean, first index on ties) of each row of
    ``y [..., g]`` in ``codebook [K, g]`` -> int64 [...]: the reference codec's search with one
    codebook."""
    g = codebook.shape[1]
    return codec.nearest_codeword(y.reshape(-1, 1, 1, g), codebook[None, None]).view(y.shape[:-1])


def vq_encode(y: torch.Tensor, codebook: torch.Tensor, bits: int):
    """Hadamard-domain ``y [..., d]`` -> (idx int64 [..., d/g], negative-sign mask bool [..., d]
    or None). 1 bit: nearest word of ``codebook``; 2 bits: signs + nearest word of |y| in the
    positive-orthant ``codebook`` (zero entries take sign +)."""
    g = codebook.shape[1]
    sub = y.reshape(*y.shape[:-1], y.shape[-1] // g, g)
    if bits == 1:
        return nearest(sub, codebook), None
    neg = y < 0
    return nearest(sub.abs(), codebook), neg


def vq_decode(idx: torch.Tensor, neg: torch.Tensor | None, codebook: torch.Tensor) -> torch.Tensor:
    """(idx [..., d/g], sign mask [..., d] or None) -> codewords [..., d] float32."""
    c = codebook.float().to(idx.device)[idx].flatten(-2)
    return c if neg is None else torch.where(neg, -c, c)


def adjust_scale(s2: torch.Tensor, y: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """Step 7: ``s2 * <y, y> / <y, c>`` per token and head; ``s2`` where ``<y, c>`` is not
    comfortably positive."""
    yy, yc = (y * y).sum(-1), (y * c).sum(-1)
    ok = yc > 1e-6 * yy.clamp_min(_EPS)
    return torch.where(ok, s2 * yy / torch.where(ok, yc, torch.ones_like(yc)), s2)


class _NSNSide:
    """Shared encode/decode of one side; keys add the RoPE turns."""

    pre_rope, block, exact = False, WINDOW, False
    positional = False

    def __init__(self, codebook: torch.Tensor, bits: int = 1):
        if bits not in (1, 2):
            raise ValueError(f"NSNQuant bits must be 1 or 2, got {bits}")
        if codebook.dim() != 2 or codebook.shape[0] > 256:
            raise ValueError(f"NSNQuant codebook must be [K <= 256, g] (uint8 indices), got {tuple(codebook.shape)}")
        if bits == 2 and bool((codebook < 0).any()):
            raise ValueError("the 2-bit NSNQuant codebook must lie in the positive orthant (entries >= 0)")
        self.codebook, self.bits = codebook.float().contiguous(), bits
        self.sub = codebook.shape[1]
        self.name = "nsnquant" if bits == 1 else "nsnquant2"
        self._had: dict = {}

    def _check(self, d: int) -> None:
        if d < 8 or d & (d - 1) or d % self.sub:
            raise ValueError(f"NSNQuant needs a power-of-two head_dim >= 8 divisible by {self.sub}, got {d}")

    def _hadamard(self, d: int, device) -> torch.Tensor:
        key = (d, str(device))
        if key not in self._had:
            self._had[key] = hadamard(d).to(device)
        return self._had[key]

    # -- the RoPE hooks (identity for values) --
    def _pre(self, x, positions):  # tokens [T, H, d] as cached -> what Normalize-1 sees
        return x.float()

    def _rope_args(self, positions):
        return {}

    def _mu_back(self, mu_hat, W, positions):  # [n, H, d] -> [n, W, H, d]
        return mu_hat[:, None].expand(-1, W, -1, -1)

    def encode(self, x, layer, state, positions=None):
        T, H, d = x.shape
        self._check(d)
        n, W = T // self.block, self.block
        xs = self._pre(x, positions).reshape(n, W, H, d)
        p = nsn_normalize(xs, quantize=True, **self._rope_args(positions))
        y = p.x3 @ self._hadamard(d, x.device)
        idx, neg = vq_encode(y, self.codebook, self.bits)
        s2 = adjust_scale(p.s2, y, vq_decode(idx, neg, self.codebook)).half()
        out = {"idx": idx.to(torch.uint8), "s2": s2,
               "s1_codes": pack_codes(p.s1_codes.reshape(n, W * H), SCALE_BITS),
               "s1_min": p.s1_min, "s1_step": p.s1_step,
               "mu_codes": pack_codes(p.mu_codes.reshape(n, H * d), SCALE_BITS),
               "mu_min": p.mu_min, "mu_step": p.mu_step}
        if neg is not None:
            out["signs"] = pack_codes(neg.reshape(n, W * H * d).to(torch.int64), 1)
        return out

    def decode(self, payload, layer, state, positions=None):
        idx = payload["idx"].long()
        n, W, H, G = idx.shape
        d = G * self.sub
        g = mu_group(d)
        neg = None
        if "signs" in payload:
            neg = unpack_codes(payload["signs"], W * H * d, 1).view(n, W, H, d).bool()
        r = (vq_decode(idx, neg, self.codebook) * payload["s2"].float()[..., None]) @ self._hadamard(d, idx.device)
        s1c = unpack_codes(payload["s1_codes"], W * H, SCALE_BITS).view(n, W, H)
        s1_hat = _dequant(s1c, payload["s1_step"][:, None], payload["s1_min"][:, None])
        muc = unpack_codes(payload["mu_codes"], H * d, SCALE_BITS).view(n, H, d // g, g)
        mu_hat = _dequant(muc, payload["mu_step"][..., None], payload["mu_min"][..., None]).view(n, H, d)
        x = s1_hat[..., None] * (r + self._mu_back(mu_hat, W, positions))
        return x.reshape(n * W, H, d)

    def bits_per_element(self, num_kv_heads, head_dim):
        d, W = head_dim, self.block
        index = (d // self.sub) * 8 + (d if self.bits == 2 else 0)
        per_token = index + 16 + SCALE_BITS  # indices (+ signs), s2' fp16, s1 code
        per_window = 32 + SCALE_BITS * d + 32 * (d // mu_group(d))  # s1 min/step, mu codes + min/step
        return (per_token + per_window / W) / d


class NSNKeys(_NSNSide):
    """NSNQuant keys: statistics before RoPE, the residual coded after it. Takes and returns
    post-RoPE keys (``pre_rope = False``) and needs the tokens' ``positions`` (``positional``)."""

    positional = True

    def __init__(self, codebook: torch.Tensor, inv_freq: torch.Tensor, attention_scaling: float = 1.0,
                 bits: int = 1):
        super().__init__(codebook, bits)
        self.inv_freq, self.attention_scaling = inv_freq.float(), float(attention_scaling)

    def _need(self, positions):
        if positions is None:
            raise ValueError("NSNKeys needs positions= (the tokens' cache indices)")
        return positions

    def _pre(self, x, positions):
        return apply_rope(x.float(), self._need(positions), self.inv_freq, self.attention_scaling, inverse=True)

    def _rope_args(self, positions):
        return {"positions": self._need(positions), "inv_freq": self.inv_freq,
                "attention_scaling": self.attention_scaling}

    def _mu_back(self, mu_hat, W, positions):
        n, H, d = mu_hat.shape
        mu = mu_hat[:, None].expand(n, W, H, d).reshape(n * W, H, d)
        return apply_rope(mu, self._need(positions), self.inv_freq, self.attention_scaling).view(n, W, H, d)


class NSNValues(_NSNSide):
    """NSNQuant values: the same code without RoPE."""


def nsnquant(codebook: torch.Tensor, inv_freq: torch.Tensor, attention_scaling: float = 1.0,
             bits: int = 1) -> KVMethod:
    """NSNQuant keys and values: ``codebook`` is the universal N(0, I) codebook [256, 8]
    (``bits=1``) or the positive-orthant one (``bits=2``)."""
    keys = NSNKeys(codebook, inv_freq, attention_scaling, bits)
    return KVMethod(keys, NSNValues(codebook, bits), keys.name)
