"""The error tree: every exception prefixreg raises derives from `PrefixregError`.

```
PrefixregError
├── UsageError                     bad arguments, names, references, content     (exit 2)
│   ├── InvalidNameError
│   ├── InvalidDigestError
│   ├── InvalidContentError        empty, not UTF-8
│   ├── RefNotFoundError (LookupError)
│   ├── AmbiguousRefError
│   ├── RegistryLocationError      not a registry, a file, newer format
│   ├── ArgumentTypeError (TypeError)    an API argument of the wrong type, named
│   └── ArgumentValueError (ValueError)  an API argument of the right type, wrong value
├── IntegrityError                 sha mismatch, symlink, corrupt record          (exit 3)
│   └── CorruptRecordError
├── EvidenceUnverifiedError        the server did not report what a claim needs   (exit 4)
├── WorkerError                    worker unreachable or HTTP error               (exit 5)
│   ├── WorkerUnreachableError (ConnectionError)
│   ├── WorkerTimeoutError (TimeoutError)
│   ├── WorkerHTTPError            carries status and the server's message
│   │   └── EngineBusyError        503 engine_busy
│   ├── MalformedResponseError     a body that is not the JSON promised
│   └── ReplyTooLargeError         a reply over the client's cap (`max_bytes`)
├── MirrorError                    rsync/ssh failure or refused mirror            (exit 6)
└── LockTimeoutError (TimeoutError)                                              (exit 7)
```

Exit codes are mapped in exactly one place, `prefixreg.cli._common.EXIT_CODES`. Context
travels as attributes (path, expected, actual, status) so callers need not parse messages.
Messages never contain secrets: an API key is never passed to an error constructor.
"""

from __future__ import annotations

from pathlib import Path


class PrefixregError(Exception):
    """Base of every error prefixreg raises; `hint` is an optional second line: what to do next."""

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.hint = hint


class UsageError(PrefixregError):
    """The caller asked for something that cannot be done as asked."""


class InvalidNameError(UsageError):
    """A name that does not match the name rules."""


class InvalidDigestError(UsageError):
    """A string that is not a sha256 digest (or an 8+ hex digit abbreviation of one)."""


class InvalidContentError(UsageError):
    """Prefix content the registry refuses: empty, or not valid UTF-8."""


class RefNotFoundError(UsageError, LookupError):
    """A reference that names no prefix."""


class AmbiguousRefError(UsageError):
    """An abbreviated sha that matches more than one object."""

    def __init__(self, message: str, *, candidates: list[str]) -> None:
        super().__init__(message, hint="use more hex digits or a name")
        self.candidates = candidates


class RegistryLocationError(UsageError):
    """A registry path that is a file, an unmarked non-empty directory, or a newer format."""


class ArgumentTypeError(UsageError, TypeError):
    """An API argument of the wrong type; the message names the argument (`check_type`)."""


class ArgumentValueError(UsageError, ValueError):
    """An API argument of the right type but a value it may not take; the message names it."""


def check_type(
    value: object,
    types: type | tuple[type, ...],
    argument: str,
    expected: str,
    *,
    hint: str | None = None,
) -> None:
    """Refuse `value` unless an instance of `types` (a bool is no int here): an
    `ArgumentTypeError` saying `argument` is `expected`, not what it was. A public function
    calls it at its door, once."""
    wanted = types if isinstance(types, tuple) else (types,)
    if not isinstance(value, wanted) or (isinstance(value, bool) and bool not in wanted):
        got = "None" if value is None else type(value).__name__
        raise ArgumentTypeError(f"{argument} is {expected}, not {got}", hint=hint)


def check_progress(progress: object, argument: str) -> None:
    """Refuse a `progress` that is neither None nor callable (`ArgumentTypeError`)."""
    if progress is not None and not callable(progress):
        got = type(progress).__name__
        raise ArgumentTypeError(f"{argument} is None or a function taking a str, not {got}")


class IntegrityError(PrefixregError):
    """Stored bytes do not hash to their name, or a record is not what it must be: nothing that
    depends on the bytes is done after this is raised (no output, no request)."""

    def __init__(
        self,
        message: str,
        *,
        path: Path | None = None,
        expected: str | None = None,
        actual: str | None = None,
    ) -> None:
        super().__init__(message)
        self.path = path
        self.expected = expected
        self.actual = actual


class CorruptRecordError(IntegrityError):
    """A JSON record (meta, name, measurement, marker) that cannot be parsed or is malformed."""


class EvidenceUnverifiedError(PrefixregError):
    """The server's reply does not carry the counts a claim needs."""


class WorkerError(PrefixregError):
    """The worker could not be reached or answered with an error."""

    def __init__(self, message: str, *, url: str | None = None, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.url = url


class WorkerUnreachableError(WorkerError, ConnectionError):
    """Connection refused, DNS failure, reset before a reply."""


class WorkerTimeoutError(WorkerError, TimeoutError):
    """The worker did not answer within the configured timeout."""


class WorkerHTTPError(WorkerError):
    """The worker answered with an HTTP error status; `message` is the server's own."""

    def __init__(
        self,
        message: str,
        *,
        status_code: int,
        code: str | None = None,
        url: str | None = None,
        hint: str | None = None,
    ) -> None:
        super().__init__(message, url=url, hint=hint)
        self.status_code = status_code
        self.code = code


class EngineBusyError(WorkerHTTPError):
    """503 `engine_busy`: the request waited longer than the server's queue timeout."""


class MalformedResponseError(WorkerError):
    """A reply that is not the JSON (or SSE) the route promises."""


class ReplyTooLargeError(WorkerError):
    """The worker's reply is larger than the reply cap (`max_bytes`)."""


class MirrorError(PrefixregError):
    """rsync or ssh failed, or a mirror was refused by its guards."""

    def __init__(
        self,
        message: str,
        *,
        returncode: int | None = None,
        stderr: str | None = None,
        hint: str | None = None,
    ) -> None:
        super().__init__(message, hint=hint)
        self.returncode = returncode
        self.stderr = stderr


class LockTimeoutError(PrefixregError, TimeoutError):
    """A registry lock could not be taken within its timeout."""

    def __init__(self, message: str, *, path: Path | None = None) -> None:
        super().__init__(message, hint="another prefixreg process holds the lock; retry later")
        self.path = path
