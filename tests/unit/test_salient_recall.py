"""bench.salient_recall: the needle's value tokens are found in the prompt, the selection it
scores is the one the decode view keeps for generation, and the summary splits by recall."""
import torch
from _support import tiny_decode_view_llama

from bench import attention_error as ae
from bench import salient_recall as SR
from bench.retrieval import Point
from sglang_tasq.config import TaSQConfig
from sglang_tasq.hf.cache import TaSQCache
from sglang_tasq.testing import random_codebooks

PROMPT = ("Some words first, then filler text that goes on. One of the special magic numbers for "
          "quiet-lake is: 7305521. More filler follows here, and again 7305521 appears once more. "
          "What is the special magic number for quiet-lake? The number is")


def test_gold_positions_cover_exactly_the_value(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = tok(PROMPT, add_special_tokens=False)["input_ids"]
    pos = SR.gold_positions(tok, PROMPT, ["7305521"], len(ids))
    first = [p for p in pos if p < pos[0] + 8 and all(q in pos for q in range(pos[0], p + 1))]
    assert "7305521" in tok.decode([ids[p] for p in first])
    assert "7305521" not in tok.decode([ids[p] for p in first[1:]])  # no token of the value left out
    assert len(pos) > len(first)  # both occurrences
    assert SR.gold_positions(tok, PROMPT, ["7305521"], pos[0]) == []  # before the end only
    assert SR.gold_positions(tok, PROMPT, ["no such value"], len(ids)) == []


def test_selection_scores_the_set_generation_reads(smollm2_tokenizer):
    tok = smollm2_tokenizer
    model = tiny_decode_view_llama(len(tok))
    cb = random_codebooks(2, 2, 16, config=TaSQConfig(codebook_size_k=16, codebook_size_v=16), seed=5)
    method = TaSQCache(cb).method
    point = Point.parse("tasq:4+8:S6")
    sample = {"task": "niah_single_1", "index": 0, "prompt": PROMPT, "outputs": ["7305521"]}
    rec = SR.selection(model, tok, method, point, sample)
    ids = torch.tensor(tok(PROMPT, add_special_tokens=False)["input_ids"])
    assert rec["T"] == len(ids) and rec["gold_candidates"] > 0
    # the decode view, as a retrieval run drives it: prompt, then one generated token
    probe = ae.Probe(ae.ProbeCache(method), 4, 8, salient=point.salient(), select_at=len(ids))
    with torch.no_grad(), ae.active(probe):
        model.model(input_ids=ids[None], past_key_values=probe.cache, use_cache=True)
        model.model(input_ids=ids[-1:][None], past_key_values=probe.cache, use_cache=True)
    kept = set(probe.kept[0][0].tolist())
    assert rec["kept"] == sorted(kept) and len(kept) == 6
    gold = [p for p in SR.gold_positions(tok, PROMPT, ["7305521"], len(ids)) if 4 <= p < len(ids) - 8]
    assert rec["recall"] == sum(p in kept for p in gold) / len(gold)
    assert (rec["best_rank"] < 6) == any(p in kept for p in gold)


def test_summary_splits_retrieval_by_recall():
    recs = [{"task": "a", "index": 0, "recall": 1.0, "best_rank": 0},
            {"task": "a", "index": 1, "recall": 0.5, "best_rank": 3},
            {"task": "b", "index": 0, "recall": 0.0, "best_rank": 40},
            {"task": "b", "index": 1, "recall": None, "best_rank": None}]
    point = {("a", 0): 100.0, ("a", 1): 0.0, ("b", 0): 50.0, ("b", 1): 100.0}
    base = {("a", 0): 0.0, ("a", 1): 0.0, ("b", 0): 100.0, ("b", 1): 100.0}
    s = SR.summarize(recs, point, base, budget=4)
    assert (s["samples"], s["scored"], s["needle_in_windows"], s["all_kept"]) == (4, 3, 1, 1)
    assert s["recall_pct"]["mean"] == 50.0 and s["median_best_rank"] == 3 and s["best_in_budget"] == 2
    assert s["niah_point_all_kept"] == {"mean": 100.0, "n": 1} and s["niah_base_all_kept"] == {"mean": 0.0, "n": 1}
    assert s["niah_point_missed"] == {"mean": 25.0, "n": 2} and s["niah_base_missed"] == {"mean": 50.0, "n": 2}
    assert "| 1/3 |" in SR.table([{"point": "p", "length": 1024, "summary": s}])
