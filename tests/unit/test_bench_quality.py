"""Quality harness on a tiny random Llama: decode-view attention agrees with SDPA and with a
token-by-token cache, bf16 against itself is exactly zero error, metrics are finite,
finished work is skipped, method names parse, reports are written."""
import json
import math
from types import SimpleNamespace

import pytest
import torch
from transformers import DynamicCache

from bench import attention_error as ae
from bench import methods as M
from bench import perplexity, report, ruler
from sglang_tasq.hf.baselines import baseline
from sglang_tasq.config import TaSQConfig
from sglang_tasq.hf.cache import QuantizedKVCache, TaSQCache
from sglang_tasq.testing import random_codebooks
from _support import tiny_decode_view_llama

V = 128


@pytest.fixture(scope="module")
def model():
    return tiny_decode_view_llama(V)


def _ids(T, seed=0):
    return torch.randint(0, V, (T,), generator=torch.Generator().manual_seed(seed))


def _probe_logits(model, ids, method, sink, recent, stats=None, chunk=64):
    cache = ae.ProbeCache(method)
    with torch.no_grad(), ae.active(ae.Probe(cache, sink, recent, stats, chunk=chunk)):
        return model(ids[None], past_key_values=cache).logits[0]


def test_bf16_probe_matches_sdpa_and_has_zero_error(model):
    ids = _ids(150)
    with torch.no_grad():
        ref = model(ids[None]).logits[0]  # no probe active: plain SDPA
    for sink, recent in [(0, 0), (4, 16)]:
        st = ae.AttnStats(2, 32, 150)
        out = _probe_logits(model, ids, baseline("bf16"), sink, recent, st, chunk=37)
        assert torch.allclose(out, ref, atol=1e-5)
        assert st.layer_nmse() == [0.0, 0.0] and st.layer_kl() == [0.0, 0.0]


def test_windows_covering_everything_are_exact(model):
    ids = _ids(100, 1)
    ref = _probe_logits(model, ids, baseline("bf16"), 0, 0)
    assert torch.allclose(_probe_logits(model, ids, baseline("kivi2"), 0, 100), ref, atol=1e-5)
    assert not torch.allclose(_probe_logits(model, ids, baseline("kivi2"), 0, 0), ref, atol=1e-3)


@pytest.mark.parametrize("sink,recent", [(4, 8), (0, 1)])
def test_probe_equals_token_by_token_serving_cache(model, sink, recent):
    """Query t of one probe forward sees what decode step t of a serving-style cache sees."""
    cb = random_codebooks(2, 2, 16, config=TaSQConfig(codebook_size_k=64, codebook_size_v=64), seed=3)
    ids = _ids(40, 2)
    method = TaSQCache(cb).method
    probe = _probe_logits(model, ids, method, sink, recent, chunk=16)
    cache = QuantizedKVCache(method, sink=sink, recent=recent, fresh_exact=True)
    with torch.no_grad():
        steps = [model(ids[None, t:t + 1], past_key_values=cache).logits[0, 0] for t in range(40)]
    assert torch.allclose(probe, torch.stack(steps), atol=1e-4)


def test_evaluate_metrics_finite_and_bf16_zero(model, tmp_path):
    wins = torch.stack([_ids(96, 5), _ids(96, 6)])
    ref = perplexity.evaluate(model, wins, baseline("bf16"), 0, 0, tmp_path, "t", stride=8, bucket=32)
    assert ref["token_kl"] == 0.0 and ref["top1_agree"] == 1.0 and ref["logit_nmse"] == 0.0
    assert ref["attn_kl"] == 0.0 and math.isfinite(ref["ppl"]) and ref["tokens"] == 2 * 95
    assert len(list(tmp_path.glob("ref_t_96_s8_*.safetensors"))) == 2
    assert all(ref["per_window"][k] == [0.0, 0.0] for k in ("token_kl", "logit_nmse", "attn_kl"))
    for name, win in [("kivi2", (0, 0)), ("fp8_e4m3", (4, 16))]:
        r = perplexity.evaluate(model, wins, baseline(name), *win, tmp_path, "t", stride=8, bucket=32)
        assert all(math.isfinite(r[k]) for k in ("ppl", "token_kl", "logit_nmse", "attn_kl", "top1_agree"))
        assert r["token_kl"] > 0 and r["logit_nmse"] > 0 and len(r["layer_nmse"]) == 2
        assert len(r["token_kl_by_pos"]) == 3 and len(r["bucket_nmse"]) == 3
        per = r["per_window"]  # equal-length windows: the means of the per-window values are the totals
        for key in ("nll", "token_kl", "attn_kl"):
            assert sum(per[key]) / 2 == pytest.approx(r[key])
        assert all(x > 0 for x in per["logit_nmse"])
    kivi_none = perplexity.evaluate(model, wins, baseline("kivi2"), 0, 0, tmp_path, "t", stride=8)
    kivi_win = perplexity.evaluate(model, wins, baseline("kivi2"), 4, 16, tmp_path, "t", stride=8)
    assert kivi_win["logit_nmse"] < kivi_none["logit_nmse"]


