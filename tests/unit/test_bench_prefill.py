"""bench.prefill's prompts are fixed per length and free of special tokens (the timing itself
is a benchmark run, not a test)."""
from bench import prefill


def test_prompt_ids_are_fixed_per_length_and_skip_special_tokens():
    a, b = prefill.prompt_ids(300), prefill.prompt_ids(300)
    assert a == b and len(a) == 300
    assert min(a) >= 100 and max(a) < 49152
    assert prefill.prompt_ids(301)[:300] != a  # each length its own prompt (no shared radix prefix)
