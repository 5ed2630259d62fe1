"""prefixreg: a content-addressed registry of LLM prompt prefixes.

The public API (DESIGN §6). Heavy parts (the HTTP client, evidence parsing) load on first
use, so `import prefixreg` and the CLI start quickly.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from prefixreg.errors import (
    AmbiguousRefError,
    CorruptRecordError,
    EngineBusyError,
    EvidenceUnverifiedError,
    IntegrityError,
    InvalidContentError,
    InvalidDigestError,
    InvalidNameError,
    LockTimeoutError,
    MalformedResponseError,
    MirrorError,
    PrefixregError,
    RefNotFoundError,
    RegistryLocationError,
    UsageError,
    WorkerError,
    WorkerHTTPError,
    WorkerTimeoutError,
    WorkerUnreachableError,
)

if TYPE_CHECKING:
    from prefixreg.evidence import evidence_from_response
    from prefixreg.keepalive import KeepAlive
    from prefixreg.loopstats import LoopStats
    from prefixreg.prefix import Prefix, fresh_tail
    from prefixreg.records import (
        CacheCounters,
        CallEvidence,
        Measurement,
        Meta,
        NameMove,
        ServerBuild,
    )
    from prefixreg.store import Registry
    from prefixreg.worker import Worker

# name -> module, loaded on first access (PEP 562) so `import prefixreg` and the CLI's
# start-up do not pay for the store, the records or the HTTP client until they are used.
_LAZY = {
    "Prefix": "prefixreg.prefix",
    "fresh_tail": "prefixreg.prefix",
    "CacheCounters": "prefixreg.records",
    "CallEvidence": "prefixreg.records",
    "Measurement": "prefixreg.records",
    "Meta": "prefixreg.records",
    "NameMove": "prefixreg.records",
    "ServerBuild": "prefixreg.records",
    "Registry": "prefixreg.store",
    "KeepAlive": "prefixreg.keepalive",
    "LoopStats": "prefixreg.loopstats",
    "Worker": "prefixreg.worker",
    "evidence_from_response": "prefixreg.evidence",
}

__version__ = "0.1.0"

__all__ = [
    "AmbiguousRefError",
    "CacheCounters",
    "CallEvidence",
    "CorruptRecordError",
    "EngineBusyError",
    "EvidenceUnverifiedError",
    "IntegrityError",
    "InvalidContentError",
    "InvalidDigestError",
    "InvalidNameError",
    "KeepAlive",
    "LockTimeoutError",
    "LoopStats",
    "MalformedResponseError",
    "Measurement",
    "Meta",
    "MirrorError",
    "NameMove",
    "Prefix",
    "PrefixregError",
    "RefNotFoundError",
    "Registry",
    "RegistryLocationError",
    "ServerBuild",
    "UsageError",
    "Worker",
    "WorkerError",
    "WorkerHTTPError",
    "WorkerTimeoutError",
    "WorkerUnreachableError",
    "__version__",
    "evidence_from_response",
    "fresh_tail",
    "open_registry",
]


def open_registry(path: Path | str | None = None) -> Registry:
    """Open the registry at `path`, else `$PREFIXREG_HOME`, else the XDG state directory."""
    from prefixreg.location import resolve_registry_path
    from prefixreg.store import Registry

    return Registry(resolve_registry_path(path))


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'prefixreg' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
