"""Which layers hold the retrieval heads (issue 14, item 2: a layer-adaptive rate): the copy score
of every (layer, query head) on RULER NIAH prompts, read in the model's own precision.

The score is the retrieval-head test of Wu et al. (2024, "Retrieval Head Mechanistically Explains
Long-Context Factuality"): the gold answer is fed after the prompt one token at a time (teacher
forcing, so the score does not depend on whether the model answers right), and a head *copies* at
a step when its highest-attended position is a needle value token (a prompt token overlapping an
occurrence of a gold string, :func:`bench.salient_recall.gold_positions`) that holds the very token
being predicted. A head's score is its copies over the steps whose target token occurs among the
needle value tokens; a layer's is the sum over its query heads (its KV heads share one codebook
rate in an artifact, so the layer is the unit a per-layer rate can follow).

The samples are drawn with seeds disjoint from the ones every NIAH bench scores (``--seed``,
default 10,000, against RULER's 42 + i), so choosing layers on them does not look at the test
samples. Written to ``bench/results/retrieval_heads/<model>_<dtype>_n<N>_<lengths>/``
(``scores.json``, ``summary.md``); ``--top K`` prints the K best layers as the layer list of a
``bench.retrieval`` layer-mix point::

    python -m bench.retrieval_heads --lengths 1024 --samples 2 --top 8
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from . import niah
from .report import write_json

RESULTS = Path(__file__).resolve().parent / "results" / "retrieval_heads"
SEED = 10_000


def copy_step(attn, target: int, prompt_ids, needle: set) -> "torch.Tensor":  # noqa: F821
    """[L, Hq] bool: heads whose top-1 key position (over ``attn`` [L, Hq, T_all]) is a needle
    value token of the prompt that equals ``target``. Ties go to the first position."""
    import torch

    top = attn.argmax(dim=-1)  # [L, Hq]
    P = len(prompt_ids)
    inside = top < P
    hit_pos = torch.zeros(P + 1, dtype=torch.bool)
    for i in needle:
        if int(prompt_ids[i]) == target:
            hit_pos[i] = True
    return inside & hit_pos[top.clamp(max=P)]


def layer_ranking(scores, top: int) -> list:
    """The ``top`` layers by summed head score, best first (ties: the lower layer)."""
    per_layer = [float(sum(row)) for row in scores]
    order = sorted(range(len(per_layer)), key=lambda i: (-per_layer[i], i))
    return order[:top]


def sample_scores(model, tok, sample: dict):
    """(copies [L, Hq] float, steps scored) of one sample under teacher forcing."""
    import torch
    from transformers import DynamicCache

    from .salient_recall import gold_positions

    prompt_ids = tok(sample["prompt"], add_special_tokens=False)["input_ids"]
    answer = tok(" " + ", ".join(sample["outputs"]), add_special_tokens=False)["input_ids"]
    needle = set(gold_positions(tok, sample["prompt"], sample["outputs"], len(prompt_ids)))
    needle_tokens = {int(prompt_ids[i]) for i in needle}
    cache = DynamicCache()
    with torch.no_grad():
        model(input_ids=torch.tensor([prompt_ids[:-1]]), past_key_values=cache, use_cache=True)
        feed = [prompt_ids[-1], *answer[:-1]]
        copies, steps = None, 0
        for x, target in zip(feed, answer):
            out = model(input_ids=torch.tensor([[x]]), past_key_values=cache, use_cache=True, output_attentions=True)
            attn = torch.stack([a[0, :, -1].float() for a in out.attentions])  # [L, Hq, T_all]
            if copies is None:
                copies = torch.zeros(attn.shape[:2])
            if target in needle_tokens:
                steps += 1
                copies += copy_step(attn, target, prompt_ids, needle).float()
    return copies, steps


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.retrieval_heads", description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", nargs="+", type=int, default=[1024])
    ap.add_argument("--samples", type=int, default=2, help="per task and length")
    ap.add_argument("--tasks", nargs="+", default=list(niah.TASKS))
    ap.add_argument("--seed", type=int, default=SEED, help="first sample seed (the NIAH benches use 42 + i)")
    ap.add_argument("--top", type=int, default=8, help="print this many best layers")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--results", default=str(RESULTS))
    a = ap.parse_args(argv)
    bad = [t for t in a.tasks if t not in niah.TASKS]
    if bad:
        print(f"bench.retrieval_heads: tasks {bad}: allowed {list(niah.TASKS)}", file=sys.stderr)
        return 2
    if a.seed < 42 + a.samples and a.seed + a.samples > 42:
        print(f"bench.retrieval_heads: seeds {a.seed}..{a.seed + a.samples - 1} overlap the NIAH benches' "
              "test samples (42 + i): choose --seed outside them", file=sys.stderr)
        return 2

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sglang_tasq.models import compute_dtype, dtype_name, resolve_model

    path = resolve_model(a.model)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=compute_dtype(), attn_implementation="eager").eval()
    t0, total, steps, per_task = time.time(), None, 0, {}
    for length in a.lengths:
        for task in a.tasks:
            for s in niah.generate_samples(task, tok, length, a.samples, seed=a.seed,
                                           formatter=niah.chat_formatter(tok)):
                c, n = sample_scores(model, tok, s)
                total = c if total is None else total + c
                steps += n
                per_task[task] = per_task.get(task, 0) + n
    scores = (total / max(steps, 1)).tolist()
    order = layer_ranking(scores, len(scores))
    top = order[: a.top]
    dtype = dtype_name(model.dtype)
    run_dir = Path(a.results) / f"{a.model}_{dtype}_n{a.samples}_{'-'.join(map(str, a.lengths))}_s{a.seed}"
    write_json(run_dir / "scores.json", {"model": a.model, "model_dtype": dtype, "lengths": a.lengths,
                                         "samples": a.samples, "seed": a.seed, "tasks": a.tasks,
                                         "steps": steps, "steps_per_task": per_task,
                                         "scores": scores, "top": top, "seconds": round(time.time() - t0, 1)})
    per_layer = [sum(r) for r in scores]
    lines = ["| layer | copy score, sum over heads | best head (score) |", "|---|---|---|"]
    for i in order:
        h = max(range(len(scores[i])), key=lambda j: scores[i][j])
        lines.append(f"| {i} | {per_layer[i]:.3f} | {h} ({scores[i][h]:.3f}) |")
    md = (f"# Retrieval heads, {a.model} ({dtype}), {a.samples} samples per task at {a.lengths}, seeds from {a.seed}\n\n"
          f"{steps} scored steps. Top {a.top} layers: {','.join(map(str, top))}\n\n" + "\n".join(lines) + "\n")
    (run_dir / "summary.md").write_text(md)
    print(md)
    print(f"[retrieval_heads] top {a.top}: {','.join(map(str, top))}  ({run_dir})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
