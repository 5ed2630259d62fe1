"""prefixreg: a content-addressed registry of LLM prompt prefixes, and the tools that make a
prompt cache resume them.

The front door (DESIGN §6): everything the README and the examples use is importable from
here, and a loop never imports a sub-package. The errors load with the package; everything
else loads on first use (PEP 562), so `import prefixreg` and the CLI start quickly.
"""

from __future__ import annotations

import importlib
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
    ReplyTooLargeError,
    UsageError,
    WorkerError,
    WorkerHTTPError,
    WorkerTimeoutError,
    WorkerUnreachableError,
)

if TYPE_CHECKING:
    from prefixreg.core.frame import Frame, Head
    from prefixreg.core.judge import (
        Judgement,
        judge,
        judge_copy,
        judge_resident,
        judge_restore,
    )
    from prefixreg.core.prefix import Prefix, fresh_tail
    from prefixreg.core.records import (
        CacheCounters,
        CallEvidence,
        Measurement,
        Meta,
        NameMove,
        ServerBuild,
    )
    from prefixreg.registry.names import NameConflictError
    from prefixreg.registry.store import Registry
    from prefixreg.server.evidence import evidence_from_response
    from prefixreg.server.worker import Worker
    from prefixreg.verbs.keepalive.run import KeepAlive
    from prefixreg.verbs.loop import LoopJudge, LoopStats
    from prefixreg.verbs.measure.warm import WarmResult, warm
    from prefixreg.verbs.pool.live import Pool
    from prefixreg.verbs.snapshot.run import restore_and_prove, save_snapshot

    __version__: str

# Public name -> the module that defines it, imported on first access.
_LAZY = {
    **dict.fromkeys(["Frame", "Head"], "prefixreg.core.frame"),
    **dict.fromkeys(["Prefix", "fresh_tail"], "prefixreg.core.prefix"),
    **dict.fromkeys(
        ["Judgement", "judge", "judge_copy", "judge_resident", "judge_restore"],
        "prefixreg.core.judge",
    ),
    **dict.fromkeys(
        ["CacheCounters", "CallEvidence", "Measurement", "Meta", "NameMove", "ServerBuild"],
        "prefixreg.core.records",
    ),
    "NameConflictError": "prefixreg.registry.names",
    "Registry": "prefixreg.registry.store",
    "evidence_from_response": "prefixreg.server.evidence",
    "Worker": "prefixreg.server.worker",
    "KeepAlive": "prefixreg.verbs.keepalive.run",
    **dict.fromkeys(["LoopJudge", "LoopStats"], "prefixreg.verbs.loop"),
    **dict.fromkeys(["WarmResult", "warm"], "prefixreg.verbs.measure.warm"),
    "Pool": "prefixreg.verbs.pool.live",
    **dict.fromkeys(["restore_and_prove", "save_snapshot"], "prefixreg.verbs.snapshot.run"),
}

__all__ = [
    "AmbiguousRefError",
    "CacheCounters",
    "CallEvidence",
    "CorruptRecordError",
    "EngineBusyError",
    "EvidenceUnverifiedError",
    "Frame",
    "Head",
    "IntegrityError",
    "InvalidContentError",
    "InvalidDigestError",
    "InvalidNameError",
    "Judgement",
    "KeepAlive",
    "LockTimeoutError",
    "LoopJudge",
    "LoopStats",
    "MalformedResponseError",
    "Measurement",
    "Meta",
    "MirrorError",
    "NameConflictError",
    "NameMove",
    "Pool",
    "Prefix",
    "PrefixregError",
    "RefNotFoundError",
    "Registry",
    "RegistryLocationError",
    "ReplyTooLargeError",
    "ServerBuild",
    "UsageError",
    "WarmResult",
    "Worker",
    "WorkerError",
    "WorkerHTTPError",
    "WorkerTimeoutError",
    "WorkerUnreachableError",
    "__version__",
    "evidence_from_response",
    "fresh_tail",
    "judge",
    "judge_copy",
    "judge_resident",
    "judge_restore",
    "open_registry",
    "restore_and_prove",
    "save_snapshot",
    "warm",
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
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
