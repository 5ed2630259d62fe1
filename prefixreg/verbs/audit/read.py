"""Reading an audit's inputs: files of one JSON document, a list, or one per line (`.jsonl`,
`.ndjson`). A document is a chat response (maybe under `response`/`body`; a `WALL_KEYS` beside
it is its wall time, the outermost winning), a request body (bare or OpenAI batch input), a
`{"request", "response"}` pair, a call-log line (`server.calllog`: hashes and counts of one
call), a measurement record (calls, head, build) or an aiperf record.

Invariants: counts come from the server only; of a request only shas, byte lengths and its drift
are kept, never text; every document goes through `jsonio.loads`; a line or `.json` document
over `MAX_DOCUMENT` bytes is skipped, never held whole; nothing read is fatal (it is listed with
a reason). Directories are walked iteratively, following nothing; only regular files are opened
(non-blocking, re-checked with fstat), others are listed skipped.
"""

from __future__ import annotations

import io
import os
import stat
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, BinaryIO, Final

from prefixreg.core.errors import CorruptRecordError, UsageError
from prefixreg.core.fields import strict_number
from prefixreg.core.frame import Frame, Head
from prefixreg.core.jsonio import JSONValue, loads
from prefixreg.core.prefix import Drift, Prefix, text_bytes
from prefixreg.core.records import CallEvidence, Measurement
from prefixreg.server.calllog import is_call_record, message_chain, read_call_record
from prefixreg.server.evidence import evidence_from_response
from prefixreg.verbs.audit.aiperf import is_aiperf, read_aiperf
from prefixreg.verbs.audit.identity import PromptSeen, SystemPrompt, system_prompt

WALL_KEYS: Final = ("wall_s", "elapsed_s", "duration_s", "latency_s")
WRAPPER_KEYS: Final = ("response", "body")
SUFFIXES: Final = (".json", ".jsonl", ".ndjson")
MAX_DOCUMENT: Final = 16 * 2**20  # bytes of one JSON line or one .json document
_RESPONSE_KEYS: Final = ("choices", "usage", "timings", "meta_info", "prompt_eval_count")


@dataclass(frozen=True, slots=True)
class Malformed:
    """Something read that is not a call, or skipped: where (`path[:line][i]`) and why."""

    source: str
    reason: str


@dataclass(frozen=True, slots=True)
class AuditCall:
    """One call read and, when known, the head it sent: from its record (prefix, build,
    frame) or its request (system sha, the frame's when in line, head and rest bytes)."""

    source: str
    evidence: CallEvidence
    sha256: str | None = None
    build_id: str | None = None
    frame: str | None = None
    head_bytes: int | None = None
    rest_bytes: int | None = None
    start_ns: int | None = None  # epoch ns, when the input timed the call (aiperf)
    end_ns: int | None = None
    chain: tuple[str, ...] = ()  # its request's session chain (`calllog.message_chain`)


@dataclass(slots=True)
class AuditInput:
    """Everything `read_outputs` found."""

    calls: list[AuditCall] = field(default_factory=list)
    prompts: list[PromptSeen] = field(default_factory=list)
    malformed: list[Malformed] = field(default_factory=list)
    skipped: list[Malformed] = field(default_factory=list)
    measurements: list[Measurement] = field(default_factory=list)
    files: int = 0

    @property
    def seen(self) -> int:
        return len(self.calls) + len(self.prompts) + len(self.malformed) + len(self.skipped)


def _wall(obj: Mapping[str, object]) -> float | None:
    walls = (strict_number(obj.get(key)) for key in WALL_KEYS)  # `"wall_s": true` is no duration
    return next((wall for wall in walls if wall is not None), None)


def _is_response(obj: Mapping[str, object]) -> bool:
    """A chat/completions reply (or an error reply in its place), not a wrapper around one."""
    reply = str(obj.get("object")).startswith(("chat.completion", "text_completion"))
    if reply or any(k in obj for k in _RESPONSE_KEYS):
        return True
    wrapped = any(isinstance(obj.get(k), dict) for k in WRAPPER_KEYS)
    return obj.get("error") is not None and not wrapped


def _is_request(obj: object) -> bool:
    keys = obj if isinstance(obj, dict) else {}
    return isinstance(keys.get("messages"), list) and not any(k in keys for k in _RESPONSE_KEYS)


