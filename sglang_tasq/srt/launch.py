"""Launch-time validation of a TaSQ serving configuration (runs before any weights load).

The artifact named by ``--tasq-config`` (exported to every SGLang process as the
environment variable :data:`ENV_CONFIG`) is loaded and checked against the served model's
``config.json`` (layers, KV heads, head_dim, RoPE via :func:`models.fingerprint`) and against
the server options TaSQ does not support: MLA, sliding window, speculative decoding, page
size other than 1, pipeline parallelism, data-parallel attention, a tensor-parallel degree
that splits the model's KV heads unevenly or one of the artifact's key-scale groups
(:mod:`sglang_tasq.sharding`), and a KV cache dtype other than ``auto``/``bf16``/``bfloat16``.
Data parallelism (``--dp N``) runs one independent TaSQ pool per scheduler. Every refusal is a
:class:`TaSQLaunchError` whose message is one line; :func:`refuse` prints it on stderr and
exits with status 2.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

from .. import options, sharding
from ..options import ENV_CONFIG
BACKEND_NAME = "tasq"
SUPPORTED_KV_DTYPES = ("auto", "bf16", "bfloat16")
SUPPORTED_PAGE_SIZES = (None, 1)

_cache: dict = {}


class TaSQLaunchError(ValueError):
    """The served configuration cannot run TaSQ; the message is one line naming the cause."""


def config_path() -> Optional[str]:
    """The active artifact path, or None when TaSQ is off (the plugin then does nothing)."""
    return options.config_path()


def active() -> bool:
    return config_path() is not None


def _one_line(msg: str) -> str:
    return " ".join(str(msg).split())


def model_config_dict(model_path: str) -> dict:
    p = Path(model_path).expanduser() / "config.json"
    if not p.is_file():
        raise TaSQLaunchError(f"tasq: model {model_path!r} has no config.json; TaSQ serves local HF checkpoints only")
    return json.loads(p.read_text())


def load_checked_artifact(path: str, model_path: Optional[str]):
    """Load the artifact at ``path`` (validated against the model when ``model_path`` is given)."""
    from ..artifact import ArtifactError, load_artifact
    from ..models import UnsupportedModelError, fingerprint

    key = (str(path), str(model_path))
    if key in _cache:
        return _cache[key]
    fp = None
    if model_path is not None:
        try:
            fp = fingerprint(model_config_dict(model_path))
        except UnsupportedModelError as e:
            raise TaSQLaunchError(f"tasq: unsupported model: {_one_line(e)}") from None
    try:
        art = load_artifact(path, model=fp)
    except ArtifactError as e:
        raise TaSQLaunchError(f"tasq: artifact {path} refused: {_one_line(e)}") from None
    _cache[key] = art
    return art


def runtime_artifact():
    """The active artifact in a serving process (already validated by the launcher)."""
    path = config_path()
    if path is None:
        raise TaSQLaunchError(f"tasq: no artifact configured (pass --tasq-config PATH or set {ENV_CONFIG})")
    return load_checked_artifact(path, None)


def rank_artifact(tp_rank: int, tp_size: int):
    """The active artifact cut to the KV heads of tensor-parallel rank ``tp_rank`` of ``tp_size``
    (:func:`sharding.shard`; the artifact itself at TP 1), scale layout in the kernels' form."""
    key = ("rank", config_path(), int(tp_rank), int(tp_size))
    if key not in _cache:
        try:
            _cache[key] = sharding.shard(runtime_artifact(), tp_rank, tp_size)
        except sharding.ShardingError as e:
            raise TaSQLaunchError(f"tasq: {_one_line(e)}") from None
    return _cache[key]


