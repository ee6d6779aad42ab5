"""Decode-view attention for quality runs, and the per-layer attention error it measures.

A serving engine reads token ``p`` at full precision while it is one of the first ``sink``
tokens or among the ``recent`` most recent ones *at the time of the query*, and from its
codes otherwise. One teacher-forced forward with a plain cache cannot show that (its
windows are relative to the end of the sequence), so the harness runs every forward with:

* :class:`ProbeCache`: a :class:`QuantizedKVCache` without windows whose buffers hold every
  token as decoded from its codes (the cache's own encode/decode), plus an exact copy;
* :func:`decode_view_attention`, registered with transformers as ``"tasq_decode_view"``:
  query ``t`` attends to key ``p <= t`` exactly when ``p < sink`` or ``p >= t + 1 - recent``,
  to the decoded key/value otherwise (fp32 softmax, queries in chunks). Windows "none"
  (0+0) read every token, itself included, from codes.

With :class:`AttnStats` attached it also records, per layer and per query-position bucket,
the attention-logit error of the scores the query used against the scores with exact keys
(same queries): NMSE = sum (s - s_exact)^2 / sum s_exact^2 over causal pairs, and
KL(softmax(s_exact) || softmax(s)) averaged over queries and heads.

Shapes: HF passes query [1, Hq, n, d] and the cache's key/value [1, H, T, d]; batch 1 only.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Optional

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from sglang_tasq.hf.baselines import KVMethod
from sglang_tasq import salient as sal
from sglang_tasq.hf.cache import QuantizedKVCache
from sglang_tasq.windows import query_window, window_columns

NAME = "tasq_decode_view"
_ACTIVE: list = []


class ProbeCache(QuantizedKVCache):
    """Every token read from codes at once (no windows), plus an exact copy per layer: the model's
    own, or (``side="fp8"``) as an fp8 side buffer holds it (:func:`sglang_tasq.salient.fp8_rows`
    per token and KV head; keys pre-RoPE, as the serving pool stores them, for a method that codes
    them so)."""

    def __init__(self, method: KVMethod, side: str = "bf16"):
        super().__init__(method, sink=0, recent=0, fresh_exact=False)
        sal.copy_bits(side, 64)  # a bad format fails here
        self.side = side
        self.exact: dict = {}  # layer -> {"k": buf, "v": buf} [1, H, cap, d]
        self.n_exact: dict = {}

    def _held(self, name: str, x: torch.Tensor, T0: int, layer: int) -> torch.Tensor:
        from sglang_tasq.hf.cache import held_copies

        if self.side == "bf16":
            return x
        side = self.layers[layer].sides[name]  # the quantizer and state that coded these tokens
        coded = None
        if self.side in sal.RESIDUAL_FORMATS and not side.q.exact and side.q.block == 1 \
                and not getattr(side.q, "positional", False):  # the codes just made
            n = x.shape[2]
            coded = torch.stack([side.q.decode(store.slice(T0, T0 + n), layer, side.state) for store in side.rows])
        return held_copies(x, T0, self.side, side.q if name == "k" else None, coder=side.q, layer=layer,
                           state=side.state, coded=coded)

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        kq, vq = super().update(key_states, value_states, layer_idx)
        T0, n = self.n_exact.get(layer_idx, 0), key_states.shape[2]
        bufs = self.exact.setdefault(layer_idx, {})
        for name, x in (("k", key_states), ("v", value_states)):
            x = self._held(name, x, T0, layer_idx)
            buf = bufs.get(name)
            if buf is None or buf.shape[2] < T0 + n:
                new = x.new_empty((*x.shape[:2], max(2 * T0, T0 + n, 64), x.shape[3]))
                if buf is not None:
                    new[:, :, :T0] = buf[:, :, :T0]
                bufs[name] = buf = new
            buf[:, :, T0:T0 + n] = x
        self.n_exact[layer_idx] = T0 + n
        return kq, vq

    def exact_kv(self, layer_idx: int):
        T, b = self.n_exact[layer_idx], self.exact[layer_idx]
        return b["k"][:, :, :T], b["v"][:, :, :T]


class AttnStats:
    """Sums per (layer, query bucket): squared logit error, squared exact logit, KL, queries."""

    def __init__(self, num_layers: int, bucket: int = 512, max_len: int = 8192):
        nb = -(-max_len // bucket)
        self.bucket = bucket
        self.err, self.ref, self.kl, self.n = (torch.zeros(num_layers, nb, dtype=torch.float64) for _ in range(4))

    def add(self, layer: int, pos: torch.Tensor, err, ref, kl) -> None:
        idx = (pos // self.bucket).clamp_max(self.err.shape[1] - 1)
        for acc, x in ((self.err, err), (self.ref, ref), (self.kl, kl), (self.n, torch.ones_like(err))):
            acc[layer].index_add_(0, idx, x.double())

    def merge(self, other: "AttnStats") -> None:
        for a, b in ((self.err, other.err), (self.ref, other.ref), (self.kl, other.kl), (self.n, other.n)):
            a += b

    def layer_nmse(self) -> list:
        return (self.err.sum(1) / self.ref.sum(1).clamp_min(1e-30)).tolist()

    def layer_kl(self) -> list:
        return (self.kl.sum(1) / self.n.sum(1).clamp_min(1)).tolist()

    def bucket_nmse(self) -> list:
        """Per query bucket: mean over layers of that bucket's NMSE (buckets with queries)."""
        used = self.n[0] > 0
        return (self.err / self.ref.clamp_min(1e-30)).mean(0)[used].tolist()

    def bucket_kl(self) -> list:
        used = self.n[0] > 0
        return (self.kl.sum(0) / self.n.sum(0).clamp_min(1))[used].tolist()


