"""The calibration pipeline: capture -> weights -> shared scale -> grouping -> k-means -> fold.

Each stage is a module of :mod:`calibrate` and a switch of :class:`TaSQConfig`, so the same
run produces TaSQ, CQ and every single-component ablation. ``run`` returns the codebooks,
the model fingerprint and a summary (per-stage wall time, held-out errors) and
``write`` saves the artifact.
"""
from __future__ import annotations

import platform
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from sglang_tasq import codec
from sglang_tasq.artifact import ModelFingerprint, save_artifact
from sglang_tasq.config import TaSQConfig
from sglang_tasq.models import fingerprint, load_config, resolve_model, rope_inv_freq

from . import corpora, evaluate, fold, grouping, kmeans, weights
from .capture import capture

DENSE_PAIRS_PER_WINDOW = 4096
EVAL_WINDOWS = 1


@dataclass
class Result:
    codebooks: codec.Codebooks
    model: ModelFingerprint
    calibration: dict
    times: dict = field(default_factory=dict)
    errors: dict = field(default_factory=dict)


@contextmanager
def _stage(times: dict, name: str, log):
    t0 = time.time()
    yield
    times[name] = round(time.time() - t0, 2)
    log(f"[{name}] {times[name]:.1f} s")


def _tailor_all(keys: torch.Tensor, cb: codec.Codebooks, layer: int, chunk: int = 32768):
    """Tailored keys in native channel order [N, H, d] f32 (weights + scale, no permutation)."""
    N, H, d = keys.shape
    out = torch.empty(N, H, d)
    inv = cb.k_inv_perm(layer)
    for s in range(0, N, chunk):
        x, _ = codec.key_tailor(keys[s:s + chunk].float(), cb, layer)
        out[s:s + chunk] = torch.gather(x.reshape(-1, H, d), 2, inv.expand(x.shape[0], H, d))
    return out


@dataclass
class Prepared:
    """Model facts and captured statistics; one capture serves many configs (ablations, CQ)."""

    model: ModelFingerprint
    model_path: Path
    corpus: str
    inv_freq: torch.Tensor
    attention_scaling: float
    train: object  # Captured (calibration windows)
    heldout: object  # Captured with queries (evaluation windows)
    window_len: int
    times: dict


