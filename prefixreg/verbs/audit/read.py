"""Reading an audit's inputs: call outputs, request bodies, pairs and measurement records.

Shapes read (each a JSON document, a JSON list of documents, or one per line in `.jsonl` /
`.ndjson`):

- a chat/completions response, maybe wrapped (`response`, `body`, nested as in OpenAI batch
  output), with an optional wall time (`wall_s`, `elapsed_s`, `duration_s`, `latency_s`) on
  the response or a wrapper (the outermost wins: it timed the whole call);
- an OpenAI chat request body (`messages` list, no `choices`/`usage`), bare or as OpenAI batch
  input (`{"custom_id", "method", "url", "body": {request}}`);
- a request+response pair: `{"request": {request}, "response": {response}, "wall_s": ...}`;
- a prefixreg measurement record (envelope `sha256`, `kind`, `build`, `body.calls`): every
  call inside, with its recorded wall time, prefix sha and server build.

Invariants:

- Counts come from the server only: responses go through `evidence_from_response`, recorded
  calls through `CallEvidence.from_dict`.
- Of a request, only the sha256 and byte length of `messages[0].content` are kept (never the
  text), so the identity check can name the registered prefix without holding prompts.
- With a frame (`audit --frame`), a request also leaves the parts of its head that drift
  from the frame (`Frame.drift`: part names, shas and setting values, never text).
- Nothing read is fatal: what is not a call output is listed in `malformed` with a reason.
- A directory is walked without following symlinks, and only regular files are opened: a
  FIFO, socket, device or symlink found in it is listed in `skipped` and never opened (a FIFO
  would block a read forever). Files are opened non-blocking and re-checked with fstat, so a
  file swapped for a FIFO between the listing and the open is skipped too.
"""

from __future__ import annotations

import math
import os
import stat
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import orjson

from prefixreg.core.errors import CorruptRecordError
from prefixreg.core.frame import Frame
from prefixreg.core.jsonio import JSONObject
from prefixreg.core.prefix import Drift
from prefixreg.core.records import CallEvidence, Measurement
from prefixreg.server.evidence import evidence_from_response
from prefixreg.verbs.audit.prompt import PromptSeen, SystemPrompt, system_prompt

__all__ = [
    "JSONL_SUFFIXES",
    "JSON_SUFFIXES",
    "WALL_KEYS",
    "AuditCall",
    "AuditInput",
    "Malformed",
    "PromptSeen",
    "SystemPrompt",
    "read_outputs",
    "system_prompt",
]

WALL_KEYS: Final = ("wall_s", "elapsed_s", "duration_s", "latency_s")
WRAPPER_KEYS: Final = ("response", "body")
JSON_SUFFIXES: Final = (".json",)
JSONL_SUFFIXES: Final = (".jsonl", ".ndjson")
_MAX_WRAP_DEPTH: Final = 4
_RESPONSE_KEYS: Final = ("choices", "usage", "timings")


@dataclass(frozen=True, slots=True)
class Malformed:
    """Something read that is not a call, or skipped: where (`path`, `path:line`,
    `path[i]`) and why."""

    source: str
    reason: str

    def to_dict(self) -> JSONObject:
        return {"source": self.source, "reason": self.reason}


@dataclass(frozen=True, slots=True)
class AuditCall:
    """One call read: its evidence, and the prefix and build when a record named them."""

    source: str
    evidence: CallEvidence
    sha256: str | None = None
    build_id: str | None = None

    @property
    def wall_s(self) -> float | None:
        return self.evidence.wall_s


@dataclass(slots=True)
class AuditInput:
    """Everything `read_outputs` found."""

    calls: list[AuditCall] = field(default_factory=list)
    prompts: list[PromptSeen] = field(default_factory=list)
    malformed: list[Malformed] = field(default_factory=list)
    skipped: list[Malformed] = field(default_factory=list)
    measurements: list[Measurement] = field(default_factory=list)
    files: int = 0
    # With a frame: (source, drift from the frame, paired with its response) per request.
    heads: list[tuple[str, tuple[Drift, ...], bool]] = field(default_factory=list)


def _wall(obj: Mapping[str, object]) -> float | None:
    for key in WALL_KEYS:
        value = obj.get(key)
        # bool is an int subclass: `"wall_s": true` is not a duration.
        if isinstance(value, int | float) and not isinstance(value, bool):
            number = float(value)
            if math.isfinite(number) and number >= 0:
                return number
    return None