class _Tok:
    """Characters as tokens (enough for greedy decoding on the tiny model)."""

    eos_token_id = None

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) % V for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i % 26) for i in ids)


def test_greedy_matches_generate_for_bf16(model):
    prompt = "some prompt text for the tiny model"
    ids = torch.tensor([[ord(c) % V for c in prompt]])
    model.generation_config.eos_token_id = None
    want = model.generate(ids, past_key_values=DynamicCache(), max_new_tokens=12, do_sample=False, pad_token_id=0)
    got = ruler.greedy(model, _Tok(), prompt, baseline("bf16"), 0, 0, max_new=12)
    assert got == _Tok().decode(want[0, ids.shape[1]:].tolist())
    assert len(ruler.greedy(model, _Tok(), prompt, baseline("kivi2"), 4, 8, max_new=5)) == 5


@pytest.mark.parametrize("sink,recent", [(4, 8), (0, 0)])
def test_serving_view_is_an_engine_with_exact_prefill(model, sink, recent):
    """view="serving": the prompt attends exactly (one-chunk prefill), each generated token reads
    the prompt from codes outside the windows, the same tokens as a serving-style cache fed
    the prompt in one call."""
    cb = random_codebooks(2, 2, 16, config=TaSQConfig(codebook_size_k=16, codebook_size_v=16), seed=4)
    method = TaSQCache(cb).method
    prompt = "a somewhat longer prompt for the tiny model, to leave the windows"
    ids = torch.tensor([[ord(c) % V for c in prompt]])
    cache = QuantizedKVCache(method, sink=sink, recent=recent, fresh_exact=True)
    want = []
    with torch.no_grad():
        logits = model(ids, past_key_values=cache).logits[0, -1]
        for _ in range(8):
            want.append(int(logits.argmax()))
            logits = model(torch.tensor([[want[-1]]]), past_key_values=cache).logits[0, 0]
    got = ruler.greedy(model, _Tok(), prompt, method, sink, recent, max_new=8, view="serving")
    assert got == _Tok().decode(want)
    with pytest.raises(ValueError, match="view"):
        ruler.greedy(model, _Tok(), prompt, method, sink, recent, max_new=1, view="prefill")


def test_cached_skips_done_work(tmp_path, model):
    calls = []
    work = lambda: calls.append(1) or {"x": 1}  # noqa: E731
    assert report.cached(tmp_path / "a.json", work) == {"x": 1}
    assert report.cached(tmp_path / "a.json", work) == {"x": 1} and len(calls) == 1
    cfg = SimpleNamespace(ppl_windows=1, ood_windows=1, ppl_len=16, kl_stride=4)
    ctx = SimpleNamespace(cfg=cfg, methods={"bf16": baseline("bf16")}, run_dir=tmp_path, model=model,
                          tok=None, log=lambda s: None)
    item = tmp_path / "items" / "perplexity" / "wiki__bf16__none.json"
    report.write_json(item, {"ppl": 3.0})
    out = perplexity.run(ctx, domains=("wiki",))  # would need a tokenizer and corpus if it ran
    assert out["wiki"]["bf16"] == {"none": {"ppl": 3.0}, "64+256": {"ppl": 3.0}}