def _find_request(value: Mapping[str, object]) -> tuple[dict[str, Any] | None, bool]:
    """The request `value` holds (bare, batch input, or a pair's); whether a response is paired."""
    request = value.get("request")
    if isinstance(request, dict):
        if not _is_request(request) and isinstance(request.get("body"), dict):
            request = request["body"]  # {"request": {"body": {...}}}: a logged HTTP request
        return request, isinstance(value.get("response"), dict)
    found = next((c for c in (value, value.get("body")) if _is_request(c)), None)
    return (found, False) if isinstance(found, dict) else (None, False)


def _lines(fh: BinaryIO) -> Iterator[bytes | None]:
    """Each line of `fh`; None for a line over `MAX_DOCUMENT` bytes, read past in chunks."""
    while line := fh.readline(MAX_DOCUMENT + 1):
        if len(line) > MAX_DOCUMENT and not line.endswith(b"\n"):
            while (rest := fh.readline(2**20)) and not rest.endswith(b"\n"):
                pass
            yield None
        else:
            yield line


def _parses(line: bytes) -> bool:
    try:
        loads(line)
    except CorruptRecordError:
        return False
    return True


def _kind(mode: int) -> str:
    kinds = {"p": "a FIFO", "s": "a socket", "c": "a character device", "b": "a block device"}
    return kinds.get(stat.filemode(mode)[0], "an unknown file type")


