"""Offline corpora: the wiki markup cleaner, the fixed split, the cache, token windows.

The corpora are built once for this module into a temporary cache (``TASQ_CACHE``, set for this
module only), so a stale cache never hides a cleaner change; the tokenizer is SmolLM2's, from the
real cache (the ``smollm2_tokenizer`` fixture).
"""
from __future__ import annotations

from pathlib import Path

import pytest

from calibrate import corpora
from calibrate.corpora import clean_wikitext, load_corpus, split_of, token_windows


@pytest.fixture(scope="module", autouse=True)
def tmp_cache(tmp_path_factory, smollm2_dir):
    """A fresh TASQ_CACHE for this module's tests (requests ``smollm2_dir`` first, so the model
    is resolved, or materialized once, in the real cache, not in this temporary one)."""
    root = tmp_path_factory.mktemp("tasq_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TASQ_CACHE", str(root))
        yield root


@pytest.fixture(scope="module")
def wiki():
    return {s: load_corpus("wiki", s) for s in corpora.SPLITS}


@pytest.fixture(scope="module")
def tokenizer(smollm2_tokenizer):
    return smollm2_tokenizer


# ----------------------------------------------------------------------------- cleaner
def test_nested_templates_and_tables_removed():
    s = ("{{Infobox|a={{x|b={{deep}}}}|c=1}}Alpha {{cite|url=y|}} beta.\n"
         "{| class=\"wikitable\"\n|-\n| cell || {{t|}}\n|}\n"
         "{{multi|\n|}}\nGamma.")
    assert clean_wikitext(s) == "Alpha beta.\n\nGamma."


def test_refs_comments_and_html_removed():
    s = ('One<ref name="a">Cite {{cite web|url=x}} [[Foo]]</ref> two<ref name=b/>'
         '<!-- hidden\nacross lines --> three<ref>x</ref>. H<sub>2</sub>O<br />next'
         '<math>x^2</math> &amp; a&nbsp;b')
    assert clean_wikitext(s) == "One two three. H2O\nnext & a b"


def test_links_with_pipes_files_categories_and_external():
    s = ("A [[political philosophy]] of [[stateless society|stateless societies]] and "
         "[[qux]]s. [[File:X.jpg|thumb|A [[b|caption]] with [brackets]]]"
         "[[Category:Things]][[de:Ding]] See [http://example.com the site] [http://bare.org] "
         "and [[:Category:Bar|cats]].")
    assert clean_wikitext(s) == ("A political philosophy of stateless societies and quxs. "
                                 "See the site and cats.")


def test_quotes_headings_lists_and_trailing_sections():
    s = ("'''Bold''' and ''italic'' and '''''both'''''.\n== History ==\n"
         "===Early years===\n* item ''one''\n# numbered\n__TOC__\n"
         "==See also==\n* [[Other]]\n==References==\n{{reflist}}")
    assert clean_wikitext(s) == "Bold and italic and both.\nHistory\nEarly years\nitem one\nnumbered"


# ----------------------------------------------------------------------------- split
def test_split_rule_is_fixed_and_about_a_fifth():
    keys = [f"doc-{i}" for i in range(2000)]
    first = [split_of(k) for k in keys]
    assert first == [split_of(k) for k in keys]
    assert 0.15 < first.count("heldout") / len(keys) < 0.25
    assert split_of("Anarchism") == split_of("Anarchism")


def test_bad_name_or_split_is_a_clear_error():
    with pytest.raises(ValueError, match="wiki"):
        load_corpus("wikitext", "train")
    with pytest.raises(ValueError, match="heldout"):
        load_corpus("wiki", "test")


