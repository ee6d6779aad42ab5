"""Where sglang-tasq keeps what it builds once: the materialized model, corpora, artifacts.

``TASQ_CACHE`` overrides the default ``~/.cache/sglang-tasq``.
"""
from __future__ import annotations

from pathlib import Path

from .options import cache_root


def cache_dir(*parts: str) -> Path:
    p = cache_root().joinpath(*parts)
    p.mkdir(parents=True, exist_ok=True)
    return p
