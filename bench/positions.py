"""Error by position beyond the calibration length (paper Appx. D: pre-RoPE keys degrade
gently past it): artifacts calibrated on 2048-token windows, tested on ``pos_len``-token
(default 8192) held-out Wikipedia windows.

Per bucket of 512 query positions: next-token KL against bf16 (reference log-probs every
``pos_stride`` positions) and attention-logit NMSE / KL averaged over layers, both window
settings. Uses :func:`bench.perplexity.evaluate` with the long windows.
"""
from __future__ import annotations

from . import perplexity


def run(ctx, settings=("none", "64+256")) -> dict:
    """{method: {setting: metrics with token_kl_by_pos, bucket_nmse, bucket_kl}}."""
    from .methods import parse_windows
    from .report import cached

    cfg, res, wins = ctx.cfg, {}, None
    names = [m for m in ctx.methods if m in cfg.pos_methods] if cfg.pos_methods else list(ctx.methods)
    for name in names:
        for setting in settings:
            key = "none" if name == "bf16" else setting
            path = ctx.run_dir / "items" / "positions" / f"{name}__{key}.json"

            def work():
                nonlocal wins
                if wins is None:
                    wins = perplexity.heldout_windows(ctx.tok, "wiki", cfg.pos_len, cfg.pos_windows)
                ctx.log(f"[positions] {name} windows={key} ({wins.shape[0]} x {wins.shape[1]})")
                out = perplexity.evaluate(ctx.model, wins, ctx.methods[name], *parse_windows(key),
                                          ctx.run_dir / "work", "pos", cfg.pos_stride, attn_stats=True)
                out.pop("layer_kl", None)
                return out

            res.setdefault(name, {})[setting] = cached(path, work)
    return res
