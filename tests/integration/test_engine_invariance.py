"""A served answer is a function of its request alone (real ``sglang.Engine`` on CPU, SmolLM2,
a calibrated artifact, radix cache ON, greedy).

The same prompts are answered cold, after unrelated requests, warm (their whole prefix in the
radix cache), inside a batch of 16 with at most 4 running at once (more requests than the
window store is sized for: the scheduler never runs one without its windows), as the third
turn of a chat whose earlier turns are radix-shared, with ``--chunked-prefill-size 256``, and
on the plain-torch path (``SGLANG_TASQ_CPU_KERNELS=0``), and after retractions (SGLang's
``SGLANG_TEST_RETRACT`` hook, on the torch run). Every answer must be the cold one up to
float rounding (a parting only at a near-tie, log-probs before it within DRIFT: SGLang's CPU
forward is not invariant to a forward's shape, for bf16 either); the engine's log-probs must
equal the HF TaSQ cache fed token by token (the same window rule by construction) within the
bf16 engine's own distance to HF.

The prompts are long (~700-1,300 tokens) so that most of every prompt is read from codes, and
the windows matter: the same artifact with no windows (sink = recent = 0) changes all three
answers checked (the two needles and the chat's third turn: "The secret code is 12: in Looe"
for "The secret passcode is 123456", ...), so serving a window from codes is caught.
"""
from __future__ import annotations

import re

import pytest

from engine_worker import assert_same_or_near_tie, assert_same_up_to_rounding, chat_ids, reference_logprobs, run_worker

NEW = 12
# Across paths whose float arithmetic differs (torch vs Numba kernels, a prefill split into
# chunks or re-run after a retraction), greedy answers may part only at a near-tie, on one of
# the top-2 tokens: at the parting step the reference run's own top-1 minus top-2 log-prob (the
# engine's top_logprobs) must be under ENGINE_TIE. The bound is the one this test applied
# before to the same gap measured on the HF reference (0.25 + 2 x 0.2 for HF's distance to the
# engine); measured partings there: "3945." vs "3945" at 0.125 nats, a passcode's first digit
# at 0.5 (torch chunked path under SGLang's retraction hook vs the Numba path, one of two runs).
HF_LOGPROB_MAX = 0.2
ENGINE_TIE = 0.65
# One request served twice with another float order (in a batch, warm): the chosen tokens'
# log-probs before any parting. Measured on AMD EPYC: TaSQ up to 0.16 nats (test_server_tasq:
# 6 chats sent together vs alone; 0.09 for the chat's third turn warm vs fresh here); the bf16
# engine 0.07 (that chat turn) and 0.13 (test_plugin_engine's shared-prefix batch vs alone). A
# request that reads another's data moves them by far more ("7421" vs "1234", issue 11).
DRIFT = 0.4
GREEDY = {"temperature": 0, "max_new_tokens": NEW}
ROWS = 4  # SGLANG_TASQ_WINDOW_ROWS: at most 4 requests run at once