@dataclass
class Probe:
    """What the decode view applies: windows, optional stats, and salient tokens kept exact
    (:mod:`sglang_tasq.salient`): when the forward that ends at ``select_at`` keys runs, each
    layer scores the positions by its last ``salient.obs`` queries and keeps its best (or, with
    ``salient.shared``, the first later forward keeps the best of all layers' summed scores in
    every layer); every later query reads them exactly (``kept``: layer -> [H, B] positions)."""

    cache: ProbeCache
    sink: int = 0
    recent: int = 0
    stats: Optional[AttnStats] = None
    chunk: int = 256
    salient: Optional[sal.SalientSpec] = None
    select_at: Optional[int] = None
    kept: dict = field(default_factory=dict)
    scores: dict = field(default_factory=dict)  # layer -> [H, T] pooled selection scores (rule "obs" or "echo")
    echo: dict = field(default_factory=dict)  # layer -> [H, T] pooled echo scores (rule "both": half the budget)
    stream: dict = field(default_factory=dict)  # streaming spec (salient.block): layer -> [H, cap] window echo
    decided: int = 0  # streaming: blocks decided so far

    def __post_init__(self):
        if self.salient is not None:
            self.salient.check_windows(self.sink, self.recent)


@contextmanager
def active(probe: Probe):
    """Route every model forward inside the block through ``probe``."""
    _ACTIVE.append(probe)
    try:
        yield probe
    finally:
        _ACTIVE.pop()


def _scores(q2, k, a: int, b: int, shape) -> torch.Tensor:
    """q2 [H, G*c, d] x keys k[:, :b] -> [H, G, c, b] with the future of the diagonal block at -inf."""
    S = torch.bmm(q2, k[:, :b].transpose(1, 2)).view(*shape, b)
    upper = torch.arange(a, b)[None] > torch.arange(a, b)[:, None]
    S[..., a:b].masked_fill_(upper, float("-inf"))
    return S


def _mix(q, kq, ke, vq, ve, a: int, b: int, sink: int, recent: int):
    """Scores [H, G, c, b] (future at -inf), probabilities and output [H, G, c, d] of the
    queries at positions [a, b): exact key/value where the decode-view windows say so."""
    H, G, c, d = q.shape
    q2 = q.reshape(H, G * c, d)
    S = _scores(q2, kq, a, b, (H, G, c))
    cols = E = None
    if sink or recent:
        cols = window_columns(a, b, sink, recent)
        t, pc = torch.arange(a, b)[:, None], cols[None]
        E = query_window(t[:, 0], cols, sink, recent) & (pc <= t)  # [c, ncols] exact pairs (the one rule)
        Se = torch.bmm(q2, ke[:, cols].transpose(1, 2)).view(H, G, c, -1)
        S[..., cols] = torch.where(E, Se, S[..., cols])
    P = torch.softmax(S, dim=-1)
    out = torch.bmm(P.view(H, G * c, b), vq[:, :b]).view(H, G, c, d)
    if cols is not None:
        dv = (ve - vq)[:, cols]
        out += torch.bmm((P[..., cols] * E).view(H, G * c, -1), dv).view(H, G, c, d)
    return S, out


def _window_echo(q, ke, a: int, b: int, sink: int, recent: int) -> torch.Tensor:
    """[H, c]: :func:`salient.query_echo` of the queries at positions [a, b) (q [H, G, c, d] already
    scaled; exact keys ``ke`` [H, T, d])."""
    H, G, c, d = q.shape
    cols = window_columns(a, b, sink, recent)
    qs = q.permute(2, 0, 1, 3).reshape(c, H * G, d)
    return sal.query_echo(qs, ke[:, cols].transpose(0, 1), torch.arange(a, b), cols, sink, recent, 1.0).T


def stream_rows(p: "Probe", upto: int) -> torch.Tensor:
    """[(layers so far) * H, upto]: the streaming echo rows of the first ``upto`` tokens, layer-major."""
    return torch.cat([p.stream[i][:, :upto] for i in sorted(p.stream)])


