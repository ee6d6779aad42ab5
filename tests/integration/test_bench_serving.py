"""bench.serving (capacity arithmetic, server commands, summary/markdown) and bench.ruler_client
(scoring with the real ``string_match_all``, tables, samples); one slow real-server run."""
import json
from pathlib import Path

import pytest

from bench import niah, ruler_client, serving

ROOT = Path(__file__).resolve().parents[2]
SMOL = Path.home() / ".cache" / "sglang-tasq" / "models" / "SmolLM2-135M-Instruct"
FAST = ROOT / "artifacts" / "smollm2-fast" / "tasq.json"
needs_model = pytest.mark.skipif(not (SMOL / "config.json").is_file(), reason="SmolLM2 not materialized")


# ---- capacity ------------------------------------------------------------------------------
def test_budget_tokens_and_requests_that_fit():
    budget = 96 * 2**20
    assert serving.budget_tokens(budget, 23040) == 4369  # bf16 SmolLM2: 3 heads x 64 x 2 (K,V) x 30 x 2 B
    assert serving.budget_tokens(budget, 11520) == 8738
    assert serving.budget_tokens(budget, 1860, fixed=budget) == 0
    assert serving.budget_tokens(100, 10, fixed=200) == 0
    assert serving.budget_tokens(1000, 10, fixed=1) == 99
    assert serving.requests_that_fit(4369, 1024, 32) == 4
    assert serving.requests_that_fit(1055, 1024, 32) == 0
    assert serving.requests_that_fit(8738, 1024, 32) == 8


@needs_model
@pytest.mark.skipif(not FAST.is_file(), reason="no calibrated artifact")
def test_kv_cells_match_pool_sizing():
    from sglang_tasq.artifact import load_artifact
    from sglang_tasq.srt.pool import bytes_per_token, window_bytes

    cells = serving.kv_cells(SMOL, FAST, window_rows=8)
    assert cells["bf16"] == (23040, 0) and cells["fp8"] == (11520, 0)
    cfg = load_artifact(FAST).config
    assert cells["tasq"] == (bytes_per_token(cfg, 3, 64, 30) + 8, window_bytes(cfg, 3, 64, 30, 8))
    assert cells["tasq"][0] == 62 * 30 + 8  # 30 + 2 + 30 bytes per layer (pool.py) + the slot's entry index
    tasq = serving.budget_tokens(96 * 2**20, *cells["tasq"])
    assert serving.requests_that_fit(tasq, 1024, 32) > 2 * serving.requests_that_fit(4369, 1024, 32)
    assert "tasq" not in serving.kv_cells(SMOL, None, 8)


def test_server_cmd_per_kind(tmp_path):
    a = serving.parse_args(["--quick", "--servers", "bf16", "fp8", "--out", str(tmp_path)])
    assert (a.input_len, a.output_len, a.concurrency, a.kv_budget_mib) == (1024, 32, [1, 4, 8], 96)
    bf16 = serving.server_cmd("bf16", SMOL, 1234, a, 4369)
    assert bf16[bf16.index("--max-total-tokens") + 1] == "4369"
    assert bf16[bf16.index("--attention-backend") + 1] == "torch_native"
    assert "--disable-radix-cache" in bf16 and "127.0.0.1" in bf16 and "--kv-cache-dtype" not in bf16
    fp8 = serving.server_cmd("fp8", SMOL, 1234, a, None)
    assert fp8[fp8.index("--kv-cache-dtype") + 1] == "fp8_e4m3" and "--max-total-tokens" not in fp8
    a.tasq_config = FAST
    tasq = serving.server_cmd("tasq", SMOL, 1234, a, 50000)
    assert tasq[tasq.index("--tasq-config") + 1] == str(FAST) and "--attention-backend" not in tasq
    same = lambda cmd: cmd[cmd.index("--mem-fraction-static") + 1]  # noqa: E731
    assert same(bf16) == same(fp8) == same(tasq)
    b = serving.parse_args(["--quick", "--servers", "bf16", "--input-len", "128", "--concurrency", "2"])
    assert (b.input_len, b.concurrency, b.output_len) == (128, [2], 32)


def test_scan_peaks_keeps_maxima():
    peak = {}
    serving.scan_peaks({"loads": [{"num_running_reqs": 3, "num_waiting_reqs": 0, "token_usage": 0.5}]}, peak)
    serving.scan_peaks({"loads": [{"num_running_reqs": 1, "num_waiting_reqs": 4, "other": 9}]}, peak)
    serving.scan_peaks({}, peak)
    assert peak == {"num_running_reqs": 3, "num_waiting_reqs": 4, "token_usage": 0.5}


# ---- summary -------------------------------------------------------------------------------
def _run(tput, ttft, running, waiting):
    return {"output_throughput": tput, "total_throughput": tput * 33, "mean_ttft_ms": ttft, "median_ttft_ms": ttft,
            "mean_tpot_ms": 100.0, "server_peak": {"num_running_reqs": running, "num_waiting_reqs": waiting}}


