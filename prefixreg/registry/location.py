"""Where the registry lives: `--registry` flag, then `$PREFIXREG_HOME`, then the XDG state dir
(`~/.local/state/prefix-registry` on Linux); the old layout kept it at `~/prefix-registry`.

Invariant: resolving only computes a path, never creating or inspecting anything, so any
command may call it; `migration_hint` only stats (read-only) the default and old locations.
"""

from __future__ import annotations

import os
from pathlib import Path

from prefixreg.registry.layout import MARKER

LEGACY_DIRNAME = "prefix-registry"


def default_registry_path() -> Path:
    """The platform's user state directory for the registry (XDG on Linux)."""
    import platformdirs  # only needed when no flag or env names the registry

    return Path(platformdirs.user_state_dir(LEGACY_DIRNAME, appauthor=False))


def resolve_registry_path(flag: Path | str | None = None) -> Path:
    """Pick the registry directory: explicit flag > $PREFIXREG_HOME > XDG state directory."""
    if flag is not None and str(flag) != "":
        return Path(flag).expanduser()
    env = os.environ.get("PREFIXREG_HOME")
    return Path(env).expanduser() if env else default_registry_path()


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
    """A hint when `path` is the default location, still empty, and `~/prefix-registry` is not."""
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
    adopt = "" if (legacy / MARKER).exists() else " --repoint"  # the seed's, hand-built
    return f"found a registry at {shown}; run prefixreg migrate {shown}{adopt}"
