"""Data and tensor parallelism through SGLang with TaSQ pools (real engines on CPU, gloo).

- ``--tp 2`` on a random-weight Llama whose 4 KV heads split evenly (mechanics only), with a
  random artifact calibrated for 2 key-scale groups: each rank's pool holds its 2 heads and
  their codebooks and computes their shared scale locally, so TP 2 must answer as TP 1 on the
  same artifact, up to the float-order effects that bf16 TP itself shows (measured in the same
  test: the tensor-parallel all-reduce sums in another order). Small windows (4 + 8), so the
  answers are read from codes (checked: they differ from bf16's).
- ``--tp 3`` on SmolLM2 (one KV head per rank) with the calibrated codebooks regrouped to 3
  scale groups: the same answers as TP 1, within bf16 TP's own drift.
- ``--dp 2`` on SmolLM2: two schedulers, each with its own pool and exact store, answer as one
  does, with the same capacity per worker.

SGLang's CPU path needs ``SGLANG_CPU_OMP_THREADS_BIND`` (cores per rank) for more than one rank
per NUMA node; both ranks share this machine's 2 cores.
"""
from __future__ import annotations

import pytest

from _support import tiny_llama_dir
from engine_worker import assert_same_or_near_tie, chat_ids, make_random_artifact, output_drift, run_worker

BIND = {"SGLANG_CPU_OMP_THREADS_BIND": "0|1"}
NEW = 24


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_llama_dir(tmp_path_factory.mktemp("tiny") / "llama4kv")


def _generate(tmp, name, model, prompts, tasq=None, env=None, **engine):
    engine = {"model_path": str(model), "mem_fraction_static": 0.05, "log_level": "error", **engine}
    spec = {"engine": {k: v for k, v in engine.items() if v is not None},
            "tasq_config": str(tasq) if tasq else None,
            "tasks": [{"op": "generate", "input_ids": prompts, "top_logprobs_num": 2, "logprob_start_len": 0,
                       "sampling_params": {"temperature": 0, "max_new_tokens": NEW}}, {"op": "info"}]}
    rc, out, err = run_worker(spec, tmp, name, env=env)
    assert rc == 0 and out, err[-3000:]
    gen, info = out["results"]
    return gen["outputs"], info


def _drift(a, b):
    """Largest |log-prob difference| of two runs: the prompts' teacher-forced log-probs (every
    prompt query reads the cache as a decode step would: windows exact, the rest from codes)
    and the chosen tokens' over the common prefix of the answers."""
    worst = 0.0
    for x, y in zip(a, b):
        assert len(x["input_logprobs"]) == len(y["input_logprobs"]) > 0
        worst = max(worst, max(abs(p - q) for p, q in zip(x["input_logprobs"], y["input_logprobs"])), output_drift(x, y))
    return worst


def _assert_same_or_near_tie(got, want, tie):
    for g, w in zip(got, want):
        assert_same_or_near_tie(g["output_ids"], w["output_ids"], w["top_logprobs"], tie)


