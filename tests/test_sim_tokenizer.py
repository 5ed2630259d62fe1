"""The simulator's tokenizer and template: counts are reproducible and give the measured shapes."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from prefixreg.core.prefix import fresh_tail
from prefixreg.sim.cache import CacheModel, PromptCache
from prefixreg.sim.tokenizer import (
    HISTORY_TAIL,
    answer_tokens,
    render_chat,
    render_completion,
    tokenize,
)

FLASH = CacheModel(
    max_entries=8,
    entries_per_request=2,
    align=0,
    partial_resume=False,
    counter_lag=0,
    entry_bytes=1,
)
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
    assert cache.admit(first).cached == 0
    assert cache.admit(first).cached == first.n - 7
    fresh = render_chat([("system", system), ("user", fresh_tail(n2))])
    expected = fresh.n - 7 if n1 == n2 else fresh.n - 19
    assert cache.admit(fresh).cached == expected


def test_measured_prompt_sizes_reproduce_the_measured_counts() -> None:
    # 2,586 of 2,593 and 2,574; 43,531 of 43,538 and 43,519 (Flash lane measurements).
    for prompt_tokens in (2593, 43538):
        system = "alpha" + " beta" * (prompt_tokens - 22 - 1)
        cache = PromptCache(FLASH)
        warm = render_chat([("system", system), ("user", fresh_tail())])
        assert warm.n == prompt_tokens
        cache.admit(warm)
        assert cache.admit(warm).cached == prompt_tokens - 7
        check = render_chat([("system", system), ("user", fresh_tail())])
        assert cache.admit(check).cached == prompt_tokens - 19


def test_answer_is_deterministic_and_retokenizes_to_its_length() -> None:
    a = render_chat([("user", "x")])
    b = render_chat([("user", "y")])
    assert answer_tokens(a, 24) == answer_tokens(a, 24)
    assert answer_tokens(a, 24) != answer_tokens(b, 24)
    assert len(tokenize("".join(answer_tokens(a, 24)))) == 24
    assert answer_tokens(a, 24)[-1] == "."


def test_completion_prompt_has_no_template() -> None:
    p = render_completion("count the words")
    assert p.tokens == ("count", " the", " words")
    assert p.system_end is None
