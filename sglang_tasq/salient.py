"""Salient tokens kept exact: which coded tokens a request reads at full precision besides its
windows (issue 14), and what that costs in bits. Plain torch, the one reference.

The rule (SnapKV-style, chosen at a selection point ``T``: the end of the prompt, or the end of
the part of it seen before the question): the attention probabilities of the last ``obs``
queries before ``T`` over the keys *as served* (exact inside the windows, decoded codes
elsewhere: what a server can compute without exact keys for a cached prefix) are summed over
those queries and over the query heads of each KV head, max-pooled over neighbouring positions
(``SalientSpec.reach``: symmetric, or reaching forward from a peak, since a needle's value follows
the words the question attends to), and the ``budget`` best positions per (layer, KV head), or
per request for a ``shared`` set, among the candidates are kept. The candidates are the tokens the
query at ``T - 1`` reads from codes: ``sink <= p < T - recent``. Every query after the selection
point reads a kept (position, head) exactly, in addition to the window rule of
:mod:`sglang_tasq.windows`. Ties go to the lower position. A token inside the recent window at
the selection point is no candidate: it is exact then, and moves to its codes as generation
pushes it out of the window (only for generations longer than ``recent``).

The echo rule (``SalientSpec.rule == "echo"``, for a question asked *before* the document, where the last
queries cannot see it): every prompt query's served attention to the prompt's head (the sink
window less its first token, where a chat prompt puts its instruction and question) is summed
over the query heads of each KV head; less its running median (:data:`ECHO_WINDOW` positions, the
drift of how much a stretch of text looks back), pooled and chosen as above. A needle's key words
attend to the same words in the question; its value follows them. It needs no extra pass: the
scores are the prompt's own attention rows, as the prefill computes them. ``"both"`` keeps the
best ``budget - budget // 2`` by the observation rule and fills the rest by the echo rule (a
server does not know where its prompts put the question).

The streaming form (``SalientSpec.block``: keep ``budget`` of every ``block`` positions, echo
rule, one set per request), the one a server can run: a prompt token's echo is its attention to
the prompt's head *within the exact keys alone* (the window rule's sink and recent window,
:func:`window_echo`) per (layer, KV head); block ``k`` (positions ``[k N, (k+1) N)``) keeps its
``budget`` best by the detrended, pooled scores summed over layers and heads as soon as the
tokens up to :func:`block_horizon` have been scored (:func:`decide_blocks`). The layers are
``0 .. SalientSpec.layer``, and the kept tokens are read exactly from
that layer on: a forward computes the echo of its own queries at a layer before that layer's
attention, so the deciding layer can apply a block decided inside the same forward, and a
prompt read whole or in chunks keeps the same tokens and attends the same way (a sum over every
layer could only be applied in a later forward: chunking would change what the prompt reads).
Scores and decisions depend on the prefix alone (never on codes, chunking, batching or which
request wrote a token), so a kept token is a property of its KV slot, shareable through a radix
cache like its codes, and the same prompt gets the same set cold, warm or chunked. A token is
exact anyway until its block is decided (``block + lookahead <= recent``, checked), so the rule
is: a query at ``i`` reads ``j`` exactly iff the window rule says so, or ``j`` is kept and the
layer is at or after the deciding one.

Bits: a kept (token, head) stores its key and value at 16 bits and one 4-byte position, on top
of its codes (kept so the selection can change without re-encoding): over a prompt of ``T``
tokens that adds ``budget / T * (16 + 16 / d)`` bits per element on each side (a shared set
needs one position per token, not per head: counted as per head, an over-count of at most
``budget / T * 16 / d``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import EXACT_FORMATS

RULES = ("obs", "echo", "both")
ECHO_SKIP = 1  # the first prompt token is the attention sink: no echo selection reads it
ECHO_WINDOW = 65  # an echo score counts above the median of the 65 positions around it
POSITION_BITS = 32  # one int32 position per kept (token, KV head), shared by its key and value


@dataclass(frozen=True)
class SalientSpec:
    """``budget`` kept positions per (layer, KV head), or, ``shared``, one set of ``budget``
    positions per request kept in every layer and head (the unit a serving pool's exact store
    keeps: a slot's entry holds all layers and heads); ``obs`` observation queries; ``pool`` the
    max-pool width (odd)."""

    budget: int
    obs: int = 32
    pool: int = 7
    shared: bool = False
    after: int | None = None  # asymmetric pooling: a token within ``after`` positions past a peak
    rule: str = "obs"  # "obs" | "echo" (:func:`echo_scores`) | "both": half the budget each
    block: int | None = None  # streaming: keep ``budget`` of every ``block`` positions (echo, shared)
    layer: int = 0  # streaming: decided at this layer from the echo of layers 0..layer, read from it on

    def __post_init__(self):
        if self.rule not in RULES:
            raise ValueError(f"salient rule {self.rule!r}: allowed {RULES}")
        if self.block is not None and (self.rule != "echo" or not self.shared or not 0 < self.budget <= self.block):
            raise ValueError(f"a streaming salient spec (block) needs the echo rule, one shared set and "
                             f"0 < budget <= block, got {self}")
        if self.layer < 0 or (self.layer and self.block is None):
            raise ValueError(f"a deciding layer needs a streaming spec (block) and layer >= 0, got {self}")
        if self.budget < 0 or self.obs < 1 or self.pool < 1 or self.pool % 2 == 0:
            raise ValueError(f"salient spec needs budget >= 0, obs >= 1 and an odd pool >= 1, got {self}")
        if self.after is not None and self.after < 0:
            raise ValueError(f"salient spec needs after >= 0, got {self}")

    @property
    def lookahead(self) -> int:
        """Positions past ``p`` whose scores the streaming score of ``p`` reads (the running
        median's half window, and the pool's reach ahead)."""
        return ECHO_WINDOW // 2 + self.reach[0]

    def check_windows(self, sink: int, recent: int) -> None:
        """A streaming spec needs every token exact until its block is decided."""
        if self.block is not None and self.block + self.lookahead > recent:
            raise ValueError(f"salient blocks of {self.block} positions are decided {self.lookahead} positions "
                             f"after they end: that needs a recent window >= {self.block + self.lookahead}, got {recent}")

    @property
    def reach(self) -> tuple[int, int]:
        """(before, after): a position is scored by the best peak from ``before`` positions ahead of
        it to ``after`` positions behind it (symmetric ``pool // 2`` unless ``after`` is set, then
        one position ahead: a needle's value follows the words the question attends to)."""
        return (self.pool // 2, self.pool // 2) if self.after is None else (1, self.after)


def candidates(T: int, sink: int, recent: int) -> tuple[int, int]:
    """[lo, hi): the positions the query at ``T - 1`` reads from codes (empty: lo >= hi)."""
    return min(sink, T), max(min(sink, T), T - recent)


def token_scores(probs: torch.Tensor, reach) -> torch.Tensor:
    """probs [H, G, w, T] (softmax rows of w observation queries of each of the G query heads
    sharing a KV head) -> [H, T] summed attention s, max-pooled: position p scores
    max s[p - after : p + before + 1] for ``reach = (before, after)`` (an int ``pool``: symmetric)."""
    return pooled(probs.float().sum((1, 2)), reach)


def echo_span(sink: int) -> tuple[int, int]:
    """[lo, hi): the prompt's head that an echo selection reads: the sink window without its
    first token (the attention sink every query leans on, whatever it asks)."""
    return min(ECHO_SKIP, sink), sink


def echo_scores(probs: torch.Tensor, sink: int) -> torch.Tensor:
    """probs [H, G, c, T] (softmax rows of the queries at c consecutive positions) -> [H, c]: the
    attention each position's own query pays to the prompt's head (:func:`echo_span`), summed
    over the query heads of each KV head.

    The question-first rule (a question before the document): the selection's last queries
    cannot see what is asked, but the document's tokens that match it do look back at it (a
    needle's key words attend to the same words in the question); with a forward reach the
    needle's value, which follows them, is kept."""
    lo, hi = echo_span(sink)
    return probs[..., lo:hi].float().sum((1, 3))


def window_echo(scores: torch.Tensor, exact: torch.Tensor, cols: torch.Tensor, sink: int) -> torch.Tensor:
    """scores [H, G, c, m] (logits of c queries over the keys at positions ``cols`` [m]), exact
    [c, m] bool (the pairs the window rule reads exactly, causal) -> [H, c]: each query's softmax
    over its exact keys only, summed over the prompt's head (:func:`echo_span`) and over the query
    heads of each KV head. Reads no code: the same whatever the codes, the chunking or the cache."""
    lo, hi = echo_span(sink)
    p = torch.softmax(scores.float().masked_fill(~exact, float("-inf")), -1)
    span = (cols >= lo) & (cols < hi)
    return p[..., span].sum((1, 3))


def query_echo(q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor, cols: torch.Tensor, sink: int, recent: int,
               scale: float, block: int = 256) -> torch.Tensor:
    """q [c, Hq, d] (post-RoPE queries at positions ``q_pos`` [c]), k [m, H, d] (the exact
    post-RoPE keys at positions ``cols`` [m]: at least each query's sink and recent window) ->
    [c, H] :func:`window_echo` of each query (fp32 logits ``scale * q . k``; queries in blocks,
    each against the columns some query of its block reads exactly: the sink and its recent
    windows, not the whole prompt a one-chunk prefill passes)."""
    from .windows import query_window

    c, Hq, d = q.shape
    H = k.shape[1]
    kh = k.float().permute(1, 2, 0)  # [H, d, m]
    out = torch.empty(c, H, dtype=torch.float32, device=q.device)
    for a in range(0, c, block):
        b = min(c, a + block)
        qp = q_pos[a:b]
        lo, hi = int(qp.min()) + 1 - recent, int(qp.max())
        use = (cols < sink) | ((cols >= lo) & (cols <= hi))
        cb, kb = (cols, kh) if bool(use.all()) else (cols[use], kh[:, :, use])
        E = query_window(qp, cb, sink, recent) & (cb[None] <= qp[:, None])
        qh = q[a:b].float().view(b - a, H, Hq // H, d).permute(1, 2, 0, 3).reshape(H, -1, d)  # [H, G*n, d]
        S = torch.bmm(qh * scale, kb).view(H, Hq // H, b - a, -1)
        out[a:b] = window_echo(S, E, cb, sink).T
    return out


def block_horizon(k: int, spec: SalientSpec) -> int:
    """Tokens that must be scored before block ``k`` is decided: its end plus the lookahead."""
    return (k + 1) * spec.block + spec.lookahead


def decided_blocks(upto: int, spec: SalientSpec) -> int:
    """How many blocks are decided once the first ``upto`` tokens are scored."""
    return max(0, (upto - spec.lookahead) // spec.block)


def decide_blocks(rows: torch.Tensor, upto: int, start: int, sink: int, spec: SalientSpec) -> torch.Tensor:
    """rows [X, >= upto] (the streaming echo of every token, one row per (layer, KV head) of the
    layers up to the deciding one: :func:`window_echo`; a 1-D tensor is one row) -> the kept
    positions (ascending) of blocks ``start`` .. ``decided_blocks(upto) - 1``: each block's
    ``budget`` best positions ``>= sink`` by the score each row gives after its running median is
    taken out and it is pooled, summed over rows (ties to the lower position). Block k reads
    ``rows[:, : block_horizon(k)]`` only."""
    n = decided_blocks(upto, spec)
    if n <= start:
        return torch.empty(0, dtype=torch.long)
    rows = rows[None] if rows.dim() == 1 else rows
    # only what blocks start.. read: from their first position less the pool's reach back and the
    # median's half window (the edges replicated by above_local_median are then never read)
    a0 = max(0, start * spec.block - spec.reach[1] - ECHO_WINDOW // 2)
    c = pooled(above_local_median(rows[:, a0:upto].float()), spec.reach).sum(0)
    out = []
    for k in range(start, n):
        lo, hi = max(k * spec.block, sink), (k + 1) * spec.block
        if hi <= lo:
            continue
        order = torch.sort(-c[lo - a0:hi - a0], stable=True).indices[: spec.budget]
        out.append(torch.sort(order + lo).values)
    return torch.cat(out) if out else torch.empty(0, dtype=torch.long)


def above_local_median(s: torch.Tensor, window: int = ECHO_WINDOW) -> torch.Tensor:
    """s [H, T] -> s minus its running median over ``window`` positions (odd; edges replicated).

    How much every token of a stretch looks back at the prompt's head drifts with distance and
    with the text; an echo is a peak above that drift. (Without it the selection goes to the
    stretch nearest the head: at 2k, recall of the needle's value tokens 18% against 71%.)"""
    if window < 1 or window % 2 == 0:
        raise ValueError(f"running median window must be odd and >= 1, got {window}")
    r = window // 2
    x = torch.nn.functional.pad(s[:, None].float(), (r, r), mode="replicate")[:, 0]
    return s - x.unfold(1, window, 1).median(-1).values


def pooled(s: torch.Tensor, reach) -> torch.Tensor:
    """s [H, T] -> max-pooled by ``reach`` (see :func:`token_scores`)."""
    before, after = (reach // 2, reach // 2) if isinstance(reach, int) else reach
    if before or after:
        padded = torch.nn.functional.pad(s[:, None], (after, before), value=float("-inf"))
        s = torch.nn.functional.max_pool1d(padded, before + after + 1, stride=1)[:, 0]
    return s


def top_positions(scores: torch.Tensor, sink: int, recent: int, budget: int) -> torch.Tensor:
    """scores [X, T] -> [X, B] best candidate positions per row (ascending), B = min(budget,
    candidates); ties to the lower position."""
    X, T = scores.shape
    lo, hi = candidates(T, sink, recent)
    B = max(0, min(budget, hi - lo))
    if B == 0:
        return torch.empty(X, 0, dtype=torch.long)
    order = torch.sort(-scores[:, lo:hi], dim=1, stable=True).indices[:, :B]  # stable: ties to the lower
    return torch.sort(order + lo, dim=1).values


def select(probs: torch.Tensor, sink: int, recent: int, spec: SalientSpec) -> torch.Tensor:
    """[H, B] kept positions of one layer (ascending per head), chosen from the observation
    probabilities ``probs`` [H, G, w, T] of a selection point at ``T``."""
    return top_positions(token_scores(probs, spec.reach), sink, recent, spec.budget)


def top_union(first: torch.Tensor, second: torch.Tensor | None, sink: int, recent: int,
              budget: int) -> torch.Tensor:
    """scores [X, T] -> [X, B] kept positions per row (ascending): the best ``budget`` by
    ``first``; with ``second``, the best ``budget - budget // 2`` by ``first`` and the best
    ``budget // 2`` of the other candidates by ``second`` (B = min(budget, candidates))."""
    if second is None:
        return top_positions(first, sink, recent, budget)
    lo, hi = candidates(first.shape[1], sink, recent)
    a = top_positions(first, sink, recent, budget - budget // 2)
    rest = min(budget // 2, max(0, hi - lo) - a.shape[1])
    masked = second.float().scatter(1, a, float("-inf"))
    return torch.sort(torch.cat([a, top_positions(masked, sink, recent, rest)], 1), dim=1).values


def select_shared(layer_scores, sink: int, recent: int, spec: SalientSpec, second=None) -> torch.Tensor:
    """[B] positions kept in every layer and head: the best of the pooled scores
    (:func:`token_scores`, [H, T] per layer) summed over layers and heads (each layer's rows sum
    to the same total, so layers weigh alike); ``second`` (the echo scores of rule "both"): half
    the budget by their sum (:func:`top_union`)."""
    def total(scores):
        return torch.stack([s.float() for s in scores]).sum((0, 1))[None]

    return top_union(total(layer_scores), None if second is None else total(second), sink, recent, spec.budget)[0]


def kept_mask(kept: torch.Tensor, T: int) -> torch.Tensor:
    """[H, T] bool: position p of head h is kept exact."""
    m = torch.zeros(kept.shape[0], T, dtype=torch.bool)
    return m.scatter_(1, kept.long(), True) if kept.numel() else m


FP8_MAX = 448.0  # largest finite float8_e4m3fn
#: how the exact copies (windows, kept tokens) are held: the served formats, and "res2" (the
#: token's own codes plus a 2-bit residual: :func:`res2_encode`; measured in the decode view only)
SIDE_FORMATS = (*EXACT_FORMATS, "res2")
RESIDUAL_FORMATS = ("res4", "res2")  # formats that complete the token's codes (they need its quantizer)
RES4_MAX = 7  # a residual element is a multiple of scale in [-7, 7], held as a nibble 1..15


def copy_bits(side: str, head_dim: int) -> float:
    """Bits per element of one exact copy: bf16, fp8 e4m3 with an fp16 scale per (token, KV
    head) (:func:`fp8_rows`), or a 4-bit (2-bit) residual over the token's codes with an fp16
    scale per (token, KV head) (:func:`res4_rows`, :func:`res2_rows`; the codes are counted as
    codes)."""
    if side not in SIDE_FORMATS:
        raise ValueError(f"side format {side!r}: allowed {SIDE_FORMATS}")
    return {"bf16": 16.0, "fp8": 8 + 16 / head_dim, "res4": 4 + 16 / head_dim, "res2": 2 + 16 / head_dim}[side]


def fp8_encode(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., d] -> (codes [..., d] uint8: float8_e4m3fn bits of x / scale, scale [...] fp16 =
    absmax / 448 per row): how an fp8 side buffer (the server's exact store) holds x."""
    scale = (x.float().abs().amax(-1) / FP8_MAX).clamp_min(2 ** -24).to(torch.float16)
    q = (x.float() / scale.float()[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(torch.uint8), scale


#: float8_e4m3fn code -> its value (f32), read by :func:`fp8_decode` as a table gather (several
#: times faster on a CPU than converting float8 elements, and the same values)
FP8_VALUES = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()


_FP8_TABLES = {"cpu": FP8_VALUES}  # the table per device, copied there once


def fp8_decode(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(codes [..., d] uint8, scale [...] fp16) of :func:`fp8_encode` -> [..., d] f32 (code x scale)."""
    table = _FP8_TABLES.get(str(codes.device))
    if table is None:
        table = _FP8_TABLES[str(codes.device)] = FP8_VALUES.to(codes.device)
    return torch.take(table, codes.long()) * scale.float()[..., None]


def fp8_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., d] -> x held as fp8 e4m3 with one fp16 scale per row (absmax / 448), read back
    in x's dtype: what an fp8 side buffer returns (:func:`fp8_encode`, :func:`fp8_decode`)."""
    return fp8_decode(*fp8_encode(x)).to(x.dtype)


def res4_encode(x: torch.Tensor, coded: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., d] and its codes' reading ``coded`` [..., d] (d even) -> (nibbles [..., d/2]
    uint8, scale [...] fp16): the residual ``x - coded`` rounded to a multiple of scale =
    absmax / 7 per row, each element as the nibble ``q + 8`` (1..15); channel ``2i`` in the low
    nibble of byte ``i``, ``2i + 1`` in the high one. The row reads back as ``coded + (nibble - 8)
    x scale`` (:func:`res4_decode`): what the codes missed, at 4.25 bits per element on top of them."""
    r = x.float() - coded.float()
    scale = (r.abs().amax(-1) / RES4_MAX).clamp_min(2 ** -24).to(torch.float16)
    q = (r / scale.float()[..., None]).round().clamp(-RES4_MAX, RES4_MAX).to(torch.int32) + 8
    return (q[..., 0::2] | (q[..., 1::2] << 4)).to(torch.uint8), scale


def res4_decode(nibbles: torch.Tensor, scale: torch.Tensor, coded: torch.Tensor) -> torch.Tensor:
    """(nibbles, scale) of :func:`res4_encode` and the same codes' reading -> [..., d] f32."""
    b = nibbles.to(torch.int32)
    q = torch.stack([b & 15, b >> 4], -1).flatten(-2) - 8
    return coded.float() + q.float() * scale.float()[..., None]


def res4_rows(x: torch.Tensor, coded: torch.Tensor) -> torch.Tensor:
    """x [..., d] as a res4 side buffer returns it (codes + 4-bit residual), in x's dtype."""
    return res4_decode(*res4_encode(x, coded), coded).to(x.dtype)


def side_bits(budget: int, T: int, head_dim: int, side: str = "bf16") -> float:
    """Bits per element each side (keys, values) spends on kept tokens over a prompt of T."""
    return min(budget, T) / T * (copy_bits(side, head_dim) + POSITION_BITS / 2 / head_dim)


def window_bits(sink: int, recent: int, T: int, side: str = "bf16", head_dim: int = 64) -> float:
    """Bits per element each side the exact windows add over a prompt of T tokens (bf16 copies,
    or fp8 ones: :func:`copy_bits`)."""
    return min(sink + recent, T) / T * copy_bits(side, head_dim)


#: the residual levels of :func:`res2_encode`, in units of the row's RMS: the four-level Lloyd-Max
#: quantizer of a unit Gaussian (levels +-0.4528, +-1.5104; cuts at 0 and +-0.9816)
RES2_LEVELS = torch.tensor([-1.5104, -0.4528, 0.4528, 1.5104])
RES2_CUTS = torch.tensor([-0.9816, 0.0, 0.9816])


def res2_encode(x: torch.Tensor, coded: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., d] and its codes' reading ``coded`` [..., d] (d a multiple of 4) -> (crumbs
    [..., d/4] uint8, scale [...] fp16): the residual ``x - coded`` per row as the nearest of
    four levels (:data:`RES2_LEVELS`) times scale = the row's RMS, each element a 2-bit index;
    channel ``4i + j`` in bits ``2j..2j+1`` of byte ``i``. 2.25 bits per element on top of the
    codes (:func:`res2_decode` reads it back)."""
    r = x.float() - coded.float()
    scale = r.pow(2).mean(-1).sqrt().clamp_min(2 ** -24).to(torch.float16)
    q = torch.bucketize(r / scale.float()[..., None], RES2_CUTS.to(r.device)).to(torch.int32)
    q = q.unflatten(-1, (-1, 4))
    return (q[..., 0] | (q[..., 1] << 2) | (q[..., 2] << 4) | (q[..., 3] << 6)).to(torch.uint8), scale


def res2_decode(crumbs: torch.Tensor, scale: torch.Tensor, coded: torch.Tensor) -> torch.Tensor:
    """(crumbs, scale) of :func:`res2_encode` and the same codes' reading -> [..., d] f32."""
    b = crumbs.to(torch.int64)
    q = torch.stack([(b >> s) & 3 for s in (0, 2, 4, 6)], -1).flatten(-2)
    return coded.float() + RES2_LEVELS.to(coded.device)[q] * scale.float()[..., None]


def res2_rows(x: torch.Tensor, coded: torch.Tensor) -> torch.Tensor:
    """x [..., d] as a res2 side buffer returns it (codes + 2-bit residual), in x's dtype."""
    return res2_decode(*res2_encode(x, coded), coded).to(x.dtype)


def residual_rows(fmt: str, x: torch.Tensor, coded: torch.Tensor) -> torch.Tensor:
    """x held as the residual format ``fmt`` (:data:`RESIDUAL_FORMATS`) over its codes' reading."""
    rows = {"res4": res4_rows, "res2": res2_rows}.get(fmt)
    if rows is None:
        raise ValueError(f"residual format {fmt!r}: allowed {RESIDUAL_FORMATS}")
    return rows(x, coded)