RESULTS = {
    "bf16": {"status": "ok", "attention_backend": "torch_native", "kv_cache_dtype": "auto", "max_total_num_tokens": 4369, "max_running_requests": 2048, "kv_cache_gb": 0.094,
             "cell_bytes": 23040, "fixed_bytes": 0, "budget_tokens": 4369,
             "runs": {"1": _run(5.0, 1000.0, 1, 0), "8": _run(10.0, 9000.0, 4, 4)}},
    "fp8": {"status": "failed", "reason": "server exited with status 1: CPU FP8 KV cache requires Intel AMX"},
    "tasq": {"status": "ok", "attention_backend": "tasq", "kv_cache_dtype": "auto", "max_total_num_tokens": 18000, "max_running_requests": 2048, "kv_cache_gb": 0.094,
             "cell_bytes": 1860, "fixed_bytes": 66 * 2**20, "budget_tokens": 18000,
             "runs": {"1": _run(4.0, 1500.0, 1, 0), "8": {"error": "timed out"}}},
}
WORKLOAD = {"preset": "quick", "input_len": 1024, "output_len": 32, "num_prompts": 4, "concurrency": [1, 8],
            "kv_budget_mib": 96, "window_rows": 8, "mem_fraction_static": 0.1, "model": "smollm2-135m",
            "model_dir": "SmolLM2-135M-Instruct", "dataset": "random-ids", "tasq_config": "a/tasq.json"}
HW = {"cpu": "Test CPU", "cores": 2, "mem_gib": 23.0, "device": "cpu", "amx": True, "python": "3.11"}


def test_summarize_from_given_numbers():
    s = serving.summarize(RESULTS, WORKLOAD, HW)
    b, t, f = s["servers"]["bf16"], s["servers"]["tasq"], s["servers"]["fp8"]
    assert (b["pool_tokens"], b["max_concurrency"], t["max_concurrency"]) == (4369, 4, 17)
    assert b["throughput_tok_s"] == {"1": 5.0, "8": 10.0} and b["ttft_ms"]["8"] == 9000.0
    assert b["server_peak"]["8"]["num_waiting_reqs"] == 4
    assert t["throughput_tok_s"] == {"1": 4.0} and t["errors"] == {"8": "timed out"}
    assert f == {"status": "failed", "reason": RESULTS["fp8"]["reason"]}
    r = s["tasq_vs_bf16"]
    assert r["pool_tokens_ratio"] == round(18000 / 4369, 2) and r["ttft_c1_ratio"] == 1.5
    assert r["prefill_overhead_ms"] == 500.0 and r["throughput_ratio"] == {"1": 0.8}
    assert s["workload"]["tokens_per_request"] == 1056 and s["hardware"]["cores"] == 2
    assert "tasq_vs_bf16" not in serving.summarize({"bf16": RESULTS["bf16"]}, WORKLOAD, HW)


def test_markdown_and_files(tmp_path):
    s = serving.write_summary(RESULTS, WORKLOAD, HW, tmp_path)
    assert json.loads((tmp_path / "summary.json").read_text()) == json.loads(json.dumps(s))
    md = (tmp_path / "summary.md").read_text()
    assert "Test CPU, 2 cores" in md and "input 1024 + output 32 tokens, max(4, concurrency) prompts" in md and "KV budget 96 MiB" in md
    assert "| bf16 | torch_native, auto | 23040 | 4369 | 0.094 | 4 | 2048 |" in md
    assert "| tasq | tasq, auto | 1860 | 18000 | 0.094 | 17 | 2048 |" in md
    assert "| fp8 | failed: server exited with status 1" in md
    assert "| bf16 | 8 | 10.00 | 330.0 | 9000.0 | 9000.0 | 100.0 | 4 / 4 |" in md
    assert "| tasq | 8 | error: timed out" in md
    assert "4.12x pool tokens" in md and "1500.0 ms vs 1000.0 ms (1.5x" in md and "output throughput 0.8x at 1" in md


def test_merge_best_keeps_the_fastest_round_per_concurrency():
    r1 = {"status": "ok", "runs": {"1": _run(4.0, 1500.0, 1, 0), "8": {"error": "timed out"}}}
    r2 = {"status": "ok", "runs": {"1": _run(3.0, 2000.0, 1, 0), "8": _run(9.0, 8000.0, 8, 0)}}
    m = serving.merge_best(serving.merge_best(None, r1), r2)
    assert m["runs"]["1"]["mean_ttft_ms"] == 1500.0 and m["runs"]["8"]["output_throughput"] == 9.0
    assert m["rounds_tok_s"] == {"1": [4.0, 3.0], "8": [None, 9.0]}
    assert serving.merge_best(m, {"status": "failed"}) is m
    assert r1["runs"]["8"] == {"error": "timed out"}  # inputs untouched


