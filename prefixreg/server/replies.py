"""Reading one reply into its parts, frame by frame. Pure: no I/O.

`ReplyReader` folds a response, or a stream's frames one at a time, into what evidence and
callers need: the text (UTF-8 bytes: memory grows with the text, never with the number of
frames), finish reason, usage, timings, runtime block, model, id, and whether the reply is
complete, with the first problem found (`error` code, `reason` words).

Invariants:
- Complete means the server proved the reply whole. A stream: `[DONE]` arrived, every event
  was JSON, no frame carried an `error`, every text piece was a string. A response: a JSON
  object without `error`, not a `*.chunk`, no choice with a `delta`, a first choice with a
  `message` (or completions `text`) and a `finish_reason` string or absent (null: not
  finished). One mid-stream chunk is never complete.
- Only the first choice (index 0) is read for text: n > 1 is not how calls are made.
- The server's own error text is never kept; `error` is a short code of ours.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from prefixreg.core.errors import CorruptRecordError
from prefixreg.core.jsonio import MAX_DEPTH, JSONObject, JSONValue, loads


def to_plain(obj: object, _depth: int = 0) -> object:
    """An SDK object (`model_dump()`, `to_dict()`, `__dict__`) as plain data; JSON passes
    (tuples become lists); anything else is returned to be judged."""
    if _depth > MAX_DEPTH:
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


def _json(value: object) -> JSONValue:
    """Keep a decoded JSON value as such (it came from `core.jsonio` or `to_plain`)."""
    return value if value is None or isinstance(value, str | int | float | dict | list) else None


@dataclass(slots=True, eq=False)
class ReplyReader:
    """One reply, read into its parts (see the module docstring)."""

    content: bytearray = field(default_factory=bytearray)
    reasoning: bytearray = field(default_factory=bytearray)
    finish_reason: str | None = None
    usage: object = None
    timings: object = None
    runtime: object = None
    model: str | None = None
    id: str | None = None
    complete: bool = True
    error: str | None = None
    reason: str | None = None

    def fail(self, error: str, reason: str) -> None:
        """Mark the reply incomplete; the first problem found is the one reported."""
        self.complete = False
        if self.error is None:
            self.error, self.reason = str(error), str(reason)

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
        """The stream is over: `done`, `[DONE]` arrived; `malformed`, why a line was unreadable."""
        if malformed is not None:
            self.fail("malformed_stream", str(malformed))
        if done is not True:
            self.fail("incomplete_stream", "stream ended without [DONE]")

    def take_response(self, resp: object) -> None:
        """Fold a whole non-streamed response, decoded or as the bytes that arrived."""
        if isinstance(resp, bytes):
            try:
                resp = loads(resp)
            except CorruptRecordError:
                self.fail("malformed_response", "the reply is not JSON")
                return
        if not isinstance(resp, dict):
            self.fail("malformed_response", "the response is not a JSON object")
            return
        if resp.get("error") is not None:
            self.fail("server_error", "error response")
            return
        self._take_meta(resp)
        kind, choices = resp.get("object"), resp.get("choices")
        if isinstance(kind, str) and kind.endswith(".chunk"):
            self.fail("incomplete_response", "a stream chunk, not a final response")
        elif not isinstance(choices, list):
            self.fail("malformed_response", "the response has no choices list")
        elif any(isinstance(c, dict) and "delta" in c for c in choices):
            self.fail("incomplete_response", "a stream chunk, not a final response")
        self._take_choices(resp, key="message")
        listed = choices if isinstance(choices, list) else []  # index 0 (absent reads as 0)
        first = next((c for c in listed if isinstance(c, dict) and c.get("index", 0) == 0), None)
        if first is None:
            self.fail("incomplete_response", "no first choice: not a final response")
        elif "finish_reason" in first and not isinstance(first["finish_reason"], str):
            self.fail("incomplete_response", "finish_reason is not set: not a final response")
        elif not isinstance(first.get("message"), dict) and "text" not in first:
            self.fail("malformed_response", "the first choice has no message")

    def _take_meta(self, frame: Mapping[str, object]) -> None:
        """Keep the last non-null usage, timings, runtime block, model and id of a frame."""
        for key, attr in (("usage", "usage"), ("timings", "timings"), ("tensorfold", "runtime")):
            if frame.get(key) is not None:
                setattr(self, attr, frame[key])
        for key in ("model", "id"):
            if isinstance(frame.get(key), str):
                setattr(self, key, frame[key])

    def _take_piece(self, target: bytearray, value: object, what: str) -> bool:
        if value is None:
            return False
        if not isinstance(value, str):
            self.fail("invalid_text_chunk", f"{what} is not a string")
            return False
        # A lone surrogate (an SDK object can carry one) is hashed as is, never a crash.
        target.extend(value.encode("utf-8", "surrogatepass"))
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
            self.finish_reason = finish if isinstance(finish, str) else self.finish_reason
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

    def view(self) -> JSONObject:
        """A flat view for the caller, never for a record (it holds the output text)."""
        return {
            "content": self.content.decode("utf-8", "surrogatepass"),
            "reasoning": self.reasoning.decode("utf-8", "surrogatepass") or None,
            "finish_reason": self.finish_reason,
            "usage": _json(self.usage),
            "timings": _json(self.timings),
            "model": self.model,
            "id": self.id,
        }
