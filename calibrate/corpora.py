"""Offline calibration corpora with a fixed train/held-out split, as HF ``datasets``.

Owns two corpora, built from files already on the machine (or fetched from PyPI once) and
cached as JSONL + Arrow under ``cache_dir("corpora")``:

* ``wiki``: the English Wikipedia dump excerpt shipped in the ``gensim==4.4.0`` wheel
  (``gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2``,
  206 pages). Main-namespace articles only; redirects and pages under 500 characters after
  cleaning are skipped. Wiki markup is removed by ``clean_wikitext`` (templates and tables,
  nested; refs, comments, html tags; file/category/interlanguage links; link targets become
  their labels; bold/italic quotes; headings kept as plain lines) and each article is cut at
  its first trailing-matter heading (References, See also, External links, ...).
  gensim itself is never imported. Wikipedia text is CC BY-SA.
* ``code``: the running interpreter's standard-library ``.py`` sources, one document per
  file, sorted by relative path; ``test``/``tests``/``idlelib``/``site-packages``/
  ``__phello__`` and ``pydoc_data`` (a generated text blob) directories and empty files skipped.

Split rule (fixed): a document is held out iff ``int(sha1(key).hexdigest(), 16) % 5 == 0``,
key = article title / posix relative path (utf-8), i.e. ~20%, else it is train. With ``% 10``
the wiki held-out set would be only 9 articles (346K chars, 73K tokens, 35 windows): enough
windows, but too few topics for a perplexity estimate; ``% 5`` gives 24 articles.

Measured with ``python -m calibrate.corpora --tokenizer <SmolLM2-135M dir>`` (Python 3.11.7;
tokens include one eos separator per document):
  wiki  train     80 docs   2,130,687 chars    477,038 tokens
  wiki  heldout   24 docs     673,515 chars    147,419 tokens  (71 windows of 2048)
  code  train    537 docs   8,621,975 chars  2,472,273 tokens
  code  heldout  131 docs   1,974,721 chars    586,517 tokens
Building both from scratch takes ~3 s; later loads read the cached JSONL/Arrow.

API: ``load_corpus(name, split)`` -> ``datasets.Dataset`` (columns ``title``, ``text``);
``token_windows(tokenizer, name, split, window_len, max_tokens)`` -> LongTensor
``[n_windows, window_len]``. Bump ``CORPUS_VERSION`` whenever the cleaning or the split
changes: it is part of the cache key.
"""
from __future__ import annotations

import argparse
import bz2
import hashlib
import html
import importlib.util
import json
import os
import re
import subprocess
import sys
import sysconfig
import tempfile
import zipfile
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Iterator, Optional

from sglang_tasq.options import default_env
from sglang_tasq.paths import cache_dir

CORPUS_VERSION = "v1"
CORPORA = ("wiki", "code")
SPLITS = ("train", "heldout")
HELDOUT_MOD = 5
MIN_ARTICLE_CHARS = 500
GENSIM_PIN = "gensim==4.4.0"
WIKI_MEMBER = ("gensim/test/test_data/"
               "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2")
CODE_EXCLUDED_DIRS = {"test", "tests", "idlelib", "site-packages", "pydoc_data", "__phello__",
                      "__pycache__"}
_TRAILING_SECTIONS = {"references", "external links", "see also", "further reading", "notes",
                      "footnotes", "bibliography", "sources", "citations", "notes and references"}


# ----------------------------------------------------------------------------- cleaning
def _line_start(text: str, k: int) -> bool:
    return not text[text.rfind("\n", 0, k) + 1:k].strip()


_NEST = re.compile(r"\{\{|\}\}|\{\||\|\}")


def _strip_nested(text: str) -> str:
    """Drop ``{{templates}}`` and ``{| tables |}`` (at line starts), any nesting; an unclosed
    one eats the rest of the text; a stray ``}}`` is dropped."""
    out, stack, pos, i = [], [], 0, 0
    while (m := _NEST.search(text, i)) is not None:
        tok, top, i = m.group(), (stack[-1] if stack else None), m.end()
        if tok == "{{" or (tok == "{|" and _line_start(text, m.start())):
            if not stack:
                out.append(text[pos:m.start()])
            stack.append(tok)
        elif (tok == "}}" and top == "{{") or (tok == "|}" and top == "{|"
                                                and _line_start(text, m.start())):
            stack.pop()
            if not stack:
                pos = i
        elif tok == "}}" and top is None:
            out.append(text[pos:m.start()])
            pos = i
        elif tok == "|}":
            i = m.start() + 1  # e.g. '|}}' closing a template: rescan from the '}'
    if not stack:
        out.append(text[pos:])
    return "".join(out)


