"""What a compressed cache costs a ``transformers`` user: prefill and per-token decode time of
``model(...)`` with each HF cache, against ``DynamicCache`` (bf16) measured in the same run.

    python -m bench.hf_decode [--prompt-tokens 1024] [--new-tokens 32] [--rounds 3] \\
        [--artifact tasq=artifacts/smollm2 --artifact salient_res4=artifacts/smollm2_salient_res4]

After one untimed warm-up run per cache (Numba compiles its kernels), each round runs every
cache once, in turn (so a slower moment of a shared machine falls on all of them): a fresh cache, one forward of the prompt (held-out wiki tokens), then ``--new-tokens``
forwards of one token each, the greedy argmax fed back (no early stop: every cache decodes the
same number of tokens). Reported per cache: the median over rounds of the prefill seconds and of
the decode milliseconds per token, each as a ratio to ``DynamicCache``'s, the cache's stored
bytes per token after the run, and whether its tokens equal bf16's. Caches: ``DynamicCache``,
``QuantizedKVCache`` with fp8 e4m3 and KIVI-2 (64 + 256 bf16 windows, as in the harness), and
a :class:`sglang_tasq.hf.cache.TaSQCache` per ``--artifact`` (its own windows, salient tokens and
exact copies; ``model=`` given when it keeps salient tokens). Written to
``bench/results/hf_decode/<model>_p<P>_n<N>/hf_decode.json`` (+ ``hf_decode.md``).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from sglang_tasq.options import passive_omp

passive_omp()

RESULTS = Path(__file__).resolve().parent / "results" / "hf_decode"
BASELINES = ("fp8_e4m3", "kivi2")


def make_caches(model, artifacts: dict, model_path) -> dict:
    """{name: zero-argument factory of a fresh cache}."""
    from transformers import DynamicCache

    from sglang_tasq.artifact import load_artifact
    from sglang_tasq.hf.baselines import baseline
    from sglang_tasq.hf.cache import QuantizedKVCache, TaSQCache
    from sglang_tasq.models import fingerprint, load_config

    out = {"bf16": DynamicCache}
    for name in BASELINES:
        out[name] = lambda name=name: QuantizedKVCache(baseline(name), sink=64, recent=256)
    fp = fingerprint(load_config(model_path))
    for name, path in artifacts.items():
        cb = load_artifact(path, fp).codebooks
        kw = {"model": model} if cb.config.salient_spec() is not None else {}
        out[name] = lambda cb=cb, kw=kw: TaSQCache(cb, **kw)
    return out


def run_one(model, ids, cache, new_tokens: int) -> dict:
    """Prefill seconds, decode ms per token and the generated ids of one fresh cache."""
    import torch

    with torch.no_grad():
        t0 = time.perf_counter()
        logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1]
        t1 = time.perf_counter()
        toks = []
        for _ in range(new_tokens):
            nxt = logits.argmax(-1, keepdim=True)
            toks.append(int(nxt))
            logits = model(input_ids=nxt, past_key_values=cache, use_cache=True).logits[:, -1]
        t2 = time.perf_counter()
    bpt = cache.bytes_per_token() if hasattr(cache, "bytes_per_token") else None
    if hasattr(cache, "close"):
        cache.close()
    return {"prefill_s": t1 - t0, "decode_ms": (t2 - t1) / new_tokens * 1e3, "tokens": toks, "bytes_per_token": bpt}


def summarize(runs: dict, bf16_bytes: float) -> dict:
    """{name: medians, ratios to bf16, bytes per token, same tokens as bf16} from {name: [run, ...]}."""
    med = {n: {k: statistics.median(r[k] for r in rs) for k in ("prefill_s", "decode_ms")} for n, rs in runs.items()}
    ref = med["bf16"]
    out = {}
    for n, rs in runs.items():
        out[n] = {**med[n], "prefill_vs_bf16": med[n]["prefill_s"] / ref["prefill_s"],
                  "decode_vs_bf16": med[n]["decode_ms"] / ref["decode_ms"],
                  "bytes_per_token": rs[-1]["bytes_per_token"] or bf16_bytes,
                  "same_tokens_as_bf16": rs[-1]["tokens"] == runs["bf16"][-1]["tokens"],
                  "rounds": [{k: r[k] for k in ("prefill_s", "decode_ms")} for r in rs]}
    return out


def markdown(summary: dict, meta: dict) -> str:
    hw = meta["hardware"]
    head = (f"# HF cache cost, {meta['model']}, {meta['prompt_tokens']}-token prompt + {meta['new_tokens']} decoded "
            f"tokens, median of {meta['rounds']} rounds\n\n{hw['cpu']}, {hw['cores']} cores, torch threads "
            f"{meta['torch_threads']}, model {meta['model_dtype']}\n\n"
            "| cache | prefill (s) | vs bf16 | decode (ms/token) | vs bf16 | stored bytes/token | tokens = bf16's |\n"
            "|---|---|---|---|---|---|---|\n")
    rows = "".join(f"| {n} | {s['prefill_s']:.2f} | {s['prefill_vs_bf16']:.2f}x | {s['decode_ms']:.1f} | "
                   f"{s['decode_vs_bf16']:.2f}x | {s['bytes_per_token']:,.0f} | {'yes' if s['same_tokens_as_bf16'] else 'no'} |\n"
                   for n, s in summary.items())
    return head + rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.hf_decode", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--artifact", action="append", default=[], metavar="NAME=DIR",
                    help="a TaSQ artifact to time under NAME (repeatable)")
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--results", default=str(RESULTS))
    a = ap.parse_args(argv)
    try:
        bad = [kv for kv in a.artifact if "=" not in kv]
        if bad:
            raise ValueError(f"--artifact {bad[0]!r}: expected NAME=DIR")
        artifacts = dict(kv.split("=", 1) for kv in a.artifact)
        if "bf16" in artifacts or any(n in artifacts for n in BASELINES):
            raise ValueError(f"--artifact names must differ from bf16 and {BASELINES}")
        if min(a.prompt_tokens, a.new_tokens, a.rounds) < 1:
            raise ValueError("--prompt-tokens, --new-tokens and --rounds must be >= 1")
    except ValueError as e:
        print(f"bench.hf_decode: {e}", file=sys.stderr)
        return 2

    import torch

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sglang_tasq.models import compute_dtype, dtype_name, resolve_model

    from .perplexity import heldout_windows
    from .report import write_json
    from .serving_report import hardware

    if a.threads:
        torch.set_num_threads(a.threads)
    path = resolve_model(a.model)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=compute_dtype()).eval()
    ids = heldout_windows(tok, "wiki", a.prompt_tokens, 1)[:1]
    caches = make_caches(model, artifacts, path)
    cfg = model.config
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    bf16_bytes = 2 * 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * d
    for make in caches.values():  # compile the Numba kernels (both sides of their serial threshold)
        run_one(model, ids[:, : min(a.prompt_tokens, 400)], make(), 2)
    runs = {n: [] for n in caches}
    for r in range(a.rounds):
        for n, make in caches.items():
            runs[n].append(run_one(model, ids, make(), a.new_tokens))
            print(f"[hf_decode] round {r + 1}/{a.rounds} {n}: prefill {runs[n][-1]['prefill_s']:.2f} s, "
                  f"decode {runs[n][-1]['decode_ms']:.1f} ms/token", flush=True)
    summary = summarize(runs, bf16_bytes)
    meta = {"model": a.model, "prompt_tokens": a.prompt_tokens, "new_tokens": a.new_tokens, "rounds": a.rounds,
            "artifacts": artifacts, "torch_threads": torch.get_num_threads(),
            "model_dtype": dtype_name(model.dtype), "hardware": hardware()}
    out = Path(a.results) / f"{a.model}_p{a.prompt_tokens}_n{a.new_tokens}"
    write_json(out / "hf_decode.json", {"meta": meta, "caches": summary})
    md = markdown(summary, meta)
    (out / "hf_decode.md").write_text(md)
    print(md + f"\n[hf_decode] wrote {out}/hf_decode.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
