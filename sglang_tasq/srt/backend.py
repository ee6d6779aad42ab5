"""The 'tasq' SGLang attention backend: extend and decode over the compressed TaSQ pool.

Every forward first stores the new tokens (``TaSQTokenToKVPool.set_kv_buffer``: keys are
un-rotated to pre-RoPE with ``forward_batch.positions``, encoded, packed), then attends.
Every query, of a prompt chunk or a decode step, follows the one window rule of
:mod:`sglang_tasq.windows` (key j read exactly iff j < sink or j >= i + 1 - recent, from its
codes otherwise), whoever wrote the key and in how many chunks: exact keys come from the
chunk's own k/v or the pool's exact store, the rest from the codes. RoPE position of a cached
token = its index in the request's ``req_to_token`` row (plain Llama-family models).

CPU path, decode: one Numba kernel call per layer for the whole batch
(:func:`numba_kernels.cpu.decode_attention`: unpack, folded decode, RoPE, softmax, value
decode, windows); ``SGLANG_TASQ_CPU_KERNELS=0`` selects the torch path below instead.
CPU path, extend: per request, decode the codes of all ``S`` tokens with the reference codec
(:mod:`sglang_tasq.codec`), take the exact keys the chunk's queries read (prefix entries of
the exact store, the chunk's own k/v), re-apply RoPE at positions ``0..S-1`` and run
:func:`windowed_prefill` (queries ``[Tq, Hq, d]`` at positions ``P..S-1``, in the model dtype,
in whole query blocks aligned to absolute positions, so a row's arithmetic does not depend on
the chunking). Decode without the kernels reads the request through the pool and runs fp32
causal attention. CUDA path: :class:`sglang_tasq.srt.serve_cuda.TaSQCudaAdapter` (Numba
encode into the pool, split-K kernels of ``numba_kernels.ops`` over a compact view of it),
dispatched in :meth:`TaSQAttnBackend._forward`.

Salient tokens (``config.salient_budget``; CPU and CUDA paths): at each layer up to the deciding one every
new token's window echo is stored in its slot (:meth:`TaSQAttnBackend._salient_echo`; a CPU decode
step takes it from the decode kernel, :meth:`TaSQAttnBackend._decode_step_cpu`); at the deciding
layer, before its attention (after it on that decode path: the same attention), the pool decides
the blocks this forward completed (:meth:`pool.TaSQTokenToKVPool.decide_salient`); from that layer on every query reads kept slots
exactly (extend: their decoded keys replaced by the exact ones; decode: the kernel's or the
torch reader's kept test).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

from .. import windows
from ..rope import cos_sin, rotate
from . import profile


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
        self._profile = profile.from_env()  # SGLANG_TASQ_PROFILE: per-forward time split (benchmarks)

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
        self._profile.begin("decode" if fb.forward_mode.is_decode() else "extend", int(q_lens.sum()))
        rows = torch.repeat_interleave(fb.req_pool_indices.to(torch.int64), q_lens)
        tok_seq = torch.repeat_interleave(seq_lens, q_lens)
        md = self.forward_metadata = dict(
            rows=rows, tok_seq_lens=tok_seq,
            req_rows=fb.req_pool_indices.tolist(), seq_lens=seq_lens.tolist(), q_lens=q_lens.tolist(),
        )
        md["prefix_lens"] = [S - t for S, t in zip(md["seq_lens"], md["q_lens"])]
        self.pool.begin_forward(md["req_rows"], md["prefix_lens"], md["seq_lens"])
        md["positions"] = fb.positions.to(torch.int64)
        md["out_loc"] = fb.out_cache_loc.to(torch.int64) if fb.out_cache_loc is not None else None
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
        out = self._forward_layer(q, k, v, layer, fb, save_kv_cache)
        if self._profile.enabled and layer.layer_id == self.pool.start_layer + self.pool.layer_num - 1:
            self._profile.end()
        return out

    def _forward_layer(self, q, k, v, layer, fb, save_kv_cache):
        md = self.forward_metadata
        prof = self._profile
        Hq, d = layer.tp_q_head_num, layer.qk_head_dim
        q3 = q.reshape(-1, Hq, d)
        if q.is_cuda:
            return self._forward_adapter(q, k, v, layer, fb, save_kv_cache)
        if save_kv_cache and k is not None and v is not None:
            with prof.part("store"):
                self.pool.set_kv_buffer(layer, fb.out_cache_loc, k, v, positions=md["positions"], req_rows=md["rows"],
                                        seq_lens=md["tok_seq_lens"], win_targets=md.get("win_targets"))
        H = layer.tp_k_head_num
        exact = not fb.forward_mode.is_decode() and k is not None and v is not None
        if not exact and "kv_indices" in md:  # the decode kernel (salient echo fused into it)
            return self._decode_step_cpu(q3, layer, md).to(q.dtype).reshape(-1, Hq * layer.v_head_dim)
        self._salient_step(q3, layer, md)
        k3 = k.reshape(-1, H, d) if exact else None
        v3 = v.reshape(-1, H, layer.v_head_dim) if exact else None
        out = torch.empty(q3.shape[0], Hq, layer.v_head_dim, dtype=q.dtype, device=q.device)
        start = 0
        for row, S, Tq in zip(md["req_rows"], md["seq_lens"], md["q_lens"]):
            sl = slice(start, start + Tq)
            chunk = (k3[sl], v3[sl]) if exact else None
            out[sl] = self._attend(q3[sl], layer, row, S, chunk).to(q.dtype)
            start += Tq
        return out.reshape(-1, Hq * layer.v_head_dim)

    def _forward_adapter(self, q, k, v, layer, fb, save_kv_cache):
        """The CUDA path (:class:`serve_cuda.TaSQCudaAdapter`; on CPU tensors, in the Numba simulator)."""
        md = self.forward_metadata
        Hq, d = layer.tp_q_head_num, layer.qk_head_dim
        q3 = q.reshape(-1, Hq, d)
        if self._cuda is None:
            self._cuda = _cuda_adapter(self.pool, self.req_to_token_pool)
        out = self._cuda.forward(q3, k, v, layer, fb, md, save_kv_cache,
                                 before_attention=lambda: self._salient_step(q3, layer, md))
        return out.to(q.dtype).reshape(-1, Hq * layer.v_head_dim)

    def _salient_step(self, q3, layer, md, echo=None) -> None:
        """Salient tokens, between the store and the attention: the new tokens' echo (layers up to
        the deciding one; ``echo`` [T, H]: already computed, by the decode kernel) and, at the
        deciding layer, the decision of the blocks they complete."""
        pool = self.pool
        if pool.salient is not None and layer.layer_id <= pool.salient.layer:
            with self._profile.part("salient"):
                if echo is None:
                    self._salient_echo(q3, layer, md)
                else:
                    pool.record_echo(layer.layer_id, md["out_loc"], echo)
                if layer.layer_id == pool.salient.layer:
                    pool.decide_salient(md["req_rows"], md["prefix_lens"], md["seq_lens"])

    def _salient_echo(self, q3, layer, md) -> None:
        """Salient tokens, a layer up to the deciding one: every new token's window echo
        (:func:`salient.query_echo` over the exact keys its query reads by the window rule: the
        store's bf16 pre-RoPE copies, which every new token has with salient tokens on) into its
        slot's echo row. A decode batch: all requests at once (:meth:`_salient_echo_decode`)."""
        if md["q_lens"] and all(t == 1 for t in md["q_lens"]):  # decode, or extends of one token
            return self._salient_echo_decode(q3, layer, md)
        return self._salient_echo_each(q3, layer, md)

    def _salient_echo_decode(self, q3, layer, md) -> None:
        """One query per request (at ``S - 1``): every request's window keys gathered from the store
        into one [B, sink + recent] batch (the sink, then the recent window without what the sink
        already holds; masked past each request's own), the same softmax over them as
        :func:`salient.query_echo`, summed over [1, sink) and each KV head's query heads."""
        from .. import salient as sal

        pool, cfg = self.pool, self.pool.tasq_config
        sink, recent = cfg.sink_window, cfg.recent_window
        lid = layer.layer_id - pool.start_layer
        dev = q3.device
        B, Hq, d = q3.shape
        H = pool.head_num
        S = torch.tensor(md["seq_lens"], dtype=torch.int64, device=dev)
        j = torch.arange(sink + recent, device=dev)[None]
        pos = torch.where(j < sink, j, S[:, None] - recent + (j - sink))  # [B, W]
        valid = (pos >= 0) & (pos < S[:, None]) & ((j < sink) | (pos >= sink))
        pos = pos.clamp(min=0, max=int(S.max()) - 1)  # masked entries read any valid position
        rows = torch.tensor(md["req_rows"], dtype=torch.int64, device=dev)
        slots = self.req_to_token_pool.req_to_token[rows[:, None], pos].to(torch.int64)
        ent = pool.exact.entry_of[slots]
        if not bool((ent[valid] > 0).all()):
            raise RuntimeError("tasq: a window key of the salient echo has no exact entry")
        cos, sin = self._cos_sin(int(S.max()), dev)
        k = rotate(pool.exact_keys(lid, ent.flatten()), cos[pos.flatten()], sin[pos.flatten()]).view(B, -1, H, d)
        logits = torch.einsum("bhgd,bwhd->bhgw", q3.float().view(B, H, Hq // H, d) * layer.scaling, k)
        p = torch.softmax(logits.masked_fill(~valid[:, None, None], float("-inf")), -1)
        lo, hi = sal.echo_span(sink)
        span = valid & (pos >= lo) & (pos < hi) & (j < sink)
        echo = (p * span[:, None, None]).sum((2, 3))  # [B, H]
        pool.record_echo(layer.layer_id, md["out_loc"], echo)

    def _salient_echo_each(self, q3, layer, md) -> None:
        """Request by request (extend chunks): :func:`salient.query_echo` of its new queries (on the
        CPU kernels its Numba twin, ``numba_kernels.cpu.query_echo``: equal up to float order)."""
        from .. import salient as sal

        pool, cfg = self.pool, self.pool.tasq_config
        echo_fn = sal.query_echo
        if pool.cpu_kernels and q3.device.type == "cpu":
            from numba_kernels import cpu

            echo_fn = cpu.query_echo
        sink, recent = cfg.sink_window, cfg.recent_window
        lid = layer.layer_id - pool.start_layer
        loc = md["out_loc"]
        start = 0
        for row, P, S, Tq in zip(md["req_rows"], md["prefix_lens"], md["seq_lens"], md["q_lens"]):
            cols = windows.window_columns(P, S, sink, recent).to(q3.device)
            slots = self.req_to_token_pool.req_to_token[row, cols].to(torch.int64)
            ent = pool.exact.entry_of[slots]
            if not bool((ent > 0).all()):
                raise RuntimeError(f"tasq: request row {row}: a window key of the salient echo has no exact entry")
            cos, sin = self._cos_sin(S, q3.device)
            k = rotate(pool.exact_keys(lid, ent), cos[cols], sin[cols])
            qpos = torch.arange(P, S, device=q3.device)
            echo = echo_fn(q3[start:start + Tq], k, qpos, cols, sink, recent, layer.scaling)
            pool.record_echo(layer.layer_id, loc[start:start + Tq], echo)
            start += Tq

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
        prof = self._profile
        if chunk is None:
            with prof.part("attention"):
                k_pre, v = pool.read_request(layer.layer_id, slots, row, S)
                return _sdpa(q, rotate(k_pre, cos, sin), v, layer.scaling)
        with prof.part("codes"):
            k_dec, k_ex, v_dec, v_ex = self._prefill_keys(layer, slots, S, Tq, cos, sin, chunk)
        with prof.part("attention"):
            return windowed_prefill(q, k_ex, v_ex, k_dec, v_dec, pool.tasq_config.sink_window,
                                    pool.tasq_config.recent_window, layer.scaling)

    def _prefill_keys(self, layer, slots, S: int, Tq: int, cos, sin, chunk):
        """The keys and values a chunk's queries read (:meth:`_attend`): (decoded keys, exact-or-
        decoded keys, both post-RoPE at positions 0..S-1; decoded values, exact-or-decoded values)."""
        pool = self.pool
        P = S - Tq
        cfg = pool.tasq_config
        sink, recent = cfg.sink_window, cfg.recent_window
        k_dec, v_dec = pool.read_codes(layer.layer_id, slots)
        k_ex, v_ex = k_dec.clone(), v_dec.clone()
        kept = pool.kept_of(layer.layer_id, slots)  # salient tokens every query reads exactly
        if P:  # the prefix keys some query of the chunk reads exactly (begin_forward checked their entries)
            j = torch.arange(P, device=slots.device)
            need = (j < sink) | (j >= P + 1 - recent)
            if kept is not None:
                need = need | kept[:P]
            pool.read_exact(layer.layer_id, slots[:P], k_ex[:P], v_ex[:P], need, coded=True)
        # the chunk's keys (and fp8 values) as the exact store keeps them (one rounding of the
        # pre-RoPE key): a window token reads the same whether this forward wrote it or an earlier
        # one (cold == warm)
        k_ex[P:], v_ex[P:] = pool.as_stored(rotate(chunk[0], cos[P:], sin[P:], inverse=True), chunk[1],
                                            coded=(k_dec[P:], v_dec[P:]))
        k_dec, k_ex = rotate(k_dec, cos, sin), rotate(k_ex, cos, sin)
        if kept is not None and bool(kept.any()):  # a kept token is exact for every query: its "codes" too
            k_dec[kept], v_dec[kept] = k_ex[kept], v_ex[kept]
        return k_dec, k_ex, v_dec, v_ex

    def _decode_step_cpu(self, q3, layer, md) -> torch.Tensor:
        """A decode step's layer through the Numba kernel. Salient tokens, a layer up to the
        deciding one: the kernel also gives every request's window echo (from the logits it
        computes anyway: :meth:`numba_kernels.cpu.DecodePlan.__call__`'s ``echo_span``, equal
        to :meth:`_salient_echo_decode` up to float order); it is recorded and, at the deciding
        layer, the blocks it completes decided after this layer's attention instead of before:
        the same attention, since a block decided at a decode step lies inside that step's
        recent window (:meth:`salient.SalientSpec.check_windows`: block + lookahead <= recent),
        which every query reads exactly, kept or not."""
        pool, prof = self.pool, self._profile
        if pool.salient is None or layer.layer_id > pool.salient.layer:
            with prof.part("attention"):
                return self._decode_cpu(q3, layer, md)
        from .. import salient as sal

        with prof.part("attention"):
            out, echo = self._decode_cpu(q3, layer, md, echo_span=sal.echo_span(pool.tasq_config.sink_window))
        self._salient_step(q3, layer, md, echo=echo)
        return out

    def _decode_cpu(self, q3, layer, md, echo_span=None):
        """Decode over the pool with the Numba kernel (``numba_kernels.cpu.DecodePlan``, built
        once per forward and reused by every layer) -> [B, Hq, d] f32 (with ``echo_span``: and
        the window echo [B, H])."""
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
                md["kv_indptr"], md["kv_indices"], pool.tasq_config,
                None if pool.tasq_config.layer_mixed else pool.code_bytes_k, layer.tp_q_head_num,
                layer.tp_k_head_num, layer.qk_head_dim, cos.squeeze(1), sin.squeeze(1),
                pool.exact.entry_of if pool.exact is not None else None)
        npv = pool._np
        if pool.exact is not None:
            kept = pool.exact.kept if pool.reads_kept(layer.layer_id) else None
            scales = (npv["wks"][lid], npv["wvs"][lid]) if npv["wks"] is not None else None
            return plan(q3, npv["k"][lid], npv["v"][lid], tab, layer.scaling, npv["wk"][lid], npv["wv"][lid],
                        kept=kept, win_scales=scales, win_format=pool.exact.fmt, echo_span=echo_span)
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


#: block of query positions of :func:`windowed_prefill` (aligned to absolute positions)
PREFILL_BLOCK = 256


def windowed_prefill(q, k_ex, v_ex, k_dec, v_dec, sink: int, recent: int, sm_scale: float,
                     block: int = PREFILL_BLOCK, dtype: torch.dtype | None = None) -> torch.Tensor:
    """CPU attention of q [Tq, Hq, d] at positions ``P..S-1`` (``P = S - Tq``) over S keys by the
    window rule: query i reads key j <= i from (k_ex, v_ex) iff j < sink or j >= i + 1 - recent,
    from (k_dec, v_dec) otherwise (k, v [S, H, d], post-RoPE keys; GQA) -> [Tq, Hq, dv] f32.

    Computed in ``dtype`` (the query's, i.e. the model's, by default: bf16 in the server, as
    SGLang's own attention) in blocks of ``block`` query positions aligned to absolute
    positions ``[m*block, (m+1)*block)``, each split into two disjoint key sets merged by their
    log-sum-exp:

    - the codes every query of the block reads, ``sink <= j < t`` with
      ``t = max(sink, m*block + 1 - recent)``: one unmasked attention (most of the work at long
      context, no mask, no doubled keys);
    - the rest, ``j < sink`` and ``t <= j <= i`` exact plus the codes ``t <= j <= i - recent``: one
      masked attention over ``< sink + 2*block + recent`` keys.

    Every query's arithmetic depends only on its own position (and S-independent key blocks), not
    on where its chunk starts: one chunk, many chunks or a radix-cached prefix give bit-identical
    attention rows."""
    Tq, Hq, _ = q.shape
    S, H = k_ex.shape[0], k_ex.shape[1]
    P = S - Tq
    dtype = dtype or q.dtype
    rep = Hq // H  # GQA: the rep query heads of a KV head are stacked along the query axis

    lo0 = (P // block) * block
    end = -(-S // block) * block  # every block is computed whole (rows and keys padded): same shapes,
    dv = v_ex.shape[2]            # so the same arithmetic per row, wherever the chunk starts or ends
    Q = torch.zeros(H, rep, end - lo0, q.shape[2], dtype=dtype, device=q.device)
    Q[:, :, P - lo0:S - lo0] = q.to(dtype).view(Tq, H, rep, -1).permute(1, 2, 0, 3)

    def heads(x):  # [S, H, d] -> [1, H, end, d] in dtype, zero keys/values past S (masked)
        y = torch.zeros(1, H, end, x.shape[2], dtype=dtype, device=x.device)
        y[0, :, :S] = x.to(dtype).transpose(0, 1)
        return y

    Ke, Ve, Kd, Vd = heads(k_ex), heads(v_ex), heads(k_dec), heads(v_dec)
    out = torch.empty(Tq, Hq, dv, dtype=torch.float32, device=q.device)
    for lo, t, s0, c1, mask, empty in _prefill_blocks(lo0, end, sink, recent, block, rep, dtype):
        hi = lo + block
        qb = Q[:, :, lo - lo0:hi - lo0].reshape(1, H, rep * block, -1)
        keys = torch.cat([Ke[:, :, :s0], Ke[:, :, t:hi], Kd[:, :, t:c1]], 2)
        vals = torch.cat([Ve[:, :, :s0], Ve[:, :, t:hi], Vd[:, :, t:c1]], 2)
        o, lse = _FLASH(qb, keys, vals, attn_mask=mask, scale=sm_scale)
        o = o.float()
        if t > sink:  # the codes every query of the block reads
            o2, lse2 = _FLASH(qb, Kd[:, :, sink:t], Vd[:, :, sink:t], scale=sm_scale)
            if empty is not None:  # rows with no key in the masked set (lse reads 0 there)
                lse = lse.masked_fill(empty, float("-inf"))
            m = torch.maximum(lse, lse2)
            w, w2 = torch.exp(lse - m).unsqueeze(-1), torch.exp(lse2 - m).unsqueeze(-1)
            o = (o * w + o2.float() * w2) / (w + w2)
        a, b = max(lo, P), min(hi, S)
        o = o.view(H, rep, block, dv)[:, :, a - lo:b - lo]
        out[a - P:b - P] = o.permute(2, 0, 1, 3).reshape(b - a, Hq, dv)
    return out


_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def _prefill_blocks(lo0: int, end: int, sink: int, recent: int, block: int, rep: int, dtype: torch.dtype):
    """The whole query blocks ``[lo, lo + block)`` of :func:`windowed_prefill` from ``lo0`` to
    ``end``: per block its first position ``lo``, the common-code bound ``t``, the sink keys ``s0``,
    the end of its local codes ``c1``, its additive mask and empty rows (:func:`_block_mask`)."""
    for lo in range(lo0, end, block):
        hi = lo + block
        t = max(sink, lo + 1 - recent)
        # past the first sink + recent positions (t > sink) every block's mask is the same: it
        # depends on positions relative to lo only
        yield (lo, t, min(sink, hi), max(t, hi - recent)) + _block_mask(lo if t == sink else -1, sink, recent, block,
                                                                         rep, dtype)


@functools.lru_cache(maxsize=32)
def _block_mask(lo: int, sink: int, recent: int, block: int, rep: int, dtype: torch.dtype) -> tuple:
    """(additive mask [1, 1, rep*block, keys], rows with an empty masked set [1, 1, rep*block] or
    None) of the block at ``lo`` (-1: any block with ``lo + 1 - recent > sink``). A pure function
    of its arguments, cached: every layer of every forward asks for the same few masks."""
    if lo < 0:
        lo = sink + recent
    hi = lo + block
    t = max(sink, lo + 1 - recent)
    s0, c1 = min(sink, hi), max(t, hi - recent)
    i = torch.arange(lo, hi)[:, None]
    ex = torch.cat([torch.arange(s0), torch.arange(t, hi)])[None]
    cd = torch.arange(t, c1)[None]
    seen = torch.cat([(ex <= i) & ((ex < sink) | (ex >= i + 1 - recent)), cd <= i - recent], 1).repeat(rep, 1)
    empty = ~seen.any(1)
    mask = torch.where(seen, torch.tensor(0.0, dtype=dtype), torch.tensor(float("-inf"), dtype=dtype))
    return mask[None, None], (empty[None, None] if bool(empty.any()) else None)
