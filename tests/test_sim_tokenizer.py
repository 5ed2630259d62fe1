"""The simulator's tokenizer and template: counts are reproducible and give the measured shapes."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixreg.core.prefix import fresh_tail
from prefixreg.sim.cache import PromptCache
from prefixreg.sim.config import SimConfig
from prefixreg.sim.tokenizer import (
    HISTORY_TAIL,
    PLAIN_CHARS,
    answer_tokens,
    render_chat,
    render_completion,
    tokenize,
)
from prefixreg.verbs.probe.options import builtin_corpus, probe_slice
from tests.test_sim_cache import admit

FLASH = SimConfig(counter_lag=0, token_bytes=0)
nonces = st.text(alphabet="0123456789abcdef", min_size=16, max_size=16)


@given(st.text())
def test_tokens_concatenate_back_to_the_text(text: str) -> None:
    assert "".join(tokenize(text)) == text


def test_tokenizer_rules() -> None:
    assert tokenize("Hello, world!  ok\n") == ["Hello", ",", " world", "!", "  ", "ok", "\n"]
    assert tokenize("") == []


@given(nonces)
def test_fresh_tail_is_always_ten_tokens(nonce: str) -> None:
    assert len(tokenize(fresh_tail(nonce))) == 10


def test_message_count_is_fixed_tokens_plus_content() -> None:
    one = render_chat([("system", "a b c")])
    two = render_chat([("system", "a b c"), ("user", "d")])
    # 2 header + 3 content + 1 footer, then a 6-token generation prompt.
    assert one.n == 2 + 3 + 1 + 6
    assert two.n - one.n == 2 + 1 + 1
    assert one.system_end == 6
    assert two.history_end == two.n - HISTORY_TAIL == two.n - 7


@settings(max_examples=60, deadline=None)
@given(system=st.text(min_size=0, max_size=400), n1=nonces, n2=nonces)
def test_repeat_resumes_all_but_7_and_fresh_tail_all_but_19(system: str, n1: str, n2: str) -> None:
    cache = PromptCache(FLASH)
    first = render_chat([("system", system), ("user", fresh_tail(n1))])
    assert admit(cache, first).cached == 0
    assert admit(cache, first).cached == first.n - 7
    fresh = render_chat([("system", system), ("user", fresh_tail(n2))])
    expected = fresh.n - 7 if n1 == n2 else fresh.n - 19
    assert admit(cache, fresh).cached == expected


# The lane's prompt tokens for the probe corpus slices (4k/16k/32k/64k characters).
MEASURED = {4000: 2593, 16000: 11374, 32000: 21337, 64000: 43538}


def probe_prompt(size: int, run_id: str = "0f1e2d3c") -> str:
    corpus = builtin_corpus(64000)
    return probe_slice(corpus, size, header=f"prefixreg probe {run_id} prefix of {size} characters")


@pytest.mark.parametrize("size", sorted(MEASURED))
def test_probe_slices_give_the_lanes_prompt_tokens_within_2_percent(size: int) -> None:
    for run_id in ("0f1e2d3c", "ffffffff"):
        prompt = render_chat([("system", probe_prompt(size, run_id)), ("user", fresh_tail())])
        assert abs(prompt.n / MEASURED[size] - 1) < 0.02, (size, prompt.n)


PROSE = Path(__file__).parent.parent / "examples" / "system-prompt.txt"


def test_english_prose_is_about_four_bytes_a_token_as_the_lane_measured() -> None:
    """The lane counted 788 tokens for a 3,056-byte English system prompt; the probe corpus
    (runs of its own vocabulary) stays dense beside it."""
    data = PROSE.read_bytes()
    assert data.isascii()
    prose = data[:3056].decode("ascii")
    assert abs(len(tokenize(prose)) / 788 - 1) < 0.05
    prompt = render_chat([("system", prose), ("user", fresh_tail())])
    assert abs(prompt.n / 788 - 1) < 0.05  # counted with the template, the same
    assert 3.7 < len(data) / len(tokenize(data.decode("ascii"))) < 4.1


def test_measured_shapes_at_the_measured_sizes() -> None:
    # A2 = prompt - 7 and B = prompt - 19 at every size; Cmax (B at 64k) is 43,519 within 2%.
    for size in (4000, 64000):
        system = probe_prompt(size)
        cache = PromptCache(FLASH)
        warm = render_chat([("system", system), ("user", fresh_tail())])
        admit(cache, warm)
        assert admit(cache, warm).cached == warm.n - 7
        check = render_chat([("system", system), ("user", fresh_tail())])
        b = admit(cache, check).cached
        assert b == check.n - 19
        if size == 64000:
            assert abs(b / 43519 - 1) < 0.02


@settings(max_examples=60, deadline=None)
@given(text=st.text(alphabet="ab c.\n", min_size=0, max_size=600), cut=st.integers(0, 600))
def test_prefix_tokens_are_the_texts_tokens_up_to_the_cut_word(text: str, cut: int) -> None:
    whole, part = tokenize(text), tokenize(text[:cut])
    # Every token of the prefix but the last one (a word the cut may shorten) is a token of
    # the whole text, in the same place.
    assert part[:-1] == whole[: max(len(part) - 1, 0)]


def test_words_are_split_only_after_the_plain_start() -> None:
    text = "x" * PLAIN_CHARS + " repository" * 40
    tokens = tokenize(text)
    assert tokens[0] == "x" * PLAIN_CHARS
    assert len(tokens) > 41  # the calibrated region splits words into pieces
    assert all(len(t.strip()) >= 1 for t in tokens)


def test_answer_is_deterministic_and_retokenizes_to_its_length() -> None:
    a = render_chat([("user", "x")])
    b = render_chat([("user", "y")])
    assert answer_tokens(a, 24) == answer_tokens(a, 24)
    assert answer_tokens(a, 24) != answer_tokens(b, 24)
    # A short answer (inside the plain start of a message) re-tokenizes to its own pieces.
    short = answer_tokens(a, 6)
    assert len("".join(short)) <= PLAIN_CHARS
    assert tokenize("".join(short)) == short
    assert answer_tokens(a, 24)[-1] == "."


def test_completion_prompt_has_no_template() -> None:
    p = render_completion("count the words")
    assert p.tokens == ("count", " the", " words")
    assert p.system_end is None
