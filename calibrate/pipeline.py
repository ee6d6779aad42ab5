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
from sglang_tasq.config import ConfigError, TaSQConfig
from sglang_tasq.models import compute_dtype, dtype_name, fingerprint, load_config, resolve_model, rope_inv_freq
from sglang_tasq.rope import apply_rope

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
    """Tailored keys in native channel order [N, H, d] f32 (weights + scale, no permutation)
    and each token's scale s_p as float32 [N, H] (1 without a scale)."""
    N, H, d = keys.shape
    out = torch.empty(N, H, d)
    scale = torch.ones(N, H)
    inv = cb.k_inv_perm(layer)
    for s in range(0, N, chunk):
        x, sc = codec.key_tailor(keys[s:s + chunk].float(), cb, layer)
        out[s:s + chunk] = torch.gather(x.reshape(-1, H, d), 2, inv.expand(x.shape[0], H, d))
        if sc is not None:
            scale[s:s + chunk] = (sc.float()[:, None] if sc.dim() == 1 else sc.float()).expand(-1, H)
    return out, scale


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
    model_dtype: str = "bfloat16"  # what the model computed in during capture (models.compute_dtype)


def resolve_device(device: str | torch.device | None) -> torch.device:
    """'cpu', 'cuda' (or 'cuda:N', or a torch.device); None: cuda when available, else cpu."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {device}: allowed cpu, cuda")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: this torch has no CUDA device (torch {torch.__version__})")
    return dev


def prepare(model: str, cfg: TaSQConfig, corpus: str = "wiki", progress: bool = True, log=print,
            dense: bool | None = None, device: str | torch.device | None = "cpu") -> Prepared:
    """Load the model on ``device`` and capture ``cfg.calib_tokens`` tokens (Fisher on
    ``cfg.fisher_tokens``); the captured statistics live on the CPU."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    times: dict = {}
    with _stage(times, "load", log):
        path = resolve_model(model)
        fp = fingerprint(load_config(path))
        cfg.check_head_dim(fp.head_dim)
        tok = AutoTokenizer.from_pretrained(path)
        dev = resolve_device(device)
        dtype = compute_dtype(dev)
        lm = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval().to(dev)
        inv_freq, att_scale = rope_inv_freq(lm)
        inv_freq = inv_freq.cpu()
        W = cfg.window_len
        train = corpora.token_windows(tok, corpus, "train", W, max_tokens=cfg.calib_tokens)
        held = corpora.token_windows(tok, corpus, "heldout", W, max_tokens=EVAL_WINDOWS * W)
    n_fisher = (cfg.fisher_tokens + W - 1) // W if cfg.fisher else 0
    dense = cfg.weighting == "dense" if dense is None else dense
    with _stage(times, "capture", log):
        cap = capture(lm, train, inv_freq, fisher_windows=n_fisher,
                      dense_pairs=DENSE_PAIRS_PER_WINDOW if dense else 0, seed=cfg.seed, progress=progress,
                      post_rope_queries=cfg.key_rope == "post")
        ev = capture(lm, held, inv_freq, store_queries=True, progress=progress)
    return Prepared(fp, path, corpus, inv_freq, att_scale, cap, ev, W, times, dtype_name(dtype))


def run(model: str, cfg: TaSQConfig, corpus: str = "wiki", progress: bool = True, log=print,
        device: str | None = None) -> Result:
    """prepare + fit: one calibration from scratch, on ``device`` (default: cuda when available)."""
    t0 = time.time()
    dev = resolve_device(device)
    prep = prepare(model, cfg, corpus, progress, log, device=dev)
    res = fit(prep, cfg, progress, log, device=dev)
    res.times = {**prep.times, **res.times, "total": round(time.time() - t0, 2)}
    res.calibration["wall_time_s"] = res.times["total"]
    res.calibration["stage_times_s"] = dict(res.times)
    if dev.type == "cuda":  # what a user's GPU must hold: the model, a window's activations, k-means
        res.calibration["peak_device_memory_gib"] = round(torch.cuda.max_memory_allocated(dev) / 2**30, 2)
    return res


