"""``python -m bench.value_space``: does an output-side tailored value space pay (issue 14, item 3)?

A value error ``delta`` of KV head h reaches the residual stream through the output projection
of the query heads that read it, so the error that counts is ``delta^T M_h delta`` with
``M_h = sum_{q in group(h)} W_o,q^T W_o,q`` (d x d, from the weights alone): the values' analogue
of the keys' query-guided weights. Restricted to each contiguous value group G (``M_GG``), the
metric folds into the codebooks: coding ``T_G v_G`` with ``T_G = M_GG^(1/2)`` and decoding
``T_G^(-1) c`` leaves serving a plain codebook lookup, so it is the cheapest form it could ship
in. Cross-group terms are left out of the fit (errors of different groups are nearly
uncorrelated) but kept in the evaluation.

Per layer, on captured calibration values (k-means as ``calibrate``: flat weighted Lloyd,
k-means++), two value codebooks at the same rate are fitted, plain (TaSQ's values, the paper)
and in the ``T_G`` space, and compared on held-out values by

* the output-space error ``sum delta^T M_h delta / sum v^T M_h v`` (full ``M_h``);
* the plain value MSE ``|delta|^2 / |v|^2``;
* the high-rate prediction of the gain, ``mean_G(AM(eig M_GG) / GM(eig M_GG))``: what an
  ideal quantizer gains by seeing the metric (1 = nothing).

Writes ``metrics.json`` and ``summary.md`` under ``--out``. The fit uses no Fisher weights
(the capture then needs no backward pass); both variants are fitted alike.

    python -m bench.value_space --layers 0 7 15 22 29
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results" / "value_space"


def output_metric(o_proj_weight: torch.Tensor, num_q_heads: int, num_kv_heads: int) -> torch.Tensor:
    """o_proj weight [hidden, Hq * d] -> M [H, d, d] float64: ``sum_q W_o,q^T W_o,q`` over the
    query heads q that read KV head h (GQA: q // (Hq / H) == h)."""
    W = o_proj_weight.double()
    d = W.shape[1] // num_q_heads
    Wq = W.view(W.shape[0], num_q_heads, d).permute(1, 2, 0)  # [Hq, d, hidden]
    per_q = Wq @ Wq.transpose(1, 2)  # [Hq, d, d]
    return per_q.view(num_kv_heads, num_q_heads // num_kv_heads, d, d).sum(1)


def group_maps(M: torch.Tensor, g: int) -> tuple[torch.Tensor, torch.Tensor]:
    """M [H, d, d] -> (T [H, G, g, g], T^-1) with ``T = M_GG^(1/2)`` (symmetric) per contiguous
    group, scaled so that mean(eig) = 1 per group (k-means is scale-free; this keeps numbers O(1))."""
    H, d, _ = M.shape
    G = d // g
    B = torch.stack([M[:, j * g:(j + 1) * g, j * g:(j + 1) * g] for j in range(G)], 1)  # [H, G, g, g]
    e, U = torch.linalg.eigh(B)
    e = e.clamp_min(e.amax(-1, keepdim=True) * 1e-9)
    e = e / e.mean(-1, keepdim=True)
    T = U @ torch.diag_embed(e.sqrt()) @ U.transpose(-1, -2)
    Ti = U @ torch.diag_embed(e.rsqrt()) @ U.transpose(-1, -2)
    return T.float(), Ti.float()


def high_rate_gain(M: torch.Tensor, g: int) -> float:
    """Mean over (head, group) of AM / GM of the eigenvalues of M_GG (1: the metric is isotropic)."""
    H, d, _ = M.shape
    out = []
    for j in range(d // g):
        e = torch.linalg.eigvalsh(M[:, j * g:(j + 1) * g, j * g:(j + 1) * g]).clamp_min(1e-30)
        out.append(e.mean(-1) / e.log().mean(-1).exp())
    return float(torch.cat(out).mean())


def _to_groups(v: torch.Tensor, g: int) -> torch.Tensor:
    """[N, H, d] -> [H * G, N, g]."""
    N, H, d = v.shape
    return v.reshape(N, H * (d // g), g).transpose(0, 1).contiguous()


def _apply(T: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """T [H, G, g, g], x [H * G, N, g] -> T x per group."""
    B = x.shape[0]
    return torch.einsum("bij,bnj->bni", T.reshape(B, *T.shape[-2:]), x)


def layer_errors(train_v: torch.Tensor, held_v: torch.Tensor, M: torch.Tensor, g: int, K: int, iters: int,
                 tol: float, seed: int) -> dict:
    """Fit plain and T-space codebooks on train_v [N, H, d]; errors on held_v [N', H, d]."""
    from calibrate.kmeans import assign_torch, kmeans

    H, d = train_v.shape[1], train_v.shape[2]
    T, Ti = group_maps(M, g)
    xt, xh = _to_groups(train_v.float(), g), _to_groups(held_v.float(), g)
    out = {}
    for name, fwd, back in (("plain", None, None), ("output", T, Ti)):
        fit = kmeans(xt if fwd is None else _apply(fwd, xt), None, K, iters, seed=seed, tol=tol)
        c = fit.centroids
        q = xh if fwd is None else _apply(fwd, xh)
        codes, _ = assign_torch(q, c)
        rec = torch.gather(c, 1, codes[..., None].expand(-1, -1, g))
        if back is not None:
            rec = _apply(back, rec)
        N = held_v.shape[0]
        v_hat = rec.transpose(0, 1).reshape(N, H, d).double()
        v = held_v.double()
        delta = v - v_hat
        num = torch.einsum("nhi,hij,nhj->", delta, M, delta)
        den = torch.einsum("nhi,hij,nhj->", v, M, v)
        out[name] = {"output_nmse": float(num / den), "value_mse": float((delta ** 2).sum() / (v ** 2).sum()),
                     "iters": fit.iters}
    out["output_gain"] = out["plain"]["output_nmse"] / out["output"]["output_nmse"]
    out["high_rate_gain"] = high_rate_gain(M, g)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.value_space", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--layers", type=int, nargs="+", default=None, help="default: every layer")
    ap.add_argument("--tokens", type=int, default=32768, help="calibration tokens captured")
    ap.add_argument("--kmeans-samples", type=int, default=32768)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--codebook-size", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=25)
    ap.add_argument("--out", type=Path, default=RESULTS)
    a = ap.parse_args(argv)

    from calibrate import pipeline
    from sglang_tasq.config import TaSQConfig
    from sglang_tasq.models import resolve_model

    t0 = time.time()
    cfg = TaSQConfig(calib_tokens=a.tokens, fisher=False, max_kmeans_samples=a.kmeans_samples,
                     kmeans_iters=a.iters, group_size_v=a.group_size, codebook_size_v=a.codebook_size)
    prep = pipeline.prepare(a.model, cfg, progress=False, log=lambda *_: None)
    from safetensors import safe_open

    path = resolve_model(a.model)
    fp = prep.model
    layers = a.layers if a.layers is not None else list(range(fp.num_layers))
    rows = {}
    gen = torch.Generator().manual_seed(cfg.seed)
    wanted = {f"model.layers.{l}.self_attn.o_proj.weight": l for l in layers}
    o_proj = {}
    for f in sorted(path.glob("*.safetensors")):  # one pass over the checkpoint's files
        with safe_open(str(f), "pt") as st:
            o_proj.update({wanted[k]: st.get_tensor(k) for k in st.keys() if k in wanted})
    missing = [l for l in layers if l not in o_proj]
    if missing:
        raise SystemExit(f"bench.value_space: no o_proj weight for layers {missing} in {path}")
    for l in layers:
        M = output_metric(o_proj[l], fp.num_q_heads, fp.num_kv_heads)
        v = prep.train.values[l].float()
        idx = torch.randperm(v.shape[0], generator=gen)[: a.kmeans_samples].sort().values
        rows[l] = layer_errors(v[idx], prep.heldout.values[l], M, a.group_size, a.codebook_size, a.iters,
                               cfg.kmeans_tol, cfg.seed + 1000 + l)
        r = rows[l]
        print(f"layer {l:2d}: output NMSE plain {r['plain']['output_nmse']:.4f}  tailored "
              f"{r['output']['output_nmse']:.4f}  (x{r['output_gain']:.3f}; high-rate bound x{r['high_rate_gain']:.3f})"
              f"  value MSE {r['plain']['value_mse']:.4f} / {r['output']['value_mse']:.4f}", flush=True)
    mean = lambda key, sub=None: sum((rows[l][key] if sub is None else rows[l][key][sub]) for l in layers) / len(layers)
    summary = {"model": a.model, "model_dtype": prep.model_dtype, "layers": layers, "tokens": prep.train.tokens,
               "heldout_tokens": prep.heldout.tokens, "group_size": a.group_size, "codebook_size": a.codebook_size,
               "kmeans_samples": a.kmeans_samples, "iters": a.iters, "seconds": round(time.time() - t0, 1),
               "mean": {"output_nmse_plain": mean("plain", "output_nmse"), "output_nmse_tailored": mean("output", "output_nmse"),
                        "value_mse_plain": mean("plain", "value_mse"), "value_mse_tailored": mean("output", "value_mse"),
                        "output_gain": mean("output_gain"), "high_rate_gain": mean("high_rate_gain")},
               "per_layer": rows}
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "metrics.json").write_text(json.dumps(summary, indent=1))
    m = summary["mean"]
    lines = [f"# Output-side value space (issue 14, item 3): {a.model}, {a.group_size} x {a.codebook_size}",
             "", f"`python -m bench.value_space --layers {' '.join(map(str, layers))} --tokens {a.tokens} --kmeans-samples "
             f"{a.kmeans_samples}`; {prep.train.tokens:,} calibration "
             f"tokens ({a.kmeans_samples:,} points per codebook, no Fisher), {prep.heldout.tokens:,} held-out; "
             f"{prep.model_dtype} model; {summary['seconds']:.0f} s.", "",
             "| layer | output NMSE, plain | output NMSE, W_o space | gain | high-rate bound | value MSE plain / W_o space |",
             "|---|---|---|---|---|---|"]
    for l in layers:
        r = rows[l]
        lines.append(f"| {l} | {r['plain']['output_nmse']:.4f} | {r['output']['output_nmse']:.4f} | "
                     f"{r['output_gain']:.3f}x | {r['high_rate_gain']:.3f}x | {r['plain']['value_mse']:.4f} / {r['output']['value_mse']:.4f} |")
    lines.append(f"| mean | {m['output_nmse_plain']:.4f} | {m['output_nmse_tailored']:.4f} | {m['output_gain']:.3f}x | "
                 f"{m['high_rate_gain']:.3f}x | {m['value_mse_plain']:.4f} / {m['value_mse_tailored']:.4f} |")
    (a.out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[-1:]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
