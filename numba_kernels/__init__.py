"""Numba CUDA kernels of TaSQ: encode into a packed pool, split-K decode and extend attention.

Public API (launch wrappers, in :mod:`.ops`): ``encode_kv``, ``decode_attention``,
``extend_attention``; per-layer inputs in :class:`.tables.LayerTables`; plain-torch
references with the same signatures in :mod:`.reference`. Importing this package does not
import numba; ``.ops`` does.
"""
