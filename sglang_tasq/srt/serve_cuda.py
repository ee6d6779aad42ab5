"""CUDA path of the 'tasq' backend: Numba encode into the pool, attention over the compressed cache.

:class:`TaSQCudaAdapter` takes what the backend gets (q, k, v, layer, forward_batch, the
pool, the backend's per-forward metadata) and follows the one window rule of
:mod:`sglang_tasq.windows` (a query at position ``i`` reads key ``j`` exactly iff
``j < sink`` or ``j >= i + 1 - recent``, from its codes otherwise), as the CPU path does:

- store: keys are un-rotated to pre-RoPE (as the CPU path does), ``encode_kv`` writes codes and
  scales into a scratch pool of ``T`` rows, the packed rows are copied to the slots
  ``out_cache_loc`` (:meth:`TaSQTokenToKVPool.write_rows`) and the window tokens into their
  exact-store entries (``md["win_targets"]``, assigned once per forward by the backend;
  one ``index_copy_`` per layer, no host sync);
- decode: ``numba_kernels.ops.decode_attention`` over a compact view of the pool (below), with
  ``kv_indptr``/``kv_indices`` built on the device from ``req_to_token``;
- extend: the strict per-query rule in torch on the device (:meth:`_extend_request`, the same
  computation as ``TaSQAttnBackend._attend`` with a chunk, with the codes decoded by this
  adapter's device tables; ``_attend`` itself reads through ``pool.read_codes``, whose
  codebooks live on the CPU). The ``extend_attention`` kernel attends a chunk exactly and its
  prefix with windows over the prefix length (the rule of a query at the chunk's start), which
  is not the rule for the chunk's later queries, so it is not used here.

Layout reconciliation (decode). The kernels read ``k_codes [S, Bk]``, ``k_scale fp16 [S]`` and,
for the windows, ``k_full``/``v_full [S, H, d]`` indexed by the SAME slot id as the codes
(shape checked against ``k_codes``). A pool-sized ``k_full`` would cost as much as a bf16
cache, so the pool keeps its slot-keyed exact store (``exact.k[l]``/``exact.v[l]``
``[E + 1, H, d]``, ``exact.entry_of[slot]``) and its packed key row (codes ++ scale). Per
forward and layer the adapter builds a COMPACT view over the batch's kv tokens: row ``j`` of
the view is the ``j``-th kv token of the batch (``kv_indices = arange``), codes/scales are
gathered from the pool rows, and ``k_full``/``v_full`` (uninitialised except on window rows)
get, on every window row, the slot's exact entry when ``entry_of[slot] > 0`` and the position is
inside the window of the request's length, else the decoded codes: exactly what the CPU path
(:meth:`TaSQTokenToKVPool.read_request`) reads. The view is built for groups of requests of at
most ``max_view_tokens`` kv tokens (memory bound).

Salient tokens (``config.salient_budget``): the backend's echo and decision run between the store
and the attention (``before_attention``); from the deciding layer on, decode passes the view's kept
flags to the kernel (their ``k_full``/``v_full`` rows filled from the slots' exact entries, found
once per forward after the decision) and extend reads kept slots exactly (as the CPU path's
``_prefill_keys``).
"""
from __future__ import annotations

from types import SimpleNamespace

import torch
from sglang.srt.mem_cache.memory_pool import unwrap_write_loc

from .. import packing, windows
from .backend import _sdpa, _windowed_attention
from ..rope import apply_rope, cos_sin, rotate

PLAN_KEY = "tasq_cuda_plan"
ROPE_KEY = "tasq_cuda_rope"


def _ragged(lens: torch.Tensor, total: int):
    """lens [B] int64 (device) -> (indptr [B+1], owner [total], offset [total]); no host sync."""
    dev = lens.device
    ptr = torch.zeros(lens.numel() + 1, dtype=torch.int64, device=dev)
    ptr[1:] = torch.cumsum(lens, 0)
    owner = torch.repeat_interleave(torch.arange(lens.numel(), device=dev), lens, output_size=total)
    return ptr, owner, torch.arange(total, device=dev) - ptr[owner]


def _codewords(codes: torch.Tensor, cb: torch.Tensor) -> torch.Tensor:
    """codes [T, H, G], cb [H, G, K, g] -> [T, H, G*g] f32."""
    T, H, G = codes.shape
    hh = torch.arange(H, device=codes.device).view(1, H, 1)
    gg = torch.arange(G, device=codes.device).view(1, 1, G)
    return cb[hh, gg, codes].reshape(T, H, G * cb.shape[-1]).float()


