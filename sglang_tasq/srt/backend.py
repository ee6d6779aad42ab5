"""The 'tasq' SGLang attention backend: extend and decode over the compressed TaSQ pool.

Every forward first stores the new tokens (``TaSQTokenToKVPool.set_kv_buffer``: keys are
un-rotated to pre-RoPE with ``forward_batch.positions``, encoded, packed), then attends.
Design choice for extend (prefill and chunked prefill), as a fused kernel would do it and as
the HF reference cache does (``fresh_exact``): the chunk's own tokens are attended with their
EXACT k/v; the prefix (earlier chunks, radix-cached tokens) is read from the pool: decoded
codes, or the request's full-precision window entries. Decode reads everything from the pool
(the new token is in the recent window). RoPE position of a cached token = its index in the
request's ``req_to_token`` row (plain Llama-family models).

CPU path, decode: one Numba kernel call per layer for the whole batch
(:func:`numba_kernels.cpu.decode_attention`: unpack, folded decode, RoPE, softmax, value
decode, windows); ``SGLANG_TASQ_CPU_KERNELS=0`` selects the torch path below instead.
CPU path, extend (and decode without the kernels): per request, decode the codes of its ``P = S - Tq`` prefix tokens with the
reference codec (:mod:`sglang_tasq.codec`), re-apply RoPE at positions ``0..P-1``, append the
chunk's post-RoPE keys and values, and run fp32 causal attention (queries ``[Tq, Hq, d]`` at
positions ``P..S-1``). CUDA path: :class:`sglang_tasq.srt.serve_cuda.TaSQCudaAdapter` (Numba
encode into the pool, split-K kernels of ``numba_kernels.ops`` over a compact view of it),
dispatched in :meth:`TaSQAttnBackend._forward`.
"""
from __future__ import annotations

import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

import torch.nn.functional as F

from .. import windows
from ..rope import cos_sin, rotate


def _cuda_adapter(pool, req_to_token_pool):
    try:
        from .serve_cuda import TaSQCudaAdapter  # noqa: WPS433 (imports the optional Numba kernels)

        return TaSQCudaAdapter(pool, req_to_token_pool)
    except ImportError as e:
        raise NotImplementedError(
            "tasq: the CUDA path needs the Numba kernels (numba_kernels.ops), which are not "
            f"available ({e}); serve on CPU (--device cpu)") from None


