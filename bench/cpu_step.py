"""CPU decode-step benchmark: the TaSQ backend's decode step (encode the new token + attention,
every layer) against a bf16 pool read the way SGLang's ``torch_native`` backend reads it, in
one process, measured alternately.

What runs: the real ``TaSQTokenToKVPool`` and ``TaSQAttnBackend`` (Numba CPU kernels) on a
calibrated artifact's codebooks, SmolLM2-135M shapes (30 layers, 9 query / 3 KV heads, d = 64),
``B`` requests of ``ctx`` tokens prefilled through the backend, then decode steps; rows:

- ``tasq``: the backend as served (the encoder and the decode kernel share each layer's codebook
  arrays, so a step reads one copy);
- ``tasq_separate_tables``: the same with the decode kernel given its own copy of the tables
  (what the backend did before sharing: each layer's codebooks are read twice per step);
- ``bf16``: per layer, the new token's K/V stored into bf16 pool buffers, then per request a
  gather of its K/V by slot and ``scaled_dot_product_attention`` (GQA), as ``torch_native``.

Only attention and KV writes are timed (no GEMMs): the figure is the attention-side cost per
decode step. Next to each time: the bytes a step must read (:func:`step_bytes`: the cache's codes,
window entries and per-token indices, and for TaSQ each layer's codebooks once; bf16: its K/V),
the effective GB/s, and its share of the machine's memory read bandwidth measured in the same
run (:func:`read_bandwidth`). Writes ``cpu_step.json`` and ``cpu_step.md`` under ``--out``
(default ``bench/results/cpu_step/``). Usage: ``python -m bench.cpu_step [--ctx 1024 4096 8192]
[--batch 1 8] [--reps 5] [--tables-ablation]`` (the ablation adds ``tasq_separate_tables``).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import types
from pathlib import Path

from sglang_tasq.options import ServeOptions, passive_omp

passive_omp()  # before torch starts OpenMP

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "results" / "cpu_step"
DEFAULT_ARTIFACTS = (ROOT / "artifacts" / "smollm2" / "tasq.json", ROOT / "artifacts" / "smollm2-fast" / "tasq.json")
L, HQ, H, D = 30, 9, 3, 64  # SmolLM2-135M


class _Batch(types.SimpleNamespace):
    """The ForwardBatch fields the backend reads."""


def _tasq_setup(art, B: int, ctx: int, share: bool, through_backend: bool = False):
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from numba_kernels import cpu
    from sglang_tasq.srt import pool as pool_mod
    from sglang_tasq.srt.backend import TaSQAttnBackend

    opts = ServeOptions(window_rows=B + 1)  # the exact store holds every request row
    pool = pool_mod.TaSQTokenToKVPool(size=B * (ctx + 8) + 8, page_size=1, dtype=torch.bfloat16, head_num=H,
                                      head_dim=D, layer_num=L, device="cpu", enable_memory_saver=False,
                                      artifact=art, options=opts)
    r2t = ReqToTokenPool(size=B + 1, max_context_len=ctx + 8, device="cpu", enable_memory_saver=False)
    be = TaSQAttnBackend(types.SimpleNamespace(device="cpu", req_to_token_pool=r2t, token_to_kv_pool=pool))
    if not share:  # the decode kernel's own copy of every layer's tables
        for lid in range(L):
            be._decode_tables[lid] = cpu.DecodeTables(art.codebooks, lid)
    layers = [types.SimpleNamespace(layer_id=i, tp_q_head_num=HQ, tp_k_head_num=H, qk_head_dim=D, v_head_dim=D,
                                    scaling=D ** -0.5) for i in range(L)]
    rows = r2t.alloc_rows(B)
    gen = torch.Generator().manual_seed(0)
    loc = torch.arange(1, 1 + B * ctx)
    for b in range(B):
        r2t.req_to_token[rows[b], :ctx] = loc[b * ctx:(b + 1) * ctx].to(torch.int32)
    fb = _Batch(req_pool_indices=torch.tensor(rows), seq_lens=torch.full((B,), ctx, dtype=torch.int32),
                extend_prefix_lens=torch.zeros(B, dtype=torch.int32), extend_seq_lens=torch.full((B,), ctx, dtype=torch.int32),
                positions=torch.arange(ctx).repeat(B), out_cache_loc=loc, forward_mode=ForwardMode.EXTEND)
    be.init_forward_metadata(fb)
    md = be.forward_metadata
    for layer in layers:  # the prompt's KV stored as a prefill stores it: real encodes, window entries
        k = torch.randn(B * ctx, H * D, generator=gen).bfloat16()
        v = torch.randn(B * ctx, H * D, generator=gen).bfloat16()
        if through_backend:  # the whole extend forward: with salient tokens, the echo and the kept blocks
            be._forward(torch.randn(B * ctx, HQ * D, generator=gen).bfloat16(), k, v, layer, fb, True)
        else:
            pool.set_kv_buffer(layer, loc, k, v, positions=md["positions"], req_rows=md["rows"],
                               seq_lens=md["tok_seq_lens"], win_targets=md.get("win_targets"))
    new = torch.arange(1 + B * ctx, 1 + B * ctx + B)
    for b in range(B):
        r2t.req_to_token[rows[b], ctx] = int(new[b])
    fbd = _Batch(req_pool_indices=torch.tensor(rows), seq_lens=torch.full((B,), ctx + 1, dtype=torch.int32),
                 extend_prefix_lens=None, extend_seq_lens=None, positions=torch.full((B,), ctx), out_cache_loc=new,
                 forward_mode=ForwardMode.DECODE)
    q = torch.randn(B, HQ * D, generator=gen).bfloat16()
    kv = torch.randn(B, H * D, generator=gen).bfloat16()

    def step():
        be.init_forward_metadata(fbd)
        for layer in layers:
            be._forward(q, kv, kv, layer, fbd, True)
    step.backend = be
    return step


def _bf16_setup(B: int, ctx: int):
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(0)
    n = B * (ctx + 1) + 1
    kbuf = [torch.randn(n, H, D, generator=gen).bfloat16() for _ in range(L)]
    vbuf = [torch.randn(n, H, D, generator=gen).bfloat16() for _ in range(L)]
    slots = [torch.arange(1 + b * (ctx + 1), 1 + (b + 1) * (ctx + 1)) for b in range(B)]
    new = torch.stack([s[-1] for s in slots])
    q = torch.randn(B, HQ, D, generator=gen).bfloat16()
    kv = torch.randn(B, H, D, generator=gen).bfloat16()

    def step():
        for lid in range(L):
            kbuf[lid][new] = kv
            vbuf[lid][new] = kv
            for b in range(B):
                k, v = kbuf[lid][slots[b]], vbuf[lid][slots[b]]
                F.scaled_dot_product_attention(q[b:b + 1].unsqueeze(2), k.transpose(0, 1).unsqueeze(0),
                                               v.transpose(0, 1).unsqueeze(0), scale=D ** -0.5, enable_gqa=True)
    return step


def measure(steps: dict, reps: int, per_rep: int = 3) -> dict:
    """Median ms per step of each function, measured round-robin (order reversed every other rep)."""
    for f in steps.values():
        f()
    times = {k: [] for k in steps}
    for r in range(reps):
        for name in (list(steps) if r % 2 == 0 else list(steps)[::-1]):
            t0 = time.perf_counter()
            for _ in range(per_rep):
                steps[name]()
            times[name].append((time.perf_counter() - t0) / per_rep * 1e3)
    return {k: {"median_ms": round(statistics.median(v), 2), "ms": [round(x, 2) for x in v]} for k, v in times.items()}


def step_bytes(cfg, B: int, S: int) -> dict:
    """Bytes one decode step at kv length ``S`` must read, per method (all layers): TaSQ the codes
    of the tokens read from codes, the bf16 window entries of the others, an 8-byte slot index and
    entry index per token, and each layer's fp32 codebooks once (``codebooks``, shared by the
    batch); bf16 its K/V and the slot index."""
    from sglang_tasq import packing

    win = min(S, cfg.sink_window + cfg.recent_window)
    exact = 2 * H * D * 2  # bf16 K + V of one token in one layer
    kv, books = B * S * 16, 0
    for layer in range(L):  # each layer at its key rate (config.mix_layers)
        kc, ks, vc = packing.row_bytes(cfg, H, D, layer)
        kv += B * ((S - win) * (kc + ks + vc) + win * exact)
        books += (cfg.key_rate(layer)[1] + cfg.codebook_size_v) * H * D * 4  # K codewords of g dims per group of g
    return {"tasq": kv + books, "tasq_codebooks": books, "bf16": B * (L * S * exact + S * 8)}


def read_bandwidth(gib: float = 1.0, reps: int = 5) -> float:
    """The machine's memory read bandwidth, GB/s: best of ``reps`` full reads (``sum``) of a
    ``gib`` GiB float32 tensor with the benchmark's threads (larger than the caches)."""
    x = torch.ones(int(gib * 2**30) // 4)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        float(x.sum())
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best / 1e9


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.cpu_step", description=__doc__.split("\n")[0])
    ap.add_argument("--tasq-config", type=Path, default=None)
    ap.add_argument("--ctx", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tables-ablation", action="store_true",
                    help="also time the decode kernel with its own copy of the codebook tables")
    ap.add_argument("--also", nargs="+", default=[], metavar="NAME=PATH",
                    help="more TaSQ artifacts timed in the same round-robin, each prompt prefilled through the "
                         "backend's extend forward (salient tokens: echo and kept blocks as served), e.g. "
                         "salient_fp8=artifacts/smollm2_salient_fp8/tasq.json")
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args(argv)
    also = {}
    for spec in a.also:
        name, sep, apath = spec.partition("=")
        if not sep or not name or name in ("tasq", "bf16", "tasq_separate_tables") or not Path(apath).is_file():
            ap.error(f"--also {spec!r}: write NAME=PATH to a tasq.json (NAME not tasq / bf16)")
        also[name] = Path(apath)
    path = a.tasq_config or next((p for p in DEFAULT_ARTIFACTS if p.is_file()), None)
    if path is None or not Path(path).is_file():
        ap.error("needs --tasq-config PATH (no calibrated artifact found; run `make calibrate`)")
    from numba_kernels import cpu
    from sglang_tasq.artifact import load_artifact

    from .serving import hardware

    arts = {name: load_artifact(str(p)) for name, p in {"tasq": path, **also}.items()}
    for name, x in arts.items():
        if (x.codebooks.num_layers, x.codebooks.num_kv_heads) != (L, H):
            ap.error(f"{name}: not a SmolLM2-135M artifact (layers/KV heads {(x.codebooks.num_layers, x.codebooks.num_kv_heads)})")
    art = arts["tasq"]
    cpu.set_threads()
    bw = read_bandwidth()
    print(f"[cpu_step] memory read bandwidth {bw:.1f} GB/s", flush=True)
    rows = []
    for ctx in a.ctx:
        for B in a.batch:
            print(f"[cpu_step] batch {B} x {ctx} tokens", flush=True)
            steps = {"tasq": _tasq_setup(art, B, ctx, True), "bf16": _bf16_setup(B, ctx)}
            if a.tables_ablation:
                steps["tasq_separate_tables"] = _tasq_setup(art, B, ctx, False)
            for name in also:
                steps[name] = _tasq_setup(arts[name], B, ctx, True, through_backend=True)
            res = measure(steps, a.reps)
            nb = step_bytes(art.config, B, ctx + 1)
            row = {"batch": B, "ctx": ctx, **res, "bytes": nb,
                   "tasq_vs_bf16": round(res["tasq"]["median_ms"] / res["bf16"]["median_ms"], 3)}
            for m in ("tasq", "bf16"):
                gbs = nb[m] / (res[m]["median_ms"] * 1e-3) / 1e9
                row[m + "_gb_s"], row[m + "_bw_share"] = round(gbs, 2), round(gbs / bw, 3)
            if a.tables_ablation:
                row["separate_vs_shared"] = round(res["tasq_separate_tables"]["median_ms"] / res["tasq"]["median_ms"], 2)
            for name in also:
                row[name + "_vs_tasq"] = round(res[name]["median_ms"] / res["tasq"]["median_ms"], 3)
            rows.append(row)
            del steps
    out = {"hardware": hardware(), "torch_threads": torch.get_num_threads(), "artifact": os.path.relpath(path, ROOT),
           "read_bandwidth_gb_s": round(bw, 1), "model_shapes": dict(layers=L, q_heads=HQ, kv_heads=H, head_dim=D),
           "also": {name: os.path.relpath(p, ROOT) for name, p in also.items()}, "rows": rows}
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "cpu_step.json").write_text(json.dumps(out, indent=1) + "\n")
    md = to_markdown(out, a.reps)
    (a.out / "cpu_step.md").write_text(md)
    print(md)
    return 0


