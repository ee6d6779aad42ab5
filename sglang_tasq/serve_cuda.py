"""CUDA path of the 'tasq' backend: Numba encode into the pool, split-K attention over a compact view.

:class:`TaSQCudaAdapter` takes what the backend gets (q, k, v, layer, forward_batch, the
pool, the backend's per-forward metadata) and runs ``numba_kernels.ops``:

- store: keys are un-rotated to pre-RoPE (as the CPU path does), ``encode_kv`` writes codes and
  scales into a scratch pool of ``T`` rows, the packed rows are copied to the slots
  ``out_cache_loc`` (:meth:`TaSQTokenToKVPool.write_rows`) and the window tokens to the
  request rings (:meth:`TaSQTokenToKVPool.write_windows`, no host sync);
- attend: ``decode_attention`` (decode) or ``extend_attention`` (chunk exact, prefix from the
  pool), with ``kv_indptr``/``kv_indices`` built on the device from ``req_to_token``.

Layout reconciliation. The kernels read ``k_codes [S, Bk]``, ``k_scale fp16 [S]`` and, for the
windows, ``k_full``/``v_full [S, H, d]`` indexed by the SAME slot id as the codes (shape checked
against ``k_codes``). A pool-sized ``k_full`` would cost as much as a bf16 cache, so the pool
keeps its per-request rings and its packed key row (codes ++ scale: SGLang's per-slot copies,
e.g. ``get_cpu_copy``, keep moving a whole token). Per forward and layer the adapter builds a
COMPACT view over the batch's kv tokens: row ``j`` of the view is the ``j``-th kv token of the
batch (``kv_indices = arange``), codes/scales are gathered from the pool rows, and
``k_full``/``v_full`` (uninitialised except on window rows) get, on every window row, the ring
entry when the ring holds that position inside the window of the request's full length, else the
decoded codes: exactly what the CPU path (:meth:`TaSQTokenToKVPool.read_request`) reads. The view
is built for groups of requests of at most ``max_view_tokens`` kv tokens (memory bound).
"""
from __future__ import annotations

import os
from types import SimpleNamespace

import torch
from sglang.srt.mem_cache.memory_pool import unwrap_write_loc

from .rope import apply_rope

PLAN_KEY = "tasq_cuda_plan"


def _view_tokens() -> int:
    return int(os.environ.get("SGLANG_TASQ_CUDA_VIEW_TOKENS", "32768"))


def _ragged(lens: torch.Tensor, total: int):
    """lens [B] int64 (device) -> (indptr [B+1], owner [total], offset [total]); no host sync."""
    dev = lens.device
    ptr = torch.zeros(lens.numel() + 1, dtype=torch.int64, device=dev)
    ptr[1:] = torch.cumsum(lens, 0)
    owner = torch.repeat_interleave(torch.arange(lens.numel(), device=dev), lens, output_size=total)
    return ptr, owner, torch.arange(total, device=dev) - ptr[owner]


def unpack_codes(packed: torch.Tensor, n: int, bits: int) -> torch.Tensor:
    """Device-side twin of :func:`codec.unpack_codes`: packed [T, nb] uint8 -> codes [T, n] int64."""
    T, nb = packed.shape
    dev = packed.device
    bit = (packed.to(torch.int64).unsqueeze(-1) >> torch.arange(8, device=dev)) & 1
    bit = bit.reshape(T, nb * 8)[:, : n * bits].reshape(T, n, bits)
    return (bit << torch.arange(bits, device=dev)).sum(-1)


def _codewords(codes: torch.Tensor, cb: torch.Tensor) -> torch.Tensor:
    """codes [T, H, G], cb [H, G, K, g] -> [T, H, G*g] f32."""
    T, H, G = codes.shape
    hh = torch.arange(H, device=codes.device).view(1, H, 1)
    gg = torch.arange(G, device=codes.device).view(1, 1, G)
    return cb[hh, gg, codes].reshape(T, H, G * cb.shape[-1]).float()


