"""Real TaSQ pools and attention backends on small random codebooks, built through their
constructors with the artifact and options as arguments (as the plugin builds them)."""
from __future__ import annotations

import types

import torch

from sglang_tasq.options import ServeOptions


def make_pool(cb, size: int = 96, window_rows: int = 4, cpu_kernels: bool = True, **options):
    """A ``TaSQTokenToKVPool`` of ``size`` slots for codebooks ``cb`` (its layers, heads, head_dim);
    ``options``: further ``ServeOptions`` fields (``forward_tokens``, ``cached_windows``; their
    defaults when None or absent)."""
    from sglang_tasq.srt.pool import TaSQTokenToKVPool

    art = types.SimpleNamespace(codebooks=cb, config=cb.config)
    return TaSQTokenToKVPool(size=size, page_size=1, dtype=torch.bfloat16, head_num=cb.num_kv_heads,
                             head_dim=cb.head_dim, layer_num=cb.num_layers, device="cpu", enable_memory_saver=False,
                             artifact=art, options=ServeOptions(window_rows=window_rows, cpu_kernels=cpu_kernels,
                                                                 **{k: v for k, v in options.items() if v is not None}))


def make_request_rows(rows: int, max_context_len: int = 64):
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    return ReqToTokenPool(size=rows, max_context_len=max_context_len, device="cpu", enable_memory_saver=False)


def make_backend(pool, req_rows: int | None = None, max_context_len: int = 64):
    """The TaSQ attention backend over ``pool`` (and a fresh ReqToTokenPool of ``req_rows`` rows)."""
    from sglang_tasq.srt.backend import TaSQAttnBackend

    r2t = make_request_rows(req_rows or pool.options.rows(), max_context_len)
    return TaSQAttnBackend(types.SimpleNamespace(device="cpu", req_to_token_pool=r2t, token_to_kv_pool=pool))
