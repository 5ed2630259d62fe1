"""Where the registry lives: `--registry` flag, then `$PREFIXREG_HOME`, then the XDG state dir.

Resolution only computes a path; it never creates or inspects anything, so it is safe to
call from any command. The default on Linux is `~/.local/state/prefix-registry`.

The old layout kept the registry at `~/prefix-registry` (`legacy_registry_path`).
`migration_hint` looks (read-only: two stats) whether the default location is still empty
while the old one exists, so commands can tell the user to run `prefixreg migrate`.
"""

from __future__ import annotations

import os
from pathlib import Path

from prefixreg.registry.layout import MARKER

ENV_HOME = "PREFIXREG_HOME"
LEGACY_DIRNAME = "prefix-registry"


def default_registry_path() -> Path:
    """The platform's user state directory for the registry (XDG on Linux)."""
    import platformdirs  # only needed when no flag or env names the registry

    return Path(platformdirs.user_state_dir(LEGACY_DIRNAME, appauthor=False))


def resolve_registry_path(flag: Path | str | None = None) -> Path:
    """Pick the registry directory: explicit flag > $PREFIXREG_HOME > XDG state directory."""
    if flag is not None and str(flag) != "":
        return Path(flag).expanduser()
    env = os.environ.get(ENV_HOME)
    if env:
        return Path(env).expanduser()
    return default_registry_path()


def legacy_registry_path() -> Path:
    """Where the old layout kept the registry: `~/prefix-registry`."""
    return Path.home() / LEGACY_DIRNAME


def display_path(path: Path) -> str:
    """`path` with the home directory shown as `~` (for messages people copy and paste)."""
    try:
        return "~/" + str(path.relative_to(Path.home()))
    except ValueError:
        return str(path)


def migration_hint(path: Path) -> str | None:
    """A one-line hint when `path` is the default location, holds no registry yet, and the
    old location `~/prefix-registry` does; otherwise None. Never creates anything."""
    legacy = legacy_registry_path()
    # Cheapest test first: without an old registry there is nothing to hint (and no need
    # to import platformdirs on a command that was given --registry).
    if legacy == path or not legacy.is_dir():
        return None
    if path != default_registry_path():
        return None  # the user named a registry on purpose (flag or $PREFIXREG_HOME)
    if (path / MARKER).exists() or (path.is_dir() and any(path.iterdir())):
        return None
    shown = display_path(legacy)
    return f"found a registry at {shown}; run prefixreg migrate {shown}"
