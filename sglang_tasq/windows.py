"""The full-precision window rule, and the slot-keyed store that serves it in the SGLang pool.

The rule (one definition; the pool, the kernels, the HF cache and the benches follow it): a
query at position ``i`` reads the key/value at position ``j <= i`` at full precision iff

    j < sink  or  j >= i + 1 - recent

and from its codes otherwise. It depends on positions only, never on which request wrote a
token, in how many chunks, or whether it came from the radix cache: so the same request gets
the same answer cold, warm, chunked, batched or after a retraction. For a decode step at
sequence length ``S`` the query sits at ``i = S - 1``: ``j < sink or j >= S - recent``.

:class:`ExactStore` keeps the exact (bf16 or fp8, pre-RoPE) copies keyed by **KV slot**, the unit
SGLang shares through its radix cache: a slot's entry is shared with every request whose
prefix holds that slot, exactly like its codes. Entries are made when a token is written
inside the window of the forward that writes it, refreshed whenever a slot is rewritten (so a
reused slot never serves an old token's values), pinned while a live request's window
covers them, and otherwise kept so that a later request matching the prefix finds its sink and
the tail before its match boundary: when the store is full it evicts first the entries an extend
left behind (:meth:`ExactStore.demote`: they serve only a match ending inside that prompt), then
the other window entries, then the salient tokens' (each oldest first); its room for finished
sequences is ``SGLANG_TASQ_CACHED_WINDOWS`` (:func:`store_entries`). A prefix match is only accepted up to
the longest boundary whose window entries are all present (:func:`exact_prefix_limit`); the
rest is recomputed, never read from codes.
"""
from __future__ import annotations

import torch


def in_window(positions: torch.Tensor, seq_len, sink: int, recent: int) -> torch.Tensor:
    """[T] bool: key positions read at full precision by a query at position ``seq_len - 1``
    (``seq_len`` an int or a [T] tensor, the kv length the query sees)."""
    return (positions < sink) | (positions >= seq_len - recent)


def query_window(q_pos: torch.Tensor, k_pos: torch.Tensor, sink: int, recent: int) -> torch.Tensor:
    """[Tq, S] bool: query at q_pos[i] reads key k_pos[j] exactly (causality not applied)."""
    return (k_pos[None, :] < sink) | (k_pos[None, :] >= q_pos[:, None] + 1 - recent)


def window_columns(a: int, b: int, sink: int, recent: int) -> torch.Tensor:
    """[m] ascending key positions that some query at a position in ``[a, b)`` reads exactly
    (``j < b``): the sink, and everything from the first query's recent window on."""
    lo = max(0, a + 1 - recent)
    return torch.cat([torch.arange(0, min(sink, lo)), torch.arange(lo, b)])


def exact_prefix_limit(has_exact: torch.Tensor, sink: int, recent: int, kept: torch.Tensor | None = None) -> int:
    """Longest usable prefix ``P' <= P`` of a matched prefix of ``P`` tokens whose entry
    presence is ``has_exact`` [P] bool: the first recomputed query sits at position ``P'`` and
    needs the entries of ``j < min(sink, P')`` and of ``P' + 1 - recent <= j < P'``, and of every
    kept (salient) position ``j < P'`` (``kept`` [P] bool)."""
    P = int(has_exact.numel())
    if P == 0:
        return 0
    if kept is not None:
        lost = torch.nonzero(kept.to(torch.bool).cpu() & ~has_exact.to(torch.bool).cpu())
        if lost.numel():
            P = int(lost[0])
            has_exact = has_exact[:P]
            if P == 0:
                return 0
    miss = ~has_exact.to(torch.bool).cpu()
    sink_miss = torch.nonzero(miss[: min(sink, P)])
    if sink_miss.numel():
        return int(sink_miss[0])
    # missing positions past the sink: P' is valid iff none lies in [max(sink, P'+1-recent), P')
    cs = torch.zeros(P + 1, dtype=torch.int64)
    cs[1:] = torch.cumsum(miss.to(torch.int64), 0)
    cand = torch.arange(P + 1)
    lo = torch.clamp(cand + 1 - recent, min=min(sink, P)).clamp(max=P)
    lo = torch.minimum(lo, cand)
    ok = (cs[cand] - cs[lo]) == 0
    return int(torch.nonzero(ok)[-1])