def test_tp2_answers_as_tp1_on_an_artifact_calibrated_for_two_scale_groups(tmp_path, tiny, smollm2_tokenizer):
    art = make_random_artifact(tmp_path / "g2", tiny, seed=1, codebook_size_k=256, codebook_size_v=256,
                               scale_groups=2, sink_window=4, recent_window=8)
    text = "The quick brown fox jumps over the lazy dog near the river bank. " * 10
    prompts = [smollm2_tokenizer(text + "Count: one, two, three,")["input_ids"],
               chat_ids(smollm2_tokenizer, "Hello there, my name is Ada. What is your name?")]
    cap = {"max_total_tokens": 16384}
    bf1, _ = _generate(tmp_path, "bf16_tp1", tiny, prompts, **cap)
    bf2, _ = _generate(tmp_path, "bf16_tp2", tiny, prompts, env=BIND, tp_size=2, **cap)
    tq1, _ = _generate(tmp_path, "tasq_tp1", tiny, prompts, tasq=art, **cap)
    tq2, info = _generate(tmp_path, "tasq_tp2", tiny, prompts, tasq=art, env=BIND, tp_size=2, **cap)
    assert info["attention_backend"] == "tasq"
    # the answers come from codes: random codebooks and 12-token windows change them
    assert [o["output_ids"] for o in tq1] != [o["output_ids"] for o in bf1]
    bf_drift, tq_drift = _drift(bf2, bf1), _drift(tq2, tq1)
    print(f"tiny model, log-prob drift TP 2 vs TP 1: bf16 {bf_drift:.3f}, TaSQ {tq_drift:.3f} nats")
    # this random model's large logits make TP's other summation order move bf16's own
    # log-probs by up to ~1.6 nats; TaSQ at TP 2 adds nothing beyond that (each rank codes its
    # heads with their own scale exactly as TP 1 does). A rank serving another rank's heads or
    # a scale spanning ranks changes every distribution (several nats).
    assert tq_drift <= 1.25 * bf_drift + 0.1, (tq_drift, bf_drift)


def test_tp2_is_refused_for_an_artifact_whose_scale_spans_the_ranks(tmp_path, tiny):
    art = make_random_artifact(tmp_path / "g1", tiny, seed=1, codebook_size_k=64, codebook_size_v=64)
    spec = {"engine": {"model_path": str(tiny), "tp_size": 2, "max_total_tokens": 4096}, "tasq_config": str(art),
            "tasks": []}
    rc, out, err = run_worker(spec, tmp_path, "refused", env=BIND)
    lines = [ln for ln in err.splitlines() if ln.startswith("tasq:")]
    assert rc == 2 and len(lines) == 1, err[-2000:]
    assert "--tp 2: the artifact shares one key scale over 4 KV heads" in lines[0] and "calibrate" in lines[0]


def _regrouped(artifact, out_dir, scale_groups):
    """The calibrated artifact's codebooks with their key scale over ``scale_groups`` head groups:
    a wiring artifact for TP mechanics (smooth k-means codebooks, so a code flipped by float
    order moves a key a little; with random codebooks one flip moves it anywhere and the
    comparison measures chaos, not TP). Not a TP-calibrated artifact: quality claims use
    ``python -m calibrate --tp N``."""
    import dataclasses

    from sglang_tasq.artifact import load_artifact, save_artifact

    art = load_artifact(artifact)
    cb = dataclasses.replace(art.codebooks, config=dataclasses.replace(art.config, scale_groups=scale_groups))
    return save_artifact(out_dir, cb, art.model, calibration={"kind": "regrouped", "from": str(artifact)})


@pytest.fixture(scope="module")
def smollm2_runs(tmp_path_factory, smollm2_dir, smollm2_tokenizer, artifact):
    """SmolLM2 (9 query / 3 KV heads: one KV head per rank at TP 3) with the calibrated codebooks
    regrouped to 3 key-scale groups: bf16 and TaSQ at TP 1 and TP 3, TaSQ at DP 2."""
    from sglang_tasq.demo import haystack

    tmp = tmp_path_factory.mktemp("smollm2_parallel")
    art = _regrouped(artifact, tmp / "g3", 3)
    needle = haystack()
    prompts = [chat_ids(smollm2_tokenizer, needle),
               chat_ids(smollm2_tokenizer, "What is the capital of France? Answer in one sentence."),
               chat_ids(smollm2_tokenizer, needle.replace("7421", "5093")),
               chat_ids(smollm2_tokenizer, "Write a haiku about the sea.")]
    bind3 = {"SGLANG_CPU_OMP_THREADS_BIND": "0|1|0"}
    runs = {"prompts": prompts}
    for name, tasq, env, kw in (("bf16_tp1", None, None, {}), ("bf16_tp3", None, bind3, {"tp_size": 3}),
                                ("tasq_tp1", art, None, {}), ("tasq_tp3", art, bind3, {"tp_size": 3}),
                                ("tasq_dp2", art, BIND, {"dp_size": 2})):
        runs[name] = _generate(tmp, name, smollm2_dir, prompts, tasq=tasq, env=env, max_running_requests=4,
                               max_total_tokens=16384, **kw)
    return runs