def to_markdown(out: dict, reps: int) -> str:
    hw = out["hardware"]
    md = [f"# CPU decode step (attention side, {L} layers, SmolLM2-135M shapes)", "",
          f"Hardware: {hw['cpu']}, {hw['cores']} cores, torch {torch.__version__}, {out['torch_threads']} threads; "
          f"memory read bandwidth {out['read_bandwidth_gb_s']} GB/s (1 GiB sum, same run). Artifact: {out['artifact']}. "
          f"Median of {reps} alternating reps (3 steps each). Bytes: what a step must read (TaSQ: codes, window "
          f"entries, indices and each layer's codebooks once; bf16: K/V).", "",
          "| batch x ctx | TaSQ ms/step | bf16 ms/step | TaSQ / bf16 | TaSQ MB/step (codebooks) | bf16 MB/step | "
          "TaSQ GB/s (% of bw) | bf16 GB/s (% of bw) |",
          "|---|---|---|---|---|---|---|---|"]
    for r in out["rows"]:
        b = r["bytes"]
        md.append(f"| {r['batch']} x {r['ctx']} | {r['tasq']['median_ms']} | {r['bf16']['median_ms']} | "
                  f"{r['tasq_vs_bf16']}x | {b['tasq'] / 1e6:.1f} ({b['tasq_codebooks'] / 1e6:.1f}) | {b['bf16'] / 1e6:.1f} | "
                  f"{r['tasq_gb_s']} ({100 * r['tasq_bw_share']:.0f}%) | {r['bf16_gb_s']} ({100 * r['bf16_bw_share']:.0f}%) |")
    if out.get("also"):
        names = list(out["also"])
        md += ["", "Other artifacts, same round-robin (prompt prefilled through the backend's extend forward): "
               + "; ".join(f"`{n}` = {out['also'][n]}" for n in names), "",
               "| batch x ctx | TaSQ ms/step | " + " | ".join(f"{n} ms/step ({n} / TaSQ)" for n in names) + " |",
               "|---|---|" + "---|" * len(names)]
        for r in out["rows"]:
            md.append(f"| {r['batch']} x {r['ctx']} | {r['tasq']['median_ms']} | "
                      + " | ".join(f"{r[n]['median_ms']} ({r[n + '_vs_tasq']}x)" for n in names) + " |")
    if any("separate_vs_shared" in r for r in out["rows"]):
        md += ["", "Decode tables ablation (the kernel's own copy of each layer's codebooks), separate / shared: "
               + ", ".join(f"{r['batch']} x {r['ctx']}: {r['separate_vs_shared']}x" for r in out["rows"])]
    return "\n".join(md) + "\n"


if __name__ == "__main__":
    sys.exit(main())
