"""`prefixreg doctor`: what a worker says about its prompt cache, and what to change.

Exit codes: 0 nothing to change, 1 a finding says what to change, 5 worker error.
"""

from __future__ import annotations

import sys

import typer

from prefixreg.cli import _common as c


def doctor_command(
    worker: c.WorkerOpt = None,
    profile: c.ProfileOpt = None,
    registry: c.RegistryOpt = None,
    json_out: c.JsonOpt = False,
    debug: c.DebugOpt = False,
) -> None:
    """Say what a worker's /health and /cache tell about its prompt cache, and what to change.

    With the registry it also weighs Cmax, the best that this build's probe receipts prove,
    against the registered prefixes' token spans; Cmax under 4,000 tokens is urgent. Exit 0
    when nothing needs changing, 1 when a finding says what to change, 5 worker error.
    """
    from prefixreg.verbs.doctor.run import doctor

    with c.cli_errors(debug):
        reg = c.open_registry_from(registry)
        with c.open_worker(worker, model=None, timeout=30.0, profile=profile) as w:
            diagnosis = doctor(w, reg)
        if json_out:
            c.emit_json({"worker": w.url, **diagnosis.to_dict()})
        else:
            sys.stdout.write(f"worker {w.url} ({diagnosis.profile})\n")
            sys.stdout.writelines(f"  [{f.level}] {f.text}\n" for f in diagnosis.findings)
        raise typer.Exit(int(c.ExitCode.OK if diagnosis.healthy else c.ExitCode.NO))


def register(app: typer.Typer) -> None:
    """Add `doctor` to `app`."""
    app.command("doctor")(doctor_command)