def test_tp3_answers_as_tp1_on_smollm2(smollm2_runs):
    r = smollm2_runs
    (bf1, _), (bf3, _), (tq1, info1), (tq3, info3) = (r[k] for k in ("bf16_tp1", "bf16_tp3", "tasq_tp1", "tasq_tp3"))
    assert info3["attention_backend"] == "tasq" and any(len(p) > 320 for p in r["prompts"])  # codes are read
    # a rank's pool holds one of the 3 KV heads: the same tokens (and window entries) in a third
    # of the bytes. (Token counts are pinned with --max-total-tokens: with more ranks than NUMA
    # nodes SGLang cannot size a rank's memory from --mem-fraction-static.)
    assert info1["max_total_num_tokens"] == info3["max_total_num_tokens"] == 16384
    ratio = info3["kvcache_gb"] / info1["kvcache_gb"]
    print(f"KV pool per rank TP 3 / TP 1: {info3['kvcache_gb']} / {info1['kvcache_gb']} GB = {ratio:.3f}")
    assert 0.3 < ratio < 0.37, (info1, info3)
    bf_drift, tq_drift = _drift(bf3, bf1), _drift(tq3, tq1)
    print(f"SmolLM2, log-prob drift TP 3 vs TP 1: bf16 {bf_drift:.3f}, TaSQ {tq_drift:.3f} nats")
    # measured: bf16 0.57 (a rare prompt token); TaSQ 0.77 here, 0.58 with the calibrated TP-3
    # artifact (a key moved by float order can flip a code at a near-tie: a little more drift)
    assert tq_drift <= 1.5 * bf_drift + 0.1, (tq_drift, bf_drift)
    # answers may part, and only where TP 1's top two are a near-tie. How many part is not
    # asked: it counts dead heats, which any change of float order flips (measured: two of the
    # four at steps 10 and 16-17, gaps 0.25 / 0.125 nats; after the decode kernel's RoPE
    # composition three, at steps 10 / 16 / 17, gaps 0.000 / 0.000 / 0.125)
    _assert_same_or_near_tie(tq3, tq1, tie=2 * max(tq_drift, bf_drift) + 0.1)


def test_dp2_answers_as_dp1_with_the_same_capacity_per_worker(smollm2_runs):
    r = smollm2_runs
    (one, info1), (two, info2) = r["tasq_tp1"], r["tasq_dp2"]
    assert info2["attention_backend"] == "tasq"
    assert info2["max_total_num_tokens"] == info1["max_total_num_tokens"]
    assert info2["kvcache_gb"] == info1["kvcache_gb"]  # each worker: the same TaSQ pool and store
    # the batch is split over two schedulers: other batch shapes, the same per-request arithmetic
    # but for bf16 GEMM rounding that depends on the batch's row count; bounded by the drift
    # of another float order that bf16 itself shows (TP 3 vs TP 1)
    bf_drift, dp_drift = _drift(r["bf16_tp3"][0], r["bf16_tp1"][0]), _drift(two, one)
    print(f"SmolLM2, TaSQ log-prob drift DP 2 vs DP 1: {dp_drift:.3f} nats")
    assert dp_drift <= 1.5 * bf_drift + 0.1, (dp_drift, bf_drift)
    # partings only at near-ties; not how many (dead heats: measured two, at steps 16 / 17, top-2
    # gaps 0.000 / 0.125 nats, with the decode kernel's composed RoPE; one before it)
    _assert_same_or_near_tie(two, one, tie=2 * dp_drift + 0.1)
