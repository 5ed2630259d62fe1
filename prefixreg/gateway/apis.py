"""The three APIs a loop speaks, as the gateway tells them apart. Pure.

Each proxied route is one `Api`: its path, the error envelope its clients parse (an SDK
raises its own typed error only on its own shape), and how its request names the model and
the stream flag. Error text is ours: a message of one line, ASCII, no request text in it.

Invariants: `error_body` always returns valid JSON bytes of the API's shape; a message is
cut to 300 characters and stripped of control characters (a header or a path echoed back
can never inject a line).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Final, Literal

import orjson

ApiName = Literal["chat", "responses", "messages", "completions"]

_CONTROL: Final = re.compile(r"[\x00-\x1f\x7f]+")


@dataclass(frozen=True, slots=True)
class Api:
    """One proxied API: `name`, its `path`, and whether its errors are Anthropic-shaped."""

    name: ApiName
    path: str
    anthropic: bool = False


CHAT: Final = Api("chat", "/v1/chat/completions")
COMPLETIONS: Final = Api("completions", "/v1/completions")
RESPONSES: Final = Api("responses", "/v1/responses")
MESSAGES: Final = Api("messages", "/v1/messages", anthropic=True)
APIS: Final = (CHAT, COMPLETIONS, RESPONSES, MESSAGES)


def clean_message(message: str) -> str:
    """One safe line: control characters (CR, LF, ...) folded to a space, at most 300."""
    return _CONTROL.sub(" ", message)[:300]


def error_body(api: Api | None, status: int, message: str) -> bytes:
    """The error envelope `api`'s SDK parses, for an error of the gateway's own."""
    text = clean_message(message)
    if api is not None and api.anthropic:
        kind = {400: "invalid_request_error", 401: "authentication_error", 413: "request_too_large"}
        shaped = {"type": kind.get(status, "api_error"), "message": text}
        return orjson.dumps({"type": "error", "error": shaped})
    kinds = {
        400: "invalid_request_error",
        401: "invalid_request_error",
        413: "invalid_request_error",
    }
    err: dict[str, str | None] = {"message": text, "type": kinds.get(status, "server_error")}
    err |= {"param": None, "code": None}
    if status == 401:
        err["code"] = "invalid_api_key"
    return orjson.dumps({"error": err})


def json_orjson_refuses(data: bytes) -> bool:
    """Whether `data`, which orjson refused, is JSON all the same (or too deep to tell): a lone
    surrogate escape such as `"\\ud800"` and nesting past 1024 levels are valid JSON that
    orjson does not read; such a body is forwarded unread, never refused as not JSON."""

    def no_constant(name: str) -> object:
        raise ValueError(name)  # NaN, Infinity: not JSON

    try:
        json.loads(data, parse_constant=no_constant)
    except RecursionError:
        return True  # deeper than Python reads: the worker is the one to say
    except ValueError:  # includes UnicodeDecodeError and JSONDecodeError
        return False
    return True
