"""Reading one reply into its parts, frame by frame. Pure: no I/O.

`ReplyReader` folds a non-streamed response, or the frames of a stream one at a time, into
what evidence and callers need: the text (as UTF-8 bytes, so memory grows with the text and
never with the number of frames), finish reason, usage, timings, runtime block, model, id, and
whether the reply is complete, with the first problem found (`error` code, `reason` words).

Invariants:

- Complete means the server proved the reply is whole. A stream: `[DONE]` arrived, every
  event was JSON, no frame carried an `error`, every text piece was a string. A non-streamed
  response: a JSON object without `error`, whose `object` is not a `*.chunk`, no choice of
  which carries a stream `delta`, and whose first choice has a `message` (or completions
  `text`) and a `finish_reason` that is a string or absent (an explicit null says the reply
  is not finished). One mid-stream chunk handed over as a response is never complete.
- Only the first choice (index 0) is read for text: n > 1 is not how calls are made.
- The server's own error text is never kept; `error` is a short code of ours.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

__all__ = ["ReplyReader", "to_plain"]

_MAX_DEPTH: Final = 64


def to_plain(obj: object, _depth: int = 0) -> object:
    """Turn an SDK object (pydantic `model_dump()`, `to_dict()`, `__dict__`) into plain data.

    Dicts, lists, strings, numbers, bools and None pass through (tuples become lists).
    Anything this cannot read is returned unchanged and later judged malformed.
    """
    if _depth > _MAX_DEPTH:
        return None
    if obj is None or isinstance(obj, str | int | float | bool):
        return obj
    if isinstance(obj, Mapping):
        return {str(k): to_plain(v, _depth + 1) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [to_plain(v, _depth + 1) for v in obj]
    for method in ("model_dump", "to_dict"):
        fn = getattr(obj, method, None)
        if callable(fn):
            return to_plain(fn(), _depth + 1)
    attrs = getattr(obj, "__dict__", None)
    if isinstance(attrs, dict):
        public = {k: v for k, v in attrs.items() if isinstance(k, str) and not k.startswith("_")}
        return to_plain(public, _depth + 1)
    return obj


def _utf8(text: str) -> bytes:
    # A lone surrogate (an SDK object can carry one) is hashed as is, never a crash.
    return text.encode("utf-8", "surrogatepass")


def _first_choice(choices: object) -> dict[str, object] | None:
    """The choice with index 0 (an absent index reads as 0), if the list has one."""
    if not isinstance(choices, list):
        return None
    for choice in choices:
        if isinstance(choice, dict) and choice.get("index", 0) == 0:
            return choice
    return None


class ReplyReader:
    """One reply, read into its parts (see the module docstring)."""

    __slots__ = (
        "complete",
        "content",
        "error",
        "finish_reason",
        "id",
        "model",
        "reason",
        "reasoning",
        "runtime",
        "timings",
        "usage",
    )

    def __init__(self) -> None:
        self.content = bytearray()
        self.reasoning = bytearray()
        self.finish_reason: str | None = None
        self.usage: object = None
        self.timings: object = None
        self.runtime: object = None
        self.model: str | None = None
        self.id: str | None = None
        self.complete = True
        self.error: str | None = None
        self.reason: str | None = None

    def fail(self, error: str, reason: str) -> None:
        """Mark the reply incomplete; the first problem found is the one reported."""
        self.complete = False
        if self.error is None:
            self.error = error
            self.reason = reason

    # ------------------------------------------------------------------ streams

    def take_frame(self, frame: object) -> bool:
        """Fold one stream frame; True when it carried a non-empty text piece."""
        if not isinstance(frame, dict):
            self.fail("malformed_stream", "a stream frame is not a JSON object")
            return False
        if frame.get("error") is not None:
            self.fail("server_stream_error", "error frame")
            return False
        self._take_meta(frame)
        return self._take_choices(frame, key="delta")

    def end_stream(self, *, done: bool, malformed: str | None) -> None:
        """The stream is over: `done` says whether `[DONE]` arrived."""
        if malformed is not None:
            self.fail("malformed_stream", malformed)
        if not done:
            self.fail("incomplete_stream", "stream ended without [DONE]")

    # ------------------------------------------------------------------ responses

    def take_response(self, resp: object) -> None:
        """Fold a whole non-streamed response (see the completeness rule above)."""
        if not isinstance(resp, dict):
            self.fail("malformed_response", "the response is not a JSON object")
            return
        if resp.get("error") is not None:
            self.fail("server_error", "error response")
            return
        self._take_meta(resp)
        kind = resp.get("object")
        choices = resp.get("choices")
        if isinstance(kind, str) and kind.endswith(".chunk"):
            self.fail("incomplete_response", "a stream chunk, not a final response")
        elif not isinstance(choices, list):
            self.fail("malformed_response", "the response has no choices list")
        elif any(isinstance(c, dict) and "delta" in c for c in choices):
            self.fail("incomplete_response", "a stream chunk, not a final response")
        self._take_choices(resp, key="message")
        first = _first_choice(choices)
        if first is None:
            self.fail("incomplete_response", "no first choice: not a final response")
        elif "finish_reason" in first and not isinstance(first["finish_reason"], str):
            self.fail("incomplete_response", "finish_reason is not set: not a final response")
        elif not isinstance(first.get("message"), dict) and "text" not in first:
            self.fail("malformed_response", "the first choice has no message")

    # ------------------------------------------------------------------ parts

    def _take_meta(self, frame: Mapping[str, object]) -> None:
        """Keep the last non-null usage, timings, runtime block, model and id of a frame."""
        if frame.get("usage") is not None:
            self.usage = frame["usage"]
        if frame.get("timings") is not None:
            self.timings = frame["timings"]
        if frame.get("tensorfold") is not None:
            self.runtime = frame["tensorfold"]
        model, ident = frame.get("model"), frame.get("id")
        if isinstance(model, str):
            self.model = model
        if isinstance(ident, str):
            self.id = ident

    def _take_piece(self, target: bytearray, value: object, what: str) -> bool:
        if value is None:
            return False
        if not isinstance(value, str):
            self.fail("invalid_text_chunk", f"{what} is not a string")
            return False
        target.extend(_utf8(value))
        return bool(value)

    def _take_choices(self, frame: Mapping[str, object], *, key: str) -> bool:
        choices = frame.get("choices")
        if choices is None:
            return False
        if not isinstance(choices, list):
            self.fail("malformed_response", "choices is not a list")
            return False
        text = False
        for choice in choices:
            if not isinstance(choice, dict):
                self.fail("malformed_response", "a choice is not an object")
                continue
            index = choice.get("index", 0)
            if type(index) is int and index != 0:
                continue  # only the first choice is hashed; n > 1 is not how we call
            finish = choice.get("finish_reason")
            if isinstance(finish, str):
                self.finish_reason = finish
            body = choice.get(key)
            if body is not None and not isinstance(body, dict):
                self.fail("malformed_response", f"{key} is not an object")
                continue
            piece = choice.get("text")
            content = body.get("content") if body is not None else None
            # Completions carry `text`, chat carries `content`; take the first non-empty one.
            text |= self._take_piece(self.content, piece if piece else content, f"{key}.content")
            if body is not None:
                reasoning = body.get("reasoning_content")
                text |= self._take_piece(self.reasoning, reasoning, f"{key}.reasoning_content")
        return text

    # ------------------------------------------------------------------ the caller's view

    def text(self) -> tuple[str, str]:
        """(content, reasoning) as text."""
        return (
            self.content.decode("utf-8", "surrogatepass"),
            self.reasoning.decode("utf-8", "surrogatepass"),
        )
