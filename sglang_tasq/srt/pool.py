"""TaSQ KV pool for SGLang: packed VQ codes per token slot plus slot-keyed full-precision windows.

Per layer and token slot (``rows = size + page_size``; slot 0 absorbs padding writes):

- ``k_buffer[l]``: uint8 ``[rows, Bk + Bs]``: the packed key codes of all heads (code
  ``n = h*Gk + j``, :func:`codec.pack_codes` layout) followed by the fp16 shared scale
  (``Bs = 2``; ``2*scale_groups`` for one scale per group of heads, ``2*H`` for per-head
  scales, 0 without).
- ``v_buffer[l]``: uint8 ``[rows, Bv]``: the packed value codes.

With a per-layer key rate (``config.mix_layers``) ``Bk`` is the layer's own (``code_bytes_k_of[l]``,
key groups ``gk_of[l]``, code bits ``bits_k_of[l]``); ``code_bytes_k`` is the main rate's.

SmolLM2 (H=3, d=64, g=8, K=1024): 30 + 2 + 30 = 62 bytes per token per layer vs 768 in bf16.

Full-precision windows follow the one rule of :mod:`sglang_tasq.windows` (a query at position
``i`` reads ``j`` exactly iff ``j < sink`` or ``j >= i + 1 - recent``), whoever wrote the token:
the exact copies (bf16, or fp8 with an fp16 scale per token and head: ``config.exact_format``)
live in an :class:`windows.ExactStore` keyed by slot (``exact.k[l]``, ``exact.v[l]`` ``[E + 1, H,
d]``, ``exact.entry_of[slot]``), so they are shared through the radix
cache exactly like the codes. ``E`` is sized for every request row SGLang can run at once
(``options.rows()`` requests x (sink + 2 recent): a chunk's own window plus the prefix tail its
queries read) and charged to the memory budget by the plugin (:func:`windows.store_bytes`); entries
no live request needs stay in LRU order for later prefix matches, and a prefix match is cut
where an entry it needs is gone (``plugin``'s match hook), so nothing is ever served from codes
that the rule says is exact.

Salient tokens (``config.salient_budget``, the streaming echo rule of :mod:`sglang_tasq.salient`):
each slot also holds its token's window echo of layers ``0..salient_layer`` (``echo_rows``, fp16
``[rows, (salient_layer + 1) * H]``) and a kept flag (``exact.kept``); every new token holds an
exact entry until its block is decided (at the deciding layer of the forward that reaches the
block's horizon, :meth:`decide_salient`); kept slots keep theirs, pinned while a live request
holds them and in LRU order after, and layers from the deciding one on read them exactly. Scores,
decisions and flags depend on the prefix alone, so they are shared through the radix cache like
the codes; a match is cut before a kept slot whose entry is gone.
"""
from __future__ import annotations

import torch
from sglang.srt.mem_cache.memory_pool import KvBufferDesc, MHATokenToKVPool, unwrap_write_loc

from numba_kernels import fastpath

from .. import codec, packing, windows
from ..options import ServeOptions
from ..rope import apply_rope


def bind(artifact, options: ServeOptions) -> type:
    """The pool class handed to SGLang's KV configurator (which instantiates the class it gets,
    with its own arguments), with this artifact and these options bound."""

    class BoundTaSQTokenToKVPool(TaSQTokenToKVPool):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, artifact=artifact, options=options, **kwargs)

    return BoundTaSQTokenToKVPool


