"""`prefixreg mirror`: one-way `rsync -a --delete` of an origin registry to its workers.

The mirror is provenance next to a worker, kept exact by a nightly job. `--delete` makes a
wrong source or destination catastrophic, so the guards are the feature (`run`): an origin
source holding objects; destinations that are local paths or `[user@]host:path`, never
nested, never overlapping the source, and missing (in an existing parent), empty, or a
mirror (`session`). What travels is checked by type and hash first (`plan`); nothing is
sent on a failure (exit 3).

Per destination: compare (two itemized dry runs: objects by size and mtime, everything
else by content) while every object there is hashed there (`sha256sum`, over the run's ssh
connection); apply the plan in the order that keeps DESIGN §3's reader promise (objects
first, each hashed at the destination after sending; names and meta never before their
object; deletions last); compare again until nothing differs. "verified" comes from
`core.judge.judge_copy`: every object there hashed and matching its name, every other file
equal by content. `REGISTRY.json`, `.locks/`, temp files and `mirror.log` never travel;
each destination's run appends one JSON line to the source's `mirror.log`.

Modules: `run` (the use case and its guards), `session` (one destination), `plan` (a plan
judged at the source), `rsync` (argv, runner, parsers), `ssh` (the shared connection),
`report` (results).
"""

from __future__ import annotations

from prefixreg.verbs.mirror.report import DestinationResult, MirrorReport, PassRecord
from prefixreg.verbs.mirror.run import ENV_SSH_OPTS, ENV_TO, mirror

__all__ = ["ENV_SSH_OPTS", "ENV_TO", "DestinationResult", "MirrorReport", "PassRecord", "mirror"]
