"""TaSQ KV pool for SGLang: packed VQ codes per token slot plus per-request full-precision windows.

Per layer and token slot (``rows = size + page_size``; slot 0 absorbs padding writes):

- ``k_buffer[l]``: uint8 ``[rows, Bk + Bs]``: the packed key codes of all heads (code
  ``n = h*Gk + j``, :func:`codec.pack_codes` layout) followed by the fp16 shared scale
  (``Bs = 2``; ``2*H`` for per-head scales, 0 without).
- ``v_buffer[l]``: uint8 ``[rows, Bv]``: the packed value codes.

SmolLM2 (H=3, d=64, g=8, K=1024): 30 + 2 + 30 = 62 bytes per token per layer vs 768 in bf16.

Full-precision windows (sink = first ``sink_window`` positions, recent = last
``recent_window`` positions) live in per-request rings:
``win_k[l]``, ``win_v[l]``: bf16 ``[N + 1, W, H, d]`` (pre-RoPE keys), ``W = sink + recent``,
with ``win_pos[N + 1, W]`` holding the position each entry stores (-1 = empty); ``N`` =
``window_ring_rows()`` (env ``SGLANG_TASQ_WINDOW_ROWS``, default 128); a ring is bound to a request row when SGLang
allocates the row (``ring_of``) and returned when it frees it. Position ``p`` lives at ring
index ``p`` (sink) or ``sink + p % recent`` (recent). A ring is cleared when it is bound, so
only tokens the request wrote itself are read in full precision; tokens of a prefix shared through the radix cache are
read from their codes (codes are per slot, so sharing, chunked prefill, retraction and
aborts need nothing else). The rings are a fixed cost per request row, charged to the
memory budget by the plugin's pool-sizing hook (:func:`window_bytes`).
"""
from __future__ import annotations

import os
from typing import Optional

import torch
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, unwrap_write_loc

from . import codec, fastpath
from .launch import runtime_artifact
from .rope import apply_rope


def window_ring_rows() -> int:
    """How many requests can hold full-precision windows at once (SGLANG_TASQ_WINDOW_ROWS, 128)."""
    return int(os.environ.get("SGLANG_TASQ_WINDOW_ROWS", "128"))


def scale_bytes(cfg, num_kv_heads: int) -> int:
    return {"shared": 2, "per_head": 2 * num_kv_heads, "none": 0}[cfg.scale]


def row_bytes(cfg, num_kv_heads: int, head_dim: int) -> tuple[int, int]:
    """(key row bytes incl. scale, value row bytes) per token per layer."""
    gk, gv = head_dim // cfg.group_size_k, head_dim // cfg.group_size_v
    kb = codec.packed_row_bytes(num_kv_heads * gk, cfg.code_bits_k) + scale_bytes(cfg, num_kv_heads)
    vb = codec.packed_row_bytes(num_kv_heads * gv, cfg.code_bits_v)
    return kb, vb


def bytes_per_token(cfg, num_kv_heads: int, head_dim: int, num_layers: int) -> int:
    """The pool's true cost per token slot over all layers (codes + scale)."""
    kb, vb = row_bytes(cfg, num_kv_heads, head_dim)
    return (kb + vb) * num_layers


def window_bytes(cfg, num_kv_heads: int, head_dim: int, num_layers: int, req_rows: int) -> int:
    """Bytes of the bf16 window rings (keys + values + positions) for ``req_rows`` rows."""
    W = cfg.sink_window + cfg.recent_window
    return req_rows * W * (2 * num_kv_heads * head_dim * 2 * num_layers + 8)


