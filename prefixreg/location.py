"""Where the registry lives: `--registry` flag, then `$PREFIXREG_HOME`, then the XDG state dir.

Resolution only computes a path; it never creates or inspects anything, so it is safe to
call from any command. The default on Linux is `~/.local/state/prefix-registry`.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["ENV_HOME", "LEGACY_DIRNAME", "default_registry_path", "resolve_registry_path"]

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
