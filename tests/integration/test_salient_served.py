"""Salient tokens served (issue 14): an artifact with ``calibrate serving --salient 36/192@17 --exact
fp8`` or ``--exact res4`` (the shipped settings: salient tokens, every exact copy held as fp8 with an
fp16 scale per token and head, or as its codes plus a 4-bit residual) through a real SGLang server (CPU, SmolLM2, radix cache on, prompts prefilled in chunks of
256, 4 requests in flight) gives the NIAH answers of the HF decode view's streaming point
``tasq:64+256:S36/192L17a12e:x8:first`` (``:r4:`` for res4) on the same artifact and question-first samples, cold and
warm (the second pass reads its prefix from the radix cache, kept slots included), and the HF
``TaSQCache`` on the same artifact (``model=``: it keeps the salient tokens itself), fed one token
at a time so that every prompt query reads the per-query window rule the server reads, answers
the same (res4 copies, the first sample: ~130 s a sample; fp8 copies in the HF cache are
tests/unit/test_hf_salient.py's). (bf16 copies: the same pool and backend code with the other store format, checked
against the same references in tests/kernels/test_salient_pool.py and test_cpu_pool.py; served
NIAH in the README.)

Samples: question-first prompts at 1k of tasks the salient point answers, so that agreeing answers
are not two failures agreeing (answers that end at a near-tie differ between the engine's bf16
GEMMs and HF's: on a multi-key and a UUID sample the two views gave the same answer but for the
last one or two characters). That the pool and backend serve the rule itself (the kept slots are
the reference's decision, chunked or whole, radix-shared, read from the deciding layer on) is
tests/kernels/test_salient_pool.py's."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bench import retrieval as R
from bench import ruler_server as RS
from bench.ruler import _samples, token_cap

from _support import ROOT

POINT = "tasq:64+256:S36/192L17a12e:{side}:first"
SIDES = {"fp8": "x8", "res4": "r4"}  # exact format -> its decode-view point suffix
TASKS = ("niah_single_1", "niah_single_2")  # answered by the point at 1k: a path that misreads fails them


def _hf_cache_answer(model, tok, codebooks, sample, cap: int) -> str:
    """Greedy answer through the HF TaSQCache (salient tokens kept by the cache), prompt fed one
    token at a time."""
    import torch

    from bench.ruler import _eos_ids, _found_all
    from sglang_tasq.hf.cache import TaSQCache

    c = codebooks.config
    cache = TaSQCache(codebooks, c.sink_window, c.recent_window, model=model)
    assert cache.exact_format == (c.exact_format if c.exact_format != "bf16" else None)
    ids, eos, out = tok(sample["prompt"], add_special_tokens=False)["input_ids"], _eos_ids(model, tok), []
    with torch.no_grad():
        for t in ids:
            logits = model(torch.tensor([[t]]), past_key_values=cache).logits[0, -1]
        assert cache.kept_positions().numel() > 0
        for _ in range(cap):
            nxt = int(logits.argmax())
            if nxt in eos:
                break
            out.append(nxt)
            if _found_all(tok.decode(out, skip_special_tokens=True), sample["outputs"]):
                break
            logits = model(torch.tensor([[nxt]]), past_key_values=cache).logits[0, -1]
    cache.close()
    return tok.decode(out, skip_special_tokens=True)


@pytest.mark.parametrize("fmt", ["fp8", "res4"])
def test_salient_tokens_served_as_the_decode_view(tmp_path, artifact, smollm2_dir, smollm2_tokenizer, fmt):
    """(res4: every exact copy held as the token's codes plus a 4-bit residual.)"""
    out = tmp_path / "salient"
    subprocess.run([sys.executable, "-m", "calibrate", "serving", str(Path(artifact).parent), "--out", str(out),
                    "--salient", "36/192@17", "--exact", fmt], check=True, cwd=str(ROOT), timeout=300)
    manifest = out / "tasq.json"

    from bench import methods as M
    from bench.perplexity import load_model
    from sglang_tasq.models import fingerprint, load_config

    model, tok = load_model("smollm2-135m")
    spec = M.parse("tasq")
    method = M.build(spec, out, fingerprint(load_config(smollm2_dir)))
    point = R.Point.parse(POINT.format(side=SIDES[fmt]))
    dec = R.evaluate(model, tok, method, point, 1024, 1, TASKS, max_new=64)
    samples = [s for t in TASKS for s in _samples(smollm2_tokenizer, t, 1024, 1, "first")]
    caps = [token_cap(s, 64) for s in samples]
    with RS.served("tasq", smollm2_dir, manifest, tmp_path / "server.log") as (base, state):
        from bench.ruler_client import served_model

        name = served_model(base)
        cold = RS.send(base, name, samples, caps)
        warm = RS.send(base, name, samples, caps)
    got = [a["text"] for a in cold]
    want = [p["pred"] for p in dec["preds"]]
    print({"decode": want, "server": got, "scores": dec["tasks"]})
    assert dec["avg"] == 100, dec["preds"]  # the decode view finds needles: agreement is not vacuous
    for s, w, g in zip(samples, want, got):
        assert RS.same_answer(w, g, s["outputs"]), (w, g)
    assert [a["text"] for a in warm] == got
    assert sum(a["cached_tokens"] or 0 for a in warm) > 0  # the warm pass read prefixes from the radix cache
    from sglang_tasq.artifact import load_artifact

    codebooks = load_artifact(manifest).codebooks
    assert codebooks.config.exact_format == fmt  # the HF cache holds its copies as the server does
    if fmt != "res4":  # fp8 copies in the HF cache: tests/unit/test_hf_salient.py (tiny Llama, token by token)
        return
    # one sample: the cache fed a token at a time costs ~130 ms per token here (~130 s a sample)
    hf = [_hf_cache_answer(model, tok, codebooks, s, c) for s, c in zip(samples[:1], caps)]
    print({"hf cache": hf})
    for s, w, h in zip(samples, want, hf):
        assert RS.same_answer(w, h, s["outputs"]), (w, h)