def test_method_names():
    assert M.parse("kivi2").closed_form == "kivi2" and M.parse("tasq").artifact_name == "tasq"
    s = M.parse("tasq_no_grouping")
    assert s.artifact_name == "tasq_no_grouping" and s.expected_config()["grouping"] == "contiguous"
    assert "--ablation" in s.calibrate_argv("m", "fast", "out")
    r = M.parse("cq@g4k256")
    assert r.artifact_name == "cq_g4k256" and r.expected_config()["weighting"] == "none"
    assert M.parse("tasq@g8k1024").artifact_name == "tasq" == M.parse("tasq@g8k1024/g8k1024").artifact_name
    split = M.parse("tasq@g4k256/g8k512")  # keys / values at their own rates
    assert split.artifact_name == "tasq_g4k256_g8k512" and M.parse("tasq@g4k256/g4k256").artifact_name == "tasq_g4k256"
    assert {k: split.expected_config()[k] for k in ("group_size_k", "codebook_size_k", "group_size_v", "codebook_size_v")} \
        == {"group_size_k": 4, "codebook_size_k": 256, "group_size_v": 8, "codebook_size_v": 512}
    argv = split.calibrate_argv("m", "default", "out")
    assert argv[argv.index("--codebook-size-k") + 1] == "256" and argv[argv.index("--codebook-size-v") + 1] == "512"
    assert "--group-size" not in argv
    assert M.parse("cq").expected_config()["grouping"] == "channels" and M.parse("cq").expected_config()["fisher"]
    cp = M.parse("cq_pairs")
    assert cp.expected_config()["grouping"] == "contiguous" and not cp.expected_config()["fisher"]
    assert cp.calibrate_argv("m", "fast", "out")[cp.calibrate_argv("m", "fast", "out").index("--method") + 1] == "cq_pairs"
    ko = M.parse("tasq_keys_only")
    assert ko.artifact_name == "tasq" and not ko.values
    tp = M.parse("tasq_tp3")
    assert tp.artifact_name == "tasq_tp3" and tp.expected_config()["scale_groups"] == 3
    argv = tp.calibrate_argv("m", "default", "out")
    assert argv[argv.index("--tp") + 1] == "3" and "scale_groups" not in M.parse("tasq").expected_config()
    assert M.parse_windows("none") == (0, 0) and M.parse_windows("64+256") == (64, 256)
    for bad in ("tasq_nope", "tasq_tp1"):
        with pytest.raises(ValueError, match="allowed"):
            M.parse(bad)
    with pytest.raises(ValueError, match="SINK"):
        M.parse_windows("64")
    cb = random_codebooks(1, 3, 64, config=TaSQConfig())
    built = TaSQCache(cb).method
    assert M.bits(built, 3, 64) == (1.3333, 1.25) and M.bits(baseline("kivi2"), 3, 64) == (3.0, 3.0)


def test_report_files(tmp_path):
    lay = {"ppl": 10.0, "logit_nmse": 0.01, "attn_kl": 0.02, "token_kl": 0.03, "top1_agree": 0.9,
           "layer_nmse": [0.01, 0.02]}
    ppl = {"wiki": {m: {s: {**lay, "ppl": p} for s in report.SETTINGS} for m, p in
                    (("bf16", 10.0), ("cq", 12.0), ("tasq", 10.5), ("tasq_no_fisher", 10.7))},
           "ood": {"bf16": {"none": {"ppl": 5.0}}}}
    r = {"tasks": {"niah_single_1": 100.0, "niah_single_2": 50.0}, "avg": 75.0}
    nia = {m: {s: {"1024": r, "2048": r} for s in report.SETTINGS} for m in ("bf16", "tasq")}
    bits = {"bf16": (16.0, 16.0), "cq": (1.25, 1.25), "tasq": (1.333, 1.25), "tasq_no_fisher": (1.333, 1.25)}
    rows = report.summary_rows(list(bits), bits, ppl, nia)
    assert len(rows) == 8 and rows[0]["niah"] == {"1024": 75.0, "2048": 75.0} and rows[0]["ppl_ood"] == 5.0
    tg = {t["target"]: t["met"] for t in report.targets(rows)}
    assert tg["TaSQ PPL increase <= half of CQ's (windows none)"] is True
    assert tg["TaSQ PPL <= 1.10x bf16 with windows"] is True
    assert tg["TaSQ NIAH with windows >= 95% of bf16 at every length"] is True
    assert tg["tasq_no_fisher worse than TaSQ (windows 64+256)"] is True
    assert "grouping is the largest single contributor (PPL, windows none)" not in tg  # no grouping row
    abl = {**ppl["wiki"], "tasq_no_grouping": {"none": {"ppl": 10.6}}}
    got = report.targets(report.summary_rows([*bits, "tasq_no_grouping"], {**bits, "tasq_no_grouping": (1.3, 1.25)},
                                             {**ppl, "wiki": abl}, nia))
    top = next(t for t in got if t["target"].startswith("grouping"))
    assert top["met"] is False and top["value"] == "no_fisher +0.20, no_grouping +0.10"
    pos = {"tasq": {"none": {"bucket": 512, "token_kl_by_pos": [0.1, 0.2], "bucket_nmse": [0.01, 0.02]}}}
    sweep = [{"base": "tasq", "windows": "none", "bits_k": b, "bits_v": b, "ppl": 20 - b, "method": "x", "g": 8,
              "K": 16, "logit_nmse": 0.1} for b in (0.5, 1.0)]
    made = report.plots(tmp_path, ppl, nia, pos, sweep, 10.0)
    assert sorted(made) == ["error_by_position.png", "layer_nmse.png", "niah.png", "rate_vs_ppl.png"]
    assert all((tmp_path / f).stat().st_size > 1000 for f in made)
    md = report.markdown(rows, report.targets(rows), nia, sweep, "# t")
    assert "| tasq | 64+256 |" in md and "NIAH 2048" in md
    json.dumps(rows)