class TaSQTokenToKVPool(MHATokenToKVPool):
    """MHATokenToKVPool whose per-slot storage is packed TaSQ codes (see module docstring)."""

    def _create_buffers(self):
        art = runtime_artifact()
        self.codebooks = art.codebooks
        self.tasq_config = cfg = art.config
        H, d = self.head_num, self.head_dim
        self.gk, self.gv = d // cfg.group_size_k, d // cfg.group_size_v
        self.code_bytes_k = codec.packed_row_bytes(H * self.gk, cfg.code_bits_k)
        self.scale_bytes = scale_bytes(cfg, H)
        self.code_bytes_v = codec.packed_row_bytes(H * self.gv, cfg.code_bits_v)
        self.store_dtype = torch.uint8
        rows = self.size + self.page_size
        for name in ("k_scale_buffer", "v_scale_buffer", "native_k_scale_buffer", "native_v_scale_buffer",
                     "dq_k_buffer", "dq_v_buffer"):
            setattr(self, name, None)
        with self.memory_saver_adapter.region("kv_cache"):
            self.k_buffer = [torch.zeros(rows, self.code_bytes_k + self.scale_bytes, dtype=torch.uint8, device=self.device)
                             for _ in range(self.layer_num)]
            self.v_buffer = [torch.zeros(rows, self.code_bytes_v, dtype=torch.uint8, device=self.device)
                             for _ in range(self.layer_num)]
        self.window = cfg.sink_window + cfg.recent_window
        self.win_k = self.win_v = self.win_pos = self.ring_of = None
        n = window_ring_rows()
        if self.window and n:
            with self.memory_saver_adapter.region("kv_cache"):
                # ring 0 is the "no window" ring: never valid (win_pos stays -1, writes dropped)
                self.win_k = [torch.zeros(n + 1, self.window, H, d, dtype=torch.bfloat16, device=self.device)
                              for _ in range(self.layer_num)]
                self.win_v = [torch.zeros(n + 1, self.window, H, d, dtype=torch.bfloat16, device=self.device)
                              for _ in range(self.layer_num)]
                self.win_pos = torch.full((n + 1, self.window), -1, dtype=torch.int64, device=self.device)
        # CPU fast paths, tested against the reference codec: codebooks prepared once per layer;
        # Numba kernels (numba_kernels.cpu) unless SGLANG_TASQ_CPU_KERNELS=0 (plain torch)
        self.cpu_kernels = fastpath.cpu_kernels_enabled()
        self._near_k = fastpath.layer_nearest(self.codebooks.tailored_k_codebook)
        self._near_v = fastpath.layer_nearest(lambda layer: self.codebooks.v_codebook[layer])
        self._unpack_idx, self._dec_tables = {}, {}
        self._rope = None
        self._encoder = None
        if self.cpu_kernels and self.codebooks.k_mix is None:
            from numba_kernels.cpu import PoolEncoder

            self._encoder = PoolEncoder(self.codebooks)
        self._kv_buffer_descs = self._build_kv_buffer_descs()
        self._init_data_ptrs_and_strides()

    # ---- windows ---------------------------------------------------------------------------
    def attach_request_rows(self, req_to_token_pool) -> None:
        """Map request rows onto the window rings (bound on row alloc, returned on row free).
        A request that finds no free ring gets no windows (reads codes only)."""
        if self.win_k is None or self.ring_of is not None:
            return
        n = self.win_pos.shape[0] - 1
        self.ring_of = torch.zeros(req_to_token_pool.req_to_token.shape[0], dtype=torch.int64, device=self.device)
        self._free_rings = list(range(n, 0, -1))
        previous_alloc, original_free = req_to_token_pool._on_alloc_rows, req_to_token_pool.free_rows

        def on_alloc_rows(rows):
            for r in rows:
                ring = self._free_rings.pop() if self._free_rings else 0
                self.ring_of[r] = ring
                if ring:
                    self.win_pos[ring] = -1
            if previous_alloc is not None:
                previous_alloc(rows)

        def free_rows(rows):
            for r in rows:
                ring = int(self.ring_of[r])
                if ring:
                    self._free_rings.append(ring)
                self.ring_of[r] = 0
            return original_free(rows)

        original_clear = req_to_token_pool.clear

        def clear():
            self.ring_of.zero_()
            self._free_rings = list(range(n, 0, -1))
            return original_clear()

        req_to_token_pool._on_alloc_rows = on_alloc_rows
        req_to_token_pool.free_rows = free_rows
        req_to_token_pool.clear = clear

    def window_index(self, positions: torch.Tensor) -> torch.Tensor:
        """positions [T] -> ring index [T] (valid for sink and recent positions)."""
        sink, recent = self.tasq_config.sink_window, self.tasq_config.recent_window
        if recent == 0:
            return positions.clamp(max=max(sink - 1, 0))
        return torch.where(positions < sink, positions, sink + positions % recent)

    def in_window(self, positions: torch.Tensor, seq_len: int) -> torch.Tensor:
        """[T] bool: positions inside the sink or the last ``recent`` positions of ``seq_len``."""
        cfg = self.tasq_config
        return (positions < cfg.sink_window) | (positions >= seq_len - cfg.recent_window)

    # ---- writes ----------------------------------------------------------------------------
    def rope_table(self, n: int):
        """cos, sin [m >= n, d/2] float32 for positions 0..m-1 (``rope.cos_sin``; cached, grown by doubling)."""
        tab = self._rope
        if tab is None or tab[0].shape[0] < n:
            from .rope import cos_sin

            m = max(n, 2 * (tab[0].shape[0] if tab is not None else 0), 1024)
            cb = self.codebooks
            tab = self._rope = cos_sin(torch.arange(m, device=self.device), cb.inv_freq.to(self.device),
                                       cb.attention_scaling)
        return tab

    def window_targets(self, positions, req_rows, seq_lens):
        """(ring [T], ring index [T]) where each of T new tokens goes (ring 0: not kept), or None
        without rings. Same for every layer of a forward: the backend computes it once."""
        if self.ring_of is None or req_rows is None:
            return None
        keep = self.in_window(positions, 0) if seq_lens is None else self._keep_mask(positions, seq_lens)
        ring = self.ring_of[req_rows]
        keep = keep & (ring > 0)
        return torch.where(keep, ring, 0), self.window_index(positions), torch.where(keep, positions, -1)

    def set_kv_buffer(self, layer, loc, cache_k, cache_v, *args, positions=None, req_rows=None,
                      seq_lens=None, win_targets=None, **kwargs):
        """Encode and store one layer's new tokens.

        cache_k: [T, H*d] or [T, H, d] POST-RoPE keys; cache_v likewise; positions [T] int
        (required: keys are un-rotated before encoding); req_rows [T] request row of each
        token and seq_lens [T] the request's kv length after this forward (for the windows);
        win_targets: :meth:`window_targets` of those, when the caller has it already.
        """
        if positions is None:
            raise NotImplementedError("TaSQTokenToKVPool.set_kv_buffer needs positions= (keys arrive "
                                      "post-RoPE); write through the 'tasq' attention backend")
        loc, _, _ = unwrap_write_loc(loc)
        lid = layer.layer_id - self.start_layer
        T, H, d = loc.shape[0], self.head_num, self.head_dim
        cb = self.codebooks
        if self._encoder is not None and T and not cache_k.is_cuda:
            if win_targets is None:
                win_targets = self.window_targets(positions, req_rows, seq_lens)
            cos, sin = self.rope_table(int(positions.max()) + 1)
            wr = wi = None
            if win_targets is not None:
                wr, wi, wpos = win_targets
            done = self._encoder.encode_into(
                layer.layer_id, cache_k.reshape(T, H, d), cache_v.reshape(T, H, d), positions, cos, sin, loc,
                self.k_buffer[lid], self.v_buffer[lid], self.code_bytes_k, wr, wi,
                self.win_k[lid] if wr is not None else None, self.win_v[lid] if wr is not None else None)
            if done:
                if wr is not None and lid == 0:
                    self.win_pos[wr, wi] = wpos
                return
        k_pre = apply_rope(cache_k.reshape(T, H, d), positions, cb.inv_freq, cb.attention_scaling, inverse=True)
        v = cache_v.reshape(T, H, d)
        x, k_scale = codec.key_tailor(k_pre, cb, layer.layer_id)  # == codec.encode_keys / encode_values
        k_codes = self._near_k(x, layer.layer_id)
        gv = self.tasq_config.group_size_v
        v_codes = self._near_v(v.float().view(T, H, d // gv, gv), layer.layer_id)
        pack = fastpath.pack
        krow = pack(k_codes.reshape(T, H * self.gk), self.tasq_config.code_bits_k)
        vrow = pack(v_codes.reshape(T, H * self.gv), self.tasq_config.code_bits_v)
        self.write_rows(lid, loc, krow, k_scale, vrow)
        self.write_windows(lid, positions, k_pre, v, req_rows, seq_lens)

    def write_rows(self, lid: int, loc, k_packed, k_scale, v_packed) -> None:
        """Store packed key codes [T, Bk] (+ fp16 scales [T] / [T, H] or None) and packed value
        codes [T, Bv] of local layer ``lid`` at slots ``loc`` (the key row is codes ++ scale bytes)."""
        T = k_packed.shape[0]
        if k_scale is not None and self.scale_bytes:
            k_packed = torch.cat([k_packed, k_scale.reshape(T, -1).contiguous().view(torch.uint8)], dim=1)
        self.k_buffer[lid][loc] = k_packed.to(self.device)
        self.v_buffer[lid][loc] = v_packed.to(self.device)

    def write_windows(self, lid: int, positions, k_pre, v, req_rows, seq_lens) -> None:
        """Copy the window tokens among [T] new ones (pre-RoPE keys k_pre, values v [T, H, d]) into
        their requests' rings; req_rows [T] request rows, seq_lens [T] kv length after this forward."""
        if self.ring_of is None or req_rows is None:
            return
        keep = self.in_window(positions, 0) if seq_lens is None else self._keep_mask(positions, seq_lens)
        ring = self.ring_of[req_rows]
        keep = keep & (ring > 0)
        # no host sync: dropped tokens land in ring 0, which is never read (its positions stay -1)
        rows, idx = torch.where(keep, ring, 0), self.window_index(positions)
        self.win_k[lid][rows, idx] = k_pre.to(torch.bfloat16)
        self.win_v[lid][rows, idx] = v.to(torch.bfloat16)
        if lid == 0:
            self.win_pos[rows, idx] = torch.where(keep, positions, -1)

    def _keep_mask(self, positions, seq_lens):
        cfg = self.tasq_config
        return (positions < cfg.sink_window) | (positions >= seq_lens - cfg.recent_window)

    # ---- reads -----------------------------------------------------------------------------
    def read_request(self, layer_id: int, slots: torch.Tensor, req_row: int, seq_len: int):
        """One request's cache: slots [S] (positions 0..S-1) -> pre-RoPE keys, values [S, H, d] f32.

        Codes are decoded with the reference codec; entries held in the request's window ring
        (and inside the window of ``seq_len``) replace them in full precision.
        """
        lid = layer_id - self.start_layer
        S, H, d = slots.shape[0], self.head_num, self.head_dim
        cfg, cb = self.tasq_config, self.codebooks
        krow = self.k_buffer[lid][slots]
        k_codes = self._unpack(krow[:, : self.code_bytes_k], H * self.gk, cfg.code_bits_k).view(S, H, self.gk)
        scale = None
        if self.scale_bytes:
            sb = krow[:, self.code_bytes_k:]  # copied to a fresh buffer: a 1-row slice keeps an odd offset
            scale = torch.empty_like(sb, memory_format=torch.contiguous_format).copy_(sb).view(torch.float16)
            scale = scale.reshape(S) if cfg.scale == "shared" else scale.reshape(S, H)
        v_codes = self._unpack(self.v_buffer[lid][slots], H * self.gv, cfg.code_bits_v).view(S, H, self.gv)
        k, v = self._decode(k_codes, scale, v_codes, layer_id)
        ring = int(self.ring_of[req_row]) if self.ring_of is not None else 0
        if ring:
            req_row = ring
            pos = torch.arange(S, device=slots.device)
            idx = self.window_index(pos)
            valid = self.in_window(pos, seq_len) & (self.win_pos[req_row, idx] == pos)
            if bool(valid.any()):
                k[valid] = self.win_k[lid][req_row, idx[valid]].float()
                v[valid] = self.win_v[lid][req_row, idx[valid]].float()
        return k, v

    def _unpack(self, packed: torch.Tensor, n: int, bits: int) -> torch.Tensor:
        """== codec.unpack_codes: each code read from the (at most 3) bytes it spans, one gather."""
        if bits > 17:
            return codec.unpack_codes(packed, n, bits)
        key = (n, bits, packed.device)
        tab = self._unpack_idx.get(key)
        if tab is None:
            start = torch.arange(n, dtype=torch.int64) * bits
            nb = packed.shape[1]
            idx = (start // 8).unsqueeze(1) + torch.arange(3)
            tab = self._unpack_idx[key] = (idx.clamp(max=nb - 1).reshape(-1).to(packed.device),
                                           (idx < nb).to(torch.int32).to(packed.device),
                                           (start % 8).to(torch.int32).to(packed.device))
        idx, ok, shift = tab
        T = packed.shape[0]
        if packed.shape[1] != codec.packed_row_bytes(n, bits):
            return codec.unpack_codes(packed, n, bits)  # raises the reference error
        b = packed.index_select(1, idx).view(T, n, 3).to(torch.int32) * ok
        word = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16)
        return ((word >> shift) & ((1 << bits) - 1)).to(torch.int64)

    def _decode(self, k_codes, scale, v_codes, layer_id: int):
        """== (codec.decode_keys, codec.decode_values) with flattened codebooks prepared once."""
        cb = self.codebooks
        if cb.k_unmix is not None:
            return codec.decode_keys(k_codes, scale, cb, layer_id), codec.decode_values(v_codes, cb, layer_id)
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
            s = scale.float()
            k = k * (s[:, None, None] if s.dim() == 1 else s[:, :, None])
        k = torch.gather(k, 2, inv.unsqueeze(0).expand(S, H, -1))
        v = vflat.index_select(0, (v_codes + voff).reshape(-1)).view(S, H, v_codes.shape[2] * vflat.shape[1])
        return k, v

    def get_kv_size_bytes(self):
        """(key bytes, value bytes) actually held, the window rings and their positions included."""
        k, v = super().get_kv_size_bytes()
        if self.win_k is not None:
            k += sum(t.numel() * t.element_size() for t in self.win_k) + self.win_pos.numel() * 8
            v += sum(t.numel() * t.element_size() for t in self.win_v)
        return k, v
