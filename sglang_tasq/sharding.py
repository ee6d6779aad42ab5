"""Tensor parallelism: which KV heads a rank holds, and the artifact slice that serves them.

SGLang splits the KV heads of a model over the tensor-parallel ranks as its
``QKVParallelLinear`` does: with ``tp < H`` heads, rank ``r`` holds the contiguous heads
``[r*H/tp, (r+1)*H/tp)`` (``tp`` must divide ``H``); with ``tp >= H`` each rank holds one head,
replicated ``tp/H`` times (``H`` must divide ``tp``).

TaSQ's key scale is shared by a group of heads (``TaSQConfig.scale_groups`` contiguous groups;
one group = all heads, the paper's setting). A rank computes and stores the scales of the heads
it holds, with no per-token communication, so every scale group must lie inside one rank: an
artifact serves at TP ``tp`` iff a rank's heads are whole groups. ``python -m calibrate --tp N``
fits the codebooks with ``N`` groups (each group's keys normalized by their own RMS), which is
what the served ranks then compute. :func:`shard` cuts a loaded artifact to one rank's heads:
the result is an ordinary artifact for an ``H/tp``-head model (its own ``scale_groups``), so every
kernel serves it unchanged.
"""
from __future__ import annotations

import copy
import dataclasses

from .config import ConfigError


class ShardingError(ValueError):
    """A tensor-parallel degree this model or artifact cannot serve; the message is one line."""


def rank_heads(num_kv_heads: int, tp_rank: int, tp_size: int) -> range:
    """The KV heads (global indices) tensor-parallel rank ``tp_rank`` of ``tp_size`` holds."""
    H, tp = int(num_kv_heads), int(tp_size)
    if tp < 1 or not 0 <= tp_rank < tp:
        raise ShardingError(f"tp rank {tp_rank} of {tp_size}: not a rank")
    if tp >= H:
        if tp % H:
            raise ShardingError(f"--tp {tp}: the model's {H} KV heads cannot be replicated evenly over {tp} ranks "
                                f"(use a multiple or a divisor of {H})")
        r = tp_rank // (tp // H)
        return range(r, r + 1)
    if H % tp:
        raise ShardingError(f"--tp {tp} does not divide the model's {H} KV heads (use a divisor or a multiple of {H})")
    n = H // tp
    return range(tp_rank * n, (tp_rank + 1) * n)


def heads_per_rank(num_kv_heads: int, tp_size: int) -> int:
    return len(rank_heads(num_kv_heads, 0, tp_size))


def check_tp(cfg, num_kv_heads: int, tp_size: int) -> int:
    """Refuse a TP degree whose ranks would split a scale group; -> scale groups per rank."""
    n = heads_per_rank(num_kv_heads, tp_size)
    if cfg.scale != "shared":
        return n if cfg.scale == "per_head" else 0
    hps = cfg.heads_per_scale(num_kv_heads)
    if n % hps:
        raise ShardingError(
            f"--tp {tp_size}: the artifact shares one key scale over {hps} KV heads ({cfg.scale_groups} scale "
            f"group(s) of the model's {num_kv_heads}), and a rank holds {n}: calibrate for this degree "
            f"(python -m calibrate ... --tp {tp_size}) or serve at a TP degree that keeps groups whole")
    return n // hps


def for_tp(cfg, num_kv_heads: int, tp_size: int):
    """``cfg`` calibrated to serve at TP ``tp_size``: a shared key scale over each rank's heads
    (``scale_groups`` = the number of distinct rank head sets); per-head or no scales already
    serve at any degree. Raises :class:`ShardingError` for a degree the model cannot split."""
    n = heads_per_rank(num_kv_heads, tp_size)
    if cfg.scale != "shared":
        return cfg
    return dataclasses.replace(cfg, scale_groups=num_kv_heads // n)


def shard_codebooks(cb, heads: range, scale_groups: int):
    """``Codebooks`` restricted to ``heads`` (every per-head tensor is [L, H, ...]) with
    ``scale_groups`` key-scale groups over them; one group per head is written as scale
    "per_head" (the same numbers: the kernels' per-head layout)."""
    def cut(t):
        if isinstance(t, tuple):  # per-layer key codebooks [H, ...] (a per-layer key rate)
            return tuple(c if heads.start == 0 and heads.stop == c.shape[0] else c[heads.start:heads.stop].contiguous()
                         for c in t)
        whole = t is None or (heads.start == 0 and heads.stop == t.shape[1])
        return t if whole else t[:, heads.start:heads.stop].contiguous()

    cfg = cb.config
    if cfg.scale == "shared":
        change = {"scale": "per_head", "scale_groups": 1} if scale_groups == len(heads) > 1 else {"scale_groups": scale_groups}
        try:
            cfg = dataclasses.replace(cfg, **change)
        except ConfigError as e:  # pragma: no cover - check_tp guarantees a valid count
            raise ShardingError(str(e)) from None
    per_head = ("k_codebook", "k_weight", "k_perm", "v_codebook", "k_mix", "k_unmix", "k_mean")
    return dataclasses.replace(cb, config=cfg, **{name: cut(getattr(cb, name)) for name in per_head})


def shard(artifact, tp_rank: int, tp_size: int):
    """The artifact slice tensor-parallel rank ``tp_rank`` of ``tp_size`` serves, with its scales
    in the kernels' layout (the artifact itself at TP 1 with one scale group or none). Raises
    :class:`ShardingError` where the ranks would split a scale group."""
    fp, cfg = artifact.model, artifact.config
    groups = check_tp(cfg, fp.num_kv_heads, tp_size)
    if int(tp_size) == 1 and not (cfg.scale == "shared" and cfg.scale_groups == fp.num_kv_heads > 1):
        return artifact
    heads = rank_heads(fp.num_kv_heads, tp_rank, tp_size)
    manifest = copy.deepcopy(artifact.manifest)
    manifest["model"]["num_kv_heads"] = len(heads)
    manifest["model"]["num_q_heads"] = fp.num_q_heads // int(tp_size)
    manifest["tp"] = {"rank": int(tp_rank), "size": int(tp_size), "kv_heads": [heads.start, heads.stop]}
    cb = shard_codebooks(artifact.codebooks, heads, max(groups, 1))
    manifest["config"] = cb.config.to_dict()
    return dataclasses.replace(artifact, manifest=manifest, codebooks=cb)
