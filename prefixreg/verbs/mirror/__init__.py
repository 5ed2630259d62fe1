"""`prefixreg mirror`: one-way `rsync -a --delete` of an origin registry to its workers.

The mirror is provenance next to a worker, kept exact by a nightly job. `--delete` makes a
wrong source or destination catastrophic, so the guards are the feature:

- The source must be an origin registry (`REGISTRY.json` role `origin`) holding objects.
- A destination must be a local path or `[user@]host:path`, never start with `-`, and be
  missing, empty, or a mirror (its own `REGISTRY.json` says role `mirror`). An origin
  registry or a directory holding anything else is refused before anything is written;
  the destination counts as empty only when rsync's listing positively says so.
- Destinations are de-duplicated (local paths resolved first); nested destinations, and a
  local one that is, holds or lies inside the source (`/` included), are refused.
- What travels is checked by type and hash before any destination is touched: an entry
  that is a symlink, device or FIFO, a directory where an object or record file belongs (or
  the reverse), or an object whose bytes do not hash to its name refuses the whole run
  (`IntegrityError`, exit 3, nothing sent). Every object sent is read back from the
  destination and hashed before any name or meta record that points to it is sent (a
  mismatch fails that destination, exit 6).

How a run goes, per destination (destinations run in parallel; one failing stops nothing):

1. compare: an itemized `rsync -a --delete --dry-run` (with `--checksum` under
   `full_verify`). Its output is the plan; when it is empty the destination already equals
   the source and that dry run *is* the confirmation, so a no-change run costs one pass.
2. apply the plan in an order that keeps the reader promise of DESIGN §3 (`session`).
3. confirm: the compare dry run again; it must list nothing. If the origin changed during
   the run it lists those changes and another round applies them (at most `max_rounds`).

"Verified" means that confirming dry run found no difference (by size and mtime, or by
content with `full_verify`) and every object sent was read back and hashed.

`REGISTRY.json` never travels (the destination keeps its own, role `mirror`, written
before anything else), nor do `.locks/`, temp files or `mirror.log`. Each destination's run
appends one JSON line to the source's `mirror.log`.

Modules, one role each: `run` (the use case), `session` (one destination's passes),
`plan` (a plan read by the layout), `verifier` (hashes at both ends), `ssh` (the shared
connection), `guards` (source and destination refusals), `report` (results); the rsync
argv builder and runner live in `prefixreg.verbs.mirror.rsync`.
"""

from __future__ import annotations

from prefixreg.verbs.mirror.guards import check_source
from prefixreg.verbs.mirror.report import DestinationResult, MirrorReport, PassRecord
from prefixreg.verbs.mirror.run import (
    ENV_SSH_OPTS,
    ENV_TO,
    destinations_from_env,
    mirror,
    ssh_options_from_env,
)

__all__ = [
    "ENV_SSH_OPTS",
    "ENV_TO",
    "DestinationResult",
    "MirrorReport",
    "PassRecord",
    "check_source",
    "destinations_from_env",
    "mirror",
    "ssh_options_from_env",
]