class TaSQTokenToKVPool(MHATokenToKVPool):
    """MHATokenToKVPool whose per-slot storage is packed TaSQ codes (see module docstring).

    ``artifact``: the loaded, validated artifact (codebooks + config); ``options``: the
    :class:`ServeOptions` of this server (``options.rows()`` requests' windows in the exact
    store, ``options.cpu_kernels``); the rest are SGLang's ``MHATokenToKVPool`` arguments."""

    def __init__(self, *args, artifact, options: ServeOptions, **kwargs):
        self.artifact, self.options = artifact, options
        super().__init__(*args, **kwargs)

    def _create_buffers(self):
        art = self.artifact
        self.codebooks = art.codebooks
        self.tasq_config = cfg = art.config
        H, d = self.head_num, self.head_dim
        if self.codebooks.num_kv_heads != H or self.codebooks.head_dim != d:
            raise RuntimeError(f"tasq: this rank's pool holds {H} KV heads of {d} dims, its codebooks "
                               f"{self.codebooks.num_kv_heads} of {self.codebooks.head_dim}")
        self.gv = d // cfg.group_size_v
        self.code_bytes_k, self.scale_bytes, self.code_bytes_v = packing.row_bytes(cfg, H, d)
        # per layer (a per-layer key rate, cfg.mix_layers, gives some layers other key groups and
        # code widths): key groups, key code bits, key code bytes of local layer lid
        layers = [self.start_layer + lid for lid in range(self.layer_num)]
        self.gk_of = [d // cfg.key_rate(l)[0] for l in layers]
        self.bits_k_of = [cfg.code_bits_k_at(l) for l in layers]
        self.code_bytes_k_of = [packing.row_bytes(cfg, H, d, l)[0] for l in layers]
        self.store_dtype = torch.uint8
        rows = self.size + self.page_size
        for name in ("k_scale_buffer", "v_scale_buffer", "native_k_scale_buffer", "native_v_scale_buffer",
                     "dq_k_buffer", "dq_v_buffer"):
            setattr(self, name, None)
        with self.memory_saver_adapter.region("kv_cache"):
            self.k_buffer = [torch.zeros(rows, self.code_bytes_k_of[lid] + self.scale_bytes, dtype=torch.uint8,
                                         device=self.device) for lid in range(self.layer_num)]
            self.v_buffer = [torch.zeros(rows, self.code_bytes_v, dtype=torch.uint8, device=self.device)
                             for _ in range(self.layer_num)]
        self.window = cfg.sink_window + cfg.recent_window
        self.exact = None
        self.win_k = self.win_v = None
        self._live = {}  # request row -> (lo, kv length): positions < sink and in [lo, length) are pinned
        self._matched = {}  # request row -> the prefix its first forward found cached (radix match)
        self._np = {}  # numpy views of long-lived buffers, made once here (never looked up by id())
        E = windows.store_entries(cfg.sink_window, cfg.recent_window, self.options.rows(), self.options.cached_windows)
        # salient tokens (cfg.salient_budget, the streaming echo rule of sglang_tasq.salient)
        self.salient = cfg.salient_spec()
        self.echo_rows = None
        if self.salient is not None:
            E += windows.salient_entries(cfg, rows, self.options.forward_tokens)
            with self.memory_saver_adapter.region("kv_cache"):
                self.echo_rows = torch.zeros(rows, windows.echo_row_width(cfg, H), dtype=torch.float16,
                                             device=self.device)
        if self.window:
            with self.memory_saver_adapter.region("kv_cache"):
                # a res4 store reads its entries over the slots' codes (the reference decode)
                self.exact = windows.ExactStore(
                    rows, E, self.layer_num, H, d, device=self.device, fmt=cfg.exact_format,
                    coded=lambda lid, slots, values=True: self.read_codes(lid + self.start_layer, slots, values))
            # [E + 1, 1, H, d] views: the kernels' (entry, index 0) addressing of the store
            self.win_k = [t.unsqueeze(1) for t in self.exact.k]
            self.win_v = [t.unsqueeze(1) for t in self.exact.v]
        # CPU fast paths, tested against the reference codec: codebooks prepared once per layer;
        # Numba kernels (numba_kernels.cpu) unless options.cpu_kernels is off (plain torch)
        self.cpu_kernels = self.options.cpu_kernels
        self._near_k = fastpath.layer_nearest(self.codebooks.tailored_k_codebook, self.cpu_kernels)
        self._near_v = fastpath.layer_nearest(lambda layer: self.codebooks.v_codebook[layer], self.cpu_kernels)
        self._unpack = fastpath.unpacker(self.cpu_kernels)  # the codes a prefill reads
        self._dec_tables = {}
        self._rope = None
        self._encoder = None
        if self.cpu_kernels and self.codebooks.k_mix is None:
            from numba_kernels.cpu import PoolEncoder

            self._encoder = PoolEncoder(self.codebooks)
        if str(self.device) == "cpu":
            from numba_kernels.fastpath import u16_view

            # exact entries as the kernels read them: bf16 bits (uint16), or fp8 bits / res4
            # nibbles (uint8) and their fp16 scales' bits [E + 1, H]
            view = (lambda t: t.numpy()) if cfg.exact_format != "bf16" else u16_view
            self._np = {"k": [t.numpy() for t in self.k_buffer], "v": [t.numpy() for t in self.v_buffer],
                        "wk": [view(t) for t in self.win_k] if self.win_k else None,
                        "wv": [view(t) for t in self.win_v] if self.win_v else None,
                        "wks": None, "wvs": None}
            if self.win_k and self.exact.k_scale is not None:
                self._np["wks"] = [u16_view(t) for t in self.exact.k_scale]
                self._np["wvs"] = [u16_view(t) for t in self.exact.v_scale]
        self._kv_buffer_descs = self._build_kv_buffer_descs()
        self._init_data_ptrs_and_strides()

    # ---- windows ---------------------------------------------------------------------------
    def attach_request_rows(self, req_to_token_pool) -> None:
        """Track live request rows (their windows are pinned in the exact store) and check that
        the store holds the windows of every row SGLang can run at once (refused at start-up)."""
        if self.exact is None or getattr(self, "_attached", None) is req_to_token_pool:
            return
        cfg = self.tasq_config
        need = windows.store_entries(cfg.sink_window, cfg.recent_window, req_to_token_pool.size)
        if need > self.exact.capacity:
            raise RuntimeError(
                f"tasq: {req_to_token_pool.size} request rows need {need} full-precision window entries, the "
                f"store holds {self.exact.capacity} (sized for {self.options.rows()} running requests); lower "
                f"--max-running-requests or raise SGLANG_TASQ_WINDOW_ROWS")
        self._attached = req_to_token_pool
        self._r2t = req_to_token_pool.req_to_token
        previous_alloc, original_free = req_to_token_pool._on_alloc_rows, req_to_token_pool.free_rows

        def on_alloc_rows(rows):
            for r in rows:
                self._live[int(r)] = (0, 0)
                self._matched.pop(int(r), None)
            if previous_alloc is not None:
                previous_alloc(rows)

        def free_rows(rows):
            for r in rows:
                self._live.pop(int(r), None)
                self._matched.pop(int(r), None)
            return original_free(rows)

        original_clear = req_to_token_pool.clear

        def clear():
            self._live.clear()
            self._matched.clear()
            return original_clear()

        req_to_token_pool._on_alloc_rows = on_alloc_rows
        req_to_token_pool.free_rows = free_rows
        req_to_token_pool.clear = clear

    def pinned_slots(self) -> torch.Tensor:
        """Slots whose exact entries a live request still needs (its sink and recent window, and
        during an extend the prefix tail its queries read)."""
        sink = self.tasq_config.sink_window
        parts = []
        for row, (lo, n) in self._live.items():
            if n:
                r = self._r2t[row]
                parts.append(r[: min(sink, n)])
                parts.append(r[max(lo, 0): n])
                if self.salient is not None:  # its kept (salient) tokens
                    s = r[:n].to(torch.int64)
                    parts.append(s[self.exact.kept[s] > 0])
        if not parts:
            return torch.zeros(0, dtype=torch.int64, device=self.device)
        return torch.cat(parts).to(torch.int64)

    def begin_forward(self, req_rows, prefix_lens, seq_lens) -> None:
        """Per forward, before any write: pin each request's windows (prefix tail included) and
        check that every exact entry its queries will read is present (never served from codes).
        An extend demotes the entries of the tokens its request computed that leave its window
        (:meth:`ExactStore.demote`: they serve only a later match ending inside them); the tail of
        a matched prefix, a proven branch point, is restored and never demoted by the requests
        that matched it."""
        if self.exact is None:
            return
        self.exact.tick()
        cfg = self.tasq_config
        sink, recent = cfg.sink_window, cfg.recent_window
        r2t = self._r2t
        for row, P, S in zip(req_rows, prefix_lens, seq_lens):
            lo = max(0, P + 1 - recent)
            self._live[int(row)] = (lo, S)
            first = int(row) not in self._matched
            m = self._matched.setdefault(int(row), P)  # the first forward's prefix: a radix match
            if S - P > 1:  # an extend: its own tokens it moves out of its last query's window (what a
                # later match of this very prefix reads: SGLang recomputes the last token of a match)
                self.exact.demote(r2t[row, max(sink, P - recent, m): max(sink, min(P, S - recent))].to(torch.int64))
            if P == 0:
                continue
            need = torch.cat([r2t[row, : min(sink, P)], r2t[row, max(lo, min(sink, P)): P]]).to(torch.int64)
            ent = self.exact.entry_of[need]
            if not bool((ent > 0).all()):
                pos = torch.cat([torch.arange(min(sink, P)), torch.arange(max(lo, min(sink, P)), P)])
                miss = pos[ent == 0]
                raise RuntimeError(
                    f"tasq: request row {row} (prefix {P} of {S} tokens) lacks {miss.numel()} full-precision "
                    f"window entries of its prefix (positions {miss[:8].tolist()}...); refusing to serve them "
                    f"from codes")
            self.exact.touch(need)
            if first:
                self.exact.demote(need, interior=False)

    def valid_prefix(self, slots: torch.Tensor) -> int:
        """Longest usable part of a matched prefix held in ``slots`` [P] (radix match hook)."""
        if self.exact is None:
            return int(slots.numel())
        cfg = self.tasq_config
        slots = slots.to(self.exact.entry_of.device).to(torch.int64)
        kept = self.exact.kept[slots] > 0 if self.salient is not None else None
        P = windows.exact_prefix_limit(self.exact.entry_of[slots] > 0, cfg.sink_window, cfg.recent_window, kept)
        if P:
            self.exact.touch(slots[:P])
        return P

    def adopt_entries(self, fresh: torch.Tensor, canon: torch.Tensor) -> None:
        """The radix cache kept its slots ``canon`` [n] for a prefix a request recomputed into
        ``fresh`` [n] (freed as duplicates): move fresh exact entries to canon slots that lack one."""
        if self.exact is None:
            return
        st = self.exact
        fresh, canon = fresh.to(torch.int64), canon.to(torch.int64).to(fresh.device)
        diff = fresh != canon
        f, c = fresh[diff], canon[diff]
        ef, ec = st.entry_of[f], st.entry_of[c]
        move = (ef > 0) & (ec == 0)
        if bool(move.any()):
            st.entry_of[c[move]] = ef[move]
            st.owner[ef[move]] = c[move]
            st.entry_of[f[move]] = 0
        if self.salient is not None:  # blocks the recompute decided (the tree's request may have ended first)
            st.kept[c] = torch.maximum(st.kept[c], st.kept[f])

    def in_window(self, positions: torch.Tensor, seq_len) -> torch.Tensor:
        """[T] bool: positions read exactly by a query at ``seq_len - 1`` (:func:`windows.in_window`)."""
        cfg = self.tasq_config
        return windows.in_window(positions, seq_len, cfg.sink_window, cfg.recent_window)

    # ---- writes ----------------------------------------------------------------------------
    def rope_table(self, n: int):
        """cos, sin [m >= n, d/2] float32 for positions 0..m-1 (``rope.cos_sin``; cached, grown by
        doubling; the values of a position do not depend on m)."""
        tab = self._rope
        if tab is None or tab[0].shape[0] < n:
            from ..rope import cos_sin

            m = max(n, 2 * (tab[0].shape[0] if tab is not None else 0), 1024)
            cb = self.codebooks
            cos, sin = cos_sin(torch.arange(m, device=self.device), cb.inv_freq.to(self.device), cb.attention_scaling)
            cos, sin = cos.float().contiguous(), sin.float().contiguous()
            tab = self._rope = (cos, sin, *((cos.numpy(), sin.numpy()) if cos.device.type == "cpu" else (None, None)))
        return tab[0], tab[1]

    def window_targets(self, positions, req_rows, seq_lens, loc=None):
        """(entry [T], index [T] (zeros), kept position [T] or -1) of T new tokens: an exact-store
        entry for every token inside the window of its forward's kv length (0: not kept), or None
        without windows. Assigns the entries (call once per forward, before layer 0 writes)."""
        if self.exact is None or seq_lens is None:
            return None
        keep = self.in_window(positions, seq_lens)
        if self.salient is not None:  # every new token may be kept when its block is decided
            keep = torch.ones_like(keep)
        slots = unwrap_write_loc(loc)[0].to(torch.int64)
        ent = self.exact.assign(slots, keep, self.pinned_slots)
        if self.salient is not None:  # new tokens already outside their forward's last query's window
            cfg = self.tasq_config
            S = torch.as_tensor(seq_lens, device=positions.device)
            out = (positions >= cfg.sink_window) & (positions < S - cfg.recent_window)
            if bool(out.any()):
                self.exact.demote(slots[out.to(slots.device)])
        return ent, torch.zeros_like(ent), torch.where(keep, positions, -1)

    def set_kv_buffer(self, layer, loc, cache_k, cache_v, *args, positions=None, req_rows=None,
                      seq_lens=None, win_targets=None, **kwargs):
        """Encode and store one layer's new tokens.

        cache_k: [T, H*d] or [T, H, d] POST-RoPE keys; cache_v likewise; positions [T] int
        (required: keys are un-rotated before encoding); seq_lens [T] the kv length of each
        token's request after this forward (for the windows); win_targets:
        :meth:`window_targets` of the forward (computed once by the backend; computed here
        when missing, which is right only for the forward's first layer).
        """
        if positions is None:
            raise NotImplementedError("TaSQTokenToKVPool.set_kv_buffer needs positions= (keys arrive "
                                      "post-RoPE); write through the 'tasq' attention backend")
        loc, _, _ = unwrap_write_loc(loc)
        lid = layer.layer_id - self.start_layer
        T, H, d = loc.shape[0], self.head_num, self.head_dim
        cb = self.codebooks
        if win_targets is None:
            win_targets = self.window_targets(positions, req_rows, seq_lens, loc)
        if self._encoder is not None and T and not cache_k.is_cuda:
            cos, sin = self.rope_table(int(positions.max()) + 1)
            _, _, cos_np, sin_np = self._rope
            wr = wi = None
            if win_targets is not None:  # window entries written in the kernel (res4: over the codes just made)
                wr, wi, _ = win_targets
            scales = (self._np["wks"][lid], self._np["wvs"][lid]) if self._np["wks"] is not None else None
            done = self._encoder.encode_into(
                layer.layer_id, cache_k.reshape(T, H, d), cache_v.reshape(T, H, d), positions, cos_np, sin_np, loc,
                self._np["k"][lid], self._np["v"][lid], self.code_bytes_k_of[lid], wr, wi,
                self._np["wk"][lid] if wr is not None else None, self._np["wv"][lid] if wr is not None else None,
                win_scales=scales if wr is not None else None,
                win_format=self.exact.fmt if self.exact is not None else None)
            if done:
                return
        k_pre = apply_rope(cache_k.reshape(T, H, d), positions, cb.inv_freq, cb.attention_scaling, inverse=True)
        v = cache_v.reshape(T, H, d)
        x, k_scale = codec.key_tailor(k_pre, cb, layer.layer_id)  # == codec.encode_keys / encode_values
        k_codes = self._near_k(x, layer.layer_id)
        gv = self.tasq_config.group_size_v
        v_codes = self._near_v(v.float().view(T, H, d // gv, gv), layer.layer_id)
        pack = fastpath.packer(self.cpu_kernels)
        krow = pack(k_codes.reshape(T, H * self.gk_of[lid]), self.bits_k_of[lid])
        vrow = pack(v_codes.reshape(T, H * self.gv), self.tasq_config.code_bits_v)
        self.write_rows(lid, loc, krow, k_scale, vrow)
        self.write_windows(lid, k_pre, v, win_targets, loc)

    def write_rows(self, lid: int, loc, k_packed, k_scale, v_packed) -> None:
        """Store packed key codes [T, Bk] (+ fp16 scales [T] / [T, H] or None) and packed value
        codes [T, Bv] of local layer ``lid`` at slots ``loc`` (the key row is codes ++ scale bytes)."""
        T = k_packed.shape[0]
        if k_scale is not None and self.scale_bytes:
            k_packed = torch.cat([k_packed, k_scale.reshape(T, -1).contiguous().view(torch.uint8)], dim=1)
        self.k_buffer[lid][loc] = k_packed.to(self.device)
        self.v_buffer[lid][loc] = v_packed.to(self.device)

    def write_windows(self, lid: int, k_pre, v, win_targets, loc=None) -> None:
        """Copy the kept tokens among [T] new ones (pre-RoPE keys k_pre, values v [T, H, d]) into
        their exact-store entries (``win_targets`` of :meth:`window_targets`). A res4 store keeps
        what their codes miss: the codes must be written at slots ``loc`` [T] first."""
        if win_targets is None:
            return
        ent = win_targets[0]
        keep = ent > 0
        if bool(keep.any()):
            coded = None
            if self.exact.fmt == "res4":
                coded = self.read_codes(lid + self.start_layer, loc.to(ent.device)[keep].to(torch.int64))
            self.exact.write(lid, ent[keep], k_pre[keep], v[keep], coded)

    def as_stored(self, k_pre: torch.Tensor, v: torch.Tensor, coded=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(pre-RoPE keys, values) [T, H, d] f32 as the exact store returns them once written (its
        one rounding: bf16 keys, values as given; fp8 keys and values; res4: ``coded``, what their
        codes read as (pre-RoPE keys, values), plus the residual), so an extend's own window
        tokens read the same as a later forward reads them from the store."""
        if self.exact is None or self.exact.fmt == "bf16":
            return k_pre.to(torch.bfloat16).float(), v.float()
        if self.exact.fmt == "res4":
            if coded is None:
                raise ValueError("as_stored with a res4 store: pass coded= (the tokens' codes as read)")
            return self.exact.held(k_pre, coded[0]), self.exact.held(v, coded[1])
        return self.exact.held(k_pre), self.exact.held(v)

    # ---- salient tokens ------------------------------------------------------------------
    def reads_kept(self, layer_id: int) -> bool:
        """Does ``layer_id`` read kept (salient) tokens exactly (the deciding layer and after)?"""
        return self.salient is not None and layer_id >= self.salient.layer

    def kept_of(self, layer_id: int, slots: torch.Tensor) -> torch.Tensor | None:
        """[S] bool: which of ``slots`` ``layer_id`` reads exactly as kept tokens (None: none)."""
        return self.exact.kept[slots] > 0 if self.reads_kept(layer_id) else None

    def record_echo(self, layer_id: int, loc: torch.Tensor, echo: torch.Tensor) -> None:
        """Store the new tokens' window echo [T, H] (:func:`salient.window_echo`) of a layer up to
        the deciding one, in their slots' echo rows (fp16, shared through the radix cache)."""
        H = self.head_num
        self.echo_rows[loc, layer_id * H:(layer_id + 1) * H] = echo.to(torch.float16)

    def decide_salient(self, req_rows, prefix_lens, seq_lens) -> None:
        """At the deciding layer, before its attention (after it in a CPU decode step, whose decided
        blocks lie inside its recent window): for each request, decide the blocks whose
        horizon this forward reached (:func:`salient.decide_blocks` over the echo rows of its
        slots) and mark the kept slots. A block's decision reads its prefix only, so any request
        holding the same prefix marks the same slots."""
        from .. import salient as sal

        spec, sink = self.salient, self.tasq_config.sink_window
        for row, P, S in zip(req_rows, prefix_lens, seq_lens):
            start, end = sal.decided_blocks(P, spec), sal.decided_blocks(S, spec)
            if end <= start:
                continue
            slots = self._r2t[row, :S].to(torch.int64)
            rows = self.echo_rows[slots].T.float()
            kept = slots[sal.decide_blocks(rows, S, start, sink, spec)]
            if not bool((self.exact.entry_of[kept] > 0).all()):
                raise RuntimeError(f"tasq: request row {row}: a salient token chosen at position < {S} has no "
                                   "full-precision entry; refusing to serve it from codes")
            self.exact.kept[kept] = 1

    # ---- reads -----------------------------------------------------------------------------
    def read_codes(self, layer_id: int, slots: torch.Tensor, values: bool = True):
        """slots [S] -> pre-RoPE keys, values [S, H, d] f32 decoded from their codes (reference
        codec); ``values=False``: keys only (values None)."""
        lid = layer_id - self.start_layer
        S, H = slots.shape[0], self.head_num
        cfg = self.tasq_config
        krow = self.k_buffer[lid][slots]
        Bk, gk = self.code_bytes_k_of[lid], self.gk_of[lid]
        k_codes = self._unpack(krow[:, :Bk], H * gk, self.bits_k_of[lid]).view(S, H, gk)
        scale = None
        if self.scale_bytes:
            sb = krow[:, Bk:]  # copied to a fresh buffer: a 1-row slice keeps an odd offset
            scale = torch.empty_like(sb, memory_format=torch.contiguous_format).copy_(sb).view(torch.float16)
            scale = scale.reshape(S) if self.scale_bytes == 2 else scale.reshape(S, self.scale_bytes // 2)
        v_codes = None
        if values:
            v_codes = self._unpack(self.v_buffer[lid][slots], H * self.gv, cfg.code_bits_v).view(S, H, self.gv)
        return self._decode(k_codes, scale, v_codes, layer_id)

    def exact_keys(self, lid: int, ent: torch.Tensor) -> torch.Tensor:
        """Pre-RoPE keys [n, H, d] f32 of exact entries ``ent`` of local layer ``lid``
        (``ExactStore.read_k``); a res4 store's on the CPU kernels in one Numba call (its slots'
        codes read and completed, bit for bit the store's reading: what the salient echo reads
        every step)."""
        ex = self.exact
        if ex.fmt != "res4" or self._encoder is None or not self._np or ent.device.type != "cpu":
            return ex.read_k(lid, ent)
        return self._encoder.res4_keys(lid + self.start_layer, ent, ex.owner, self._np["k"][lid],
                                       self.code_bytes_k_of[lid], self._np["wk"][lid], self._np["wks"][lid])

    def read_exact(self, layer_id: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, use: torch.Tensor,
                   coded: bool = False) -> None:
        """Overwrite k, v [S, H, d] (pre-RoPE) with the exact entries of ``slots`` where ``use`` [S];
        every used slot must hold an entry (checked: nothing the rule says is exact is read from codes).
        ``coded``: k, v hold what the slots' codes read as (:meth:`read_codes`), which a res4 store
        completes (its entries' slots are these: ``owner[entry_of[s]] == s``) instead of
        decoding the codes again."""
        if self.exact is None or not bool(use.any()):
            return
        lid = layer_id - self.start_layer
        ent = self.exact.entry_of[slots[use]]
        if not bool((ent > 0).all()):
            raise RuntimeError(f"tasq: {int((ent == 0).sum())} window tokens have no full-precision entry")
        given = coded and self.exact.fmt == "res4"  # (other formats read their entries alone)
        k[use], v[use] = self.exact.read(lid, ent, (k[use], v[use]) if given else None)

    def read_request(self, layer_id: int, slots: torch.Tensor, req_row: int, seq_len: int):
        """One request's cache as a query at position ``seq_len - 1`` reads it: slots [S] (positions
        0..S-1) -> pre-RoPE keys, values [S, H, d] f32 (codes decoded, window positions exact)."""
        k, v = self.read_codes(layer_id, slots)
        if self.exact is not None:
            pos = torch.arange(slots.shape[0], device=slots.device)
            use = self.in_window(pos, seq_len)
            kept = self.kept_of(layer_id, slots)
            self.read_exact(layer_id, slots, k, v, use if kept is None else use | kept, coded=True)
        return k, v

    def _decode(self, k_codes, scale, v_codes, layer_id: int):
        """== (codec.decode_keys, codec.decode_values) with flattened codebooks prepared once."""
        cb = self.codebooks
        if cb.k_unmix is not None:
            return (codec.decode_keys(k_codes, scale, cb, layer_id),
                    None if v_codes is None else codec.decode_values(v_codes, cb, layer_id))
        tab = self._dec_tables.get(layer_id)
        if tab is None:
            kc, vc = cb.k_codebook[layer_id].float(), cb.v_codebook[layer_id].float()
            H, Gk, Kk, gk = kc.shape
            _, Gv, Kv, gv = vc.shape
            tab = self._dec_tables[layer_id] = (
                kc.reshape(H * Gk * Kk, gk).contiguous(), torch.arange(H * Gk).view(H, Gk) * Kk,
                vc.reshape(H * Gv * Kv, gv).contiguous(), torch.arange(H * Gv).view(H, Gv) * Kv,
                cb.k_inv_perm(layer_id))
        kflat, koff, vflat, voff, inv = tab
        S, H, _ = k_codes.shape
        k = kflat.index_select(0, (k_codes + koff).reshape(-1)).view(S, H, k_codes.shape[2] * kflat.shape[1])
        if scale is not None:
            k = codec.apply_scale(k, scale)
        k = torch.gather(k, 2, inv.unsqueeze(0).expand(S, H, -1))
        if v_codes is None:
            return k, None
        v = vflat.index_select(0, (v_codes + voff).reshape(-1)).view(S, H, v_codes.shape[2] * vflat.shape[1])
        return k, v

    def _build_kv_buffer_descs(self):
        """One descriptor per buffer from its own shape (SGLang's takes layer 0's for all, and a
        per-layer key rate gives the layers' key rows different widths)."""
        descs = []
        for prefix, bufs in (("k", self.k_buffer), ("v", self.v_buffer)):
            for layer, t in enumerate(bufs):
                descs.append(KvBufferDesc(f"{prefix}{layer}", tuple(t.shape), row_bytes=t.shape[1] * t.element_size(),
                                          tokens_per_row=1))
        return descs

    def get_kv_size_bytes(self):
        """(key bytes, value bytes) actually held, the exact window store included."""
        k, v = super().get_kv_size_bytes()
        if self.exact is not None:
            k += self.exact.nbytes()
        return k, v
