"""`prefixreg mirror`: one-way `rsync -a --delete` of an origin registry to its workers.

The mirror is provenance next to a worker, kept exact by a nightly job. `--delete` makes a
wrong source or destination catastrophic, so the guards are the feature (`run`, `session`);
what travels is checked by type and hash first (`plan`): nothing is sent on a failure.
Each destination is compared (objects by size and mtime while every object there is hashed
there; everything else by content), written in the order of DESIGN §3's reader promise,
and compared again until nothing differs; "verified" comes from `core.judge.judge_copy`.
`REGISTRY.json`, `.locks/`, temp files and `mirror.log` never travel; each destination's
run appends one JSON line to the source's `mirror.log`. `rsync` holds the argv builders,
the runner and the parsers.
"""

from __future__ import annotations

from prefixreg.verbs.mirror.run import ENV_SSH_OPTS, ENV_TO, MirrorReport, mirror
from prefixreg.verbs.mirror.session import DestinationResult, PassRecord

__all__ = ["ENV_SSH_OPTS", "ENV_TO", "DestinationResult", "MirrorReport", "PassRecord", "mirror"]