def _stream(p: "Probe", q, ke, T: int, n: int, layer: int, H: int) -> None:
    """Streaming salient tokens, layers up to the deciding one (``salient.layer``): record this
    forward's queries' window echo (per KV head); at the deciding layer, decide every block the
    scored tokens reach, before its attention (so a query past a block's horizon reads that
    block's kept tokens in the same forward: the same whether the prompt comes whole or chunked)."""
    row = p.stream.get(layer)
    if row is None or row.shape[1] < T:
        grown = torch.zeros(H, max(T, 2 * (0 if row is None else row.shape[1]), 1024), dtype=torch.float64)
        if row is not None:
            grown[:, : row.shape[1]] = row
        p.stream[layer] = row = grown
    for s in range(0, n, p.chunk):
        e = min(n, s + p.chunk)
        row[:, T - n + s: T - n + e] = _window_echo(q[:, :, s:e], ke, T - n + s, T - n + e, p.sink, p.recent).double()
    if layer == p.salient.layer:
        k = sal.decided_blocks(T, p.salient)
        if k > p.decided:
            new = sal.decide_blocks(stream_rows(p, T), T, p.decided, p.sink, p.salient)
            p.decided = k
            p.kept["all"] = torch.cat([p.kept.get("all", torch.empty(0, dtype=torch.long)), new])


def _stats(q, ke, S, a: int, b: int):
    """Per query [c]: sum of squared logit error, sum of squared exact logits, mean KL over heads."""
    H, G, c, d = q.shape
    Sx = _scores(q.reshape(H, G * c, d), ke, a, b, (H, G, c))
    fut = torch.isinf(Sx)
    err = (S - Sx).masked_fill_(fut, 0.0).square_().sum((0, 1, 3))
    ref = Sx.masked_fill(fut, 0.0).square_().sum((0, 1, 3))
    lpx, lp = torch.log_softmax(Sx, -1), torch.log_softmax(S, -1)
    kl = (lpx.exp() * (lpx - lp)).masked_fill_(fut, 0.0).sum(-1).mean((0, 1))
    return err, ref, kl


def decode_view_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention function (see module docstring); plain SDPA when no probe is active."""
    if not _ACTIVE:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    p = _ACTIVE[-1]
    B, Hq, n, d = query.shape
    if B != 1:
        raise ValueError(f"decode-view attention runs one sequence at a time, got batch {B}")
    H, T = key.shape[1], key.shape[2]
    G, layer = Hq // H, module.layer_idx
    scaling = d ** -0.5 if scaling is None else scaling
    kx, vx = p.cache.exact_kv(layer)
    q = query[0].float().reshape(H, G, n, d) * scaling
    kq, vq, ke, ve = key[0].float(), value[0].float(), kx[0].float(), vx[0].float()
    streaming = p.salient is not None and p.salient.block is not None
    if streaming and layer <= p.salient.layer:
        _stream(p, q, ke, T, n, layer, H)
    if p.salient is not None and p.salient.shared and p.scores and not p.kept and T > p.select_at:
        second = [p.echo[i] for i in sorted(p.echo)] or None
        shared = sal.select_shared([p.scores[i] for i in sorted(p.scores)], p.sink, p.recent, p.salient, second)
        p.kept.update({i: shared.expand(p.scores[i].shape[0], -1) for i in p.scores})  # every layer, head
    kept = p.kept.get(layer)
    if streaming:
        kept = p.kept.get("all") if layer >= p.salient.layer else None
        kept = None if kept is None else kept.expand(H, -1)
    if kept is not None and kept.numel():  # kept positions read exactly by every later query
        m = sal.kept_mask(kept, T)[..., None]
        kq, vq = torch.where(m, ke, kq), torch.where(m, ve, vq)
    out = torch.empty(H, G, n, d)
    selecting = not streaming and p.salient is not None and T == p.select_at and layer not in p.scores
    echo = torch.zeros(H, T) if selecting and p.salient.rule != "obs" else None
    for s in range(0, n, p.chunk):
        e = min(n, s + p.chunk)
        a, b = T - n + s, T - n + e
        S, out[:, :, s:e] = _mix(q[:, :, s:e], kq, ke, vq, ve, a, b, p.sink, p.recent)
        if p.stats is not None:
            p.stats.add(layer, torch.arange(a, b), *_stats(q[:, :, s:e], ke, S, a, b))
        if echo is not None:  # every prompt query's attention to the prompt's head, as served
            echo[:, a:b] = sal.echo_scores(torch.softmax(S, -1), p.sink)
    if echo is not None:
        echo = sal.pooled(sal.above_local_median(echo), p.salient.reach)
    if selecting and p.salient.rule == "echo":
        p.scores[layer] = echo
    elif selecting:
        w = min(p.salient.obs, n)  # the selection point's observation queries, over the keys as served
        S, _ = _mix(q[:, :, n - w:], kq, ke, vq, ve, T - w, T, p.sink, p.recent)
        p.scores[layer] = sal.token_scores(torch.softmax(S, -1), p.salient.reach)
        if echo is not None:
            p.echo[layer] = echo
    if selecting and not p.salient.shared:
        p.kept[layer] = sal.top_union(p.scores[layer], p.echo.get(layer), p.sink, p.recent, p.salient.budget)
    return out.reshape(Hq, n, d).transpose(0, 1)[None].to(query.dtype), None


AttentionInterface.register(NAME, decode_view_attention)
AttentionMaskInterface.register(NAME, sdpa_mask)


def use_decode_view(model) -> None:
    """Switch a loaded HF model to the decode-view attention (SDPA outside a probe)."""
    model.set_attn_implementation(NAME)