#: bytes per KV slot of the exact store's slot -> entry index (int64), charged with the codes
SLOT_INDEX_BYTES = 8


def store_entries(sink: int, recent: int, rows: int, cached: int = 0) -> int:
    """Entries of the exact store for ``rows`` concurrently running requests: each needs its
    sink, its own recent window, and (during an extend) the recent tail of the prefix before
    its chunk, so ``sink + 2 * recent``; plus ``sink + recent`` for each of ``cached`` finished
    sequences whose windows it keeps for later radix matches; 0 without windows."""
    if sink + recent == 0:
        return 0
    return max(1, int(rows)) * (sink + 2 * recent) + max(0, int(cached)) * (sink + recent)


def entry_bytes(num_kv_heads: int, head_dim: int, num_layers: int, fmt: str = "bf16") -> int:
    """Bytes of one exact-store entry: keys + values of every layer (bf16; fp8 with an fp16 scale
    per KV head, ``fmt="fp8"``; two 4-bit residuals a byte with an fp16 scale per KV head,
    ``fmt="res4"``), owner, stamp, free list (8 bytes each), interior flag."""
    row = {"bf16": num_kv_heads * head_dim * 2, "fp8": num_kv_heads * (head_dim + 2),
           "res4": num_kv_heads * (head_dim // 2 + 2)}[fmt]
    return 2 * row * num_layers + 25


def salient_entries(cfg, num_slots: int, forward_tokens: int) -> int:
    """Entries the salient tokens (``cfg.salient_budget``) need on top of the windows: ``budget /
    block`` of every slot, and one per token a forward writes outside its request's recent window
    (each token holds an entry until its block is decided; the window's are counted with the
    windows): ``forward_tokens - recent`` at most; 0 without."""
    if not cfg.salient_budget:
        return 0
    return -(-int(num_slots) * cfg.salient_budget // cfg.salient_block) + max(0, int(forward_tokens) - cfg.recent_window)


def echo_row_width(cfg, num_kv_heads: int) -> int:
    """fp16 echo scores per slot with salient tokens: one per (layer up to the deciding one, KV head)."""
    return (cfg.salient_layer + 1) * num_kv_heads if cfg.salient_budget else 0


def salient_bytes_per_token(cfg, num_kv_heads: int, head_dim: int, num_layers: int) -> int:
    """Bytes per token slot the salient tokens add: their share of exact entries (rounded up), the
    slot's echo scores (fp16) and its kept flag."""
    if not cfg.salient_budget:
        return 0
    share = -(-cfg.salient_budget * entry_bytes(num_kv_heads, head_dim, num_layers, cfg.exact_format)
              // cfg.salient_block)
    return share + 2 * echo_row_width(cfg, num_kv_heads) + 1


def cell_bytes(cfg, num_kv_heads: int, head_dim: int, num_layers: int) -> int:
    """Bytes per token slot the plugin reports to SGLang's pool sizing: the packed codes and
    scale, the slot's exact-store index, and with salient tokens their per-slot share."""
    from .packing import bytes_per_token

    return (bytes_per_token(cfg, num_kv_heads, head_dim, num_layers) + SLOT_INDEX_BYTES
            + salient_bytes_per_token(cfg, num_kv_heads, head_dim, num_layers))


def store_bytes(cfg, num_kv_heads: int, head_dim: int, num_layers: int, rows: int, forward_tokens: int = 0,
                cached: int = 0) -> int:
    """Fixed bytes of the exact store for ``rows`` running requests and ``cached`` finished
    sequences' windows (and, with salient tokens, the
    entries of one forward's new tokens; their per-slot share is charged per token slot by
    :func:`salient_bytes_per_token`): keys + values of every layer (``cfg.exact_format``) plus owner
    and stamp per entry, and its free list (the per-slot index is :data:`SLOT_INDEX_BYTES`, charged
    per slot)."""
    E = store_entries(cfg.sink_window, cfg.recent_window, rows, cached) + salient_entries(cfg, 0, forward_tokens)
    return (E + 1) * entry_bytes(num_kv_heads, head_dim, num_layers, cfg.exact_format) - 8


class ExactStoreFull(RuntimeError):
    """More window entries are pinned by live requests than the store holds."""


class ExactStore:
    """Exact K/V copies for ``num_entries`` KV slots, keyed by slot (entry 0 = none).

    ``k[l]``, ``v[l]``: [E + 1, H, d] (keys pre-RoPE): bf16, or with ``fmt="fp8"`` uint8
    float8_e4m3fn bits with one fp16 scale per (entry, KV head) in ``k_scale[l]``/``v_scale[l]``
    [E + 1, H] (:func:`sglang_tasq.salient.fp8_encode`; None for bf16), or with ``fmt="res4"``
    [E + 1, H, d / 2] uint8 nibbles of the residual over the slot's own codes, with their scales
    likewise (:func:`sglang_tasq.salient.res4_encode`): writing and reading such an entry needs
    what the slot's codes read as, ``coded(layer, slots, values=True) -> (pre-RoPE keys, values)
    [n, H, d] f32`` (the pool's reference decode; ``values=False``: keys only, values None). Write with :meth:`write`,
    read with :meth:`read` (f32), so every reader sees one rounding. ``entry_of`` [num_slots] int64
    slot -> entry; ``owner`` [E + 1] entry -> slot (-1 free); ``stamp`` [E + 1] the clock of last
    use; ``interior`` [E + 1] entries :meth:`demote` d. Eviction runs only when the free list is empty:
    never a pinned entry or one used at the current clock; interior entries first, then the other
    window entries, then those of kept slots, each oldest first.
    """

    def __init__(self, num_slots: int, num_entries: int, num_layers: int, num_heads: int, head_dim: int,
                 device="cpu", fmt: str = "bf16", coded=None):
        from .config import EXACT_FORMATS

        if fmt not in EXACT_FORMATS:
            raise ValueError(f"exact store format {fmt!r}: allowed {EXACT_FORMATS}")
        if fmt == "res4" and coded is None:
            raise ValueError("exact store format 'res4' holds residuals over the slots' codes: pass coded=")
        E = int(num_entries)
        self.capacity, self.fmt, self.coded = E, fmt, coded
        dtype = torch.bfloat16 if fmt == "bf16" else torch.uint8
        width = head_dim // 2 if fmt == "res4" else head_dim
        self.k = [torch.zeros(E + 1, num_heads, width, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(E + 1, num_heads, width, dtype=dtype, device=device) for _ in range(num_layers)]
        self.k_scale = self.v_scale = None
        if fmt != "bf16":
            self.k_scale, self.v_scale = ([torch.zeros(E + 1, num_heads, dtype=torch.float16, device=device)
                                           for _ in range(num_layers)] for _ in range(2))
        self.entry_of = torch.zeros(num_slots, dtype=torch.int64, device=device)
        # salient tokens: a slot whose token its prefix chose to keep exact (read exactly by every
        # later query from the deciding layer on); a property of the slot, reset when it is rewritten
        self.kept = torch.zeros(num_slots, dtype=torch.uint8, device=device)
        self.owner = torch.full((E + 1,), -1, dtype=torch.int64, device=device)
        self.stamp = torch.zeros(E + 1, dtype=torch.int64, device=device)
        # an entry its request's extend left behind (outside its sink and its next query's window):
        # it serves only a later match ending near it, so it is evicted before the sink and tail
        # that a match of the whole cached sequence (or of its prompt) needs
        self.interior = torch.zeros(E + 1, dtype=torch.bool, device=device)
        self.clock = 1
        self._free = torch.arange(E, 0, -1, dtype=torch.int64, device=device)  # pop from the end
        self._nfree = E
        self.evictions = 0

    def nbytes(self) -> int:
        t = sum(x.numel() * x.element_size() for x in self.k + self.v + (self.k_scale or []) + (self.v_scale or []))
        return (t + sum(x.numel() * 8 for x in (self.entry_of, self.owner, self.stamp, self._free)) + self.kept.numel()
                + self.interior.numel())

    # ---- contents ------------------------------------------------------------------------
    def held(self, x: torch.Tensor, coded: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., H, d] as this store returns it after a write (f32): one rounding for every
        reader (``fmt="res4"``: over ``coded``, what x's codes read as)."""
        from .salient import fp8_decode, fp8_encode, res4_rows

        if self.fmt == "bf16":
            return x.to(torch.bfloat16).float()
        if self.fmt == "res4":
            return res4_rows(x.float(), coded)
        return fp8_decode(*fp8_encode(x))

    def write(self, layer: int, ent: torch.Tensor, k_pre: torch.Tensor, v: torch.Tensor, coded=None) -> None:
        """Store pre-RoPE keys and values [n, H, d] of local layer ``layer`` in entries ``ent`` [n]
        (> 0; entry 0 is never read). ``fmt="res4"``: ``coded`` = what the tokens' codes read as
        ((pre-RoPE keys, values) [n, H, d], the pool's decode of the codes just written)."""
        from .salient import fp8_encode, res4_encode

        dev = self.k[layer].device
        if self.fmt == "bf16":
            self.k[layer][ent] = k_pre.to(dev, torch.bfloat16)
            self.v[layer][ent] = v.to(dev, torch.bfloat16)
            return
        if self.fmt == "res4":
            if coded is None:
                raise ValueError("a res4 store writes residuals over the tokens' codes: pass coded=")
            (kn, ks), (vn, vs) = (res4_encode(x.to(dev, torch.float32), c.to(dev, torch.float32))
                                  for x, c in ((k_pre, coded[0]), (v, coded[1])))
        else:
            codes, scale = fp8_encode(torch.stack([k_pre.to(dev, torch.float32), v.to(dev, torch.float32)]))
            (kn, vn), (ks, vs) = codes, scale
        self.k[layer][ent], self.v[layer][ent] = kn, vn
        self.k_scale[layer][ent], self.v_scale[layer][ent] = ks, vs

    def read(self, layer: int, ent: torch.Tensor, coded=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(pre-RoPE keys, values) [n, H, d] f32 of entries ``ent`` [n] of local layer ``layer``.
        ``coded``: (keys, values) [n, H, d], what the entries' slots' codes read as, when the
        caller has them already (a res4 store completes those instead of decoding them again)."""
        if self.fmt == "res4":
            kc, vc = coded if coded is not None else self.coded(layer, self.owner[ent])
            return (self._read(self.k, self.k_scale, layer, ent, kc),
                    self._read(self.v, self.v_scale, layer, ent, vc))
        return self.read_k(layer, ent), self._read(self.v, self.v_scale, layer, ent)

    def read_k(self, layer: int, ent: torch.Tensor) -> torch.Tensor:
        """Pre-RoPE keys [n, H, d] f32 of entries ``ent`` of local layer ``layer``."""
        if self.fmt == "res4":  # (the window echo reads keys only: values' codes not decoded)
            return self._read(self.k, self.k_scale, layer, ent, self.coded(layer, self.owner[ent], values=False)[0])
        return self._read(self.k, self.k_scale, layer, ent)

    def _read(self, buf, sbuf, layer: int, ent: torch.Tensor, coded=None) -> torch.Tensor:
        from .salient import fp8_decode, res4_decode

        if self.fmt == "bf16":
            return buf[layer][ent].float()
        if self.fmt == "res4":
            return res4_decode(buf[layer][ent], sbuf[layer][ent], coded)
        return fp8_decode(buf[layer][ent], sbuf[layer][ent])

    def tick(self) -> None:
        self.clock += 1

    def used(self) -> int:
        return self.capacity - self._nfree

    def lookup(self, slots: torch.Tensor) -> torch.Tensor:
        return self.entry_of[slots]

    def touch(self, slots: torch.Tensor) -> None:
        e = self.entry_of[slots]
        self.stamp[e[e > 0]] = self.clock

    def demote(self, slots: torch.Tensor, interior: bool = True) -> None:
        """Mark the entries of ``slots`` interior (evicted first; see ``interior``) until rewritten,
        or (``interior=False``) restore them to the other window entries."""
        e = self.entry_of[slots]
        self.interior[e[e > 0]] = interior

    def release_slots(self, slots: torch.Tensor) -> None:
        """Drop the entries of ``slots`` (freed, or rewritten outside every window)."""
        e = self.entry_of[slots]
        e = e[e > 0]
        if e.numel():
            e = torch.unique(e)
            self.entry_of[self.owner[e]] = 0
            self.owner[e] = -1
            self._push(e)
        self.entry_of[slots] = 0

    def assign(self, slots: torch.Tensor, keep: torch.Tensor, pinned=None) -> torch.Tensor:
        """Entries for the new tokens at ``slots`` [T] (unique): a fresh or refreshed entry where
        ``keep``, none (and any old one dropped) elsewhere -> entries [T] (0 = not kept).
        ``pinned()`` -> slots that must not be evicted (called only when eviction is needed)."""
        keep = keep.to(torch.bool)
        self.kept[slots] = 0  # new tokens: not kept until their block is decided
        if bool((~keep).any()):
            self.release_slots(slots[~keep])
        old = self.entry_of[slots]
        need = keep & (old == 0)
        n = int(need.sum())
        if n:
            if n > self._nfree:
                self._evict(n - self._nfree, pinned, protect=slots[keep])
            new = self._pop(n)
            s = slots[need]
            self.entry_of[s] = new
            self.owner[new] = s
        ent = torch.where(keep, self.entry_of[slots], torch.zeros_like(old))
        self.stamp[ent[keep]] = self.clock
        self.interior[ent[keep]] = False
        return ent

    def _pop(self, n: int) -> torch.Tensor:
        out = self._free[self._nfree - n: self._nfree].flip(0).clone()
        self._nfree -= n
        return out

    def _push(self, e: torch.Tensor) -> None:
        n = e.numel()
        if self._nfree + n > self._free.numel():
            raise RuntimeError("tasq: exact store free list overflow (an entry was released twice)")
        self._free[self._nfree: self._nfree + n] = e
        self._nfree += n
        self.interior[e] = False

    def _evict(self, n: int, pinned, protect: torch.Tensor) -> None:
        E = self.capacity
        used = self.owner[1:] >= 0
        keep = torch.zeros(E + 1, dtype=torch.bool, device=self.owner.device)
        pins = pinned() if pinned is not None else None
        for s in (pins, protect):
            if s is not None and s.numel():
                e = self.entry_of[s]
                keep[e[e > 0]] = True
        keep |= self.stamp >= self.clock
        cand = torch.nonzero(used & ~keep[1:]).flatten() + 1
        if cand.numel() < n:
            raise ExactStoreFull(
                f"tasq: the full-precision window store ({E} entries) is full: {n} more needed, "
                f"{cand.numel()} evictable; raise SGLANG_TASQ_WINDOW_ROWS or lower --max-running-requests")
        # interior entries, then the other window entries, then those of kept (salient) slots
        # (paid for per slot; losing one cuts every cached prefix that holds it), each oldest first;
        # evict a little more than needed (never an extra kept one) so that eviction does not run
        # every step
        kept = (self.kept[self.owner[cand]] > 0).to(torch.int64)
        rank = torch.where(kept > 0, 2, torch.where(self.interior[cand], 0, 1))
        take = max(n, min(E // 16, cand.numel() - int(kept.sum())))
        order = torch.argsort(self.stamp[cand] + rank * (self.clock + 1), stable=True)
        victims = cand[order[:take]]
        self.entry_of[self.owner[victims]] = 0
        self.owner[victims] = -1
        self._push(victims)
        self.evictions += int(take)
