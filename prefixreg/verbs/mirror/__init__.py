"""`prefixreg mirror`: one-way `rsync -a --delete` of an origin registry to its workers.

The mirror is provenance next to a worker, kept exact by a nightly job. `--delete` makes a
wrong source or destination catastrophic, so the guards are the feature (`run`, `session`);
what travels is checked by type and hash first (`plan`); `rsync` is the transport.
`REGISTRY.json`, `.locks/`, temp files and `mirror.log` never travel.
"""

from __future__ import annotations

from prefixreg.verbs.mirror.run import ENV_SSH_OPTS, ENV_TO, MirrorReport, mirror, mirror_targets
from prefixreg.verbs.mirror.session import DestinationResult, PassRecord

__all__ = [
    "ENV_SSH_OPTS",
    "ENV_TO",
    "DestinationResult",
    "MirrorReport",
    "PassRecord",
    "mirror",
    "mirror_targets",
]