def _looks_like_response(obj: Mapping[str, object]) -> bool:
    """A chat/completions reply (or an error reply in its place), not a wrapper around one."""
    if any(key in obj for key in _RESPONSE_KEYS):
        return True
    kind = obj.get("object")
    if isinstance(kind, str) and kind.startswith(("chat.completion", "text_completion")):
        return True
    return obj.get("error") is not None and not any(
        isinstance(obj.get(key), dict) for key in WRAPPER_KEYS
    )


def _looks_like_request(obj: Mapping[str, object]) -> bool:
    return isinstance(obj.get("messages"), list) and not any(k in obj for k in _RESPONSE_KEYS)


def _looks_like_measurement(obj: Mapping[str, object]) -> bool:
    body = obj.get("body")
    return (
        all(key in obj for key in ("sha256", "kind", "build"))
        and isinstance(body, dict)
        and "calls" in body
    )


class _Reader:
    """Accumulates calls, prompts and problems while walking the inputs."""

    def __init__(self, frame: Frame | None = None) -> None:
        self.out = AuditInput()
        self.frame = frame

    def head(self, request: Mapping[str, object], source: str, paired: bool) -> None:
        if self.frame is not None:
            self.out.heads.append((source, tuple(self.frame.drift(request)), paired))

    def bad(self, source: str, reason: str) -> None:
        self.out.malformed.append(Malformed(source, reason))

    def skip(self, source: str, reason: str) -> None:
        self.out.skipped.append(Malformed(source, reason))

    def take(self, value: object, source: str, *, top: bool = True) -> None:
        """One decoded JSON document: a response (maybe wrapped), a request, a pair, a
        record, or a list of them."""
        if isinstance(value, list):
            if not top:
                self.bad(source, "a list inside a list is not a call output")
                return
            if not value:
                self.bad(source, "an empty list")
            for i, item in enumerate(value):
                self.take(item, f"{source}[{i}]", top=False)
            return
        if not isinstance(value, dict):
            self.bad(source, "not a JSON object or a list of them")
            return
        if _looks_like_measurement(value):
            self.take_measurement(value, source)
            return
        if self.take_request(value, source):
            return
        self.take_response(value, source)

    def take_request(self, value: dict[str, object], source: str) -> bool:
        """Record the request in `value` (bare, batch input, or the `request` of a pair).
        True when `value` holds nothing more to read (no response beside the request)."""
        request = value.get("request")
        if isinstance(request, dict):
            inner = request.get("body")
            if not _looks_like_request(request) and isinstance(inner, dict):
                request = inner  # {"request": {"body": {...}}}: a logged HTTP request
            paired = isinstance(value.get("response"), dict)
            self.out.prompts.append(PromptSeen(source, system_prompt(request), paired))
            self.head(request, source, paired)
            return not paired
        body = value.get("body")
        for candidate in (value, body):
            if isinstance(candidate, dict) and _looks_like_request(candidate):
                self.out.prompts.append(PromptSeen(source, system_prompt(candidate), False))
                self.head(candidate, source, False)
                return True
        return False

    def take_response(self, value: dict[str, object], source: str) -> None:
        wall: float | None = None
        obj: dict[str, object] = value
        for _ in range(_MAX_WRAP_DEPTH):
            if wall is None:
                wall = _wall(obj)  # the outermost wall time wins: it timed the whole call
            if _looks_like_response(obj):
                break
            inner = next(
                (obj[k] for k in WRAPPER_KEYS if isinstance(obj.get(k), dict)),
                None,
            )
            if not isinstance(inner, dict):
                self.bad(source, "not a call output (no choices, usage, error or messages)")
                return
            obj = inner
        else:
            self.bad(source, "not a call output (wrapped too deep)")
            return
        self.out.calls.append(AuditCall(source, evidence_from_response(obj, wall_s=wall)))

    def take_measurement(self, value: Mapping[str, object], source: str) -> None:
        try:
            record = Measurement.from_dict(dict(value))
        except CorruptRecordError as exc:
            self.bad(source, f"corrupt measurement record: {exc}")
            return
        self.out.measurements.append(record)
        calls = record.body.get("calls")
        if not isinstance(calls, list):
            self.bad(source, "measurement record: body.calls is not a list")
            return
        for i, call in enumerate(calls):
            where = f"{source}#calls[{i}]"
            raw = call.get("evidence") if isinstance(call, dict) else None
            try:
                evidence = CallEvidence.from_dict(raw)
            except CorruptRecordError as exc:
                self.bad(where, f"corrupt call evidence: {exc}")
                continue
            self.out.calls.append(AuditCall(where, evidence, record.sha256, record.build.build_id))

    def read_file(self, path: Path, *, follow: bool) -> None:
        source = str(path)
        data = self.read_regular(path, follow=follow)
        if data is None:
            return
        self.out.files += 1
        if path.suffix.lower() in JSONL_SUFFIXES:
            self.read_lines(data, source)
            return
        try:
            value: object = orjson.loads(data)
        except orjson.JSONDecodeError:
            # A .json file that is really JSON lines: read it as such if every line parses.
            lines = [line for line in data.splitlines() if line.strip()]
            if len(lines) > 1 and all(_parses(line) for line in lines):
                self.read_lines(data, source)
            else:
                self.bad(source, "not valid JSON")
            return
        self.take(value, source)

    def read_regular(self, path: Path, *, follow: bool) -> bytes | None:
        """The bytes of `path` if it is a regular file; otherwise None, said in `skipped`.
        Non-blocking open: opening a FIFO for reading would otherwise wait for a writer."""
        flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
        try:
            fd = os.open(path, flags)
        except OSError as exc:
            if not follow and path.is_symlink():
                self.skip(str(path), "a symlink (not followed)")
            else:
                self.bad(str(path), f"cannot read: {exc.strerror or exc}")
            return None
        try:
            mode = os.fstat(fd).st_mode
            if not stat.S_ISREG(mode):
                self.skip(str(path), f"not a regular file ({_kind(mode)})")
                return None
            with os.fdopen(fd, "rb", closefd=False) as fh:
                return fh.read()
        except OSError as exc:
            self.bad(str(path), f"cannot read: {exc.strerror or exc}")
            return None
        finally:
            os.close(fd)

    def read_lines(self, data: bytes, source: str) -> None:
        seen = False
        for lineno, line in enumerate(data.splitlines(), 1):
            if not line.strip():
                continue
            seen = True
            where = f"{source}:{lineno}"
            try:
                value: object = orjson.loads(line)
            except orjson.JSONDecodeError:
                self.bad(where, "not valid JSON")
                continue
            self.take(value, where)
        if not seen:
            self.bad(source, "empty file")

    def walk(self, directory: Path) -> Iterator[Path]:
        """Regular call-output files under `directory`, sorted. Nothing is followed: a
        symlinked directory (a link back up the tree would never end) or file, and any
        entry that is not a regular file, is listed in `skipped` instead."""
        suffixes = JSON_SUFFIXES + JSONL_SUFFIXES
        for root, dirs, files in os.walk(directory, followlinks=False):
            dirs.sort()
            for name in dirs:
                if (Path(root) / name).is_symlink():
                    self.skip(str(Path(root) / name), "a symlinked directory (not followed)")
            for name in sorted(files):
                if not name.lower().endswith(suffixes):
                    continue
                path = Path(root) / name
                try:
                    mode = os.lstat(path).st_mode
                except OSError as exc:
                    self.bad(str(path), f"cannot read: {exc.strerror or exc}")
                    continue
                if stat.S_ISLNK(mode):
                    self.skip(str(path), "a symlink (not followed)")
                elif not stat.S_ISREG(mode):
                    self.skip(str(path), f"not a regular file ({_kind(mode)})")
                else:
                    yield path


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISLNK, "a symlink"),
    ):
        if test(mode):
            return name
    return "an unknown file type"


def _parses(line: bytes) -> bool:
    try:
        orjson.loads(line)
    except orjson.JSONDecodeError:
        return False
    return True


def read_outputs(paths: Iterable[Path | str], *, frame: Frame | None = None) -> AuditInput:
    """Read every call output and request under `paths` (files or directories). Never
    raises for bad input: missing paths, unreadable files and non-calls are listed in
    `malformed`, non-regular files and symlinks inside directories in `skipped`. A path
    named directly may be a symlink to a regular file (the user chose it). `frame`: each
    request's drift from it is kept in `heads`."""
    reader = _Reader(frame)
    for item in paths:
        path = Path(item)
        if path.is_dir():
            out = reader.out
            before = len(out.calls) + len(out.prompts) + len(out.malformed) + len(out.skipped)
            for file in reader.walk(path):
                reader.read_file(file, follow=False)
            after = len(out.calls) + len(out.prompts) + len(out.malformed) + len(out.skipped)
            if after == before:
                reader.bad(str(path), "no .json or .jsonl files in this directory")
        elif path.exists():
            reader.read_file(path, follow=True)
        else:
            reader.bad(str(path), "no such file or directory")
    return reader.out