class TaSQCudaAdapter:
    """Backend inputs -> Numba kernels. Device-agnostic (CPU tensors run in the simulator)."""

    def __init__(self, pool, req_to_token_pool, ops=None, full_dtype=torch.bfloat16, max_view_tokens=None):
        if ops is None:
            from numba_kernels import ops  # noqa: WPS433 (imports numba)
        self.ops, self.pool, self.req_to_token = ops, pool, req_to_token_pool.req_to_token
        self.full_dtype = full_dtype
        self.max_view_tokens = max_view_tokens or _view_tokens()
        self.cfg = pool.tasq_config
        self.windows = pool.ring_of is not None and (self.cfg.sink_window + self.cfg.recent_window) > 0
        self._tables: dict = {}

    def tables(self, layer_id: int, device):
        """The layer's LayerTables on ``device``, built on first use."""
        key = (layer_id, str(device))
        if key not in self._tables:
            from numba_kernels.tables import LayerTables  # noqa: WPS433

            self._tables[key] = LayerTables.from_codebooks(self.pool.codebooks, layer_id, device)
        return self._tables[key]

    # ---- entry -------------------------------------------------------------------------------
    def forward(self, q3, k, v, layer, fb, md, save_kv_cache=True) -> torch.Tensor:
        """q3 [N, Hq, d] post-RoPE; k, v [N, H*d] (post-RoPE keys) or None -> out [N, Hq, d] f32."""
        tb = self.tables(layer.layer_id, q3.device)
        H, d = self.pool.head_num, self.pool.head_dim
        decode = fb.forward_mode.is_decode()
        if save_kv_cache and k is not None and v is not None:
            self.store(layer, fb, k.reshape(-1, H, d), v.reshape(-1, H, d), md, tb)
        if not decode and (k is None or v is None):
            raise NotImplementedError("tasq: the CUDA extend path needs the chunk's k and v")
        plan = md.get(PLAN_KEY)
        if plan is None:
            plan = md[PLAN_KEY] = self._plan(fb, md, q3.device, decode)
        out = torch.empty(q3.shape, dtype=torch.float32, device=q3.device)
        lid = layer.layer_id - self.pool.start_layer
        sink, recent = (self.cfg.sink_window, self.cfg.recent_window) if self.windows else (0, 0)
        for g in plan:
            view = self._view(lid, tb, g)
            if decode:
                self.ops.decode_attention(q3[g.b0:g.b1], *view[:3], g.kv_indptr, g.kv_indices, tb, layer.scaling,
                                          *view[3:], sink=sink, recent=recent, out=out[g.b0:g.b1],
                                          max_kv_len=g.max_n)
            else:
                rows = slice(g.q0, g.q1)
                kc = k.reshape(-1, H, d)[rows].contiguous()
                vc = v.reshape(-1, H, d)[rows].to(kc.dtype).contiguous()
                self.ops.extend_attention(q3[rows], kc, vc, g.qo_indptr, *view[:3], g.kv_indptr, g.kv_indices,
                                          tb, layer.scaling, *view[3:], sink=sink, recent=recent, out=out[rows])
        return out

    # ---- store -------------------------------------------------------------------------------
    def store(self, layer, fb, k, v, md, tb) -> None:
        """Encode the new tokens k (post-RoPE), v [T, H, d] into slots ``fb.out_cache_loc``."""
        loc, _, _ = unwrap_write_loc(fb.out_cache_loc)
        T = loc.shape[0]
        if T == 0:
            return
        lid = layer.layer_id - self.pool.start_layer
        positions = fb.positions.to(torch.int64)
        k_pre = apply_rope(k, positions, tb.inv_freq, tb.attention_scaling, inverse=True).contiguous()
        v = v.contiguous()
        scratch = tb.allocate_pool(T, k.device)
        self.ops.encode_kv(k_pre, v, torch.arange(T, dtype=torch.int32, device=k.device), tb,
                           scratch["k_codes"], scratch["v_codes"], scratch["k_scale"])
        scale = scratch["k_scale"] if self.cfg.scale != "none" else None
        self.pool.write_rows(lid, loc, scratch["k_codes"], scale, scratch["v_codes"])
        self.pool.write_windows(lid, positions, k_pre, v, md["rows"], md["tok_seq_lens"])

    # ---- per-forward plan --------------------------------------------------------------------
    def _plan(self, fb, md, dev, decode: bool) -> list:
        """Request groups with their kv index tensors (and window rows), shared by all layers."""
        S, Tq = md["seq_lens"], md["q_lens"]
        n = list(S) if decode else [s - t for s, t in zip(S, Tq)]
        seq_dev = fb.seq_lens.to(dev, torch.int64)
        rows_dev = fb.req_pool_indices.to(dev, torch.int64)
        n_dev = seq_dev if decode else seq_dev - fb.extend_seq_lens.to(dev, torch.int64)
        groups, b0, q0 = [], 0, 0
        while b0 < len(n):
            b1, tot = b0 + 1, n[b0]
            while b1 < len(n) and tot + n[b1] <= self.max_view_tokens:
                tot, b1 = tot + n[b1], b1 + 1
            q1 = q0 + sum(Tq[b0:b1])
            g = self._group(rows_dev[b0:b1], n_dev[b0:b1], seq_dev[b0:b1], n[b0:b1], tot, dev)
            g.b0, g.b1, g.q0, g.q1 = b0, b1, q0, q1
            if not decode:
                qo = torch.tensor([0] + Tq[b0:b1], dtype=torch.int64).cumsum(0)
                g.qo_indptr = qo.to(torch.int32).to(dev)
            groups.append(g)
            b0, q0 = b1, q1
        return groups

    def _group(self, rows, n_dev, seq_dev, n_host, tot, dev) -> SimpleNamespace:
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
            ring = self.pool.ring_of[rows[wown]]
            idx = self.pool.window_index(pos)
            held = (ring > 0) & (self.pool.win_pos[ring, idx] == pos)
            valid = held & self.pool.in_window(pos, seq_dev[wown])
            g.win = SimpleNamespace(crow=ptr[wown] + pos, ring=ring, idx=idx, valid=valid[:, None, None])
        return g

    # ---- per-layer compact view --------------------------------------------------------------
    def _view(self, lid: int, tb, g):
        """(k_codes, v_codes, k_scale, k_full, v_full) of group g in layer lid, rows = kv order."""
        pool, cfg = self.pool, self.cfg
        H, d, Bk = pool.head_num, pool.head_dim, pool.code_bytes_k
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
        kc = unpack_codes(k_codes[w.crow], H * pool.gk, cfg.code_bits_k).view(-1, H, pool.gk)
        vc = unpack_codes(v_codes[w.crow], H * pool.gv, cfg.code_bits_v).view(-1, H, pool.gv)
        kp = _codewords(kc, tb.k_cb)
        if cfg.scale != "none":
            s = k_scale[w.crow].float()
            kp = kp * (s[:, None, None] if s.dim() == 1 else s[:, :, None])
        k_dec = torch.empty_like(kp).scatter_(2, tb.k_perm.long().unsqueeze(0).expand_as(kp), kp)
        v_dec = _codewords(vc, tb.v_cb)
        k_full = torch.empty(rows, H, d, dtype=self.full_dtype, device=krows.device)
        v_full = torch.empty(rows, H, d, dtype=self.full_dtype, device=krows.device)
        k_full[w.crow] = torch.where(w.valid, pool.win_k[lid][w.ring, w.idx].float(), k_dec).to(self.full_dtype)
        v_full[w.crow] = torch.where(w.valid, pool.win_v[lid][w.ring, w.idx].float(), v_dec).to(self.full_dtype)
        return k_codes, v_codes, k_scale, k_full, v_full
