"""The simulator's tokenizer, chat template and answer generator. Pure: no I/O.

A raw token is one match of ``TOKEN_RE``: a word or one punctuation character, each with at most one
leading space, or a run of whitespace. A word is one token (as English BPE tokenizes prose: about
3.9 bytes a token, the measured lane's 788 tokens for a 3,056-byte English system prompt) except
past a message's first ``PLAIN_CHARS`` characters, where a word of the probe corpus's vocabulary
(``PROBE_WORDS``, any case, over ``SHORT_WORD`` characters) that follows another such word on its
line, no punctuation between, splits into pieces tracking ``DENSITY`` (pieces per word character
by offset): the probe corpus is runs of those words, and the lane's counts for it are dense,
fitted within 0.5% to its 2,593 / 11,374 / 21,337 / 43,538 prompt tokens for the 4k/16k/32k/64k
slices. A word's pieces depend on the text before it only. Invariants: ``"".join(tokenize(s)) ==
s``; a message's tokens depend on its own characters only, and a prefix of a text tokenizes as the
text up to the last word the prefix cuts; a word never splits into more pieces than it has word
characters.

Chat template (Qwen-like): a message is ``IM_START``, ``"{role}\\n"``, its content tokens and
``IM_END``, ``2 + len(tokenize(content)) + 1`` tokens whatever its neighbours; the prompt ends with
the six tokens of ``GENERATION_PROMPT``. Snapshot places: ``system_end`` (end of a system/developer
``messages[0]``), ``last_message_start``, ``history_end`` (``HISTORY_TAIL`` = 7 tokens before the
end, also on `/v1/completions`). So an identical repeat resumes all but 7 tokens, and the same
system bytes with a new ``fresh_tail()`` (10 content tokens) all but 2 + 10 + 1 + 6 = 19.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

from prefixreg.core.probe_words import PROBE_WORDS

TOKEN_RE = re.compile(r" ?\w+| ?[^\w\s]|\s+")

# (first character offset, word pieces per word character from there on), fitted to the lane.
PLAIN_CHARS = 64
DENSITY = ((0, 0.0), (PLAIN_CHARS, 0.8489), (4000, 0.9784), (16000, 0.8471), (32000, 0.9417))
# Words this short stay one token and neither start nor break a run of vocabulary words.
SHORT_WORD = 2
_VOCABULARY = frozenset(PROBE_WORDS)

IM_START = "<|im_start|>"
IM_END = "<|im_end|>\n"
GENERATION_PROMPT = (IM_START, "assistant\n", "<think>", "\n\n", "</think>", "\n\n")
# Footer of the last message plus the generation prompt: the tokens after `history_end`.
HISTORY_TAIL = 1 + len(GENERATION_PROMPT)

# Published as /health `chat_template.sha256`: a new tokenizer or template is a new build.
_TEMPLATE_SPEC = (
    f"prefixreg.sim template v3\ntoken_re={TOKEN_RE.pattern}\ndensity={DENSITY!r}\n"
    f"dense=runs of {sorted(_VOCABULARY)!r} over {SHORT_WORD} characters\n"
    f"message={IM_START!r} '{{role}}\\n' content {IM_END!r}\n"
    f"generation={GENERATION_PROMPT!r}\n"
)
TEMPLATE_SHA256 = hashlib.sha256(_TEMPLATE_SPEC.encode("utf-8")).hexdigest()

_WORDS = (
    "amber", "basalt", "cedar", "delta", "ember", "fjord", "garnet", "harbor", "indigo", "juniper",
    "kelp", "lumen", "marble", "nectar", "onyx", "pollen", "quartz", "raven", "sable", "tundra",
    "umber", "velvet", "willow", "xenon", "yarrow", "zephyr", "acorn", "birch", "cobalt", "dune",
    "echo", "fern", "glacier", "heron", "iris", "jade", "kestrel", "lichen", "maple", "nimbus",
    "orchid", "pebble", "quill", "reef", "slate", "thistle", "upland", "vale", "wren", "yew",
    "zinc", "aspen", "bramble", "cinder", "drift", "elm", "flint", "grove", "hazel", "inlet",
    "jasper", "knoll", "larch", "moss",
)  # fmt: skip


def _split(token: str, pieces: int) -> list[str]:
    """A word (maybe space-led) in `pieces` near-equal parts, each with a word character."""
    lead = int(token[0] == " ")
    size = len(token) - lead
    pieces = min(pieces, size)
    cuts = [0] + [lead + (i * size + pieces // 2) // pieces for i in range(1, pieces + 1)]
    return [token[a:b] for a, b in pairwise(cuts)]


def tokenize(text: str) -> list[str]:
    """Raw tokens; a vocabulary word in a run splits so the running count of pieces follows
    ``DENSITY`` (the module docstring)."""
    if len(text) <= PLAIN_CHARS:
        return TOKEN_RE.findall(text)
    out: list[str] = []
    target, emitted = 0.0, 0  # word pieces asked for and given so far (calibrated region)
    run = 0  # vocabulary words in a row on this line, this one included
    for match in TOKEN_RE.finditer(text):
        token, start = match.group(), match.start()
        word = token[1:] if token[0] == " " else token
        if not (token[-1].isalnum() or token[-1] == "_"):
            run = 0 if token.strip() or "\n" in token else run  # a break or a sign ends a run
            out.append(token)
            continue
        if len(word) > SHORT_WORD:
            run = run + 1 if word.lower() in _VOCABULARY else 0
        density = next(d for first, d in reversed(DENSITY) if start >= first)
        if density <= 0 or run < 2 or len(word) <= SHORT_WORD:
            out.append(token)
            continue
        target += len(word) * density
        parts = _split(token, max(round(target - emitted), 1))
        emitted += len(parts)
        out.extend(parts)
    return out


def token_digest(tokens: Sequence[str]) -> bytes:
    """sha256 over the tokens, each followed by a 0x1f separator (so boundaries count)."""
    return hashlib.sha256(("\x1f".join(tokens) + "\x1f").encode("utf-8")).digest()


@dataclass(frozen=True, slots=True)
class RenderedPrompt:
    """A prompt's tokens and the places (a snapshot at p holds tokens[:p]) one may be taken."""

    tokens: tuple[str, ...]
    system_end: int | None
    last_message_start: int | None

    @property
    def n(self) -> int:
        return len(self.tokens)

    @property
    def history_end(self) -> int:
        """``HISTORY_TAIL`` tokens before the end, on both routes."""
        return max(self.n - HISTORY_TAIL, 0)