def prepare(model: str, cfg: TaSQConfig, corpus: str = "wiki", progress: bool = True, log=print,
            dense: bool | None = None) -> Prepared:
    """Load the model and capture ``cfg.calib_tokens`` tokens (Fisher on ``cfg.fisher_tokens``)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    times: dict = {}
    with _stage(times, "load", log):
        path = resolve_model(model)
        fp = fingerprint(load_config(path))
        cfg.check_head_dim(fp.head_dim)
        tok = AutoTokenizer.from_pretrained(path)
        lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
        inv_freq, att_scale = rope_inv_freq(lm)
        W = cfg.window_len
        train = corpora.token_windows(tok, corpus, "train", W, max_tokens=cfg.calib_tokens)
        held = corpora.token_windows(tok, corpus, "heldout", W, max_tokens=EVAL_WINDOWS * W)
    n_fisher = (cfg.fisher_tokens + W - 1) // W if cfg.fisher else 0
    dense = cfg.weighting == "dense" if dense is None else dense
    with _stage(times, "capture", log):
        cap = capture(lm, train, inv_freq, fisher_windows=n_fisher,
                      dense_pairs=DENSE_PAIRS_PER_WINDOW if dense else 0, seed=cfg.seed, progress=progress)
        ev = capture(lm, held, inv_freq, store_queries=True, progress=progress)
    return Prepared(fp, path, corpus, inv_freq, att_scale, cap, ev, W, times)


def run(model: str, cfg: TaSQConfig, corpus: str = "wiki", progress: bool = True, log=print) -> Result:
    """prepare + fit: one calibration from scratch."""
    t0 = time.time()
    prep = prepare(model, cfg, corpus, progress, log)
    res = fit(prep, cfg, progress, log)
    res.times = {**prep.times, **res.times, "total": round(time.time() - t0, 2)}
    res.calibration["wall_time_s"] = res.times["total"]
    res.calibration["stage_times_s"] = dict(res.times)
    return res


def fit(prep: Prepared, cfg: TaSQConfig, progress: bool = True, log=print) -> Result:
    """Weights -> scale -> grouping -> k-means -> fold -> held-out errors, on captured data."""
    t_start = time.time()
    times: dict = {}
    torch.manual_seed(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    fp, cap, ev, W = prep.model, prep.train, prep.heldout, prep.window_len
    if cfg.fisher and cap.fisher_k is None:
        raise ValueError("config asks for Fisher weighting but the capture has no Fisher pass")
    if cfg.weighting == "dense" and cap.q_dense_sums is None:
        raise ValueError("config asks for dense weighting but the capture has no dense query moments")
    L, H, d = fp.num_layers, fp.num_kv_heads, fp.head_dim
    gk, gv = cfg.group_size_k, cfg.group_size_v
    Gk, Gv = d // gk, d // gv
    with _stage(times, "weights", log):
        k_mix = k_unmix = None
        if cfg.weighting == "diag":
            w = weights.diag_weights(cap.q_diag_sums, cap.q_pair_count, cfg.weight_floor)
        else:
            w = torch.ones(L, H, d)
        if cfg.weighting == "dense":
            k_mix, k_unmix = weights.dense_mix(cap.q_dense_sums, cap.q_dense_count, cfg.weight_floor)
    ident = torch.arange(d).expand(L, H, d).clone()
    cb = codec.Codebooks(cfg, torch.zeros(L, H, Gk, cfg.codebook_size_k, gk), w, ident,
                         torch.zeros(L, H, Gv, cfg.codebook_size_v, gv), prep.inv_freq, prep.attention_scaling,
                         k_mix, k_unmix)
    with _stage(times, "scale+covariance", log):
        sig = torch.empty(L, H, d, d, dtype=torch.float64)
        for l in range(L):
            x = _tailor_all(cap.keys[l], cb, l).double()
            sig[l] = torch.einsum("nhi,nhj->hij", x, x) / x.shape[0]
    with _stage(times, "grouping", log):
        cb.k_perm = grouping.grouping(sig, gk, cfg.grouping)
        contiguous = grouping.grouping(sig[:1, :1], gk, "contiguous")[0, 0]
        cost = {"tasq": sum(grouping.group_cost(sig[l, h], cb.k_perm[l, h], gk) for l in range(L) for h in range(H)),
                "contiguous": sum(grouping.group_cost(sig[l, h], contiguous, gk) for l in range(L) for h in range(H))}
    with _stage(times, "kmeans", log):
        k_tail = torch.empty(L, H, Gk, cfg.codebook_size_k, gk)
        v_cb = torch.empty(L, H, Gv, cfg.codebook_size_v, gv)
        for l in tqdm(range(L), desc="k-means", unit="layer", disable=not progress):
            k_tail[l] = _fit_keys(cap, cb, l, gen).view(H, Gk, cfg.codebook_size_k, gk)
            v_cb[l] = _fit_values(cap, cfg, l, gen).view(H, Gv, cfg.codebook_size_v, gv)
    with _stage(times, "fold", log):
        cb.k_codebook = k_tail if cfg.weighting == "dense" else fold.fold_key_codebooks(k_tail, w, cb.k_perm)
        cb.v_codebook = v_cb
    with _stage(times, "evaluate", log):
        errs = [evaluate.layer_errors(cb, l, ev.keys[l], ev.values[l], ev.queries[l], W, seed=cfg.seed)
                for l in range(L)]
        errors = {k: sum(e[k] for e in errs) / L for k in errs[0]}
        errors["group_cost_logdet"] = cost
        errors["per_layer"] = errs
    times["fit_total"] = round(time.time() - t_start, 2)
    n_fisher_tok = cap.fisher_k.shape[1] if (cfg.fisher and cap.fisher_k is not None) else 0
    calib = {"corpus": f"{prep.corpus}/train", "tokens": cap.tokens, "fisher_tokens": n_fisher_tok,
             "windows": cap.tokens // W, "window_len": W, "seed": cfg.seed,
             "wall_time_s": times["fit_total"], "stage_times_s": dict(times), "lm_loss": round(cap.loss, 4),
             "heldout": {"corpus": f"{prep.corpus}/heldout", "tokens": ev.tokens,
                         **{k: v for k, v in errors.items() if k != "per_layer"}},
             "host": f"{platform.machine()} {torch.get_num_threads()} threads",
             "torch": torch.__version__, "model_path": str(prep.model_path)}
    return Result(cb, fp, calib, times, errors)


def _sample(x: torch.Tensor, wts, n: int, gen: torch.Generator):
    """x [B, N, g], weights [B, N] or None -> (points, weights or None) for k-means.

    Above ``n`` points, draw n by importance (weights) or uniformly and fit them unweighted
    (an unbiased stand-in for the weighted objective); otherwise fit all points weighted."""
    B, N, g = x.shape
    if N <= n:
        return x, wts
    idx = kmeans.importance_sample(torch.ones(B, N) if wts is None else wts, n, gen)
    return torch.gather(x, 1, idx[..., None].expand(B, n, g)), None


def _fit_keys(cap, cb: codec.Codebooks, l: int, gen) -> torch.Tensor:
    """Tailored key codebooks of layer l: [H*Gk, K, g]."""
    cfg = cb.config
    H, d = cb.num_kv_heads, cb.head_dim
    g = cfg.group_size_k
    n_pool = cap.fisher_k.shape[1] if cap.fisher_k is not None else cap.keys.shape[1]
    xt = _tailor_all(cap.keys[l, :n_pool], cb, l)  # native order, tailored [N, H, d]
    perm = cb.k_perm[l]
    x = torch.gather(xt, 2, perm.expand(n_pool, H, d)).view(n_pool, H * d // g, g).transpose(0, 1)
    wts = None
    if cap.fisher_k is not None:
        f = cap.fisher_k[l].float() / cb.k_weight[l].pow(2)  # native units, per channel
        wts = torch.gather(f, 2, perm.expand(n_pool, H, d)).view(n_pool, H * d // g, g).sum(-1).transpose(0, 1)
    xs, ws = _sample(x.contiguous(), wts, cfg.max_kmeans_samples, gen)
    return _fit(xs, ws, cfg, cfg.codebook_size_k, cfg.seed + l)


def _fit_values(cap, cfg: TaSQConfig, l: int, gen) -> torch.Tensor:
    """Value codebooks of layer l: [H*Gv, K, g] (contiguous groups, native units)."""
    g = cfg.group_size_v
    n_pool = cap.fisher_v.shape[1] if cap.fisher_v is not None else cap.values.shape[1]
    v = cap.values[l, :n_pool].float()
    H, d = v.shape[1], v.shape[2]
    x = v.reshape(n_pool, H * d // g, g).transpose(0, 1).contiguous()
    wts = None
    if cap.fisher_v is not None:
        wts = cap.fisher_v[l].float().reshape(n_pool, H * d // g, g).sum(-1).transpose(0, 1)
    xs, ws = _sample(x, wts, cfg.max_kmeans_samples, gen)
    return _fit(xs, ws, cfg, cfg.codebook_size_v, cfg.seed + 1000 + l)


def _fit(xs, ws, cfg: TaSQConfig, K: int, seed: int) -> torch.Tensor:
    if cfg.kmeans == "tree" and K >= 16:
        return kmeans.kmeans_tree(xs, ws, K, cfg.kmeans_iters, seed=seed)
    return kmeans.kmeans(xs, ws, K, cfg.kmeans_iters, seed=seed).centroids


def write(result: Result, out_dir) -> Path:
    return save_artifact(out_dir, result.codebooks, result.model, result.calibration)
