"""The package version, read from the installed distribution's metadata (pyproject.toml is the
one place it is written). Read on first use only: importlib.metadata costs start-up time."""

from __future__ import annotations

import functools


@functools.cache
def package_version() -> str:
    """The installed prefixreg version, or "0+unknown" when run from an uninstalled tree."""
    from importlib import metadata

    try:
        return metadata.version("prefixreg")
    except metadata.PackageNotFoundError:
        return "0+unknown"
