"""The simulator's tokenizer, chat template and answer generator. Pure: no I/O.

Tokenizer. A token is one match of ``TOKEN_RE``: a word (a run of ``\\w`` characters) with at
most one leading space, one punctuation character with at most one leading space, or a run of
whitespace. Every character falls in exactly one token, so ``"".join(tokenize(s)) == s`` and the
count of a text never depends on anything but its characters (no vocabulary, no merges).

Chat template (Qwen-like). Each message is two fixed header tokens, its content tokenized on
its own, and one fixed footer token; the prompt ends with a fixed six-token generation prompt::

    "<|im_start|>" "{role}\\n" <content tokens> "<|im_end|>\\n"      per message
    "<|im_start|>" "assistant\\n" "<think>" "\\n\\n" "</think>" "\\n\\n"   generation prompt

Because the fixed tokens are separate from the content tokens, a message's token count is
``2 + len(tokenize(content)) + 1`` whatever its neighbours are.

Snapshot places this module reports (the cache module decides which are stored):

- ``system_end``: the end of ``messages[0]`` when it is a system/developer message;
- ``last_message_start``: where the last message begins;
- ``history_end``: the end of the last message's content, i.e. ``HISTORY_TAIL`` = 7 fixed tokens
  (its footer and the generation prompt) before the prompt end.

That is what produces the measured Flash shapes from the template alone: an identical repeat
resumes at ``history_end`` (all but 7 tokens); the same system bytes with a new
``prefixreg.core.prefix.fresh_tail()`` user message (whose content is always 10 tokens:
``prefixreg`` `` resume`` `` check`` `` <hex>`` ``.`` `` Reply`` `` with`` `` one`` `` word`` ``.``)
resume at ``system_end``: 2 + 10 + 1 + 6 = 19 tokens before the end.

``/v1/completions`` prompts are tokenized raw (no template); their ``history_end`` is also
``HISTORY_TAIL`` tokens before the end, so one rule covers both routes.

The answer is a fixed-length word sequence chosen by hashing the prompt tokens, so the output
(and its sha256) is a pure function of the prompt and the token budget.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "GENERATION_PROMPT",
    "HISTORY_TAIL",
    "TEMPLATE_SHA256",
    "TOKEN_RE",
    "RenderedPrompt",
    "answer_tokens",
    "render_chat",
    "render_completion",
    "tokenize",
]

TOKEN_RE = re.compile(r" ?\w+| ?[^\w\s]|\s+")

IM_START = "<|im_start|>"
IM_END = "<|im_end|>\n"
GENERATION_PROMPT: tuple[str, ...] = (
    IM_START,
    "assistant\n",
    "<think>",
    "\n\n",
    "</think>",
    "\n\n",
)
# Footer of the last message plus the generation prompt: the tokens after `history_end`.
HISTORY_TAIL = 1 + len(GENERATION_PROMPT)

SYSTEM_ROLES = frozenset({"system", "developer"})

# What identifies this template; published as /health `chat_template.sha256`, so a change of
# tokenizer or template changes the build identity prefixreg records.
_TEMPLATE_SPEC = (
    f"prefixreg.sim template v1\ntoken_re={TOKEN_RE.pattern}\n"
    f"message={IM_START!r} '{{role}}\\n' content {IM_END!r}\n"
    f"generation={GENERATION_PROMPT!r}\n"
)
TEMPLATE_SHA256 = hashlib.sha256(_TEMPLATE_SPEC.encode("utf-8")).hexdigest()

_WORDS = (
    "amber", "basalt", "cedar", "delta", "ember", "fjord", "garnet", "harbor",
    "indigo", "juniper", "kelp", "lumen", "marble", "nectar", "onyx", "pollen",
    "quartz", "raven", "sable", "tundra", "umber", "velvet", "willow", "xenon",
    "yarrow", "zephyr", "acorn", "birch", "cobalt", "dune", "echo", "fern",
    "glacier", "heron", "iris", "jade", "kestrel", "lichen", "maple", "nimbus",
    "orchid", "pebble", "quill", "reef", "slate", "thistle", "upland", "vale",
    "wren", "yew", "zinc", "aspen", "bramble", "cinder", "drift", "elm",
    "flint", "grove", "hazel", "inlet", "jasper", "knoll", "larch", "moss",
)  # fmt: skip


def tokenize(text: str) -> list[str]:
    """Split `text` into tokens; the tokens concatenate back to `text` exactly."""
    return TOKEN_RE.findall(text)


@dataclass(frozen=True, slots=True)
class RenderedPrompt:
    """A prompt as the engine sees it: its tokens and the places a snapshot may be taken.

    Places are token counts from the start (a snapshot at place p holds tokens[:p]).
    """

    tokens: tuple[str, ...]
    system_end: int | None
    last_message_start: int | None
    history_end: int

    @property
    def n(self) -> int:
        return len(self.tokens)

    def digest(self) -> bytes:
        """sha256 over the tokens with a separator, so boundaries count, not only the text."""
        h = hashlib.sha256()
        for token in self.tokens:
            h.update(token.encode("utf-8"))
            h.update(b"\x1f")
        return h.digest()


def render_chat(messages: Sequence[tuple[str, str]]) -> RenderedPrompt:
    """Render (role, content) pairs through the template (see the module docstring)."""
    tokens: list[str] = []
    system_end: int | None = None
    last_start: int | None = None
    for index, (role, content) in enumerate(messages):
        last_start = len(tokens)
        tokens.append(IM_START)
        tokens.append(f"{role}\n")
        tokens.extend(tokenize(content))
        tokens.append(IM_END)
        if index == 0 and role in SYSTEM_ROLES:
            system_end = len(tokens)
    tokens.extend(GENERATION_PROMPT)
    return RenderedPrompt(
        tokens=tuple(tokens),
        system_end=system_end,
        last_message_start=last_start,
        history_end=max(len(tokens) - HISTORY_TAIL, 0),
    )


def render_completion(prompt: str) -> RenderedPrompt:
    """A raw `/v1/completions` prompt: no template, no system place."""
    tokens = tuple(tokenize(prompt))
    return RenderedPrompt(
        tokens=tokens,
        system_end=None,
        last_message_start=None,
        history_end=max(len(tokens) - HISTORY_TAIL, 0),
    )


def answer_tokens(prompt: RenderedPrompt, length: int) -> list[str]:
    """The deterministic answer: `length` tokens (words, then a final "."), chosen by hash.

    Each token is one token of `tokenize` (a word with a leading space, or "."), so
    re-tokenizing the joined answer gives the same count.
    """
    if length <= 0:
        return []
    stream = hashlib.shake_256(prompt.digest()).digest(length)
    words = [_WORDS[b % len(_WORDS)] for b in stream[: length - 1]]
    out = [(" " if i else "") + (w.capitalize() if i == 0 else w) for i, w in enumerate(words)]
    out.append(".")
    return out