class _Reader:
    """Accumulates calls, prompts and problems while walking the inputs."""

    def __init__(self, frame: Head | None) -> None:
        self.out = AuditInput()
        self.frame = frame
        self.aiperf: dict[str, tuple[bool, AuditCall, PromptSeen | None]] = {}

    def bad(self, source: str, reason: str) -> None:
        self.out.malformed.append(Malformed(source, reason))

    def skip(self, source: str, reason: str) -> None:
        self.out.skipped.append(Malformed(source, reason))

    def take(self, value: JSONValue, source: str, *, top: bool = True) -> None:
        """One decoded document: a response, request, pair, record, or (at the top) a list."""
        if isinstance(value, list) and top:
            if not value:
                self.bad(source, "an empty list")
            for i, item in enumerate(value):
                self.take(item, f"{source}[{i}]", top=False)
        elif isinstance(value, list):
            self.bad(source, "a list inside a list is not a call output")
        elif not isinstance(value, dict):
            self.bad(source, "not a JSON object or a list of them")
        elif isinstance(value.get("body"), dict) and {"sha256", "kind", "build"} <= value.keys():
            self.take_measurement(value, source)
        elif is_aiperf(value):
            self.take_aiperf(value, source)
        elif is_call_record(value):
            self.take_call_record(value, source)
        else:
            request, paired = _find_request(value)
            sent = {} if request is None else self.take_request(request, source)
            if request is None or paired:
                self.take_response(value, source, sent)

    def take_request(self, request: dict[str, Any], source: str) -> dict[str, Any]:
        """Record the request; what it sent, as `AuditCall` fields."""
        system = system_prompt(request)
        messages = request["messages"] if isinstance(request.get("messages"), list) else []
        drift = None if self.frame is None else self.drift(self.frame, request, source)
        self.out.prompts.append(PromptSeen(source, system, drift))
        frame = self.frame if drift == () else None  # in line: the head it sent is the frame
        return {
            "sha256": system.sha256,
            "frame": frame.sha256 if frame and frame.kind == "frame" else None,
            "head_bytes": frame.head_bytes if frame else system.bytes,
            "rest_bytes": text_bytes(messages[1:]),
            "chain": message_chain(request),
        }

    def take_call_record(self, value: dict[str, Any], source: str) -> None:
        """A call-log line: the request's hashes and counts and the server's evidence."""
        got = read_call_record(value)
        if isinstance(got, str):
            self.bad(source, got)
            return
        system = SystemPrompt(
            got.sha256, got.system_bytes, None if got.sha256 else "no text first message (call log)"
        )
        self.out.prompts.append(PromptSeen(source, system, None))
        self.out.calls.append(
            AuditCall(
                source,
                got.evidence,
                sha256=got.sha256,
                head_bytes=got.system_bytes,
                rest_bytes=got.rest_bytes,
                chain=got.chain,
            )
        )

    def drift(self, frame: Head, request: dict[str, Any], source: str) -> tuple[Drift, ...] | None:
        """The request's drift from `frame`; None (listed as malformed) when its head cannot
        be compared: a content part whose text is not a string, a part that is not JSON."""
        messages = request.get("messages")
        first = messages[0] if isinstance(messages, list) and messages else None
        parts = first.get("content") if isinstance(first, dict) else None
        for i, part in enumerate(parts if isinstance(parts, list) else ()):
            if isinstance(part, dict) and not isinstance(part.get("text", ""), str):
                self.bad(source, f"messages[0].content[{i}].text is not a string")
                return None
        try:
            return tuple(frame.drift(request))
        except UsageError as exc:
            self.bad(source, f"request head: {exc}")
            return None

    def take_response(self, value: dict[str, JSONValue], source: str, sent: dict[str, Any]) -> None:
        wall, obj = _wall(value), value  # the outermost wall time wins: it timed the call
        for _ in range(4):
            if _is_response(obj):
                ev = evidence_from_response(obj, wall_s=wall)
                self.out.calls.append(AuditCall(source, ev, **sent))
                return
            inner = next((obj[k] for k in WRAPPER_KEYS if isinstance(obj.get(k), dict)), None)
            if not isinstance(inner, dict):
                self.bad(source, "not a call output (no choices, usage, error or messages)")
                return
            obj, wall = inner, wall if wall is not None else _wall(inner)
        self.bad(source, "not a call output (wrapped too deep)")

    def take_aiperf(self, value: dict[str, Any], source: str) -> None:
        """An aiperf record; a request read from both exports counts once, from the raw one."""
        got = read_aiperf(value)
        if isinstance(got, str):
            self.skip(source, got)
            return
        sent, prompt = {}, None
        if got.request is not None:
            sent = self.take_request(got.request, source)
            prompt = self.out.prompts.pop()
        wall = None if got.start_ns is None or got.end_ns is None else got.end_ns - got.start_ns
        ev = evidence_from_response(got.reply, wall_s=None if wall is None else wall / 1e9)
        ev = ev if got.error is None else replace(ev, reason=got.error)
        call = AuditCall(source, ev, **sent, start_ns=got.start_ns, end_ns=got.end_ns)
        seen = self.aiperf.get(key := got.request_id or source)
        if seen is not None and (seen[0] or not got.raw):
            self.skip(source, f"the same aiperf request as {seen[1].source}")
            return
        if seen is not None:
            self.skip(seen[1].source, f"the same aiperf request as {source} (raw export)")
        self.aiperf[key] = (got.raw, call, prompt)

    def finish(self) -> AuditInput:
        """The aiperf calls join the rest in start order (the raw export is not)."""
        for _, call, prompt in sorted(self.aiperf.values(), key=lambda t: t[1].start_ns or 0):
            self.out.calls.append(call)
            self.out.prompts.extend([prompt] if prompt is not None else [])
        return self.out

    def take_measurement(self, value: dict[str, JSONValue], source: str) -> None:
        try:
            record = Measurement.from_dict(value)
        except CorruptRecordError as exc:
            self.bad(source, f"corrupt measurement record: {exc}")
            return
        self.out.measurements.append(record)
        calls = record.body.get("calls")  # the recorded calls themselves: not in `outcome`
        if not isinstance(calls, list):
            self.bad(source, "measurement record: body.calls is not a list")
            return
        head = (record.sha256, record.build.build_id, record.outcome.frame)
        for i, call in enumerate(calls):
            where = f"{source}#calls[{i}]"
            raw = call.get("evidence") if isinstance(call, dict) else None
            try:
                self.out.calls.append(AuditCall(where, CallEvidence.from_dict(raw), *head))
            except CorruptRecordError as exc:
                self.bad(where, f"corrupt call evidence: {exc}")

    def read_file(self, path: Path, *, follow: bool) -> None:
        """Read one file: opened non-blocking (a FIFO never waits for a writer), then
        re-checked with fstat (a file swapped for a FIFO after the listing is skipped)."""
        flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
        try:
            with os.fdopen(os.open(path, flags), "rb") as fh:
                mode = os.fstat(fh.fileno()).st_mode
                if not stat.S_ISREG(mode):
                    self.skip(str(path), f"not a regular file ({_kind(mode)})")
                    return
                self.out.files += 1
                if path.suffix.lower() in (".jsonl", ".ndjson"):
                    self.read_lines(fh, str(path))
                    return
                data = fh.read(MAX_DOCUMENT + 1)
        except OSError as exc:
            if not follow and path.is_symlink():
                self.skip(str(path), "a symlink (not followed)")
            else:
                self.bad(str(path), f"cannot read: {exc.strerror or exc}")
            return
        if len(data) > MAX_DOCUMENT:
            self.skip(str(path), f"a JSON document over {MAX_DOCUMENT:,} bytes: not read")
            return
        try:
            self.take(loads(data), str(path))  # `take` lists what it cannot read, never raises
        except CorruptRecordError as exc:
            lines = [line for line in data.splitlines() if line.strip()]
            if len(lines) > 1 and all(map(_parses, lines)):  # a .json file holding JSON lines
                self.read_lines(io.BytesIO(data), str(path))
            else:
                self.bad(str(path), str(exc))

    def read_lines(self, fh: BinaryIO, source: str) -> None:
        seen = False
        for lineno, line in enumerate(_lines(fh), 1):
            where = f"{source}:{lineno}"
            if line is not None and not line.strip():
                continue
            seen = True
            if line is None:
                self.skip(where, f"a line over {MAX_DOCUMENT:,} bytes: read past, not parsed")
                continue
            try:
                self.take(loads(line), where)
            except CorruptRecordError as exc:
                self.bad(where, str(exc))
        if not seen:
            self.bad(source, "empty file")

    def walk(self, top: Path) -> None:
        """The call-output files under `top`, depth first in name order, without recursion; a
        symlink (to a directory: a loop) or a non-regular entry is skipped, never opened."""
        stack = [top]
        while stack:
            try:
                with os.scandir(stack.pop()) as it:
                    entries = sorted(it, key=lambda e: e.name)
            except OSError as exc:
                self.bad(str(exc.filename), f"cannot read: {exc.strerror or exc}")
                continue
            subdirs = []
            for entry in entries:
                try:
                    mode = entry.stat(follow_symlinks=False).st_mode
                    if stat.S_ISLNK(mode) and entry.is_dir():
                        self.skip(entry.path, "a symlinked directory (not followed)")
                    elif stat.S_ISDIR(mode):
                        subdirs.append(Path(entry.path))
                    elif not entry.name.lower().endswith(SUFFIXES):
                        continue
                    elif stat.S_ISLNK(mode):
                        self.skip(entry.path, "a symlink (not followed)")
                    elif not stat.S_ISREG(mode):
                        self.skip(entry.path, f"not a regular file ({_kind(mode)})")
                    else:
                        self.read_file(Path(entry.path), follow=False)
                except OSError as exc:
                    self.bad(entry.path, f"cannot read: {exc.strerror or exc}")
            stack.extend(reversed(subdirs))


def read_outputs(paths: Iterable[Path | str], *, frame: Head | None = None) -> AuditInput:
    """Every call output and request under `paths` (files or directories); bad input is
    listed in `malformed` or `skipped`, never raised. A path named directly may be a symlink
    to a regular file (the user chose it). `frame`: each request's drift from it is kept
    (`PromptSeen.drift`). Raises `UsageError`: `paths` is a single path or string, or
    `frame` is not a head."""
    if isinstance(paths, str | bytes | Path) or not isinstance(paths, Iterable):
        raise UsageError("paths must be a list of files or directories")
    if frame is not None and not isinstance(frame, Prefix | Frame):
        raise UsageError(f"frame must be a head (Registry.head), not {type(frame).__name__}")
    reader = _Reader(frame)
    for item in paths:
        path, before = Path(item), reader.out.seen + len(reader.aiperf)
        if path.is_dir():
            reader.walk(path)
            if reader.out.seen + len(reader.aiperf) == before:
                reader.bad(str(path), "no .json or .jsonl files in this directory")
        elif path.exists():
            reader.read_file(path, follow=True)
        else:
            reader.bad(str(path), "no such file or directory")
    return reader.finish()
