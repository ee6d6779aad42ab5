"""``python -m bench.layer_errors``: held-out errors of artifacts layer by layer, side by side.

What ``calibrate`` reports as one mean (``held-out key MSE / logit NMSE / value MSE``, from
:func:`calibrate.evaluate.layer_errors` on the same held-out windows and seed), split by layer,
for one or more artifacts of the model. Two readings on top:

* ``--ls-scale``: the logit NMSE with a least-squares key scale instead of the RMS one. For the
  codes ``z`` the encoder chose, ``s = <k^w, C~[z]> / |C~[z]|^2`` (over all KV heads of the
  token, in the tailored space, where the squared error is the query-weighted one) is the
  scale that minimizes the token's error for those codes; ``ls2`` re-encodes ``k^w / s`` and
  refits ``s`` once. Decode is unchanged (``s * C~[z]``), so this measures what an encoder-side
  change could buy without touching the artifact or the kernels. Not served.
* with two artifacts (``--artifact`` twice) that differ only in the keys' rate, the layer mix
  the held-out logit NMSE would choose: layers ranked by how much the second artifact lowers
  their error, and for the best 1..n the mean logit NMSE and mean key bits of the mix (a mix
  layer reads the second artifact's keys, every other layer the first's; the values are the
  first's). A per-layer key rate is served as one ``--mix-layers`` artifact (``calibrate``).

Writes ``metrics.json`` and ``summary.md`` under ``--out``::

    python -m bench.layer_errors --artifact 1.3=artifacts/smollm2 --ls-scale \\
        --artifact 1.7=artifacts/quality/default/tasq_g4k256_g8k1024
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results" / "layer_errors"


def ls_scale(kw: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """kw, c [T, ...] (tailored key, unnormalized, and the chosen codewords) -> fp16 scale [T]
    minimizing ``|kw - s c|^2`` per token."""
    dims = tuple(range(1, kw.dim()))
    s = (kw * c).sum(dims) / (c * c).sum(dims).clamp_min(1e-12)
    return s.clamp_min(1e-6).half()


def ls_scale_nmse(cb, layer: int, keys: torch.Tensor, queries: torch.Tensor, window: int, seed: int) -> dict:
    """{'ls': logit NMSE with the least-squares scale for the RMS-scale codes, 'ls2': after one
    re-encode with that scale}. Shared scale over all KV heads only (the paper's)."""
    from calibrate.evaluate import logit_nmse
    from sglang_tasq import codec

    if cb.config.scale != "shared" or cb.config.scale_groups != 1 or cb.config.key_rope != "pre" or cb.k_mix is not None:
        raise ValueError("--ls-scale reads artifacts with the paper's key path (pre-RoPE, diagonal weights, "
                         "one shared scale per token)")
    k = keys.float()
    x, s = codec.key_tailor(k, cb, layer)
    kw = x * s.float()[:, None, None, None]
    tcb = cb.tailored_k_codebook(layer)
    def nmse(z, s):
        return logit_nmse(queries.float(), k, codec.decode_keys(z, s, cb, layer), cb.inv_freq, window, 8192, seed)

    def fit(z):
        return ls_scale(kw, codec._gather_codewords(z, tcb).view(kw.shape))

    z = codec.nearest_codeword(x, tcb)  # the served codes (RMS scale)
    s1 = fit(z)
    z2 = codec.nearest_codeword(kw / s1.float()[:, None, None, None], tcb)
    out = {"ls": nmse(z, s1), "ls2": nmse(z2, fit(z2))}
    return out


def mix_ranking(first: list, second: list) -> list:
    """Per-layer logit NMSE of two artifacts -> layers ordered by the gain of the second
    (largest first; ties: the lower layer)."""
    gain = [a - b for a, b in zip(first, second)]
    return sorted(range(len(gain)), key=lambda i: (-gain[i], i))


def mix_curve(first: list, second: list, bits_first: list, bits_second: list, upto: int) -> list:
    """[{n, layers, logit_nmse, bits_k}] for the best 1..upto layers of :func:`mix_ranking`."""
    order, rows = mix_ranking(first, second), []
    L = len(first)
    for n in range(1, upto + 1):
        chosen = set(order[:n])
        nmse = sum(second[i] if i in chosen else first[i] for i in range(L)) / L
        bits = sum(bits_second[i] if i in chosen else bits_first[i] for i in range(L)) / L
        rows.append({"n": n, "layers": sorted(chosen), "logit_nmse": nmse, "bits_k": bits})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.layer_errors", description=__doc__.split("\n\n")[0])
    ap.add_argument("--artifact", action="append", required=True, metavar="NAME=DIR",
                    help="an artifact of the model, named in the tables (give two for the mix reading)")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--ls-scale", action="store_true", help="also the logit NMSE with a least-squares key scale")
    ap.add_argument("--mix-upto", type=int, default=10, help="mix reading: the best 1..N layers")
    ap.add_argument("--out", default=str(RESULTS / "run"))
    a = ap.parse_args(argv)
    try:
        named = dict(kv.split("=", 1) for kv in a.artifact)
    except ValueError:
        print("bench.layer_errors: --artifact takes NAME=DIR", file=sys.stderr)
        return 2

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from calibrate import corpora, evaluate
    from calibrate.capture import capture
    from calibrate.pipeline import EVAL_WINDOWS
    from sglang_tasq.artifact import ArtifactError, load_artifact
    from sglang_tasq.models import compute_dtype, dtype_name, fingerprint, load_config, resolve_model, rope_inv_freq

    path = resolve_model(a.model)
    fp = fingerprint(load_config(path))
    try:
        arts = {n: load_artifact(d, fp) for n, d in named.items()}
    except ArtifactError as e:
        print(f"bench.layer_errors: {e}", file=sys.stderr)
        return 2
    windows = {art.config.window_len for art in arts.values()}
    seeds = {art.config.seed for art in arts.values()}
    if len(windows) != 1 or len(seeds) != 1:
        print(f"bench.layer_errors: the artifacts were calibrated with other window lengths {windows} or seeds "
              f"{seeds}: their held-out errors are not on the same pairs", file=sys.stderr)
        return 2
    W, seed = windows.pop(), seeds.pop()
    tok = AutoTokenizer.from_pretrained(path)
    dtype = compute_dtype(torch.device("cpu"))
    lm = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    inv_freq, att_scale = rope_inv_freq(lm)
    held = corpora.token_windows(tok, "wiki", "heldout", W, max_tokens=EVAL_WINDOWS * W)
    ev = capture(lm, held, inv_freq.cpu(), store_queries=True, progress=False)

    layers = {}
    for name, art in arts.items():
        cb = art.codebooks
        rows = []
        for l in range(cb.num_layers):
            e = evaluate.layer_errors(cb, l, ev.keys[l], ev.values[l], ev.queries[l], W, seed=seed,
                                      attention_scaling=att_scale)
            if a.ls_scale:
                e.update({f"logit_nmse_{k}": v for k, v in ls_scale_nmse(cb, l, ev.keys[l], ev.queries[l], W, seed).items()})
            e["bits_k"] = art.config.for_layer(l).bits_k(fp.num_kv_heads, fp.head_dim)
            rows.append(e)
            print(f"[layer_errors] {name} layer {l}: " + " ".join(f"{k} {v:.5f}" for k, v in e.items()), flush=True)
        layers[name] = rows

    mean = {n: {k: sum(r[k] for r in rows) / len(rows) for k in rows[0]} for n, rows in layers.items()}
    res = {"model": a.model, "model_dtype": dtype_name(dtype), "heldout_tokens": ev.tokens, "seed": seed,
           "artifacts": {n: {"dir": named[n], "sha256": art.manifest["tensors"]["sha256"],
                             "manifest_heldout": art.manifest["calibration"].get("heldout", {})}
                         for n, art in arts.items()},
           "per_layer": layers, "mean": mean}
    names = list(arts)
    if len(names) == 2:
        f, s = (layers[n] for n in names)
        res["mix"] = {"first": names[0], "second": names[1], "curve": mix_curve(
            [r["logit_nmse"] for r in f], [r["logit_nmse"] for r in s], [r["bits_k"] for r in f],
            [r["bits_k"] for r in s], min(a.mix_upto, len(f)))}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.json").write_text(json.dumps(res, indent=1))
    md = summary(res)
    (out / "summary.md").write_text(md)
    print(md)
    print(f"[layer_errors] {out}")
    return 0


def summary(res: dict) -> str:
    names = list(res["per_layer"])
    cols = [k for k in res["per_layer"][names[0]][0] if k != "bits_k"]
    lines = [f"# Held-out errors by layer, {res['model']} ({res['model_dtype']}), {res['heldout_tokens']:,} held-out tokens\n",
             "| layer | " + " | ".join(f"{n} {c}" for n in names for c in cols) + " |",
             "|---|" + "---|" * (len(names) * len(cols))]
    for l in range(len(res["per_layer"][names[0]])):
        lines.append(f"| {l} | " + " | ".join(f"{res['per_layer'][n][l][c]:.5f}" for n in names for c in cols) + " |")
    lines.append("| mean | " + " | ".join(f"**{res['mean'][n][c]:.5f}**" for n in names for c in cols) + " |")
    if "mix" in res:
        m = res["mix"]
        lines += ["", f"Layer mix by held-out logit NMSE: keys of the best n layers from `{m['second']}`, "
                      f"every other layer from `{m['first']}`.\n",
                  "| n | layers | mean key bits | mean logit NMSE |", "|---|---|---|---|"]
        for r in m["curve"]:
            lines.append(f"| {r['n']} | {','.join(map(str, r['layers']))} | {r['bits_k']:.4f} | {r['logit_nmse']:.5f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