class TaSQAttnBackend(AttentionBackend):
    """Attention over packed TaSQ codes; decode/extend share one per-request reader."""

    def __init__(self, model_runner):
        super().__init__()
        self.device = model_runner.device
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.pool = model_runner.token_to_kv_pool
        from .pool import TaSQTokenToKVPool

        if not isinstance(self.pool, TaSQTokenToKVPool):
            raise RuntimeError(f"tasq: attention backend 'tasq' needs the TaSQ KV pool, got "
                               f"{type(self.pool).__name__} (start with --tasq-config PATH)")
        self.pool.attach_request_rows(self.req_to_token_pool)
        self.codebooks = self.pool.codebooks
        self.forward_metadata = None
        self._cuda = None
        # Numba CPU decode kernel: all requests of a decode batch in one call per layer
        self._decode_kernel = self.pool.cpu_kernels and self.codebooks.k_unmix is None
        self._decode_tables = {}

    # ---- metadata ----------------------------------------------------------------------------
    def init_forward_metadata(self, forward_batch):
        """Per-token request rows and kv lengths; the window entries of the new tokens (assigned
        once per forward) after pinning every request's windows (:meth:`TaSQTokenToKVPool.begin_forward`);
        per-request lists on CPU."""
        fb = forward_batch
        seq_lens = fb.seq_lens.to(torch.int64)
        if fb.forward_mode.is_decode():
            q_lens = torch.ones_like(seq_lens)
        else:
            q_lens = fb.extend_seq_lens.to(torch.int64)
        rows = torch.repeat_interleave(fb.req_pool_indices.to(torch.int64), q_lens)
        tok_seq = torch.repeat_interleave(seq_lens, q_lens)
        md = self.forward_metadata = dict(
            rows=rows, tok_seq_lens=tok_seq,
            req_rows=fb.req_pool_indices.tolist(), seq_lens=seq_lens.tolist(), q_lens=q_lens.tolist(),
        )
        md["prefix_lens"] = [S - t for S, t in zip(md["seq_lens"], md["q_lens"])]
        self.pool.begin_forward(md["req_rows"], md["prefix_lens"], md["seq_lens"])
        md["positions"] = fb.positions.to(torch.int64)
        if fb.out_cache_loc is not None and md["positions"].numel():
            md["win_targets"] = self.pool.window_targets(md["positions"], rows, tok_seq, fb.out_cache_loc)
        if self._decode_kernel and fb.forward_mode.is_decode() and not seq_lens.is_cuda:
            # the kernel reads every request's slots 0..S-1 through one flat index (all layers)
            r2t = self.req_to_token_pool.req_to_token
            md["kv_indptr"] = torch.tensor([0] + md["seq_lens"], dtype=torch.int64).cumsum(0)
            md["kv_indices"] = (torch.cat([r2t[r, :n] for r, n in zip(md["req_rows"], md["seq_lens"])]).to(torch.int64)
                                if md["req_rows"] else torch.zeros(0, dtype=torch.int64))

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int):
        raise NotImplementedError("tasq: CUDA graphs are not supported; pass --disable-cuda-graph")

    def get_cuda_graph_seq_len_fill_value(self):
        return 1

    def support_triton(self):
        return False

    # ---- forward -----------------------------------------------------------------------------
    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        return self._forward(q, k, v, layer, forward_batch, save_kv_cache)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        return self._forward(q, k, v, layer, forward_batch, save_kv_cache)

    def _forward(self, q, k, v, layer, fb, save_kv_cache):
        md = self.forward_metadata
        Hq, d = layer.tp_q_head_num, layer.qk_head_dim
        q3 = q.reshape(-1, Hq, d)
        if q.is_cuda:
            if self._cuda is None:
                self._cuda = _cuda_adapter(self.pool, self.req_to_token_pool)
            out = self._cuda.forward(q3, k, v, layer, fb, md, save_kv_cache)
            return out.to(q.dtype).reshape(-1, Hq * layer.v_head_dim)
        if save_kv_cache and k is not None and v is not None:
            self.pool.set_kv_buffer(layer, fb.out_cache_loc, k, v, positions=md["positions"],
                                    req_rows=md["rows"], seq_lens=md["tok_seq_lens"], win_targets=md.get("win_targets"))
        H = layer.tp_k_head_num
        exact = not fb.forward_mode.is_decode() and k is not None and v is not None
        k3 = k.reshape(-1, H, d) if exact else None
        v3 = v.reshape(-1, H, layer.v_head_dim) if exact else None
        if not exact and "kv_indices" in md:
            return self._decode_cpu(q3, layer, md).to(q.dtype).reshape(-1, Hq * layer.v_head_dim)
        out = torch.empty(q3.shape[0], Hq, layer.v_head_dim, dtype=q.dtype, device=q.device)
        start = 0
        for row, S, Tq in zip(md["req_rows"], md["seq_lens"], md["q_lens"]):
            sl = slice(start, start + Tq)
            chunk = (k3[sl], v3[sl]) if exact else None
            out[sl] = self._attend(q3[sl], layer, row, S, chunk).to(q.dtype)
            start += Tq
        return out.reshape(-1, Hq * layer.v_head_dim)

    def _attend(self, q, layer, row: int, S: int, chunk=None) -> torch.Tensor:
        """q [Tq, Hq, d] post-RoPE at positions S-Tq..S-1 -> [Tq, Hq, d] f32, by the window rule of
        :mod:`sglang_tasq.windows` for every query (so one chunk, many chunks or a radix-cached
        prefix give the same attention): query i reads key j exactly iff j < sink or
        j >= i + 1 - recent, from its codes otherwise.

        chunk: (k [Tq, H, d] post-RoPE, v [Tq, H, d]) exact k/v of the last Tq positions (their
        codes already in the pool), or None to read all ``S`` tokens from the pool (decode).
        """
        Tq = q.shape[0]
        slots = self.req_to_token_pool.req_to_token[row, :S].to(torch.int64)
        pool = self.pool
        cos, sin = self._cos_sin(S, q.device)  # == apply_rope at positions 0..S-1 (same table values)
        if chunk is None:
            k_pre, v = pool.read_request(layer.layer_id, slots, row, S)
            return _sdpa(q, rotate(k_pre, cos, sin), v, layer.scaling)
        P = S - Tq
        cfg = pool.tasq_config
        sink, recent = cfg.sink_window, cfg.recent_window
        q_pos = torch.arange(P, S, device=q.device)
        k_pos = torch.arange(S, device=q.device)
        ex = windows.query_window(q_pos, k_pos, sink, recent)  # [Tq, S]
        causal = k_pos[None, :] <= q_pos[:, None]
        if bool((ex | ~causal).all()):  # every key a query sees is in its window: exact attention
            k_ex, v_ex = chunk[0].float(), chunk[1].float()
            if P:
                k_pre, v_pre = pool.read_codes(layer.layer_id, slots[:P])
                pool.read_exact(layer.layer_id, slots[:P], k_pre, v_pre, torch.ones(P, dtype=torch.bool))
                k_ex = torch.cat([rotate(k_pre, cos[:P], sin[:P]), k_ex])
                v_ex = torch.cat([v_pre, v_ex])
            return _sdpa(q, k_ex, v_ex, layer.scaling)
        k_dec, v_dec = pool.read_codes(layer.layer_id, slots)
        k_ex, v_ex = k_dec.clone(), v_dec.clone()
        need = ex.any(0)
        need[P:] = False
        pool.read_exact(layer.layer_id, slots, k_ex, v_ex, need)
        k_dec, k_ex = rotate(k_dec, cos, sin), rotate(k_ex, cos, sin)
        k_ex[P:] = chunk[0].float()
        v_ex[P:] = chunk[1].float()
        return _windowed_attention(q, k_ex, v_ex, k_dec, v_dec, ex & causal, causal, layer.scaling)

    def _decode_cpu(self, q3, layer, md) -> torch.Tensor:
        """Decode over the pool with the Numba kernel (``numba_kernels.cpu.DecodePlan``, built
        once per forward and reused by every layer) -> [B, Hq, d] f32."""
        from numba_kernels import cpu

        pool, lid = self.pool, layer.layer_id - self.pool.start_layer
        tab = self._decode_tables.get(layer.layer_id)
        if tab is None:
            enc = pool._encoder  # share the encoder's codebook arrays (one copy read per step)
            tab = self._decode_tables[layer.layer_id] = cpu.DecodeTables(
                self.codebooks, layer.layer_id, enc.prepared(layer.layer_id) if enc is not None else None)
        plan = md.get("plan")
        if plan is None:
            cos, sin = self._cos_sin(max(md["seq_lens"], default=1), q3.device)
            plan = md["plan"] = cpu.DecodePlan(
                md["kv_indptr"], md["kv_indices"], pool.tasq_config, pool.code_bytes_k, layer.tp_q_head_num,
                layer.tp_k_head_num, layer.qk_head_dim, cos.squeeze(1), sin.squeeze(1),
                pool.exact.entry_of if pool.exact is not None else None)
        npv = pool._np
        if pool.exact is not None:
            return plan(q3, npv["k"][lid], npv["v"][lid], tab, layer.scaling, npv["wk"][lid], npv["wv"][lid])
        return plan(q3, npv["k"][lid], npv["v"][lid], tab, layer.scaling)

    def _cos_sin(self, n: int, device):
        """cos, sin [n, 1, d/2] of positions 0..n-1 (the pool's cached ``rope.cos_sin`` table)."""
        if torch.device(device) != torch.device(self.pool.device):
            cb = self.codebooks
            cos, sin = cos_sin(torch.arange(n, device=device), cb.inv_freq.to(device), cb.attention_scaling)
            return cos.unsqueeze(1), sin.unsqueeze(1)
        cos, sin = self.pool.rope_table(n)
        return cos[:n].unsqueeze(1), sin[:n].unsqueeze(1)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float,
          dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Causal attention (GQA, in ``dtype``; fp32 by default) of q [Tq, Hq, d] at the last Tq of
    S positions over k, v [S, H, d] -> [Tq, Hq, d]; equals :func:`codec.attention_dense` up to
    float rounding."""
    Tq, S = q.shape[0], k.shape[0]
    qh = q.to(dtype).transpose(0, 1).unsqueeze(0)
    kh = k.to(dtype).transpose(0, 1).unsqueeze(0)
    vh = v.to(dtype).transpose(0, 1).unsqueeze(0)
    mask, causal = None, False
    if Tq == S:
        causal = Tq > 1
    elif Tq > 1:  # query i sits at position S - Tq + i
        mask = torch.ones(Tq, S, dtype=torch.bool, device=q.device).tril(S - Tq)
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, is_causal=causal, scale=sm_scale,
                                         enable_gqa=q.shape[1] != k.shape[1])
    return out.squeeze(0).transpose(0, 1)


def _windowed_attention(q, k_ex, v_ex, k_dec, v_dec, ex, causal, sm_scale: float, block: int = 256) -> torch.Tensor:
    """fp32 attention of q [Tq, Hq, d] (the last Tq of S positions) over S keys where query i
    reads key j from (k_ex, v_ex) when ``ex[i, j]`` and from (k_dec, v_dec) otherwise, among the
    keys ``causal[i, j]`` allows (k, v [S, H, d], post-RoPE keys; GQA). One SDPA call per block of
    queries over the exact and the decoded keys side by side, each masked to where it is read,
    and only up to the block's last causal key (memory and work ~ block x S)."""
    Tq, Hq, d = q.shape
    S, H = k_ex.shape[0], k_ex.shape[1]
    P = S - Tq
    out = torch.empty(Tq, Hq, v_ex.shape[2], dtype=torch.float32, device=q.device)
    for a in range(0, Tq, block):
        b = min(Tq, a + block)
        hi = P + b  # keys past the block's last query are masked for all of its queries
        e, c = ex[a:b, :hi], causal[a:b, :hi]
        keys = torch.cat([k_ex[:hi], k_dec[:hi]]).float().transpose(0, 1).unsqueeze(0)
        vals = torch.cat([v_ex[:hi], v_dec[:hi]]).float().transpose(0, 1).unsqueeze(0)
        mask = torch.cat([e & c, ~e & c], dim=1)
        o = F.scaled_dot_product_attention(q[a:b].float().transpose(0, 1).unsqueeze(0), keys, vals, attn_mask=mask,
                                           scale=sm_scale, enable_gqa=Hq != H)
        out[a:b] = o.squeeze(0).transpose(0, 1)
    return out