def test_config_cli_and_folder_name():
    from bench import quality as Q

    cfg, _ = Q.parse_args(["--quick", "--artifact", "tasq=artifacts/x", "--niah-lengths", "1024"])
    assert cfg.quick and cfg.methods == ("bf16", "cq", "tasq") and cfg.niah_lengths == (1024,)
    same, _ = Q.parse_args(["--quick", "--niah-lengths", "1024"])
    assert cfg.name() == same.name() and cfg.name().startswith("smollm2-135m_quick_fast_")  # artifact paths: same results
    assert Q.parse_args(["--quick", "--ppl-windows", "3"])[0].name() != cfg.name()
    with pytest.raises(ValueError, match="allowed"):
        Q.QualityConfig(methods=("bf16", "nope"))
    # where the question sits: the default keeps earlier run names, "first" is a run of its own
    first, _ = Q.parse_args(["--quick", "--niah-lengths", "1024", "--niah-question", "first"])
    assert first.niah_question == "first" and first.name() != cfg.name()
    assert Q.parse_args(["--quick", "--niah-lengths", "1024", "--niah-question", "last"])[0].name() == cfg.name()
    with pytest.raises(ValueError, match="niah_question"):
        Q.QualityConfig(niah_question="middle")


def test_method_lists_keep_layer_mixes_whole():
    from bench import quality as Q

    mix = "tasq+tasq@g4k256/g8k1024@L17,18,21,23"
    assert M.split_names(f"bf16,{mix},tasq") == ("bf16", mix, "tasq")
    assert M.split_names(f"{mix}") == (mix,)
    cfg, _ = Q.parse_args(["--methods", f"bf16,{mix}", "--niah-methods", mix, "--benches", "perplexity"])
    assert cfg.methods == ("bf16", mix) and cfg.niah_methods == (mix,)
    with pytest.raises(SystemExit, match="'18'"):  # a number that is no mix's layer is still refused
        Q.parse_args(["--methods", "bf16,18"])


def test_headline_only_from_perplexity_runs():
    from bench.quality import QualityConfig, replaces_headline

    full = [{"method": "bf16", "quick": False}]
    assert replaces_headline(QualityConfig(), None)
    assert replaces_headline(QualityConfig(), full)
    assert not replaces_headline(QualityConfig(quick=True), full)
    assert replaces_headline(QualityConfig(quick=True), [{"method": "bf16", "quick": True}])
    assert not replaces_headline(QualityConfig(benches=("rate_sweep",)), None)
    assert not replaces_headline(QualityConfig(benches=("positions", "ruler")), full)


def test_results_resume_only_with_the_same_artifacts(tmp_path):
    from bench import quality as Q

    Q.check_artifacts(tmp_path, {"tasq": "a" * 64})
    Q.check_artifacts(tmp_path, {"tasq": "a" * 64, "cq": "b" * 64})  # a new artifact name is added
    with pytest.raises(ValueError, match="computed with other artifacts"):
        Q.check_artifacts(tmp_path, {"tasq": "c" * 64})


def test_an_artifact_served_otherwise_is_another_artifact(tmp_path):
    """Two artifacts with the same tensors but other serving settings (``calibrate serving``:
    salient tokens, fp8 exact copies) have other ids, so a run folder refuses to mix their items;
    the default settings keep the bare tensors sha256 (earlier run folders stay valid)."""
    import dataclasses

    from bench import methods as M
    from bench import quality as Q
    from sglang_tasq.artifact import ModelFingerprint, save_artifact
    from sglang_tasq.config import TaSQConfig
    from sglang_tasq.testing import random_codebooks

    cb = random_codebooks(2, 2, 16, config=TaSQConfig(codebook_size_k=16, codebook_size_v=16), seed=1)
    fp = ModelFingerprint(architecture="LlamaForCausalLM", num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=16,
                          rope_theta=10000.0, rope_scaling=None)
    cal = {"corpus": "random", "tokens": 0, "seed": 1, "wall_time_s": 0.0}
    ids = {}
    for name, change in (("plain", {}), ("salient", dict(salient_budget=3, salient_block=16, salient_layer=1,
                                                          salient_after=4, recent_window=64)),
                         ("salient8", dict(salient_budget=3, salient_block=16, salient_layer=1, salient_after=4,
                                           recent_window=64, exact_format="fp8"))):
        art = save_artifact(tmp_path / name, dataclasses.replace(cb, config=dataclasses.replace(cb.config, **change)),
                            fp, calibration=cal).parent
        ids[name] = M.artifact_sha(art)
    tensors = ids["plain"]
    assert len(tensors) == 64 and "+" not in tensors
    assert ids["salient"].startswith(tensors + "+serving:") and ids["salient8"].startswith(tensors + "+serving:")
    assert ids["salient"] != ids["salient8"]
    Q.check_artifacts(tmp_path / "run", {"tasq": ids["salient"]})
    with pytest.raises(ValueError, match=r"\+serving:"):
        Q.check_artifacts(tmp_path / "run", {"tasq": ids["salient8"]})