def check_server_args(sa) -> None:
    """Refuse server options TaSQ does not support. ``sa``: a ServerArgs (or look-alike)."""
    def get(name, default=None):
        return getattr(sa, name, default)

    for name in ("attention_backend", "prefill_attention_backend", "decode_attention_backend"):
        val = get(name)
        if val not in (None, BACKEND_NAME):
            raise TaSQLaunchError(f"tasq: --{name.replace('_', '-')} {val} is not supported with --tasq-config; use 'tasq' (or leave it unset)")
    if get("speculative_algorithm"):
        raise TaSQLaunchError(f"tasq: speculative decoding ({get('speculative_algorithm')}) is not supported")
    if get("page_size") not in SUPPORTED_PAGE_SIZES:
        raise TaSQLaunchError(f"tasq: --page-size {get('page_size')} is not supported; TaSQ uses page size 1")
    if (get("pp_size") or 1) > 1:
        raise TaSQLaunchError(f"tasq: --pp-size {get('pp_size')} is not supported (pipeline parallelism); "
                              "use --tp and/or --dp")
    if get("enable_dp_attention"):
        raise TaSQLaunchError("tasq: --enable-dp-attention is not supported; use --dp N (one TaSQ pool per "
                              "data-parallel scheduler) and/or --tp N")
    kvd = str(get("kv_cache_dtype") or "auto")
    if kvd not in SUPPORTED_KV_DTYPES:
        raise TaSQLaunchError(f"tasq: --kv-cache-dtype {kvd} is not supported; allowed {', '.join(SUPPORTED_KV_DTYPES)} (TaSQ replaces the KV format)")


def check_model_config(cfg: dict) -> None:
    """Refuse MLA and sliding-window models before the artifact comparison (one line each)."""
    if cfg.get("kv_lora_rank") or cfg.get("q_lora_rank"):
        raise TaSQLaunchError("tasq: MLA (latent attention) models are not supported")
    if cfg.get("sliding_window") and cfg.get("use_sliding_window", cfg.get("model_type") == "mistral"):
        raise TaSQLaunchError(f"tasq: sliding-window attention (sliding_window={cfg['sliding_window']}) is not supported")


def validate(sa, path: Optional[str] = None):
    """Full launch check for server args ``sa``; returns the loaded Artifact or raises."""
    path = path or config_path()
    if path is None:
        raise TaSQLaunchError(f"tasq: no artifact configured (pass --tasq-config PATH or set {ENV_CONFIG})")
    check_server_args(sa)
    model_path = getattr(sa, "model_path", None)
    if model_path is None:
        raise TaSQLaunchError("tasq: --model-path is required")
    check_model_config(model_config_dict(model_path))
    art = load_checked_artifact(path, model_path)
    if art.config.key_rope != "pre":
        raise TaSQLaunchError(f"tasq: artifact {path} codes keys after RoPE (key_rope '{art.config.key_rope}', the "
                              "NovaKV baseline); the serving kernels code pre-RoPE keys: serve a --method tasq artifact")
    tp = int(getattr(sa, "tp_size", 1) or 1)
    try:
        groups = sharding.check_tp(art.config, art.model.num_kv_heads, tp)
    except sharding.ShardingError as e:
        raise TaSQLaunchError(f"tasq: artifact {path}: {_one_line(e)}") from None
    n = sharding.heads_per_rank(art.model.num_kv_heads, tp)
    if str(getattr(sa, "device", "") or "").startswith("cuda") and 1 < groups < n:
        raise TaSQLaunchError(f"tasq: artifact {path} has {groups} key-scale groups per TP rank of {n} KV heads; the "
                              f"CUDA kernels serve one group or one per head: serve it at --tp "
                              f"{art.config.scale_groups} or calibrate with --tp {tp}")
    if art.config.salient_budget:
        if tp > 1:
            raise TaSQLaunchError(f"tasq: artifact {path} keeps salient tokens (salient_budget "
                                  f"{art.config.salient_budget}), chosen from every KV head's echo; a tensor-parallel "
                                  f"rank sees only its own heads: serve it at --tp 1 (--dp N scales out)")
    if not art.codebooks.pairs_in_groups:
        raise TaSQLaunchError(f"tasq: artifact {path} groups keys by contiguous channels (grouping "
                              f"'{art.config.grouping}', the CQ baseline), which splits RoPE pairs across groups; "
                              "the serving kernels need whole pairs per group: serve a --method tasq artifact")
    return art


def refuse(err: BaseException, code: int = 2) -> None:
    """Print the refusal as one line on stderr and exit non-zero."""
    print(_one_line(err), file=sys.stderr, flush=True)
    sys.exit(code)