def _haystack(n: int, code: str, seed: int) -> str:
    towns = ["Avon", "Brill", "Corfe", "Dent", "Eye", "Frome", "Hay", "Looe", "Mere", "Rye"]
    filler = [f"Note {i}: in {towns[(i * seed) % 10]} the market opened at {(i * 7 + seed) % 12 + 1} o'clock."
              for i in range(n)]
    filler.insert(n // 3, f"The secret passcode is {code}.")
    return " ".join(filler) + "\n\nWhat is the secret passcode? Answer with the number only."


@pytest.fixture(scope="module")
def prompts(smollm2_tokenizer):
    tok = smollm2_tokenizer
    main = [chat_ids(tok, _haystack(n, c, s)) for n, c, s in ((60, "7421", 1), (45, "3945", 3))]
    others = [chat_ids(tok, _haystack(30 + 3 * i, str(1000 + 37 * i), i + 2)) for i in range(14)]
    unrelated = [chat_ids(tok, q) for q in ("What is the capital of France?", "Name three colours.")]
    turns = [{"role": "user", "content": _haystack(40, "5182", 5)},
             {"role": "assistant", "content": "The secret passcode is 5182."},
             {"role": "user", "content": "In which town did the market open at 3 o'clock?"},
             {"role": "assistant", "content": "It opened at 3 o'clock in Dent."},
             {"role": "user", "content": "Repeat the passcode, then name the first town in the notes."}]
    chat = [_chat(tok, turns[: n]) for n in (1, 3, 5)]
    return {"main": main, "others": others, "unrelated": unrelated, "chat": chat}


def _chat(tok, msgs) -> list[int]:
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def _gen(ids):
    """A greedy request with its log-probs and each step's top 2."""
    return {"op": "generate", "input_ids": ids, "sampling_params": GREEDY, "top_logprobs_num": 2}


def _tasks(p, full: bool = True):
    main, t = p["main"], []
    if not full:  # cold, then a batch of 6 (4 at a time)
        return t + [{"op": "flush"}] + [_gen(ids) for ids in main] + [{"op": "flush"}, _gen(main + p["others"][:4])]
    t += [{"op": "flush"}] + [_gen(ids) for ids in main]                  # 1, 2: cold
    t += [_gen(ids) for ids in p["unrelated"]] + [_gen(ids) for ids in main]  # 5, 6: after others, warm
    t += [{"op": "flush"}, _gen(main + p["others"])]                      # 8: batch of 16, 4 at a time
    t += [{"op": "flush"}] + [_gen(ids) for ids in p["chat"]]              # 12: 3rd turn, turns 1-2 shared
    t += [{"op": "flush"}, _gen(p["chat"][-1])]                           # 14: the same conversation fresh
    return t


def _run(model, artifact, prompts, tmp, name, env=None, engine=None, full=True):
    spec = {"engine": dict({"model_path": str(model), "mem_fraction_static": 0.05}, **(engine or {})),
            "tasq_config": str(artifact), "tasks": _tasks(prompts, full)}
    rc, out, err = run_worker(spec, tmp, name, env=dict({"SGLANG_TASQ_WINDOW_ROWS": str(ROWS)}, **(env or {})))
    assert rc == 0 and out is not None, err[-3000:]
    r = out["results"]
    out = lambda i, j=0: r[i]["outputs"][j]  # noqa: E731  (output_ids, output_logprobs, top_logprobs)
    if not full:
        return {"cold": [out(1), out(2)], "batch": [out(4, 0), out(4, 1)], "log": err}
    return {"cold": [out(1), out(2)], "after": [out(5), out(6)], "batch": [out(8, 0), out(8, 1)],
            "chat_warm": out(12), "chat_fresh": out(14), "log": err}


@pytest.fixture(scope="module")
def numba_run(smollm2_dir, artifact, prompts, tmp_path_factory):
    return _run(smollm2_dir, artifact, prompts, tmp_path_factory.mktemp("nb"), "numba")


@pytest.fixture(scope="module")
def torch_chunked_run(smollm2_dir, artifact, prompts, tmp_path_factory):
    # + SGLang's test hook that retracts running decode requests every third forward
    return _run(smollm2_dir, artifact, prompts, tmp_path_factory.mktemp("tc"), "torch",
                env={"SGLANG_TASQ_CPU_KERNELS": "0", "SGLANG_TEST_RETRACT": "1"},
                engine={"chunked_prefill_size": 256, "log_level": "warning"}, full=False)


def test_same_answer_cold_after_others_warm_and_in_a_batch(numba_run):
    """One path (Numba kernels, one-chunk prefill): the same prompt cold, after unrelated requests
    (warm: its prefix radix-matched), in a batch of 16 run 4 at a time, and a chat's third turn
    with turns 1-2 radix-shared vs the same conversation fresh. The same tokens up to float
    rounding: a parting only at a near-tie of the reference, and the chosen tokens' log-probs
    before it within DRIFT. SGLang's CPU forward is not invariant to the shape of a forward, for
    bf16 as for TaSQ (the bf16 engine on the chat's third turn, AMD EPYC: first-token log-prob
    -0.6609 warm vs -0.6557 fresh, 0.074 apart at the second; single-threaded, torch's bf16 GEMM
    of the down projection, K = 1536, gives a lone row other bits than the same row among
    several). Measured partings: batched "...4 2 1 ." EOS vs cold "...4 2 1" EOS (CI, stop 24,
    top-2 gap 0.125); the chat turn warm at a dead heat (top-2 gap 0.000) vs fresh (0.125)."""
    run = numba_run
    assert all(len(x["output_ids"]) > 0 for x in run["cold"])
    for name in ("after", "batch"):
        for got, want in zip(run[name], run["cold"]):
            assert_same_up_to_rounding(got, want, ENGINE_TIE, DRIFT)
    assert_same_up_to_rounding(run["chat_warm"], run["chat_fresh"], ENGINE_TIE, DRIFT)


def test_torch_path_same_answer_in_a_batch_with_retractions(torch_chunked_run):
    """The plain-torch path, chunked prefill (256), SGLang's retraction hook: a batch of 6, 4 at
    a time, answers as cold; a retracted request's prefill is recomputed in other chunks, so the
    two may part only at a near-tie of the reference (measured: "3945." vs "3945" at a top-2
    gap of ~0.1 nats)."""
    run = torch_chunked_run
    for got, want in zip(run["batch"], run["cold"]):
        assert_same_or_near_tie(got["output_ids"], want["output_ids"], want["top_logprobs"], ENGINE_TIE)


def test_the_torch_run_retracted_requests(torch_chunked_run):
    """The torch run's batch ran under SGLang's retraction test hook: requests were
    retracted (their KV freed, prefilled again: partly radix-matched, partly recomputed) and
    still answered as cold (test above)."""
    assert re.search(r"retraction\. #retracted_reqs: [1-9]", torch_chunked_run["log"]), torch_chunked_run["log"][-2000:]


def test_chunked_prefill_and_torch_path_match_the_kernel_path(numba_run, torch_chunked_run):
    """Chunked prefill (256) on the torch path vs one-chunk prefill on the Numba path: the same
    attention by the window rule, so the same tokens up to float rounding: they may part only at
    a near-tie of the reference."""
    for got, want in zip(torch_chunked_run["cold"], numba_run["cold"]):
        assert_same_or_near_tie(got["output_ids"], want["output_ids"], want["top_logprobs"], ENGINE_TIE)


def test_logprobs_match_hf_token_by_token(numba_run, prompts, smollm2_dir, artifact):
    """Teacher-forced log-probs of the engine's tokens under the HF TaSQ cache fed one token at a
    time (each query sees the window rule exactly). Tolerance: what differs is arithmetic, not
    what is read: the engine attends in fp32 over decoded codes and bf16 windows, HF casts the
    decoded keys to bf16 and runs bf16 SDPA, and the two run different bf16 GEMM kernels for the
    same weights. The bf16 engine (torch_native) vs HF bf16 on the 1.1k-token prompt: max 0.062,
    mean 0.011 nats. TaSQ on the 1.1k prompt: max 0.12, mean 0.032 with the ff34e20 artifact;
    max 0.144, mean 0.053 with the issue-13 artifact (flat Fisher-weighted k-means), whose first
    two answer tokens differ by 0.12 nats each. Bounds (re-set with that artifact, ~40% headroom):
    max 0.2, mean 0.08; a window served from codes changes the answers outright (module doc)."""
    from sglang_tasq.srt.launch import load_checked_artifact

    art = load_checked_artifact(str(artifact), None)
    lp = numba_run["cold"][1]["output_logprobs"]
    ids = [t for _, t in lp]
    cfg = art.config
    ref = reference_logprobs(smollm2_dir, art.codebooks, prompts["main"][1], ids, cfg.sink_window, cfg.recent_window)
    diffs = [abs(a - b) for (a, _), b in zip(lp, ref)]
    print('logprob diffs', [round(x, 4) for x in diffs])
    assert max(diffs) < HF_LOGPROB_MAX and sum(diffs) / len(diffs) < 0.08, (diffs, lp, ref)