_DROP_LINK = re.compile(r"\s*(?:(?i:file|image|media|category)|[a-z]{2,3}(?:-[a-z]+)?)\s*:")
_LINK = re.compile(r"\[\[((?:\[[^\[\]]*\]|(?!\[\[|\]\]).){0,3000})\]\]", re.S)  # innermost first


def _link(m: re.Match) -> str:
    target, _, label = m.group(1).partition("|")
    if _DROP_LINK.match(target):  # '[[:Category:X]]' (leading colon) is an ordinary link
        return ""
    if "|" in label:  # [[a|b|c]] (leftover file options): the caption is last
        label = label.rsplit("|", 1)[1]
    return (label or target).strip().lstrip(":")


def clean_wikitext(text: str) -> str:
    """Wiki markup -> plain prose (see the module docstring for what is removed)."""
    text = re.sub(r"<!--.*?(-->|$)", "", text, flags=re.S)
    text = re.sub(r"<ref[^>]*/>", "", text, flags=re.I)
    text = re.sub(r"<ref[^>]*>.*?</ref\s*>", "", text, flags=re.I | re.S)
    text = re.sub(r"<(math|gallery|timeline|imagemap|score|chem)\b[^>]*>.*?</\1\s*>", "",
                  text, flags=re.I | re.S)
    text = _strip_nested(text)
    prev = None
    while prev != text:  # innermost [[links]] first, so captions with links resolve
        prev, text = text, _LINK.sub(_link, text)
    text = re.sub(r"\[(?:https?:|ftp:|//)[^\s\]]*\s*([^\]]*)\]", r"\1", text)
    text = re.sub(r"<br\s*/?>", "\n", text, flags=re.I)
    text = re.sub(r"</?[a-zA-Z][^>]*>", "", text)
    text = re.sub(r"'{2,}", "", text)
    text = re.sub(r"__[A-Z]+__", "", text)
    text = html.unescape(text).replace("\xa0", " ")
    lines = []
    for line in text.split("\n"):
        line = line.strip()
        heading = re.fullmatch(r"(=+)\s*(.*?)\s*\1", line)
        if heading:
            if heading.group(2).lower() in _TRAILING_SECTIONS:
                break
            line = heading.group(2)
        line = re.sub(r"^[*#:;]+\s*", "", line)
        line = re.sub(r"[ \t]{2,}", " ", line)
        line = re.sub(r"\(\s*[,;]?\s*\)", "", line)  # "( )" left by removed templates
        lines.append(line)
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


# ----------------------------------------------------------------------------- sources
def _wiki_bytes() -> bytes:
    spec = importlib.util.find_spec("gensim")
    for loc in (spec.submodule_search_locations or []) if spec else []:
        path = Path(loc).parent / WIKI_MEMBER
        if path.is_file():
            return path.read_bytes()
    with tempfile.TemporaryDirectory() as tmp:  # not installed: fetch the wheel once
        r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps",
                            "--only-binary=:all:", "-d", tmp, GENSIM_PIN],
                           capture_output=True, text=True)
        wheels = sorted(Path(tmp).glob("gensim-*.whl"))
        if r.returncode != 0 or not wheels:
            raise FileNotFoundError(f"wiki corpus: {GENSIM_PIN} is not installed and "
                                    f"`pip download` failed:\n{r.stderr[-2000:]}")
        with zipfile.ZipFile(wheels[0]) as z:
            return z.read(WIKI_MEMBER)


def _wiki_docs() -> Iterator[dict]:
    root = ET.fromstring(bz2.decompress(_wiki_bytes()))
    ns = root.tag[: root.tag.index("}") + 1] if root.tag.startswith("{") else ""
    for page in root.iter(f"{ns}page"):
        title, text = page.findtext(f"{ns}title"), page.findtext(f"{ns}revision/{ns}text") or ""
        if (page.findtext(f"{ns}ns") != "0" or page.find(f"{ns}redirect") is not None
                or re.match(r"\s*#redirect", text, re.I)):
            continue
        text = clean_wikitext(text)
        if len(text) >= MIN_ARTICLE_CHARS:
            yield {"title": title, "text": text}


def _code_docs() -> Iterator[dict]:
    root = Path(sysconfig.get_paths()["stdlib"])
    rels = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.py")
                  if not CODE_EXCLUDED_DIRS & set(p.relative_to(root).parts[:-1]))
    for rel in rels:
        try:
            text = (root / rel).read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            yield {"title": rel, "text": text}


