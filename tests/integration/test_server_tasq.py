"""A real ``sglang.launch_server --tasq-config`` (CPU, SmolLM2, a calibrated artifact, radix cache
on) through its HTTP APIs, greedy: a 3-turn chat through the OpenAI API answers its third turn
as the same conversation sent fresh; more concurrent requests than the window store is sized
for (``SGLANG_TASQ_WINDOW_ROWS=2``) are each answered as when sent alone (both up to float
rounding: a parting only at a near-tie, log-probs within 0.4 nats); an empty prompt gets
HTTP 400 and the server answers the next request. One server for the module.

The concurrency check uses prompts that share only the chat template: see the comment there.
"""
from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from _support import ROOT
from engine_worker import assert_same_up_to_rounding
from test_engine_invariance import DRIFT, ENGINE_TIE
from sglang_tasq.options import child_env
from sglang_tasq.demo import _free_port, haystack, stop_server, wait_ready

ROWS = 2


def _post(base: str, path: str, body: dict, timeout: float = 600) -> tuple[int, dict | str]:
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            body = r.read()
            try:
                return r.status, json.loads(body)
            except ValueError:  # e.g. /flush_cache answers plain text
                return r.status, body.decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm2_dir, artifact):
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    log = tmp_path_factory.mktemp("srv") / "server.log"
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(smollm2_dir),
           "--tasq-config", str(artifact), "--device", "cpu", "--disable-cuda-graph", "--mem-fraction-static", "0.05",
           "--host", "127.0.0.1", "--port", str(port)]
    env = child_env(SGLANG_TASQ_WINDOW_ROWS=str(ROWS))
    env.pop("SGLANG_TASQ_CONFIG", None)
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=str(ROOT), start_new_session=True)
    try:
        wait_ready(base, proc, timeout=600)
        yield base, str(smollm2_dir), proc, log
    finally:
        stop_server(proc)


def _chat(base, model, msgs, max_tokens=24) -> dict:
    """-> the answer as ``text``, with each token's log-prob and top 2 through the OpenAI API, in
    the shape :func:`engine_worker.assert_same_up_to_rounding` reads (tokens as strings)."""
    status, out = _post(base, "/v1/chat/completions", {"model": model, "temperature": 0, "max_tokens": max_tokens,
                                                       "messages": msgs, "logprobs": True, "top_logprobs": 2})
    assert status == 200, out
    choice = out["choices"][0]
    steps = choice["logprobs"]["content"]
    return {"text": choice["message"]["content"], "output_ids": [e["token"] for e in steps],
            "output_logprobs": [[e["logprob"], e["token"]] for e in steps],
            "top_logprobs": [[[t["logprob"], t["token"]] for t in e["top_logprobs"]] for e in steps]}


def test_three_turn_chat_equals_the_conversation_sent_fresh(server):
    base, model, _, _ = server
    questions = [haystack(45), "What is the weather like in the notes?", "Repeat the secret passcode."]
    msgs = []
    for q in questions:  # each turn's prompt shares the earlier turns through the radix cache
        msgs.append({"role": "user", "content": q})
        answer = _chat(base, model, msgs)
        msgs.append({"role": "assistant", "content": answer["text"]})
    assert _post(base, "/flush_cache?timeout=60", {})[0] == 200
    fresh = _chat(base, model, msgs[:-1])
    # the same tokens up to float rounding (test_engine_invariance): SGLang's CPU forward of a
    # radix-matched suffix is not bit-identical to the whole prompt's, for bf16 as for TaSQ
    assert_same_up_to_rounding(answer, fresh, ENGINE_TIE, DRIFT)


def test_more_concurrent_requests_than_window_rows(server):
    base, model, _, _ = server
    # distinct notes from the first one on: requests share the chat template (sink) through the
    # radix cache, not a long prefix. A long prefix computed inside another prefill batch can
    # differ by one bf16 ulp (this CPU's bf16 GEMM rows depend on the batch's row count) and flip
    # a VQ code at a near-tie: a float effect of SGLang's batching, not of the windows.
    from test_engine_invariance import _haystack

    prompts = [_haystack(25 + 6 * i, str(2000 + 71 * i), i + 1) for i in range(3 * ROWS)]
    assert _post(base, "/flush_cache?timeout=60", {})[0] == 200
    alone = [_chat(base, model, [{"role": "user", "content": p}], 12) for p in prompts]
    assert _post(base, "/flush_cache?timeout=60", {})[0] == 200
    with ThreadPoolExecutor(len(prompts)) as ex:
        together = list(ex.map(lambda p: _chat(base, model, [{"role": "user", "content": p}], 12), prompts))
    for got, want in zip(together, alone):  # up to float rounding, as above
        assert_same_up_to_rounding(got, want, ENGINE_TIE, DRIFT)
    with urllib.request.urlopen(base + "/get_server_info", timeout=30) as r:
        info = json.loads(r.read())
    assert info.get("max_running_requests") == ROWS, {k: v for k, v in info.items() if "running" in k}


def test_empty_prompt_is_refused_and_the_server_stays_up(server):
    base, model, proc, log = server
    status, body = _post(base, "/generate", {"text": "", "sampling_params": {"max_new_tokens": 4}})
    assert 400 <= status < 500, (status, body)
    status, out = _post(base, "/generate", {"text": "The capital of France is",
                                            "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
    assert status == 200 and proc.poll() is None, (status, out, log.read_text()[-3000:])
