"""`python -m prefixreg` runs the command-line app."""

from __future__ import annotations

from prefixreg.cli.main import run

run()