def test_paired_rounds_give_per_round_ratios(tmp_path):
    """--paired: rounds are folded like interleaved ones, and the summary adds the per-round
    TaSQ/bf16 ratios (a failed round is None, not a zero) and their median."""
    b, t = dict(RESULTS["bf16"]), dict(RESULTS["tasq"])
    b["rounds_tok_s"] = {"1": [5.0, 2.0, 6.0], "8": [10.0]}
    t["rounds_tok_s"] = {"1": [4.0, 1.8, None], "8": [None]}
    s = serving.summarize({"bf16": b, "tasq": t}, dict(WORKLOAD, paired=True, rounds=3), HW)
    r = s["tasq_vs_bf16"]
    assert r["paired_ratios"] == {"1": [0.8, 0.9, None], "8": [None]}
    assert r["paired_ratio_median"] == {"1": 0.85}
    md = serving.to_markdown(s)
    assert "median over rounds 0.85x at 1" in md and "best of 3 paired round(s)" in md
    assert "paired_ratios" not in serving.summarize({"bf16": b, "tasq": t}, WORKLOAD, HW)["tasq_vs_bf16"]
    a = serving.parse_args(["--quick", "--paired", "--servers", "bf16", "--out", str(tmp_path)])
    assert "--sleep-on-idle" in serving.server_cmd("bf16", SMOL, 1234, a, 4369)
    assert "--sleep-on-idle" not in serving.server_cmd("bf16", SMOL, 1234, serving.parse_args(["--quick", "--servers", "bf16"]), 4369)


@needs_model
def test_main_reuses_existing_results(tmp_path, monkeypatch):
    for name in ("bf16", "fp8"):
        (tmp_path / f"{name}.json").write_text(json.dumps(RESULTS[name]))

    def no_launch(*a, **k):
        raise AssertionError("a server with results must not be relaunched")

    monkeypatch.setattr(serving, "run_server", no_launch)
    assert serving.main(["--quick", "--servers", "bf16", "fp8", "--out", str(tmp_path)]) == 0
    s = json.loads((tmp_path / "summary.json").read_text())
    assert set(s["servers"]) == {"bf16", "fp8"} and s["servers"]["bf16"]["pool_tokens"] == 4369


# ---- RULER client --------------------------------------------------------------------------
def test_ruler_scoring_with_real_scorer():
    samples = [{"task": "niah_single_1", "target": 1024, "outputs": ["1234567"]},
               {"task": "niah_single_1", "target": 1024, "outputs": ["7654321"]},
               {"task": "niah_multivalue", "target": 1024, "outputs": ["111", "222", "333", "444"]},
               {"task": "niah_single_1", "target": 2048, "outputs": ["abc-def"]}]
    preds = [" is 1234567.", "I do not know", "111, 222 and\x00333", "The answer: ABC-DEF"]
    scores = ruler_client.score(samples, preds)
    assert scores == {"niah_single_1": {"1024": 50.0, "2048": 100.0}, "niah_multivalue": {"1024": 75.0}}
    assert scores["niah_single_1"]["1024"] == niah.string_match_all(preds[:2], [["1234567"], ["7654321"]])
    assert ruler_client.averages(scores, [1024, 2048, 4096]) == {"1024": 62.5, "2048": 100.0}
    md = ruler_client.to_markdown(scores, [1024, 2048], "t")
    assert "| niah_single_1 | 50.0 | 100.0 |" in md and "| niah_multivalue | 75.0 | - |" in md
    assert "| **average** | 62.5 | 100.0 |" in md
    with pytest.raises(ValueError):
        ruler_client.score(samples, preds[:3])


@needs_model
def test_ruler_samples_use_chat_template():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(SMOL))
    out = ruler_client.build_samples(tok, ["niah_single_1", "niah_multikey_2"], [1024], 2, seed=42)
    assert [(s["task"], s["target"], s["index"]) for s in out] == [
        ("niah_single_1", 1024, 0), ("niah_single_1", 1024, 1), ("niah_multikey_2", 1024, 0), ("niah_multikey_2", 1024, 1)]
    for s in out:
        assert s["prompt"].startswith("<|im_start|>") and "<|im_start|>assistant\n" in s["prompt"]
        assert s["prompt"].endswith(s["answer_prefix"].lstrip())
        assert s["length"] + 128 <= 1024 and s["max_new_tokens"] == 128
        assert all(g in s["input"] for g in s["outputs"])


# ---- one real server (slow) ---------------------------------------------------------------
@pytest.mark.slow
@needs_model
def test_bf16_server_budget_end_to_end(tmp_path):
    """A bf16 server in a 16 MiB KV budget gets exactly 16 MiB // 23040 B token slots and serves."""
    rc = serving.main(["--servers", "bf16", "--input-len", "64", "--output-len", "4", "--num-prompts", "2",
                       "--concurrency", "2", "--kv-budget-mib", "16", "--out", str(tmp_path),
                       "--start-timeout", "240", "--bench-timeout", "180"])
    assert rc == 0
    s = json.loads((tmp_path / "summary.json").read_text())["servers"]["bf16"]
    assert s["status"] == "ok" and s["pool_tokens"] == 16 * 2**20 // 23040 == s["budget_tokens"]
    assert s["throughput_tok_s"]["2"] > 0 and s["ttft_ms"]["2"] > 0