def render_chat(messages: Sequence[tuple[str, str]]) -> RenderedPrompt:
    """Render (role, content) pairs through the template (see the module docstring)."""
    tokens: list[str] = []
    system_end: int | None = None
    last_start: int | None = None
    for index, (role, content) in enumerate(messages):
        last_start = len(tokens)
        tokens += [IM_START, f"{role}\n", *tokenize(content), IM_END]
        if index == 0 and role in ("system", "developer"):
            system_end = len(tokens)
    tokens.extend(GENERATION_PROMPT)
    return RenderedPrompt(tuple(tokens), system_end, last_start)


def render_completion(prompt: str) -> RenderedPrompt:
    """A raw `/v1/completions` prompt: no template, no system place."""
    return RenderedPrompt(tuple(tokenize(prompt)), None, None)


def answer_tokens(prompt: RenderedPrompt, length: int) -> list[str]:
    """The answer, a pure function of the prompt and `length`: raw tokens (words chosen by hash,
    then "."). A short one (within ``PLAIN_CHARS``) re-tokenizes to the same tokens."""
    stream = hashlib.shake_256(token_digest(prompt.tokens)).digest(length)
    words = [_WORDS[b % len(_WORDS)] for b in stream[: length - 1]]
    return [f" {w}" if i else w.capitalize() for i, w in enumerate(words)] + ["."]
