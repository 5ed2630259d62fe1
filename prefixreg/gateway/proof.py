"""The proof of one call: the server's own counts, read by `server.evidence` (and, for a
stream, `server.sse` + `server.replies`), judged by `core.judge` against the head's span,
with the reason a call that should have resumed did not.

The three APIs report the same numbers under different names. Responses (`input_tokens`,
`input_tokens_details.cached_tokens`) and Anthropic Messages (`input_tokens` beside
`cache_read_input_tokens` and `cache_creation_input_tokens`, which Anthropic counts apart
from it) are rewritten into the chat shape the evidence parser reads; their values are
passed on unread (the evidence module checks each one strictly), as it does for SGLang and
Ollama replies. Nothing here compares a cached count with anything: the judge does.

Invariants:
- A stream's proof reads at most `cap` bytes (past it: unverified, "too long to read"), keeps
  no frame, and folds only the text it hashes (bounded by the cap).
- A reply that is not 2xx, not JSON, or an error frame is unverified with the evidence
  module's reason; never an exception.
- `miss` is a reason only for a call not `resumed`: first call of the head, head changed
  (drift), routed elsewhere, evicted since the last call, or the engine reported nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

import orjson

from prefixreg.core.judge import Judgement, judge, judge_unknown_head, judge_unproven
from prefixreg.core.records import CallEvidence
from prefixreg.gateway.apis import Api
from prefixreg.gateway.head import Head
from prefixreg.server.evidence import evidence_from_response
from prefixreg.server.replies import ReplyReader
from prefixreg.server.sse import SSEParser

_RESPONSES_DONE: Final = ("response.completed", "response.incomplete", "response.failed")


def _responses_reply(resp: Mapping[str, Any]) -> dict[str, Any]:
    """A Responses object in the chat shape: its output text, status and usage."""
    text: list[str] = []
    output = resp.get("output")
    for item in output if isinstance(output, list) else ():
        content = item.get("content") if isinstance(item, dict) else None
        for part in content if isinstance(content, list) else ():
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                text.append(part["text"])
    usage = resp.get("usage")
    out: dict[str, Any] = {"object": "chat.completion"}
    status = resp.get("status")
    finish = status if status in ("completed", "incomplete") else None
    out["choices"] = [{"index": 0, "message": {"content": "".join(text)}, "finish_reason": finish}]
    if isinstance(usage, dict):
        out["usage"] = {
            "prompt_tokens": usage.get("input_tokens"),
            "completion_tokens": usage.get("output_tokens"),
            "prompt_tokens_details": usage.get("input_tokens_details"),
        }
    if resp.get("error") is not None:
        out["error"] = {"type": "response_error"}
    return out


def _messages_usage(usage: Mapping[str, Any]) -> dict[str, Any]:
    """Anthropic usage in the chat shape: the prompt is input + cache read + cache creation
    (Anthropic counts the three apart); an absent or malformed part makes the prompt count
    absent (unverified), never a guess."""
    parts = [usage.get(k, 0) for k in ("cache_read_input_tokens", "cache_creation_input_tokens")]
    inputs = usage.get("input_tokens")
    counts = [inputs, *parts]
    valid = all(type(v) is int and v >= 0 for v in counts)
    prompt = sum(v for v in counts if isinstance(v, int)) if valid else None
    cached = usage.get("cache_read_input_tokens")
    return {
        "prompt_tokens": prompt,
        "completion_tokens": usage.get("output_tokens"),
        "prompt_tokens_details": None if cached is None else {"cached_tokens": cached},
    }


def _messages_reply(resp: Mapping[str, Any]) -> dict[str, Any]:
    content = resp.get("content")
    text = "".join(
        b["text"]
        for b in (content if isinstance(content, list) else ())
        if isinstance(b, dict) and isinstance(b.get("text"), str)
    )
    stop = resp.get("stop_reason")
    out: dict[str, Any] = {"object": "chat.completion"}
    out["choices"] = [{"index": 0, "message": {"content": text}, "finish_reason": stop}]
    usage = resp.get("usage")
    if isinstance(usage, dict):
        out["usage"] = _messages_usage(usage)
    if resp.get("type") == "error":
        out["error"] = {"type": "error"}
    return out


def evidence_of(api: Api, status: int, data: bytes, wall_s: float | None) -> CallEvidence:
    """The evidence of a buffered reply of `api` (its bytes as they arrived)."""
    if not 200 <= status < 300:
        return evidence_from_response({"error": {"status": status}}, wall_s=wall_s)
    if api.name in ("chat", "completions"):
        return _chat(data, wall_s)
    try:
        resp = orjson.loads(data)
    except orjson.JSONDecodeError:
        return _chat(data, wall_s)  # not JSON: the evidence module says so
    if not isinstance(resp, dict):
        return _chat(data, wall_s)
    shaped = _responses_reply(resp) if api.name == "responses" else _messages_reply(resp)
    return evidence_from_response(shaped, wall_s=wall_s)


def _chat(data: bytes, wall_s: float | None) -> CallEvidence:
    reply = ReplyReader()
    reply.take_response(data)
    return evidence_from_response(reply, wall_s=wall_s)


class Tally:
    """A stream's proof, fed the pieces as they are forwarded (see the invariants)."""

    def __init__(self, api: Api, cap: int) -> None:
        self.api = api
        self.cap = cap
        self.seen = 0
        self.parser = SSEParser(keep=False)
        self.reply = ReplyReader()
        self.done = False
        self.broken_reason: str | None = None
        self.pending: bytes | None = None  # a piece sent on, read once the next is asked for

    def feed(self, piece: bytes) -> None:
        if self.broken_reason is not None:
            return
        self.seen += len(piece)
        if self.seen > self.cap:
            self.broken("the stream is too long for the proof to read")
            return
        for frame in self.parser.feed(piece):
            self._take(frame)

    def _take(self, frame: object) -> None:
        if self.api.name in ("chat", "completions") or not isinstance(frame, dict):
            self.reply.take_frame(frame)
            return
        kind = frame.get("type")
        if self.api.name == "responses":
            if kind == "response.output_text.delta" and isinstance(frame.get("delta"), str):
                self.reply.content.extend(frame["delta"].encode("utf-8", "surrogatepass"))
            elif kind in _RESPONSES_DONE and isinstance(frame.get("response"), dict):
                shaped = _responses_reply(frame["response"])
                self.reply.usage = shaped.get("usage")
                self.reply.finish_reason = shaped["choices"][0]["finish_reason"]
                if kind == "response.failed":
                    self.reply.fail("server_stream_error", "response.failed")
                self.done = True
            elif kind == "error":
                self.reply.fail("server_stream_error", "error frame")
            return
        self._take_message_event(kind, frame)

    def _take_message_event(self, kind: object, frame: dict[str, Any]) -> None:
        if kind == "message_start" and isinstance(frame.get("message"), dict):
            usage = frame["message"].get("usage")
            if isinstance(usage, dict):
                self.reply.usage = _messages_usage(usage)
                self._start_usage = usage
        elif kind == "content_block_delta" and isinstance(frame.get("delta"), dict):
            text = frame["delta"].get("text")
            if isinstance(text, str):
                self.reply.content.extend(text.encode("utf-8", "surrogatepass"))
        elif kind == "message_delta":
            usage, delta = frame.get("usage"), frame.get("delta")
            if isinstance(usage, dict):  # later counts win over message_start's
                merged = {**getattr(self, "_start_usage", {}), **usage}
                self.reply.usage = _messages_usage(merged)
            if isinstance(delta, dict) and isinstance(delta.get("stop_reason"), str):
                self.reply.finish_reason = delta["stop_reason"]
        elif kind == "message_stop":
            self.done = True
        elif kind == "error":
            self.reply.fail("server_stream_error", "error frame")

    def broken(self, why: str) -> None:
        if self.broken_reason is None:
            self.broken_reason = why

    def evidence(self, status: int, wall_s: float | None, ttft_s: float | None) -> CallEvidence:
        if not 200 <= status < 300:
            return evidence_from_response({"error": {"status": status}}, wall_s=wall_s)
        stream = self.parser.finish()
        done = stream.done if self.api.name in ("chat", "completions") else self.done
        if self.broken_reason is not None:
            self.reply.fail("incomplete_stream", self.broken_reason)
        self.reply.end_stream(done=done, malformed=stream.malformed)
        return evidence_from_response(self.reply, wall_s=wall_s, ttft_s=ttft_s)


@dataclass(frozen=True, slots=True)
class Proof:
    """One call's verdict: the judgement, and why a call that is not resumed missed."""

    judgement: Judgement
    miss: str | None

    @property
    def verdict(self) -> str:
        return self.judgement.verdict


def prove(
    evidence: CallEvidence, head: Head | None, rest_bytes: int | None, *, miss: str | None
) -> Proof:
    """The judge's verdict of a call against its head's span; `miss` (the door's reason why
    the head might not be cached) is kept only for a call that is not resumed, and an
    unverified call's reason is what the engine did not report."""
    if head is None:
        j = judge_unknown_head(evidence, "no head to judge the cached count against")
    elif evidence.cache_state == "unverified":
        j = judge_unproven(evidence.reason or "the server did not report its counts")
    else:
        j = judge(evidence, head_bytes=head.head_bytes, rest_bytes=rest_bytes)
    if j.verdict == "resumed":
        return Proof(j, None)
    if j.verdict == "unverified" and evidence.cache_state == "unverified":
        why = evidence.reason or "no counts"
        if why == "usage missing":
            why += " (a stream sent without stream_options.include_usage has no usage)"
        return Proof(j, f"engine reported nothing: {why}")
    return Proof(j, miss)