class TaSQCudaAdapter:
    """Backend inputs -> Numba kernels. Device-agnostic (CPU tensors run in the simulator)."""

    def __init__(self, pool, req_to_token_pool, ops=None, full_dtype=None, max_view_tokens=None):
        if ops is None:
            from numba_kernels import ops  # noqa: WPS433 (imports numba)
        self.ops, self.pool, self.req_to_token = ops, pool, req_to_token_pool.req_to_token
        # the decode view's exact rows: bf16 (the store's own dtype), f32 for an fp8 store (its
        # codes times scales, unrounded: the CPU path's values)
        if full_dtype is None:
            coded_rows = pool.exact is not None and pool.exact.fmt != "bf16"  # fp8, res4
            full_dtype = torch.float32 if coded_rows else torch.bfloat16
        self.full_dtype = full_dtype
        self.max_view_tokens = max_view_tokens or pool.options.cuda_view_tokens
        self.cfg = pool.tasq_config  # key rates per layer: each layer's tables (tb.config, tb.k_groups)
        self.windows = pool.exact is not None and (self.cfg.sink_window + self.cfg.recent_window) > 0
        self._tables: dict = {}

    def tables(self, layer_id: int, device):
        """The layer's LayerTables on ``device``, built on first use."""
        key = (layer_id, str(device))
        if key not in self._tables:
            from numba_kernels.tables import LayerTables  # noqa: WPS433

            self._tables[key] = LayerTables.from_codebooks(self.pool.codebooks, layer_id, device)
        return self._tables[key]

    # ---- entry -------------------------------------------------------------------------------
    def forward(self, q3, k, v, layer, fb, md, save_kv_cache=True, before_attention=None) -> torch.Tensor:
        """q3 [N, Hq, d] post-RoPE; k, v [N, H*d] (post-RoPE keys) or None -> out [N, Hq, d] f32.
        ``before_attention``: called after the store, before the attention reads the pool (the
        backend's salient echo and decision)."""
        tb = self.tables(layer.layer_id, q3.device)
        H, d = self.pool.head_num, self.pool.head_dim
        decode = fb.forward_mode.is_decode()
        if save_kv_cache and k is not None and v is not None:
            self.store(layer, fb, k.reshape(-1, H, d), v.reshape(-1, H, d), md, tb)
        if before_attention is not None:
            before_attention()
        if not decode and (k is None or v is None):
            raise NotImplementedError("tasq: the CUDA extend path needs the chunk's k and v")
        out = torch.empty(q3.shape, dtype=torch.float32, device=q3.device)
        lid = layer.layer_id - self.pool.start_layer
        if not decode:
            kc, vc = k.reshape(-1, H, d), v.reshape(-1, H, d)
            start = 0
            for row, S, Tq in zip(md["req_rows"], md["seq_lens"], md["q_lens"]):
                sl = slice(start, start + Tq)
                if Tq:
                    out[sl] = self._extend_request(q3[sl], kc[sl], vc[sl], lid, layer, tb, md, row, S)
                start += Tq
            return out
        plan = md.get(PLAN_KEY)
        if plan is None:
            plan = md[PLAN_KEY] = self._plan(fb, md, q3.device)
        sink, recent = (self.cfg.sink_window, self.cfg.recent_window) if self.windows else (0, 0)
        reads_kept = self.pool.salient is not None and self.pool.reads_kept(layer.layer_id)
        for g in plan:
            view = self._view(lid, tb, g)
            kept = self._kept_view(lid, g, view) if reads_kept else None
            self.ops.decode_attention(q3[g.b0:g.b1], *view[:3], g.kv_indptr, g.kv_indices, tb, layer.scaling,
                                      *view[3:], sink=sink, recent=recent, out=out[g.b0:g.b1], max_kv_len=g.max_n,
                                      kept=kept)
        return out

    # ---- store -------------------------------------------------------------------------------
    def store(self, layer, fb, k, v, md, tb) -> None:
        """Encode the new tokens k (post-RoPE), v [T, H, d] into slots ``fb.out_cache_loc``; the
        window tokens also into their exact-store entries (``md["win_targets"]``)."""
        loc, _, _ = unwrap_write_loc(fb.out_cache_loc)
        T = loc.shape[0]
        if T == 0:
            return
        lid = layer.layer_id - self.pool.start_layer
        positions = md["positions"] if "positions" in md else fb.positions.to(torch.int64)
        k_pre = apply_rope(k, positions, tb.inv_freq, tb.attention_scaling, inverse=True).contiguous()
        v = v.contiguous()
        scratch = tb.allocate_pool(T, k.device)
        self.ops.encode_kv(k_pre, v, torch.arange(T, dtype=torch.int32, device=k.device), tb,
                           scratch["k_codes"], scratch["v_codes"], scratch["k_scale"])
        scale = scratch["k_scale"] if self.cfg.scale != "none" else None
        self.pool.write_rows(lid, loc, scratch["k_codes"], scale, scratch["v_codes"])
        wt = md.get("win_targets")
        if self.windows and wt is not None:
            # tokens outside every window (entry 0) all land on entry 0, the store's never-read
            # "none" entry: one unmasked copy instead of a masked one (which would sync)
            coded = self.pool.read_codes(layer.layer_id, loc) if self.pool.exact.fmt == "res4" else None
            self.pool.exact.write(lid, wt[0].to(k.device, torch.int64), k_pre, v, coded)

    # ---- extend (strict per-query windows) ---------------------------------------------------
    def _rope(self, md, n: int, device, tb):
        """cos, sin [n, 1, d/2] of positions 0..n-1 (== the CPU path's table), once per forward."""
        tab = md.get(ROPE_KEY)
        if tab is None or tab[0].shape[0] < n:
            m = max([n] + list(md.get("seq_lens", [])))
            cos, sin = cos_sin(torch.arange(m, device=device), tb.inv_freq, tb.attention_scaling)
            tab = md[ROPE_KEY] = (cos.float().unsqueeze(1), sin.float().unsqueeze(1))
        return tab[0][:n], tab[1][:n]

    def _decode_slots(self, lid: int, tb, slots: torch.Tensor):
        """slots [S] -> pre-RoPE keys, values [S, H, d] f32 decoded from their codes (device tables)."""
        pool, cfg = self.pool, self.cfg
        H, Bk = pool.head_num, tb.k_row_bytes
        krows = pool.k_buffer[lid].index_select(0, slots)
        vrows = pool.v_buffer[lid].index_select(0, slots)
        scale = None
        if cfg.scale != "none":
            scale = torch.empty_like(krows[:, Bk:], memory_format=torch.contiguous_format).copy_(krows[:, Bk:])
            scale = scale.view(torch.float16)
            scale = scale.reshape(-1) if cfg.scale == "shared" else scale.reshape(-1, H)
        return self._decode_rows(krows[:, :Bk], vrows, scale, tb)

    def _decode_rows(self, k_codes, v_codes, k_scale, tb):
        """Packed rows (+ fp16 scales [n] / [n, H] or None) -> pre-RoPE k, v [n, H, d] f32."""
        pool, cfg = self.pool, self.cfg
        H = pool.head_num
        kc = packing.unpack_codes(k_codes, H * tb.k_groups, tb.config.code_bits_k).view(-1, H, tb.k_groups)
        vc = packing.unpack_codes(v_codes, H * pool.gv, cfg.code_bits_v).view(-1, H, pool.gv)
        kp = _codewords(kc, tb.k_cb)
        if k_scale is not None:
            s = k_scale.float()
            kp = kp * (s[:, None, None] if s.dim() == 1 else s[:, :, None])
        k_dec = torch.empty_like(kp).scatter_(2, tb.k_perm.long().unsqueeze(0).expand_as(kp), kp)
        return k_dec, _codewords(vc, tb.v_cb)

    def _extend_request(self, q, k_chunk, v_chunk, lid: int, layer, tb, md, row: int, S: int) -> torch.Tensor:
        """One request's chunk: q [Tq, Hq, d] post-RoPE at positions S-Tq..S-1, its k (post-RoPE),
        v [Tq, H, d] -> [Tq, Hq, d] f32 by the window rule for every query (as
        ``TaSQAttnBackend._attend`` with a chunk): query i reads key j exactly iff j < sink or
        j >= i + 1 - recent (prefix keys from their exact entries, chunk keys from the chunk),
        from the codes in the pool otherwise."""
        Tq = q.shape[0]
        P = S - Tq
        dev = q.device
        slots = self.req_to_token[row, :S].to(dev, torch.int64)
        cos, sin = self._rope(md, S, dev, tb)
        sink, recent = (self.cfg.sink_window, self.cfg.recent_window) if self.windows else (0, 0)
        q_pos = torch.arange(P, S, device=dev)
        k_pos = torch.arange(S, device=dev)
        causal = k_pos[None, :] <= q_pos[:, None]
        ex = windows.query_window(q_pos, k_pos, sink, recent)  # [Tq, S] (no windows: all False)
        k_chunk, v_chunk = self._as_stored(k_chunk, v_chunk, cos[P:], sin[P:], layer.layer_id, slots[P:])
        if bool((ex | ~causal).all()):  # every key a query sees is in its window: exact attention
            k_ex, v_ex = k_chunk, v_chunk
            if P:
                k_pre, v_pre = self._prefix_exact(lid, slots[:P])
                k_ex = torch.cat([rotate(k_pre, cos[:P], sin[:P]), k_ex])
                v_ex = torch.cat([v_pre, v_ex])
            return _sdpa(q, k_ex, v_ex, layer.scaling)
        k_dec, v_dec = self._decode_slots(lid, tb, slots)
        k_ex, v_ex = k_dec, v_dec
        kept = self.pool.kept_of(layer.layer_id, slots) if self.pool.salient is not None else None
        if self.windows and P:
            need = ex[:, :P].any(0) if kept is None else ex[:, :P].any(0) | kept[:P]
            ent = self.pool.exact.entry_of[slots[:P]]
            use = (need & (ent > 0))[:, None, None]
            kx, vx = self.pool.exact.read(lid, ent)
            k_ex = torch.cat([torch.where(use, kx, k_dec[:P]), k_dec[P:]])
            v_ex = torch.cat([torch.where(use, vx, v_dec[:P]), v_dec[P:]])
        k_dec, k_ex = rotate(k_dec, cos, sin), rotate(k_ex, cos, sin)
        k_ex[P:] = k_chunk
        v_ex = v_ex.clone() if v_ex is v_dec else v_ex
        v_ex[P:] = v_chunk
        if kept is not None:  # a kept token is exact for every query: its "codes" too
            m = kept[:, None, None]
            k_dec, v_dec = torch.where(m, k_ex, k_dec), torch.where(m, v_ex, v_dec)
        return _windowed_attention(q, k_ex, v_ex, k_dec, v_dec, ex & causal, causal, layer.scaling)

    def _as_stored(self, k_chunk, v_chunk, cos, sin, layer_id: int, slots):
        """The chunk's post-RoPE keys and values [Tq, H, d] f32 as the exact store keeps them
        (``pool.as_stored`` of the pre-RoPE key; a res4 store over the codes of ``slots``, the
        chunk's), so a window token reads the same whether this forward or an earlier one wrote
        it (as the CPU path); unchanged without windows."""
        if not self.windows:
            return k_chunk.float(), v_chunk.float()
        coded = self.pool.read_codes(layer_id, slots) if self.pool.exact.fmt == "res4" else None
        pre, v = self.pool.as_stored(rotate(k_chunk, cos, sin, inverse=True), v_chunk, coded)
        return rotate(pre, cos, sin), v

    def _prefix_exact(self, lid: int, slots: torch.Tensor):
        """Exact pre-RoPE k, v [P, H, d] f32 of prefix slots that all lie in every query's window
        (``begin_forward`` checked that their entries are present)."""
        ex = self.pool.exact
        return ex.read(lid, ex.entry_of[slots])

    # ---- per-forward plan (decode) -----------------------------------------------------------
    def _plan(self, fb, md, dev) -> list:
        """Request groups with their kv index tensors (and window rows), shared by all layers."""
        n = list(md["seq_lens"])
        seq_dev = fb.seq_lens.to(dev, torch.int64)
        rows_dev = fb.req_pool_indices.to(dev, torch.int64)
        groups, b0 = [], 0
        while b0 < len(n):
            b1, tot = b0 + 1, n[b0]
            while b1 < len(n) and tot + n[b1] <= self.max_view_tokens:
                tot, b1 = tot + n[b1], b1 + 1
            g = self._group(rows_dev[b0:b1], seq_dev[b0:b1], n[b0:b1], tot, dev)
            g.b0, g.b1 = b0, b1
            groups.append(g)
            b0 = b1
        return groups

    def _group(self, rows, n_dev, n_host, tot, dev) -> SimpleNamespace:
        ptr, owner, off = _ragged(n_dev, tot)
        slots = self.req_to_token[rows[owner], off].to(torch.int64)
        g = SimpleNamespace(
            tot=tot, max_n=max(n_host),
            kv_indptr=ptr.to(torch.int32),
            # one padding row (slot 0) keeps every view and index list non-empty
            kv_indices=torch.arange(tot + 1, dtype=torch.int32, device=dev),
            slots=torch.cat([slots, torch.zeros(1, dtype=torch.int64, device=dev)]),
            win=None)
        if self.windows:
            sink, recent = self.cfg.sink_window, self.cfg.recent_window
            n_sink = n_dev.clamp(max=sink)
            count = n_sink + (n_dev - n_sink).clamp(max=recent)
            tw = sum(min(m, sink) + min(recent, m - min(m, sink)) for m in n_host)
            _, wown, woff = _ragged(count, tw)
            pos = torch.where(woff < n_sink[wown], woff, n_dev[wown] - (count[wown] - woff))
            slot = self.req_to_token[rows[wown], pos].to(torch.int64)
            ent = self.pool.exact.entry_of[slot]
            valid = (ent > 0) & self.pool.in_window(pos, n_dev[wown])
            g.win = SimpleNamespace(crow=ptr[wown] + pos, ent=ent, valid=valid[:, None, None])
        return g

    def _kept_view(self, lid: int, g, view) -> torch.Tensor:
        """Group g's kept flags u8 [rows] for a layer that reads salient tokens, with their exact
        pre-RoPE k, v written into the view's k_full/v_full rows. The flags change only at the
        deciding layer (before its attention), so they are read once per forward, at the first
        layer that reads them (one host sync), and reused by the later layers."""
        ex = self.pool.exact
        if getattr(g, "kept", None) is None:
            flags = ex.kept[g.slots].to(torch.uint8)
            flags[-1] = 0  # the padding row
            rows = torch.nonzero(flags).flatten()
            ent = ex.entry_of[g.slots[rows]]
            if not bool((ent > 0).all()):
                raise RuntimeError("tasq: a kept (salient) slot has no exact entry")
            g.kept = SimpleNamespace(flags=flags.contiguous(), rows=rows, ent=ent)
        k_full, v_full = view[3], view[4]
        kx, vx = ex.read(lid, g.kept.ent)
        k_full[g.kept.rows] = kx.to(k_full.dtype)
        v_full[g.kept.rows] = vx.to(v_full.dtype)
        return g.kept.flags

    # ---- per-layer compact view (decode) -----------------------------------------------------
    def _view(self, lid: int, tb, g):
        """(k_codes, v_codes, k_scale, k_full, v_full) of group g in layer lid, rows = kv order."""
        pool, cfg = self.pool, self.cfg
        H, d, Bk = pool.head_num, pool.head_dim, tb.k_row_bytes
        krows = pool.k_buffer[lid].index_select(0, g.slots)
        k_codes = krows[:, :Bk].contiguous()
        v_codes = pool.v_buffer[lid].index_select(0, g.slots)
        rows = krows.shape[0]
        if cfg.scale == "none":
            k_scale = torch.ones(1, dtype=torch.float16, device=krows.device)
        else:
            k_scale = torch.empty_like(krows[:, Bk:], memory_format=torch.contiguous_format).copy_(krows[:, Bk:]).view(torch.float16)
            k_scale = k_scale.reshape(rows) if cfg.scale == "shared" else k_scale.reshape(rows, H)
        if g.win is None:
            return k_codes, v_codes, k_scale, None, None
        w = g.win
        k_dec, v_dec = self._decode_rows(k_codes[w.crow], v_codes[w.crow],
                                         k_scale[w.crow] if cfg.scale != "none" else None, tb)
        k_full = torch.empty(rows, H, d, dtype=self.full_dtype, device=krows.device)
        v_full = torch.empty(rows, H, d, dtype=self.full_dtype, device=krows.device)
        ex = pool.exact
        kx, vx = ex.read(lid, w.ent)
        k_full[w.crow] = torch.where(w.valid, kx, k_dec).to(self.full_dtype)
        v_full[w.crow] = torch.where(w.valid, vx, v_dec).to(self.full_dtype)
        return k_codes, v_codes, k_scale, k_full, v_full
