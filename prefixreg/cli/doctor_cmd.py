"""`prefixreg doctor`: what a worker says about its prompt cache, and what to change.

Exit codes: 0 nothing to change, 1 a finding says what to change, 5 worker error.
"""

from __future__ import annotations

import sys

import typer

from prefixreg.cli._common import (
    DebugOpt,
    ExitCode,
    JsonOpt,
    ProfileOpt,
    RegistryOpt,
    WorkerOpt,
    cli_errors,
    emit_json,
    open_registry_from,
    open_worker,
)


def doctor_command(
    worker: WorkerOpt = None,
    profile: ProfileOpt = None,
    registry: RegistryOpt = None,
    json_out: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Say what a worker's /health and /cache tell about its prompt cache, and what to change.

    With the registry (--registry, else the default one) it also compares Cmax from the latest
    probe of this build with the registered prefixes' token spans; Cmax under 4,000 tokens is
    urgent. Exit 0 when nothing needs changing, 1 when a finding says what to change, 5 worker
    error.
    """
    from prefixreg.verbs.doctor.run import doctor

    with cli_errors(debug):
        reg = open_registry_from(registry)
        with open_worker(worker, model=None, timeout=30.0, profile=profile) as w:
            diagnosis = doctor(w, reg)
            url = w.url
        if json_out:
            emit_json({"worker": url, **diagnosis.to_dict()})
        else:
            sys.stdout.write(f"worker {url} ({diagnosis.profile})\n")
            for f in diagnosis.findings:
                sys.stdout.write(f"  [{f.level}] {f.text}\n")
        raise typer.Exit(int(ExitCode.OK if diagnosis.healthy else ExitCode.NO))


def register(app: typer.Typer) -> None:
    """Add `doctor` to `app`."""
    app.command("doctor")(doctor_command)
