"""The quality suite's NIAH "server" view through a real TaSQ server (CPU, SmolLM2, a calibrated
artifact): 2 tasks x 1 sample at 1024 tokens, prefilled in chunks of 256 with the radix cache on.
Both passes are answered, the second one from the radix cache, the item has the view's fields,
and each sample's warm answer is its cold answer (the server's promise: the same request gets the
same tokens whatever the cache state). A decode-view result written afterwards into the run that
differs only by the view is picked up on the next run, without a server."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from bench import ruler_server as RS
from bench.quality import QualityConfig
from bench.report import write_json
from bench.ruler import item_path

TASKS = ("niah_single_1", "niah_multikey_2")


def test_server_view_through_a_tasq_server(tmp_path, artifact, smollm2_tokenizer):
    cfg = QualityConfig(methods=("tasq",), benches=("ruler",), niah_view="server", niah_methods=("tasq",),
                        niah_lengths=(1024,), niah_samples=1, niah_tasks=TASKS, niah_max_new=64,
                        artifacts=(("tasq", str(Path(artifact).parent)),))
    logs = []
    ctx = SimpleNamespace(cfg=cfg, tok=smollm2_tokenizer, methods={"tasq": None}, run_dir=tmp_path / cfg.name(),
                          log=logs.append)
    res = RS.run(ctx)
    assert list(res) == ["tasq"] and list(res["tasq"]) == ["64+256"]  # 'none' cannot be served: not run
    assert any("'none' cannot be served" in line for line in logs)
    item = res["tasq"]["64+256"]["1024"]
    for key in ("tasks", "avg", "tasks_warm", "avg_warm", "warm_equal", "warm_equal_all", "warm_equal_count",
                "agree_decode", "agree_score", "cached_tokens", "server", "seconds_by_pass", "preds"):
        assert key in item, key
    assert item["view"] == "server" and item["windows"] == "64+256" and item["n_preds"] == 2
    assert set(item["tasks"]) == set(item["tasks_warm"]) == set(item["warm_equal"]) == set(TASKS)
    assert item["agree_decode"] is None  # no decode-view run yet
    assert item["server"]["max_running_requests"] == 4
    log = (ctx.run_dir / item["server"]["log"]).read_text(errors="replace")
    assert "#new-token: 256" in log  # the ~900-token prompts were prefilled in chunks of 256
    for p in item["preds"]:
        assert p["prompt_tokens"] == p["length"] > 2 * RS.CHUNK  # the sample's tokens, several chunks
        assert isinstance(p["pred_warm"], str) and p["completion_tokens_warm"] > 0  # the second pass answered
        assert p["cached_warm"] > p["cached_cold"]  # ... from a radix-shared prefix
    differ = [(p["task"], p["pred"], p["pred_warm"]) for p in item["preds"] if p["pred"] != p["pred_warm"]]
    assert not differ, f"warm != cold: {differ}"
    assert item["warm_equal_all"] == 1.0 and item["tasks"] == item["tasks_warm"]
    on_disk = json.loads(next((ctx.run_dir / "items" / "ruler_server").glob("tasq__64+256__1024.json")).read_text())
    assert on_disk["preds"][0]["pred"] == item["preds"][0]["pred"]

    # a decode-view result of the same samples appears (one prediction changed): picked up by the rerun
    twin = tmp_path / RS.decode_twin(cfg)
    preds = [{k: p[k] for k in ("task", "index", "length", "gold", "pred")} for p in item["preds"]]
    preds[1]["pred"] = "something else"
    write_json(item_path(twin, "tasq", "64+256", 1024), {"samples_per_task": 1, "view": "decode", "preds": preds})
    again = RS.run(ctx)["tasq"]["64+256"]["1024"]  # no server: the item exists
    assert again["agree_decode_count"] == 1 and again["agree_decode_all"] == 0.5 and again["decode_run"] == twin.name
    assert [p["agrees_decode"] for p in again["preds"]] == [True, False]