# ----------------------------------------------------------------------------- wiki / code
def test_wiki_splits_sizes_disjoint_and_follow_the_rule(wiki):
    titles = {s: list(wiki[s]["title"]) for s in corpora.SPLITS}
    assert len(titles["train"]) >= 60 and len(titles["heldout"]) >= 15
    assert not set(titles["train"]) & set(titles["heldout"])
    for s, ts in titles.items():
        assert all(split_of(t) == s for t in ts)
    assert "Anarchism" in titles["train"] + titles["heldout"]
    assert not any(t.lower().startswith("accessiblecomputing") for t in titles["train"])  # redirect
    assert sum(map(len, wiki["heldout"]["text"])) > 300_000


def test_wiki_split_is_deterministic_between_calls(wiki):
    again = load_corpus("wiki", "heldout")
    assert list(again["title"]) == list(wiki["heldout"]["title"])
    assert list(again["text"]) == list(wiki["heldout"]["text"])


def test_wiki_text_has_no_markup_left(wiki):
    for s in corpora.SPLITS:
        for text in wiki[s]["text"]:
            assert len(text) >= corpora.MIN_ARTICLE_CHARS
            for bad in ("{{", "}}", "[[", "]]", "<ref", "</ref", "'''", "&amp;", "<!--"):
                assert bad not in text, (bad, text[:200])


def test_second_load_uses_the_cache(wiki, tmp_cache):
    """A second load reads the split files as they are (same inode and mtime: not parsed and
    written again). The cache key names ``CORPUS_VERSION``, so a bump points at a new directory,
    and a directory without its split files is built from the source."""
    def stamps(files):
        return [(f.stat().st_ino, f.stat().st_mtime_ns) for f in files]

    (key_dir,) = (tmp_cache / "corpora").glob("wiki-*")
    assert key_dir.name.startswith(f"wiki-{corpora.CORPUS_VERSION}-")
    files = [key_dir / f"{s}.jsonl" for s in ("heldout", "train")]
    before = stamps(files)
    assert len(load_corpus("wiki", "train")) == len(wiki["train"])
    assert stamps(files) == before
    files[0].unlink()  # as in a new key's directory: rebuilt, both splits written again
    assert list(load_corpus("wiki", "heldout")["title"]) == list(wiki["heldout"]["title"])
    after = stamps(files)
    assert after[0] != before[0] and after[1] != before[1]


def test_code_corpus_is_the_stdlib_without_tests():
    titles = [t for s in corpora.SPLITS for t in load_corpus("code", s)["title"]]
    assert "json/decoder.py" in titles and "os.py" in titles
    assert len(titles) == len(set(titles)) > 300
    assert not any(set(Path(t).parts[:-1]) & {"test", "tests", "idlelib", "site-packages"}
                   for t in titles)
    code = load_corpus("code", corpora.split_of("json/decoder.py"))
    doc = code[list(code["title"]).index("json/decoder.py")]["text"]
    assert "class JSONDecoder" in doc


# ----------------------------------------------------------------------------- windows
def test_token_windows_shapes_order_and_determinism(tokenizer, wiki):
    w = token_windows(tokenizer, "wiki", "heldout", window_len=2048)
    assert w.dtype.is_floating_point is False and w.shape[1] == 2048 and w.shape[0] >= 16
    first_doc = tokenizer(wiki["heldout"][0]["text"], add_special_tokens=False)["input_ids"]
    assert w.view(-1)[:len(first_doc) + 1].tolist() == first_doc + [tokenizer.eos_token_id]
    assert (w == tokenizer.eos_token_id).sum() >= 16  # one separator per document
    again = token_windows(tokenizer, "wiki", "heldout", window_len=2048, max_tokens=16 * 2048)
    assert again.shape == (16, 2048) and bool((again == w[:16]).all())


def test_token_windows_caps_and_errors(tokenizer):
    w = token_windows(tokenizer, "code", "heldout", window_len=256, max_tokens=1000)
    assert tuple(w.shape) == (3, 256)
    with pytest.raises(ValueError, match="fewer than one window"):
        token_windows(tokenizer, "wiki", "train", window_len=2048, max_tokens=100)