def split_of(key: str) -> str:
    """The fixed split rule: sha1(key) mod HELDOUT_MOD == 0 -> 'heldout', else 'train'."""
    h = int(hashlib.sha1(key.encode("utf-8")).hexdigest(), 16)
    return "heldout" if h % HELDOUT_MOD == 0 else "train"


# ----------------------------------------------------------------------------- cache + API
def _check(name: str, split: str) -> None:
    if name not in CORPORA:
        raise ValueError(f"unknown corpus {name!r}: expected one of {CORPORA}")
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}: expected one of {SPLITS}")


def _corpus_dir(name: str) -> Path:
    key = f"{name}-{CORPUS_VERSION}-mod{HELDOUT_MOD}"
    if name == "code":  # the stdlib differs between interpreters
        key += f"-py{sys.version_info[0]}{sys.version_info[1]}"
    return cache_dir("corpora", key)


def _jsonl(name: str, split: str) -> Path:
    """Parse the source once, write both splits' JSONL atomically; later calls just reuse it."""
    d = _corpus_dir(name)
    paths = {s: d / f"{s}.jsonl" for s in SPLITS}
    if not all(p.is_file() for p in paths.values()):
        docs = _wiki_docs() if name == "wiki" else _code_docs()
        tmps = {s: p.with_name(f"{p.name}.{os.getpid()}.tmp") for s, p in paths.items()}
        files = {s: t.open("w", encoding="utf-8") for s, t in tmps.items()}
        try:
            for doc in docs:
                files[split_of(doc["title"])].write(json.dumps(doc, ensure_ascii=False) + "\n")
        finally:
            for f in files.values():
                f.close()
        for s in SPLITS:
            tmps[s].replace(paths[s])
    return paths[split]


def load_corpus(name: str, split: str):
    """``name`` in {'wiki', 'code'}, ``split`` in {'train', 'heldout'} -> ``datasets.Dataset``
    with columns ``title`` (article title / stdlib relative path) and ``text``."""
    _check(name, split)
    default_env("HF_DATASETS_OFFLINE", "1")  # the corpora are local files: never ask the hub
    import datasets

    path = _jsonl(name, split)
    return datasets.Dataset.from_json(str(path), cache_dir=str(_corpus_dir(name) / "arrow"),
                                      features=datasets.Features({"title": datasets.Value("string"),
                                                                  "text": datasets.Value("string")}))


def token_windows(tokenizer, name: str, split: str, window_len: int = 2048,
                  max_tokens: Optional[int] = None, batch_docs: int = 32):
    """Documents in corpus order, each followed by the eos token (or "\\n\\n" without one),
    tokenized in batches and cut into consecutive non-overlapping ``window_len`` windows.
    ``max_tokens`` caps the tokens used (stops tokenizing early). -> LongTensor [n, window_len]."""
    import torch

    if window_len < 1:
        raise ValueError(f"window_len must be >= 1, got {window_len}")
    ds = load_corpus(name, split)
    eos = tokenizer.eos_token_id
    sep = [eos] if eos is not None else tokenizer("\n\n", add_special_tokens=False)["input_ids"]
    budget = max_tokens if max_tokens is not None else float("inf")
    ids: list = []
    for start in range(0, len(ds), batch_docs):
        if len(ids) >= budget:
            break
        texts = list(ds[start:start + batch_docs]["text"])
        for doc in tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]:
            ids.extend(doc)
            ids.extend(sep)
    usable = int(min(len(ids), budget)) // window_len * window_len
    if usable == 0:
        raise ValueError(f"corpus {name}/{split}: {min(len(ids), budget)} tokens available, "
                         f"fewer than one window of {window_len}")
    return torch.tensor(ids[:usable], dtype=torch.long).view(-1, window_len)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="Build (once) and describe the calibration corpora.")
    ap.add_argument("--tokenizer", help="HF tokenizer directory: also count tokens")
    ap.add_argument("--corpus", choices=CORPORA, action="append", help="default: all")
    args = ap.parse_args(argv)
    import datasets
    datasets.disable_progress_bars()
    tok = None
    if args.tokenizer:
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(args.tokenizer)
    for name in args.corpus or CORPORA:
        for split in SPLITS:
            texts = list(load_corpus(name, split)["text"])
            line = f"{name:5s} {split:8s} {len(texts):6,d} docs {sum(map(len, texts)):12,d} chars"
            if tok is not None:
                ids = tok(texts, add_special_tokens=False, verbose=False)["input_ids"]
                line += f" {sum(map(len, ids)) + len(ids):12,d} tokens (with one separator per doc)"
            print(line, flush=True)


if __name__ == "__main__":
    main()
