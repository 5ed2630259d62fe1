"""prefixreg: a content-addressed registry of LLM prompt prefixes.

The public API (DESIGN §6). Heavy parts (the HTTP client, evidence parsing) load on first
use, so `import prefixreg` and the CLI start quickly.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from prefixreg.core.errors import (
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
    __version__: str
    from prefixreg.core.prefix import Prefix, fresh_tail
    from prefixreg.core.records import (
        CacheCounters,
        CallEvidence,
        Measurement,
        Meta,
        NameMove,
        ServerBuild,
    )
    from prefixreg.registry.store import Registry
    from prefixreg.server.evidence import evidence_from_response
    from prefixreg.server.worker import Worker
    from prefixreg.verbs.keepalive.run import KeepAlive
    from prefixreg.verbs.loop import LoopStats

# name -> module, loaded on first access (PEP 562) so `import prefixreg` and the CLI's
# start-up do not pay for the store, the records or the HTTP client until they are used.
_LAZY = {
    "Prefix": "prefixreg.core.prefix",
    "fresh_tail": "prefixreg.core.prefix",
    "CacheCounters": "prefixreg.core.records",
    "CallEvidence": "prefixreg.core.records",
    "Measurement": "prefixreg.core.records",
    "Meta": "prefixreg.core.records",
    "NameMove": "prefixreg.core.records",
    "ServerBuild": "prefixreg.core.records",
    "Registry": "prefixreg.registry.store",
    "KeepAlive": "prefixreg.verbs.keepalive.run",
    "LoopStats": "prefixreg.verbs.loop",
    "Worker": "prefixreg.server.worker",
    "evidence_from_response": "prefixreg.server.evidence",
}

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
    from prefixreg.registry.location import resolve_registry_path
    from prefixreg.registry.store import Registry

    return Registry(resolve_registry_path(path))


def __getattr__(name: str) -> Any:
    if name == "__version__":
        from prefixreg.core.version import package_version

        return package_version()
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'prefixreg' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
