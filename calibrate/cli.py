"""``python -m calibrate``: fit TaSQ codebooks and write one artifact; ``check`` validates one.

    python -m calibrate --model smollm2-135m --out artifacts/smollm2 [--preset fast] [--tp N]
    python -m calibrate check artifacts/smollm2/tasq.json [--model smollm2-135m]
    python -m calibrate serving artifacts/smollm2 --out artifacts/smollm2_salient --salient 36/192@17
    python -m calibrate serving artifacts/smollm2 --out artifacts/smollm2_salient8 --salient 36/192@17 --exact fp8
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from sglang_tasq.config import ABLATIONS, RATES, ConfigError, TaSQConfig

PRESETS = ("default", "fast")


def build_config(a: argparse.Namespace) -> TaSQConfig:
    base = TaSQConfig.fast() if a.preset == "fast" else TaSQConfig()
    if a.method == "cq":
        base = dataclasses.replace(base, weighting="none", scale="none", grouping="channels", fisher=True)
    elif a.method == "cq_pairs":
        base = dataclasses.replace(base, weighting="none", scale="none", grouping="contiguous", fisher=False)
    elif a.method == "novakv":
        nova = TaSQConfig.novakv()
        base = dataclasses.replace(base, **{k: getattr(nova, k) for k in (
            "weighting", "scale", "grouping", "fisher", "key_rope", "group_size_k", "codebook_size_k")})
    if a.ablation:
        base = base.ablation(a.ablation)
    if a.rate is not None:
        sizes = [f for f in ("group_size", "codebook_size", "group_size_k", "codebook_size_k", "group_size_v",
                             "codebook_size_v") if getattr(a, f) is not None]
        if sizes:
            raise ConfigError(f"--rate {a.rate} sets the group and codebook sizes; it cannot be combined with "
                              + ", ".join("--" + f.replace("_", "-") for f in sizes))
        gk, kk, gv, kv = RATES[a.rate]
        base = dataclasses.replace(base, group_size_k=gk, codebook_size_k=kk, group_size_v=gv, codebook_size_v=kv)
    side = lambda one, both: one if one is not None else both  # noqa: E731  (a side's flag beats --group-size)
    overrides = {"group_size_k": side(a.group_size_k, a.group_size), "group_size_v": side(a.group_size_v, a.group_size),
                 "codebook_size_k": side(a.codebook_size_k, a.codebook_size),
                 "codebook_size_v": side(a.codebook_size_v, a.codebook_size), "calib_tokens": a.tokens, "kmeans_iters": a.iters,
                 "max_kmeans_samples": a.kmeans_samples, "kmeans_tol": a.kmeans_tol, "fisher_tokens": a.fisher_tokens, "seed": a.seed,
                 "sink_window": a.sink, "recent_window": a.recent, "mix_layers": a.mix_layers,
                 "mix_group_size_k": a.mix_group_size_k, "mix_codebook_size_k": a.mix_codebook_size_k}
    if a.mix_layers is None and (a.mix_group_size_k is not None or a.mix_codebook_size_k is not None):
        raise ConfigError("--mix-group-size-k / --mix-codebook-size-k set the rate of the --mix-layers; "
                          "name the layers with --mix-layers")
    return dataclasses.replace(base, **{k: v for k, v in overrides.items() if v is not None})


def _layer_list(text: str) -> tuple:
    """'17,18,21' -> (17, 18, 21): each layer once, in increasing order."""
    try:
        layers = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: a comma-separated list of layer indices, e.g. 17,18,21") from None
    if list(layers) != sorted(set(layers)) or any(i < 0 for i in layers):
        raise argparse.ArgumentTypeError(f"{text!r}: list each layer once, in increasing order, from 0")
    return layers


def _calibrate_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m calibrate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="'smollm2-135m' (embedded) or a local HF checkpoint dir")
    ap.add_argument("--out", required=True, help="output directory (tasq.json + tasq.safetensors)")
    ap.add_argument("--preset", choices=PRESETS, default="default",
                    help="default: 128k tokens; fast: 16k tokens, fewer Lloyd iterations (demos, CI)")
    ap.add_argument("--method", choices=("tasq", "cq", "cq_pairs", "novakv"), default="tasq",
                    help="cq: Coupled Quantization as published (contiguous channel groups, Fisher-weighted "
                         "k-means; a quality baseline, not servable); cq_pairs: CQ on whole-RoPE-pair groups, "
                         "unweighted k-means (servable); novakv: NovaKV's post-RoPE keys (query-whitened KLT, "
                         "stratified groups, per-head scale; keys g=4 K=256 unless --group-size/--codebook-size; "
                         "a quality baseline, not servable)")
    ap.add_argument("--device", help="where the model runs and k-means fits: cpu or cuda[:N] "
                                     "(default: cuda when available, else cpu)")
    ap.add_argument("--ablation", choices=ABLATIONS, help="remove one TaSQ component")
    ap.add_argument("--corpus", choices=("wiki", "code"), default="wiki")
    ap.add_argument("--group-size", type=int, help="channels per group, K and V (default 8)")
    ap.add_argument("--codebook-size", type=int, help="centroids per codebook, K and V (default 1024)")
    ap.add_argument("--rate", choices=tuple(RATES),
                    help="a named rate, about the mean code bits per element: " + "; ".join(
                        f"{n}: keys g={r[0]} K={r[1]}, values g={r[2]} K={r[3]}" for n, r in RATES.items())
                    + " (default: 1.3, the paper's)")
    for side, name in (("k", "keys"), ("v", "values")):
        ap.add_argument(f"--group-size-{side}", type=int, help=f"channels per group for the {name} only")
        ap.add_argument(f"--codebook-size-{side}", type=int, help=f"centroids per codebook for the {name} only")
    ap.add_argument("--mix-layers", type=_layer_list, metavar="L,L,...",
                    help="a per-layer key rate: code the keys of these layers with --mix-group-size-k channels "
                         "per group and --mix-codebook-size-k codewords (default 4 x 256, the 1.7 rate's keys), "
                         "every other layer's at the main rate; e.g. the retrieval-head layers "
                         "(python -m bench.retrieval_heads)")
    ap.add_argument("--mix-group-size-k", type=int, help="channels per key group in the --mix-layers (default 4)")
    ap.add_argument("--mix-codebook-size-k", type=int, help="key codewords in the --mix-layers (default 256)")
    ap.add_argument("--tokens", type=int, help="calibration tokens")
    ap.add_argument("--fisher-tokens", type=int, help="tokens that get a backward pass for the Fisher")
    ap.add_argument("--iters", type=int, help="at most this many Lloyd iterations (default 25)")
    ap.add_argument("--kmeans-tol", type=float, help="stop when the k-means objective moves by less (relative; default 1e-3)")
    ap.add_argument("--kmeans-samples", type=int, help="points per codebook for k-means")
    ap.add_argument("--sink", type=int, help="full-precision sink tokens at serving (default 64)")
    ap.add_argument("--recent", type=int, help="full-precision recent tokens at serving (default 256)")
    ap.add_argument("--tp", type=int, default=1, metavar="N",
                    help="the tensor-parallel degree the artifact will serve at: the key scale is shared by the "
                         "KV heads of one TP rank (the model's KV heads in N groups; default 1: all heads, the "
                         "paper's setting); an artifact serves at any TP degree that keeps its groups whole")
    ap.add_argument("--seed", type=int)
    ap.add_argument("--quiet", action="store_true", help="no progress bars")
    return ap


def summary_lines(manifest: dict) -> list[str]:
    m, c, cal = manifest["model"], manifest["config"], manifest["calibration"]
    held = cal.get("heldout", {})
    lines = [
        f"model        {m['architecture']}  layers={m['num_layers']} q_heads={m['num_q_heads']} "
        f"kv_heads={m['num_kv_heads']} head_dim={m['head_dim']} rope_theta={m['rope_theta']:g}",
        f"quantizer    K: g={c['group_size_k']} K={c['codebook_size_k']}"
        + (f" (layers {','.join(map(str, c['mix_layers']))}: g={c['mix_group_size_k']} K={c['mix_codebook_size_k']})"
           if c.get("mix_layers") else "")
        + f"  V: g={c['group_size_v']} K={c['codebook_size_v']}  "
        f"weighting={c['weighting']} scale={c['scale']}"
        + (f" over {c['scale_groups']} head groups (TP {c['scale_groups']})" if c.get("scale_groups", 1) > 1 else "")
        + f" grouping={c['grouping']} fisher={c['fisher']}"
        f" keys={c.get('key_rope', 'pre')}-RoPE",
        f"bits/elem    K {manifest['bits_k']:.4f}  V {manifest['bits_v']:.4f}  (bf16: 16; "
        f"{32 / (manifest['bits_k'] + manifest['bits_v']):.1f}x smaller before windows)",
        f"windows      sink {manifest['windows']['sink']} + recent {manifest['windows']['recent']} tokens full precision"
        + (f"; salient tokens: {c['salient_budget']} of every {c['salient_block']} kept exact, decided at layer "
           f"{c['salient_layer']} (echo rule, pooled {c['salient_after']} ahead)" if c.get("salient_budget") else "")
        + {"fp8": "; exact copies held as fp8 (e4m3, fp16 scale per token and KV head)",
           "res4": "; exact copies held as codes + a 4-bit residual (fp16 scale per token and KV head)"}.get(
               c.get("exact_format", "bf16"), ""),
        f"calibration  {cal['corpus']}: {cal['tokens']:,} tokens ({cal.get('fisher_tokens', 0):,} with Fisher), "
        f"seed {cal['seed']}, {cal.get('model_dtype', 'bfloat16')} model, {cal['wall_time_s']:.0f} s",
    ]
    if held:
        lines.append(f"held-out     key MSE {held.get('key_mse', float('nan')):.4f}  logit NMSE "
                     f"{held.get('logit_nmse', float('nan')):.4f}  value MSE {held.get('value_mse', float('nan')):.4f}"
                     f"  ({held.get('tokens', 0):,} tokens of {held.get('corpus', '?')})")
        gc = held.get("group_cost")
        if gc:
            lines.append(f"grouping     sum det^(1/g): {gc['chosen']:.2f} (chosen) vs {gc['contiguous']:.2f} (contiguous pairs)")
    km = cal.get("kmeans")
    if km:
        lines.append(f"k-means      flat Lloyd, {km['points_per_codebook']:,} points per codebook, {km['iters_min']}-{km['iters_max']} "
                     f"iterations (tol {km['tol']:g}; last change <= {km['last_rel_change_max']:.2g}), on {km['device']}")
    st = cal.get("stage_times_s")
    if st:
        lines.append("stage times  " + "  ".join(f"{k} {v:.0f}s" for k, v in st.items()))
    return lines


def cmd_calibrate(argv) -> int:
    a = _calibrate_parser().parse_args(argv)
    try:
        cfg = build_config(a)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from sglang_tasq.models import UnsupportedModelError

    from . import pipeline

    if cfg.layer_mixed:  # refused before the capture, not after it
        from sglang_tasq.models import fingerprint, load_config, resolve_model

        try:
            fp = fingerprint(load_config(resolve_model(a.model)))
            cfg.check_layers(fp.num_layers)
            cfg.check_head_dim(fp.head_dim)
        except (UnsupportedModelError, FileNotFoundError, ConfigError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    if a.tp != 1:
        from sglang_tasq import sharding
        from sglang_tasq.models import fingerprint, load_config, resolve_model

        try:
            H = fingerprint(load_config(resolve_model(a.model))).num_kv_heads
            cfg = sharding.for_tp(cfg, H, a.tp)
        except (UnsupportedModelError, FileNotFoundError, sharding.ShardingError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2

    try:
        pipeline.resolve_device(a.device)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        res = pipeline.run(a.model, cfg, corpus=a.corpus, progress=not a.quiet, device=a.device,
                           log=(lambda s: None) if a.quiet else (lambda s: print(s, file=sys.stderr)))
    except (UnsupportedModelError, ConfigError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    mpath = pipeline.write(res, a.out)
    manifest = json.loads(mpath.read_text())
    print(f"wrote {mpath} and {mpath.parent / manifest['tensors']['file']}")
    print("\n".join(summary_lines(manifest)))
    return 0


def cmd_check(argv) -> int:
    ap = argparse.ArgumentParser(prog="python -m calibrate check", description="Validate a TaSQ artifact.")
    ap.add_argument("manifest", help="path to tasq.json (or its directory)")
    ap.add_argument("--model", help="also check against this model ('smollm2-135m' or a local HF dir)")
    a = ap.parse_args(argv)
    from sglang_tasq.artifact import ArtifactError, load_artifact
    from sglang_tasq.models import UnsupportedModelError, fingerprint, load_config, resolve_model

    try:
        fp = fingerprint(load_config(resolve_model(a.model))) if a.model else None
        art = load_artifact(a.manifest, model=fp)
    except (ArtifactError, UnsupportedModelError, FileNotFoundError) as e:
        print(f"invalid: {e}", file=sys.stderr)
        return 1
    print(f"ok: {art.path}" + (f" matches {a.model}" if a.model else ""))
    print("\n".join(summary_lines(art.manifest)))
    return 0


def _salient_arg(text: str) -> tuple:
    """'36/192@17' -> (36, 192, 17); 'none' -> (0, None, None)."""
    if text == "none":
        return (0, None, None)
    try:
        kept, rest = text.split("/")
        block, layer = rest.split("@")
        return int(kept), int(block), int(layer)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: write KEPT/BLOCK@LAYER (e.g. 36/192@17) or none") from None


def cmd_serving(argv) -> int:
    """Write a copy of an artifact with other serving-time settings (windows, salient tokens): the
    same codebooks and calibration record, no refit."""
    ap = argparse.ArgumentParser(prog="python -m calibrate serving", description=cmd_serving.__doc__)
    ap.add_argument("artifact", help="path to tasq.json (or its directory)")
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--sink", type=int, help="full-precision prefix tokens")
    ap.add_argument("--recent", type=int, help="full-precision most recent tokens")
    ap.add_argument("--salient", type=_salient_arg, metavar="KEPT/BLOCK@LAYER",
                    help="keep KEPT of every BLOCK tokens exact, chosen by the streaming echo rule and read exactly "
                         "from layer LAYER on (issue 14; e.g. 36/192@17), or none")
    ap.add_argument("--salient-after", type=int, help="pool the echo this many positions forward (default 12)")
    ap.add_argument("--exact", choices=("bf16", "fp8", "res4"),
                    help="how the server holds its exact copies (windows, salient tokens): bf16, fp8 e4m3 with "
                         "an fp16 scale per token and KV head (8.25 bits per element at head_dim 64), or res4: "
                         "the token's codes plus a 4-bit residual with an fp16 scale per token and KV head (4.25 "
                         "bits per element over the codes)")
    a = ap.parse_args(argv)
    from sglang_tasq.artifact import ArtifactError, load_artifact, save_artifact

    try:
        art = load_artifact(a.artifact)
        change = {"sink_window": a.sink, "recent_window": a.recent, "salient_after": a.salient_after,
                  "exact_format": a.exact}
        if a.salient is not None:
            kept, block, layer = a.salient
            change.update(salient_budget=kept, salient_block=block, salient_layer=layer)
        cfg = dataclasses.replace(art.config, **{k: v for k, v in change.items() if v is not None})
        cfg.check_layers(art.model.num_layers)
    except (ArtifactError, ConfigError, FileNotFoundError, TypeError) as e:
        print(f"calibrate serving: {e}", file=sys.stderr)
        return 2
    path = save_artifact(a.out, dataclasses.replace(art.codebooks, config=cfg), art.model, art.manifest["calibration"])
    print(f"wrote {path}")
    print("\n".join(summary_lines(load_artifact(path).manifest)))
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "check":
        return cmd_check(argv[1:])
    if argv and argv[0] == "serving":
        return cmd_serving(argv[1:])
    return cmd_calibrate(argv)
