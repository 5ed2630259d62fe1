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

from prefixreg.core.errors import AmbiguousRefError as AmbiguousRefError
from prefixreg.core.errors import ArgumentTypeError as ArgumentTypeError
from prefixreg.core.errors import ArgumentValueError as ArgumentValueError
from prefixreg.core.errors import CorruptRecordError as CorruptRecordError
from prefixreg.core.errors import EngineBusyError as EngineBusyError
from prefixreg.core.errors import EvidenceUnverifiedError as EvidenceUnverifiedError
from prefixreg.core.errors import IntegrityError as IntegrityError
from prefixreg.core.errors import InvalidContentError as InvalidContentError
from prefixreg.core.errors import InvalidDigestError as InvalidDigestError
from prefixreg.core.errors import InvalidNameError as InvalidNameError
from prefixreg.core.errors import LockTimeoutError as LockTimeoutError
from prefixreg.core.errors import MalformedResponseError as MalformedResponseError
from prefixreg.core.errors import MirrorError as MirrorError
from prefixreg.core.errors import PrefixregError as PrefixregError
from prefixreg.core.errors import RefNotFoundError as RefNotFoundError
from prefixreg.core.errors import RegistryLocationError as RegistryLocationError
from prefixreg.core.errors import ReplyTooLargeError as ReplyTooLargeError
from prefixreg.core.errors import UsageError as UsageError
from prefixreg.core.errors import WorkerError as WorkerError
from prefixreg.core.errors import WorkerHTTPError as WorkerHTTPError
from prefixreg.core.errors import WorkerTimeoutError as WorkerTimeoutError
from prefixreg.core.errors import WorkerUnreachableError as WorkerUnreachableError

if TYPE_CHECKING:
    from prefixreg.core.frame import Frame as Frame
    from prefixreg.core.frame import Head as Head
    from prefixreg.core.judge import Judgement as Judgement
    from prefixreg.core.judge import judge as judge
    from prefixreg.core.judge import judge_copy as judge_copy
    from prefixreg.core.judge import judge_resident as judge_resident
    from prefixreg.core.judge import judge_restore as judge_restore
    from prefixreg.core.prefix import Prefix as Prefix
    from prefixreg.core.prefix import fresh_tail as fresh_tail
    from prefixreg.core.prefix import rest_bytes as rest_bytes
    from prefixreg.core.records import CacheCounters as CacheCounters
    from prefixreg.core.records import CallEvidence as CallEvidence
    from prefixreg.core.records import Measurement as Measurement
    from prefixreg.core.records import Meta as Meta
    from prefixreg.core.records import NameMove as NameMove
    from prefixreg.core.records import ServerBuild as ServerBuild
    from prefixreg.registry.names import NameConflictError as NameConflictError
    from prefixreg.registry.store import Registry as Registry
    from prefixreg.server.calllog import call_line as call_line
    from prefixreg.server.calllog import call_record as call_record
    from prefixreg.server.evidence import evidence_from_response as evidence_from_response
    from prefixreg.server.worker import Worker as Worker
    from prefixreg.verbs.keepalive.run import KeepAlive as KeepAlive
    from prefixreg.verbs.loop import LoopJudge as LoopJudge
    from prefixreg.verbs.loop import LoopStats as LoopStats
    from prefixreg.verbs.loop import Session as Session
    from prefixreg.verbs.measure.warm import WarmResult as WarmResult
    from prefixreg.verbs.measure.warm import warm as warm
    from prefixreg.verbs.mirror.snapshots import ship_snapshot as ship_snapshot
    from prefixreg.verbs.pool.live import Pool as Pool
    from prefixreg.verbs.pool.spec import PoolSpec as PoolSpec
    from prefixreg.verbs.pool.spec import pool_spec as pool_spec
    from prefixreg.verbs.qualify.run import QualifyResult as QualifyResult
    from prefixreg.verbs.qualify.run import qualify as qualify
    from prefixreg.verbs.snapshot.run import restore_and_prove as restore_and_prove
    from prefixreg.verbs.snapshot.run import save_snapshot as save_snapshot

    __version__: str

# The module (under prefixreg.) of each public name not imported above (space-separated),
# imported on first use.
_LAZY = {
    "core.frame": "Frame Head",
    "core.judge": "Judgement judge judge_copy judge_resident judge_restore",
    "core.prefix": "Prefix fresh_tail rest_bytes",
    "core.records": "CacheCounters CallEvidence Measurement Meta NameMove ServerBuild",
    "registry.names": "NameConflictError",
    "registry.store": "Registry",
    "server.calllog": "call_line call_record",
    "server.evidence": "evidence_from_response",
    "server.worker": "Worker",
    "verbs.keepalive.run": "KeepAlive",
    "verbs.loop": "LoopJudge LoopStats Session",
    "verbs.measure.warm": "WarmResult warm",
    "verbs.mirror.snapshots": "ship_snapshot",
    "verbs.pool.live": "Pool",
    "verbs.qualify.run": "QualifyResult qualify",
    "verbs.pool.spec": "PoolSpec pool_spec",
    "verbs.snapshot.run": "restore_and_prove save_snapshot",
}
# The face: every error of the tree (imported above), every lazy name, the version and
# `open_registry`.
_ERRORS = [n for n, v in globals().items() if isinstance(v, type) and issubclass(v, PrefixregError)]
__all__ = sorted([*_ERRORS, *" ".join(_LAZY.values()).split(), "__version__", "open_registry"])


def open_registry(path: Path | str | None = None) -> Registry:
    """Open the registry at `path`, else `$PREFIXREG_HOME`, else the XDG state directory."""
    from prefixreg.core.errors import check_type
    from prefixreg.registry.location import resolve_registry_path
    from prefixreg.registry.store import Registry

    check_type(path, (str, Path, type(None)), "open_registry: path", "a str, a Path or None")
    return Registry(resolve_registry_path(path))


def __getattr__(name: str) -> Any:
    if name == "__version__":
        from prefixreg.core.version import package_version

        return package_version()
    module = next((m for m, names in _LAZY.items() if name in names.split()), None)
    if module is None:
        raise AttributeError(f"module 'prefixreg' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"prefixreg.{module}"), name)
    globals()[name] = value
    return value
