"""The plain-torch reference codec: the TaSQ math every kernel and backend is tested against.

Keys (pre-RoPE, native channel order) are mapped into the tailored space
``x = P M k / s`` (M: query-guided weights, diagonal ``diag(w)`` or, for the ablation, a
dense ``A^{1/2}``; s: fp16 RMS scale per token shared by all KV heads; P: permutation that
keeps whole RoPE pairs inside each group of ``g`` channels), split into ``d/g`` groups and
coded by the nearest codeword of the group's codebook. Decode is folded (paper sec. 4.4):
``k_perm = s * C~[z]`` already in native units and permuted order, and RoPE can be applied
there because every group holds whole pairs. Values: plain contiguous groups, no scale.

NovaKV's keys (``config.key_rope == 'post'``) use the same functions on *post-RoPE* keys:
``x = P M (k - m) / s`` with M the dense query-whitened KLT map (``k_mix``), m the keys' mean
(``k_mean``), s a per-(token, head) scale and P the stratified grouping; decode un-permutes,
applies ``M^{-1}`` and adds m back, and no RoPE follows.

Inside every key group the layout is rotate-half with half ``g/2``: permuted channel
``j*g + l`` (``l < g/2``) pairs with ``j*g + l + g/2`` and turns at ``inv_freq[perm[j*g+l]]``.

Shapes: T tokens, H KV heads, d head_dim, G = d/g groups, K codebook size.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .config import TaSQConfig
from .rope import apply_rope, rotate


@dataclass
class Codebooks:
    """Runtime tensors of one artifact (all layers).

    k_codebook: [L, H, Gk, Kk, gk] f32 folded decode codewords (native units, permuted order)
    k_weight:   [L, H, d] f32 diagonal weights w (native order; ones if weighting is off)
    k_perm:     [L, H, d] int64, permuted channel i holds native channel k_perm[i]
    v_codebook: [L, H, Gv, Kv, gv] f32
    inv_freq:   [d/2] f32 RoPE frequencies of the model
    k_mix:      [L, H, d, d] f32 or None: dense weighting M (ablation); then k_codebook holds
                tailored codewords and decode applies M^{-1} (k_unmix) after un-permuting.
    k_mean:     [L, H, d] f32 or None: subtracted before M (NovaKV's centring), added back at decode.

    With a per-layer key rate (``config.mix_layers``) ``k_codebook`` is a tuple of L tensors
    ``[H, Gk_l, Kk_l, gk_l]``, each at its layer's rate (:meth:`TaSQConfig.key_rate`); every
    reader indexes it by layer, so both forms read alike.
    """

    config: TaSQConfig
    k_codebook: torch.Tensor
    k_weight: torch.Tensor
    k_perm: torch.Tensor
    v_codebook: torch.Tensor
    inv_freq: torch.Tensor
    attention_scaling: float = 1.0
    k_mix: Optional[torch.Tensor] = None
    k_unmix: Optional[torch.Tensor] = None
    k_mean: Optional[torch.Tensor] = None

    @property
    def num_layers(self) -> int:
        return self.k_weight.shape[0]

    @property
    def num_kv_heads(self) -> int:
        return self.k_weight.shape[1]

    @property
    def layer_mixed(self) -> bool:
        """The keys' rate differs between layers (``k_codebook`` is a tuple per layer)."""
        return not isinstance(self.k_codebook, torch.Tensor)

    def key_group_size(self, layer: int) -> int:
        """Channels per key group in ``layer`` (the config's, or the mix rate's)."""
        return self.k_codebook[layer].shape[-1]

    @property
    def head_dim(self) -> int:
        return self.k_weight.shape[-1]

    def k_inv_perm(self, layer: int) -> torch.Tensor:
        return torch.argsort(self.k_perm[layer], dim=-1)

    def tailored_k_codebook(self, layer: int) -> torch.Tensor:
        """[H, Gk, Kk, gk] codewords in the tailored space (what the encoder searches)."""
        cb = self.k_codebook[layer]
        if self.k_mix is not None:
            return cb
        H, G, K, g = cb.shape
        w = torch.gather(self.k_weight[layer], 1, self.k_perm[layer]).view(H, G, 1, g)
        return cb * w

    @property
    def pairs_in_groups(self) -> bool:
        """Every key group holds whole RoPE pairs in the canonical in-group layout (permuted
        channel j*g + l pairs with j*g + l + g/2): what RoPE in the permuted space, and so the
        serving kernels, need. False for CQ's native-channel groups, and for post-RoPE keys
        (NovaKV), whose coded coordinates are KLT coefficients, not RoPE pairs."""
        if self.config.key_rope != "pre":
            return False
        L, H, d = self.k_perm.shape
        sizes = [self.key_group_size(layer) for layer in range(L)]
        for g in set(sizes):
            p = self.k_perm[[l for l in range(L) if sizes[l] == g]].reshape(-1, d // g, g)
            if not bool((p[..., g // 2:] == p[..., : g // 2] + d // 2).all()):
                return False
        return True

    def rope_freq_perm(self, layer: int) -> torch.Tensor:
        """[H, Gk, gk/2] inv_freq of each pair in the permuted in-group layout."""
        if not self.pairs_in_groups:
            raise ValueError("key groups split RoPE pairs (grouping='channels'): RoPE cannot be applied "
                             "in the permuted space; decode to native order (decode_keys) first")
        H, G, _, g = self.k_codebook[layer].shape
        first = self.k_perm[layer].view(H, G, g)[..., : g // 2]
        return self.inv_freq[first]


def contiguous_pair_permutation(d: int, g: int) -> torch.Tensor:
    """[d]: group j holds pairs j*g/2 .. (j+1)*g/2-1 (contiguous in the interleaved pair order)."""
    half, m = d // 2, g // 2
    pairs = torch.arange(half).view(-1, m)
    return torch.cat([pairs, pairs + half], dim=1).reshape(-1)


def stratified_permutation(d: int, g: int) -> torch.Tensor:
    """[d]: NovaKV's stratified groups: permuted channel j*g + i holds coefficient i*G + j
    (G = d/g), so with coefficients sorted by variance every group spans the spectrum."""
    G = d // g
    return (torch.arange(g).view(1, g) * G + torch.arange(G).view(G, 1)).reshape(-1)


# ---- nearest codeword ---------------------------------------------------------------------
def prepare_codebook(codebook: torch.Tensor):
    """codebook [H, G, K, g] -> (codewords^T [H*G, g, K] f32, norms [H*G, 1, K] f32): the
    per-call preparation of :func:`nearest_codeword`, done once (pass it as ``prepared=``)."""
    cb = codebook.float()
    H, G, K, g = cb.shape
    cn = (cb * cb).sum(-1)  # [H, G, K], as in nearest_codeword
    # largest |x| for which no product sum can overflow (then no NaN: the blocked argmin is exact)
    big = float(cb.abs().max()) * g if cb.numel() and bool(torch.isfinite(cn).all()) else float("inf")
    x_limit = 1e37 / big if big > 0 else float("inf")
    return cb.reshape(H * G, K, g).transpose(1, 2).contiguous(), cn.reshape(H * G, 1, K).contiguous(), x_limit


def _nearest_prepared(x: torch.Tensor, prepared, chunk: int) -> torch.Tensor:
    """Same products (one bmm per (head, group), as the einsum does) and the same
    ``cn - 2 dots`` (``-2 * dots + cn`` is exact-equal: the scaling is a power of two), in
    cache-sized token chunks with in-place ops."""
    cbt, cn, x_limit = prepared
    T, H, G, g = x.shape
    xb = x.float().reshape(T, H * G, g).transpose(0, 1).contiguous()  # [HG, T, g]
    out = torch.empty(H * G, T, dtype=torch.int64)
    blocked = T > 0 and float(xb.abs().max()) < x_limit  # finite inputs, no overflow: no NaN distances
    for s in range(0, T, chunk):
        dots = torch.bmm(xb[:, s : s + chunk], cbt).mul_(-2).add_(cn)
        out[:, s : s + chunk] = _first_argmin(dots) if blocked else torch.argmin(dots, dim=-1)
    return out.t().reshape(T, H, G)


def _first_argmin(d: torch.Tensor, block: int = 32) -> torch.Tensor:
    """== ``torch.argmin(d, dim=-1)`` for d [B, M, K] (first index on ties), in two levels:
    the first block of ``block`` entries holding the minimum (block minima are a vectorized
    reduction), then the first minimum inside it; plain argmin's index-tracking scan is slow.
    d must hold no NaN."""
    B, M, K = d.shape
    if K % block or K < 4 * block:
        return torch.argmin(d, dim=-1)
    x = d.view(B, M, K // block, block)
    j = x.amin(-1).argmin(-1)  # [B, M]: first block holding the minimum
    inner = torch.gather(x, 2, j[..., None, None].expand(B, M, 1, block)).squeeze(2).argmin(-1)
    return j * block + inner


class LayerNearest:
    """:func:`nearest_codeword` (same codes) with each layer's codebook prepared once;
    ``make_codebook(layer) -> [H, G, K, g]``. ``prepare(codebook)`` and ``search(x, prepared)``
    default to this module's plain-torch pair; the Numba CPU kernels pass theirs
    (``numba_kernels.cpu.prepare`` / ``nearest``, tested to give the same codes)."""

    def __init__(self, make_codebook, prepare=None, search=None):
        self.make, self.cache = make_codebook, {}
        self.prepare = prepare or prepare_codebook
        self.search = search or (lambda x, prep: _nearest_prepared(x, prep, 32))

    def __call__(self, x: torch.Tensor, layer: int) -> torch.Tensor:
        """x [T, H, G, g] -> codes [T, H, G] int64."""
        prep = self.cache.get(layer)
        if prep is None:
            prep = self.cache[layer] = self.prepare(self.make(layer))
        return self.search(x, prep)


def nearest_codeword(x: torch.Tensor, codebook: torch.Tensor, chunk: int = 4096, prepared=None) -> torch.Tensor:
    """x [T, H, G, g], codebook [H, G, K, g] -> codes [T, H, G] int64 (argmin L2, first on ties).

    prepared: optional :func:`prepare_codebook` of ``codebook`` (fast path, same codes)."""
    if prepared is not None:
        return _nearest_prepared(x, prepared, 32)
    T = x.shape[0]
    out = torch.empty(x.shape[:3], dtype=torch.int64)
    cb = codebook.float()
    cn = (cb * cb).sum(-1)  # [H, G, K]
    for s in range(0, T, chunk):
        xs = x[s : s + chunk].float()
        dots = torch.einsum("thgc,hgkc->thgk", xs, cb)
        out[s : s + chunk] = torch.argmin(cn.unsqueeze(0) - 2 * dots, dim=-1)
    return out


# ---- keys ---------------------------------------------------------------------------------
def key_tailor(k: torch.Tensor, cb: Codebooks, layer: int):
    """Pre-RoPE keys [T, H, d] (post-RoPE for key_rope 'post') -> (tailored x [T, H, G, g] f32,
    scale fp16 [T] (shared, one group), [T, scale_groups] (shared), [T, H] (per_head) or None)."""
    cfg = cb.config
    T, H, d = k.shape
    k = k.float()
    if cb.k_mean is not None:
        k = k - cb.k_mean[layer]
    if cb.k_mix is not None:
        kw = torch.einsum("hij,thj->thi", cb.k_mix[layer], k)
    else:
        kw = k * cb.k_weight[layer]
    scale = None
    if cfg.scale == "shared" and cfg.scale_groups == 1:
        scale = kw.pow(2).mean(dim=(1, 2)).sqrt().clamp_min(1e-6).half()  # [T]
        kw = kw / scale.float()[:, None, None]
    elif cfg.scale == "shared":  # one scale per contiguous group of H / scale_groups heads
        Gs = cfg.scale_groups
        cfg.check_kv_heads(H)
        scale = kw.reshape(T, Gs, -1).pow(2).mean(dim=2).sqrt().clamp_min(1e-6).half()  # [T, Gs]
        kw = kw / scale.float().repeat_interleave(H // Gs, dim=1)[:, :, None]
    elif cfg.scale == "per_head":
        scale = kw.pow(2).mean(dim=2).sqrt().clamp_min(1e-6).half()  # [T, H]
        kw = kw / scale.float()[:, :, None]
    perm = cb.k_perm[layer].unsqueeze(0).expand(T, H, d)
    x = torch.gather(kw, 2, perm)
    g = cb.key_group_size(layer)
    return x.view(T, H, d // g, g), scale


def encode_keys(k: torch.Tensor, cb: Codebooks, layer: int):
    """Pre-RoPE keys [T, H, d] -> (codes [T, H, Gk] int64, scale fp16 as :func:`key_tailor`)."""
    x, scale = key_tailor(k, cb, layer)
    return nearest_codeword(x, cb.tailored_k_codebook(layer)), scale


def _gather_codewords(codes: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """codes [T, H, G], codebook [H, G, K, g] -> codewords [T, H, G*g] f32."""
    T, H, G = codes.shape
    g = codebook.shape[-1]
    hh = torch.arange(H).view(1, H, 1)
    gg = torch.arange(G).view(1, 1, G)
    return codebook[hh, gg, codes].reshape(T, H, G * g).float()


def apply_scale(x: torch.Tensor, scale: Optional[torch.Tensor]) -> torch.Tensor:
    if scale is None:
        return x
    s = scale.float()
    if s.dim() == 1:
        return x * s[:, None, None]
    if s.shape[1] != x.shape[1]:  # one scale per group of heads
        s = s.repeat_interleave(x.shape[1] // s.shape[1], dim=1)
    return x * s[:, :, None]


def decode_keys_permuted(codes: torch.Tensor, scale, cb: Codebooks, layer: int) -> torch.Tensor:
    """Folded decode ``s * C~[z]`` -> pre-RoPE keys [T, H, d] in the permuted order.

    Only meaningful with diagonal (or no) weighting; the dense ablation un-mixes in
    :func:`decode_keys`.
    """
    return apply_scale(_gather_codewords(codes, cb.k_codebook[layer]), scale)


def decode_keys(codes: torch.Tensor, scale, cb: Codebooks, layer: int) -> torch.Tensor:
    """codes [T, H, Gk], scale -> pre-RoPE keys [T, H, d] f32 in native channel order."""
    xp = decode_keys_permuted(codes, scale, cb, layer)
    T, H, d = xp.shape
    inv = cb.k_inv_perm(layer).unsqueeze(0).expand(T, H, d)
    k = torch.gather(xp, 2, inv)
    if cb.k_unmix is not None:
        k = torch.einsum("hij,thj->thi", cb.k_unmix[layer], k)
    if cb.k_mean is not None:
        k = k + cb.k_mean[layer]
    return k


def rope_permuted(x: torch.Tensor, positions: torch.Tensor, cb: Codebooks, layer: int,
                  inverse: bool = False) -> torch.Tensor:
    """RoPE in the permuted in-group layout: x [T, H, d] permuted, positions [T]."""
    T, H, d = x.shape
    g = cb.key_group_size(layer)
    freq = cb.rope_freq_perm(layer)  # [H, G, g/2]
    ang = positions.to(torch.float64).view(T, 1, 1, 1) * freq.to(torch.float64).unsqueeze(0)
    cos = (torch.cos(ang) * cb.attention_scaling).float()
    sin = (torch.sin(ang) * cb.attention_scaling).float()
    return rotate(x.view(T, H, d // g, g), cos, sin, inverse=inverse).reshape(T, H, d)


# ---- values -------------------------------------------------------------------------------
def encode_values(v: torch.Tensor, cb: Codebooks, layer: int) -> torch.Tensor:
    """Values [T, H, d] -> codes [T, H, Gv] int64 (contiguous groups, no transform)."""
    T, H, d = v.shape
    g = cb.config.group_size_v
    return nearest_codeword(v.float().view(T, H, d // g, g), cb.v_codebook[layer])


def decode_values(codes: torch.Tensor, cb: Codebooks, layer: int) -> torch.Tensor:
    """codes [T, H, Gv] -> values [T, H, d] f32."""
    return _gather_codewords(codes, cb.v_codebook[layer])


# ---- attention over codes -----------------------------------------------------------------
def attention_over_codes(q: torch.Tensor, q_positions: torch.Tensor, k_codes: torch.Tensor, k_scale,
                         v_codes: torch.Tensor, kv_positions: torch.Tensor, cb: Codebooks, layer: int,
                         sm_scale: float, causal: bool = True,
                         k_full: Optional[torch.Tensor] = None, v_full: Optional[torch.Tensor] = None,
                         full_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One request's attention over a compressed cache.

    q [Tq, Hq, d] post-RoPE queries at q_positions [Tq]; k_codes [S, H, Gk], v_codes
    [S, H, Gv], kv_positions [S]. Keys are decoded, rotated by RoPE at their positions, and
    attended with softmax in fp32 (GQA: query head i reads KV head i // (Hq // H)).
    Optional full-precision window: k_full [S, H, d] pre-RoPE, v_full [S, H, d], used
    where full_mask [S] is True. Returns [Tq, Hq, d] f32.
    """
    k = decode_keys(k_codes, k_scale, cb, layer)
    v = decode_values(v_codes, cb, layer)
    if full_mask is not None:
        k = torch.where(full_mask[:, None, None], k_full.float(), k)
        v = torch.where(full_mask[:, None, None], v_full.float(), v)
    k = apply_rope(k, kv_positions, cb.inv_freq, cb.attention_scaling)
    return attention_dense(q, q_positions, k, v, kv_positions, sm_scale, causal)


def attention_dense(q, q_positions, k, v, kv_positions, sm_scale: float, causal: bool = True):
    """Plain attention: q [Tq, Hq, d], k/v [S, H, d] post-RoPE -> [Tq, Hq, d] f32."""
    Hq, H = q.shape[1], k.shape[1]
    rep = Hq // H
    k = k.float().repeat_interleave(rep, dim=1)
    v = v.float().repeat_interleave(rep, dim=1)
    logits = torch.einsum("qhd,shd->hqs", q.float(), k) * sm_scale
    if causal:
        mask = kv_positions.view(1, 1, -1) > q_positions.view(1, -1, 1)
        logits = logits.masked_fill(mask, float("-inf"))
    p = torch.softmax(logits, dim=-1)
    return torch.einsum("hqs,shd->qhd", p, v)
