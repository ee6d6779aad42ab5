"""Rate sweep: CQ and TaSQ at several (group size g, codebook size K) points spanning about
0.5 to 2 bits per element (code bits log2(K)/g; TaSQ keys add the shared fp16 scale).

Each point is its own calibrated artifact (``cq@g8k256`` ...; g8k1024 reuses the main
``cq``/``tasq`` artifact) scored on held-out Wikipedia perplexity and logit error with
:func:`bench.perplexity.evaluate`, both window settings.
"""
from __future__ import annotations

from . import perplexity
from .methods import REF_G, REF_K

DEFAULT_POINTS = ((8, 16), (8, 256), (8, 1024), (4, 64), (4, 256))  # 0.5, 1.0, 1.25, 1.5, 2.0 bits


def point_name(base: str, g: int, k: int) -> str:
    """'tasq' at the reference rate, else 'tasq@g{g}k{K}'."""
    return base if (g, k) == (REF_G, REF_K) else f"{base}@g{g}k{k}"


def names(bases, points) -> list:
    return [point_name(b, g, k) for b in bases for g, k in points]


def run(ctx, settings=("none", "64+256")) -> list:
    """Rows {base, g, K, method, windows, bits_k, bits_v, ppl, logit_nmse, token_kl, attn_kl, per_window}
    (``per_window``: the item's per-window values, None in items made before them)."""
    from .methods import parse_windows
    from .report import cached

    cfg, rows, wins = ctx.cfg, [], None
    for base in cfg.sweep_methods:
        for g, k in cfg.sweep_points:
            name = point_name(base, g, k)
            for setting in settings:
                path = ctx.run_dir / "items" / "rate_sweep" / f"{name}__{setting}.json"

                def work():
                    nonlocal wins
                    if wins is None:
                        wins = perplexity.heldout_windows(ctx.tok, "wiki", cfg.ppl_len, cfg.sweep_windows)
                    ctx.log(f"[rate_sweep] {name} windows={setting}")
                    return perplexity.evaluate(ctx.model, wins, ctx.sweep[name], *parse_windows(setting),
                                               ctx.run_dir / "work", "wiki", cfg.kl_stride, attn_stats=True)

                r = cached(path, work)
                bk, bv = ctx.bits[name]
                rows.append({"base": base, "g": g, "K": k, "method": name, "windows": setting, "bits_k": bk,
                             "bits_v": bv, "ppl": r["ppl"], "logit_nmse": r["logit_nmse"], "token_kl": r["token_kl"],
                             "attn_kl": r["attn_kl"], "per_window": r.get("per_window")})
    return rows
