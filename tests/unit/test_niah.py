"""RULER NIAH generator: exact template strings, haystacks, scoring, and sizing with SmolLM2's
tokenizer (the ``smollm2_tokenizer`` fixture: materialized on first use, never skipped)."""
import re

import numpy as np
import pytest

from bench import niah
from bench.niah import TASKS, generate_samples, make_sample, string_match_all


def test_depths_are_rounded_linspace():
    assert niah.DEPTHS == [int(x) for x in np.round(np.linspace(0, 100, 40))]


def test_single_needle_template_singular():
    s = make_sample(TASKS["niah_single_1"], 10, seed=3)
    (gold,) = s["outputs"]
    m = re.search(r"One of the special magic numbers for (\S+) is: (\d{7})\.", s["input"])
    assert m and m.group(2) == gold
    key = m.group(1)
    assert re.fullmatch(r"[a-z' ]+-[a-zA-Z' ]+", key)
    assert s["input"].startswith(
        "A special magic number is hidden within the following text. Make sure to memorize it. "
        "I will quiz you about the number afterwards.\n" + niah.NOISE + "\n")
    assert s["input"].endswith(f"\nWhat is the special magic number for {key} mentioned in the provided text?")
    assert s["answer_prefix"] == f" The special magic number for {key} mentioned in the provided text is"
    lines = s["input"].split("\n")[1:-1]
    assert len(lines) == 11 and lines.count(niah.NOISE) == 10


def test_multiquery_template_plural():
    s = make_sample(TASKS["niah_multiquery"], 300, seed=0)
    assert s["input"].startswith("Some special magic numbers are hidden within the following text. Make sure "
                                 "to memorize it. I will quiz you about the numbers afterwards.\n")
    q = re.search(r"What are all the special magic numbers for (.+) mentioned in the provided text\?$", s["input"])
    keys = re.split(r", and |, ", q.group(1))
    assert len(keys) == 4 and len(set(keys)) == 4
    assert s["answer_prefix"] == f" The special magic numbers for {q.group(1)} mentioned in the provided text are"
    assert len(s["outputs"]) == 4
    for k, v in zip(keys, s["outputs"]):
        assert f"One of the special magic numbers for {k} is: {v}." in s["input"]


def test_multivalue_and_uuid_tasks():
    s = make_sample(TASKS["niah_multivalue"], 300, seed=1)
    assert len(s["outputs"]) == 4 and "What are all the special magic numbers for" in s["input"]
    assert all(f"is: {v}." in s["input"] for v in s["outputs"])
    u = make_sample(TASKS["niah_multikey_3"], 20, seed=1)
    uuid_re = r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}"
    assert re.fullmatch(uuid_re, u["outputs"][0])
    assert "What is the special magic uuid for " in u["input"]
    lines = u["input"].split("\n")[1:-1]
    assert len(lines) == 21 and all(re.fullmatch(rf"One of the special magic uuids for {uuid_re} is: {uuid_re}\.", x)
                                    for x in lines)


def test_essay_haystack_and_determinism():
    a = make_sample(TASKS["niah_multikey_1"], 2000, seed=7)
    b = make_sample(TASKS["niah_multikey_1"], 2000, seed=7)
    assert a == b
    assert a["input"].count("One of the special magic numbers for") == 4
    assert "\n" not in a["input"].split("\n", 1)[1].rsplit("\n", 1)[0]  # essay context is one paragraph
    assert make_sample(TASKS["niah_multikey_1"], 2000, seed=8) != a


def test_string_match_all_hand_cases():
    assert string_match_all(["The numbers are 1234567 and 7654321."], [["1234567", "7654321"]]) == 100.0
    assert string_match_all(["1234567", "nothing"], [["1234567"], ["7654321"]]) == 50.0
    assert string_match_all(["only 1 and 2"], [["1", "2", "3", "4"]]) == 50.0
    assert string_match_all(["ABC-DEF\x00"], [["abc-def"]]) == 100.0  # case-insensitive
    assert string_match_all([], []) == 0.0
    with pytest.raises(ValueError):
        string_match_all(["a"], [])


@pytest.mark.parametrize("task", sorted(TASKS))
def test_sizes_fit_target_length(smollm2_tokenizer, task):
    tokenizer = smollm2_tokenizer
    fmt = niah.chat_formatter(tokenizer)
    samples = generate_samples(task, tokenizer, 1024, 2, formatter=fmt)
    for s in samples:
        n = niah.count_tokens(tokenizer, s["prompt"])
        assert n == s["length"] and n + niah.TOKENS_TO_GENERATE <= 1024
        assert n >= 0.85 * (1024 - niah.TOKENS_TO_GENERATE)  # the haystack fills the budget
        assert all(g in s["input"] for g in s["outputs"])
        assert s["prompt"].startswith("<|im_start|>system\n")
        assert s["prompt"].endswith("<|im_start|>assistant\n" + s["answer_prefix"].lstrip())


def test_sizes_fit_4k_plain(smollm2_tokenizer):
    (s,) = generate_samples("niah_single_2", smollm2_tokenizer, 4096, 1)
    assert s["prompt"] == s["input"] + s["answer_prefix"]
    assert 0.95 * (4096 - 128) <= s["length"] <= 4096 - 128


@pytest.mark.parametrize("task", ["niah_single_1", "niah_multiquery"])
def test_question_first_moves_only_the_question(task):
    """Question first: the same needles, haystack and key; the question before the haystack and
    nothing after it that names the key (what a selection from the last queries reads)."""
    last = make_sample(TASKS[task], 40, seed=5)
    first = make_sample(TASKS[task], 40, seed=5, question="first")
    assert first["outputs"] == last["outputs"]
    q_last = last["input"].rsplit("\n", 1)[1]
    context = last["input"].split("\n", 1)[1].rsplit("\n", 1)[0]
    head, body = first["input"].split("\n", 1)
    assert body == context + "\nNow answer the question asked before the text."
    key = re.search(r" for (.+) mentioned in the provided text\?$", q_last).group(1)
    assert head.endswith(f"answer this question: {q_last}") and key in head
    tail = body[len(context):] + first["answer_prefix"]
    assert not any(k in tail for k in re.split(r", and |, ", key))
    singular = TASKS[task].num_q * TASKS[task].num_v == 1
    assert first["answer_prefix"] == (" The special magic number asked for is" if singular
                                      else " The special magic numbers asked for are")
    with pytest.raises(ValueError, match="question order"):
        make_sample(TASKS[task], 40, seed=5, question="middle")


def test_question_first_samples_fit_and_say_their_order(smollm2_tokenizer):
    fmt = niah.chat_formatter(smollm2_tokenizer)
    (s,) = generate_samples("niah_multikey_2", smollm2_tokenizer, 1024, 1, formatter=fmt, question="first")
    (r,) = generate_samples("niah_multikey_2", smollm2_tokenizer, 1024, 1, formatter=fmt)
    assert (s["question"], r["question"]) == ("first", "last") and s["outputs"] == r["outputs"]
    assert s["length"] + niah.TOKENS_TO_GENERATE <= 1024 and s["length"] >= 0.85 * (1024 - niah.TOKENS_TO_GENERATE)
    assert s["prompt"].endswith("<|im_start|>assistant\n" + s["answer_prefix"].lstrip())
