"""Perplexity, next-token KL and top-1 agreement with bf16, and per-layer attention error,
from one decode-view forward per window (:mod:`bench.attention_error`).

Windows are consecutive held-out token windows (``calibrate.corpora.token_windows``):
``wiki`` (held-out Wikipedia) and ``code`` (held-out stdlib sources, the second domain).
Every method runs the same code path; the reference is the ``bf16`` method through it, so
bf16 against itself is exactly zero error. The reference's log-probabilities at every
``stride``-th position (fp32) and its top-1 tokens at every position are stored once per
window as safetensors under the run's ``work/`` folder; next-token KL is
KL(p_bf16 || p_method) at those positions, top-1 agreement over all positions.
Logits come from the final hidden states through ``lm_head`` in chunks (no [T, V] tensor).
"""
from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import load_file, save_file

from sglang_tasq.hf.baselines import KVMethod, baseline

from .attention_error import AttnStats, Probe, ProbeCache, active, use_decode_view

DOMAINS = {"wiki": "wiki", "ood": "code"}  # metric name -> calibrate.corpora corpus


def load_model(name: str):
    """(model, tokenizer): eval, decode-view attention, in :func:`sglang_tasq.models.compute_dtype`
    (bf16, or float32 on a CPU without bf16 matmuls)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sglang_tasq.models import compute_dtype, resolve_model

    path = resolve_model(name)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=compute_dtype()).eval()
    use_decode_view(model)
    return model, tok


def heldout_windows(tok, domain: str, length: int, n: int) -> torch.Tensor:
    """[n', length] LongTensor (n' <= n) of held-out tokens of ``domain`` ('wiki' or 'ood')."""
    from calibrate.corpora import token_windows

    if domain not in DOMAINS:
        raise ValueError(f"domain {domain!r}: allowed {tuple(DOMAINS)}")
    return token_windows(tok, DOMAINS[domain], "heldout", length, max_tokens=n * length)


@torch.no_grad()
def hidden(model, ids: torch.Tensor, method: KVMethod, sink: int, recent: int,
           stats: Optional[AttnStats] = None) -> torch.Tensor:
    """Final hidden states [T, D] of ids [T] under ``method`` with decode-view windows."""
    cache = ProbeCache(method)
    with active(Probe(cache, sink, recent, stats)):
        out = model.model(input_ids=ids[None], past_key_values=cache, use_cache=True)
    return out.last_hidden_state[0]


@torch.no_grad()
def token_scores(model, h: torch.Tensor, ids: torch.Tensor, stride: int, chunk: int = 512) -> dict:
    """nll [T-1] and top1 [T-1] of next tokens; logp [m, V] fp32 at positions 0, stride, ..."""
    T = ids.shape[0]
    nll, top1, logp = [], [], []
    for s in range(0, T - 1, chunk):
        e = min(T - 1, s + chunk)
        lp = torch.log_softmax(model.lm_head(h[s:e]).float(), dim=-1)
        nll.append(-lp.gather(1, ids[s + 1:e + 1, None])[:, 0])
        top1.append(lp.argmax(-1))
        first = -s % stride
        logp.append(lp[first::stride].clone())
    return {"nll": torch.cat(nll), "top1": torch.cat(top1), "logp": torch.cat(logp)}


def reference(model, ids: torch.Tensor, path: Path, stride: int, scores: Optional[dict] = None) -> dict:
    """The bf16 scores of one window, from ``path`` or computed (or taken from ``scores``) and saved."""
    if path.is_file():
        return load_file(str(path))
    if scores is None:
        scores = token_scores(model, hidden(model, ids, baseline("bf16"), 0, 0), ids, stride)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in scores.items()}, str(path))
    return scores


def evaluate(model, windows: torch.Tensor, method: KVMethod, sink: int, recent: int, ref_dir: Path,
             tag: str, stride: int = 32, attn_stats: bool = True, bucket: int = 512) -> dict:
    """Metrics of one method and window setting over ``windows`` [n, T].

    Returns ppl, nll, tokens, top1_agree, token_kl (mean over stride positions),
    token_kl_by_pos (per ``bucket`` of positions) and, with ``attn_stats``, layer_nmse /
    layer_kl [L], logit_nmse / attn_kl (mean over layers), bucket_nmse / bucket_kl.
    ``per_window``: {"nll", "token_kl"[, "logit_nmse", "attn_kl"]} -> [n] values of each window
    alone (mean NLL per token, mean KL, mean over layers of the window's NMSE / KL), the
    units :mod:`bench.separation` resamples.
    """
    n, T = windows.shape
    L = model.config.num_hidden_layers
    stats = AttnStats(L, bucket, T) if attn_stats else None
    nll = kl_sum = agree = 0.0
    n_tok = n_kl = 0
    nb = -(-T // bucket)
    kl_pos, kl_cnt = torch.zeros(nb, dtype=torch.float64), torch.zeros(nb, dtype=torch.float64)
    per: dict = {"nll": [], "token_kl": [], **({"logit_nmse": [], "attn_kl": []} if attn_stats else {})}
    t0 = time.time()
    for i in range(n):
        ids = windows[i]
        win = AttnStats(L, bucket, T) if attn_stats else None
        sc = token_scores(model, hidden(model, ids, method, sink, recent, win), ids, stride)
        is_ref = method.name == "bf16"
        ref = reference(model, ids, Path(ref_dir) / f"ref_{tag}_{T}_s{stride}_{i}.safetensors", stride,
                        sc if is_ref else None)
        kl = (ref["logp"].exp() * (ref["logp"] - sc["logp"])).sum(-1).clamp_min(0.0)
        pos = torch.arange(0, T - 1, stride)[: kl.shape[0]]
        kl_pos.index_add_(0, pos // bucket, kl.double())
        kl_cnt.index_add_(0, pos // bucket, torch.ones_like(kl, dtype=torch.float64))
        nll += sc["nll"].double().sum().item()
        n_tok += sc["nll"].numel()
        agree += (sc["top1"] == ref["top1"]).sum().item()
        kl_sum += kl.double().sum().item()
        n_kl += kl.numel()
        per["nll"].append(sc["nll"].double().mean().item())
        per["token_kl"].append(kl.double().mean().item())
        if win is not None:
            stats.merge(win)
            per["logit_nmse"].append(sum(win.layer_nmse()) / L)
            per["attn_kl"].append(sum(win.layer_kl()) / L)
    out = {"ppl": math.exp(nll / n_tok), "nll": nll / n_tok, "tokens": n_tok, "windows": n, "window_len": T,
           "top1_agree": agree / n_tok, "token_kl": kl_sum / max(1, n_kl), "kl_stride": stride,
           "bucket": bucket, "token_kl_by_pos": (kl_pos / kl_cnt.clamp_min(1)).tolist(),
           "per_window": per, "seconds": round(time.time() - t0, 1)}
    if stats is not None:
        ln, lk = stats.layer_nmse(), stats.layer_kl()
        out.update(layer_nmse=ln, layer_kl=lk, logit_nmse=sum(ln) / L, attn_kl=sum(lk) / L,
                   bucket_nmse=stats.bucket_nmse(), bucket_kl=stats.bucket_kl())
    return out


def run(ctx, domains=("wiki", "ood"), settings=("none", "64+256")) -> dict:
    """Every (method, window setting, domain) of ``ctx`` not yet done -> item JSON files.
    Attention stats on the wiki windows only. Returns {domain: {method: {setting: metrics}}}."""
    from .methods import parse_windows
    from .report import cached

    cfg, res = ctx.cfg, {}
    for domain in domains:
        n = cfg.ppl_windows if domain == "wiki" else cfg.ood_windows
        wins = None
        for name in ctx.methods:
            for setting in settings:
                key = "none" if name == "bf16" else setting  # bf16 has no windows to differ by
                path = ctx.run_dir / "items" / "perplexity" / f"{domain}__{name}__{key}.json"

                def work():
                    nonlocal wins
                    if wins is None:
                        wins = heldout_windows(ctx.tok, domain, cfg.ppl_len, n)
                    ctx.log(f"[perplexity] {domain} {name} windows={key} ({wins.shape[0]} x {wins.shape[1]})")
                    return evaluate(ctx.model, wins, ctx.methods[name], *parse_windows(key), ctx.run_dir / "work",
                                    domain, cfg.kl_stride, attn_stats=domain == "wiki")

                res.setdefault(domain, {}).setdefault(name, {})[setting] = cached(path, work)
    return res