def fit(prep: Prepared, cfg: TaSQConfig, progress: bool = True, log=print,
        device: str | torch.device | None = "cpu") -> Result:
    """Weights -> scale -> grouping -> k-means -> fold -> held-out errors, on captured data
    (k-means on ``device``; the other stages are small and stay on the CPU)."""
    if cfg.kmeans != "flat":
        raise ConfigError(f"kmeans={cfg.kmeans!r} is recorded in older artifacts and no longer fitted; use 'flat'")
    dev = resolve_device(device)
    t_start = time.time()
    times: dict = {}
    torch.manual_seed(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    fp, cap, ev, W = prep.model, prep.train, prep.heldout, prep.window_len
    if cfg.fisher and cap.fisher_k is None:
        raise ValueError("config asks for Fisher weighting but the capture has no Fisher pass")
    if cfg.weighting == "dense" and cap.q_dense_sums is None:
        raise ValueError("config asks for dense weighting but the capture has no dense query moments")
    if cfg.weighting == "qpca" and cap.q_post_sums is None:
        raise ValueError("config asks for the post-RoPE key map but the capture has no post-RoPE query moments")
    L, H, d = fp.num_layers, fp.num_kv_heads, fp.head_dim
    gk, gv = cfg.group_size_k, cfg.group_size_v
    Gk, Gv = d // gk, d // gv

    def layer_keys(l: int, n: int | None = None) -> torch.Tensor:
        return quantizer_keys(cap.keys[l, :n], cfg, prep.inv_freq, prep.attention_scaling, W)

    with _stage(times, "weights", log):
        k_mix = k_unmix = k_mean = None
        if cfg.weighting == "diag":
            w = weights.diag_weights(cap.q_diag_sums, cap.q_pair_count, cfg.weight_floor)
        else:
            w = torch.ones(L, H, d)
        if cfg.weighting == "dense":
            k_mix, k_unmix = weights.dense_mix(cap.q_dense_sums, cap.q_dense_count, cfg.weight_floor)
        if cfg.weighting == "qpca":
            maps = [weights.qpca_map(layer_keys(l), cap.q_post_sums[l], cap.q_post_count, cfg.weight_floor)
                    for l in range(L)]
            k_mix, k_unmix, k_mean = (torch.stack(t) for t in zip(*maps))
    cfg.check_layers(L)
    ident = torch.arange(d).expand(L, H, d).clone()
    rates = [cfg.key_rate(l) for l in range(L)]  # (g, K) of each layer's keys
    k_init = torch.zeros(L, H, Gk, cfg.codebook_size_k, gk)
    if cfg.layer_mixed:  # one codebook tensor per layer, at its rate (Codebooks' per-layer form)
        k_init = tuple(torch.zeros(H, d // g, K, g) for g, K in rates)
    cb = codec.Codebooks(cfg, k_init, w, ident,
                         torch.zeros(L, H, Gv, cfg.codebook_size_v, gv), prep.inv_freq, prep.attention_scaling,
                         k_mix, k_unmix, k_mean)
    with _stage(times, "scale+covariance", log):
        sig = torch.empty(L, H, d, d, dtype=torch.float64)
        for l in range(L):
            sig[l] = grouping.covariance(_tailor_all(layer_keys(l), cb, l)[0])
    with _stage(times, "grouping", log):
        perm = torch.empty(L, H, d, dtype=torch.long)
        contiguous = {}
        for g in sorted({g for g, _ in rates}):
            at = [l for l in range(L) if rates[l][0] == g]
            perm[at] = grouping.grouping(sig[at], g, cfg.grouping).long()
            contiguous[g] = grouping.grouping(sig[:1, :1], g, "contiguous")[0, 0]
        cb.k_perm = perm
        cost = {"chosen": sum(grouping.group_cost(sig[l, h], cb.k_perm[l, h], rates[l][0]) for l in range(L) for h in range(H)),
                "contiguous": sum(grouping.group_cost(sig[l, h], contiguous[rates[l][0]], rates[l][0])
                                  for l in range(L) for h in range(H))}
    with _stage(times, "kmeans", log):
        k_tail = [None] * L
        v_cb = torch.empty(L, H, Gv, cfg.codebook_size_v, gv)
        km_stats = []
        for l in tqdm(range(L), desc="k-means", unit="layer", disable=not progress):
            g, K = rates[l]
            rk = _fit(*_key_points(cap, cb, l, gen, layer_keys(l, _pool_size(cap, cfg))), cfg, K, cfg.seed + l, dev)
            rv = _fit(*_value_points(cap, cfg, l, gen), cfg, cfg.codebook_size_v, cfg.seed + 1000 + l, dev)
            k_tail[l] = rk.centroids.cpu().view(H, d // g, K, g)
            v_cb[l] = rv.centroids.cpu().view(H, Gv, cfg.codebook_size_v, gv)
            km_stats += [rk, rv]
    with _stage(times, "fold", log):
        if cfg.mixes_keys:
            cb.k_codebook = torch.stack(k_tail)
        elif cfg.layer_mixed:  # each layer folded alone: the fold is per layer and head
            cb.k_codebook = tuple(fold.fold_key_codebooks(k_tail[l][None], w[l:l + 1], cb.k_perm[l:l + 1])[0]
                                  for l in range(L))
        else:
            cb.k_codebook = fold.fold_key_codebooks(torch.stack(k_tail), w, cb.k_perm)
        cb.v_codebook = v_cb
    with _stage(times, "evaluate", log):
        errs = [evaluate.layer_errors(cb, l, ev.keys[l], ev.values[l], ev.queries[l], W, seed=cfg.seed,
                                      attention_scaling=prep.attention_scaling) for l in range(L)]
        errors = {k: sum(e[k] for e in errs) / L for k in errs[0]}
        errors["group_cost"] = cost
        errors["per_layer"] = errs
    times["fit_total"] = round(time.time() - t_start, 2)
    n_fisher_tok = cap.fisher_k.shape[1] if (cfg.fisher and cap.fisher_k is not None) else 0
    calib = {"corpus": f"{prep.corpus}/train", "tokens": cap.tokens, "fisher_tokens": n_fisher_tok,
             "windows": cap.tokens // W, "window_len": W, "seed": cfg.seed,
             "wall_time_s": times["fit_total"], "stage_times_s": dict(times), "lm_loss": round(cap.loss, 4),
             "kmeans": {"points_per_codebook": int(min(cfg.max_kmeans_samples, _pool_size(cap, cfg))),
                        "iters_min": min(r.iters for r in km_stats), "iters_max": max(r.iters for r in km_stats),
                        "last_rel_change_max": max(r.rel_change for r in km_stats), "tol": cfg.kmeans_tol,
                        "empty_reseeded": sum(r.empty_reseeded for r in km_stats), "device": str(dev)},
             "heldout": {"corpus": f"{prep.corpus}/heldout", "tokens": ev.tokens,
                         **{k: v for k, v in errors.items() if k != "per_layer"}},
             "host": f"{platform.machine()} {torch.get_num_threads()} threads",
             "torch": torch.__version__, "model_dtype": prep.model_dtype, "model_path": str(prep.model_path)}
    return Result(cb, fp, calib, times, errors)


def _pool_size(cap, cfg: TaSQConfig) -> int:
    """Tokens k-means may draw from: the Fisher tokens when the fit is Fisher-weighted."""
    return cap.fisher_k.shape[1] if cfg.fisher else cap.keys.shape[1]


def _subset(x: torch.Tensor, wts, n: int, gen: torch.Generator):
    """x [B, N, g], weights [B, N] or None -> at most n points per codebook, a uniform random
    subset (the same tokens for every codebook) with their weights: the weighted objective
    is estimated without bias, and the weights still enter the fit."""
    N = x.shape[1]
    if N <= n:
        return x, wts
    idx = torch.randperm(N, generator=gen)[:n].sort().values
    return x[:, idx], None if wts is None else wts[:, idx]


def quantizer_keys(keys: torch.Tensor, cfg: TaSQConfig, inv_freq: torch.Tensor, attention_scaling: float,
                   window: int) -> torch.Tensor:
    """Captured pre-RoPE keys [N, H, d] (rows of consecutive ``window``-token windows) -> the
    keys the quantizer codes, float32: as captured, or (key_rope 'post') rotated by RoPE at their
    position in the window, as the model caches them."""
    if cfg.key_rope == "pre":
        return keys.float()
    pos = torch.arange(keys.shape[0]) % window
    return apply_rope(keys.float(), pos, inv_freq, attention_scaling)


def _key_points(cap, cb: codec.Codebooks, l: int, gen, keys: torch.Tensor | None = None):
    """Tailored key points of layer l [H*Gk, N, g] and their Fisher weights [H*Gk, N] (or None).
    ``keys`` [N_pool, H, d]: the layer's keys in the quantizer's space (default: as captured).

    The Fisher is taken in the tailored space (paper sec. 4.4): with k = s_p W^(-1/2) k~,
    F~_i = (dL/dk_i)^2 * s_p^2 / w_i^2, summed over the group's channels."""
    cfg = cb.config
    H, d = cb.num_kv_heads, cb.head_dim
    g = cb.key_group_size(l)
    n_pool = _pool_size(cap, cfg)
    keys = cap.keys[l, :n_pool] if keys is None else keys
    xt, scale = _tailor_all(keys, cb, l)  # native order, tailored [N, H, d]
    perm = cb.k_perm[l]
    x = torch.gather(xt, 2, perm.expand(n_pool, H, d)).view(n_pool, H * d // g, g).transpose(0, 1)
    wts = None
    if cfg.fisher:
        f = cap.fisher_k[l].float() * scale.pow(2)[..., None] / cb.k_weight[l].pow(2)  # [N, H, d]
        wts = torch.gather(f, 2, perm.expand(n_pool, H, d)).view(n_pool, H * d // g, g).sum(-1).transpose(0, 1)
    return _subset(x.contiguous(), wts, cfg.max_kmeans_samples, gen)


def _value_points(cap, cfg: TaSQConfig, l: int, gen):
    """Value points of layer l [H*Gv, N, g] (contiguous groups, native units) and their Fisher."""
    g = cfg.group_size_v
    n_pool = _pool_size(cap, cfg)
    v = cap.values[l, :n_pool].float()
    H, d = v.shape[1], v.shape[2]
    x = v.reshape(n_pool, H * d // g, g).transpose(0, 1).contiguous()
    wts = None
    if cfg.fisher:
        wts = cap.fisher_v[l].float().reshape(n_pool, H * d // g, g).sum(-1).transpose(0, 1)
    return _subset(x, wts, cfg.max_kmeans_samples, gen)


def _fit(xs, ws, cfg: TaSQConfig, K: int, seed: int, device: torch.device) -> kmeans.KMeansResult:
    return kmeans.kmeans(xs.to(device), None if ws is None else ws.to(device), K, cfg.kmeans_iters,
                         seed=seed, tol=cfg.kmeans_tol)


def write(result: Result, out_dir) -> Path:
    return save_artifact(out_dir, result.codebooks, result.model, result.calibration)
