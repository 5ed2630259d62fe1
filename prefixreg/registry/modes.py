"""Which write bits on a registry entry let another local user change it: the rule `verify`
reports as `insecure_mode` and adoption (`repointing.adopt`) drops, stated once.

Invariants:
- Everyone's write bit is always unsafe; the group's is unsafe unless the group is its
  owner's private one (the umask 002 convention: a group of that name, with no members).
- The common case (no group or other write bit) costs no user or group lookup.
"""

from __future__ import annotations

import grp
import os
import pwd
import stat


def _group_is_private(st: os.stat_result) -> bool:
    """Is the entry's group its owner's private group (umask 002)? Then group write is safe."""
    try:
        group, owner = grp.getgrgid(st.st_gid), pwd.getpwuid(st.st_uid)
    except KeyError:
        return False
    return group.gr_name == owner.pw_name and owner.pw_gid == st.st_gid and not group.gr_mem


def unsafe_write_bits(st: os.stat_result) -> int:
    """The write bits `insecure_mode` flags on an entry: everyone's, and its group's unless
    the group is its owner's private one (0: none)."""
    mode = stat.S_IMODE(st.st_mode)
    if not mode & 0o022:  # the common case, before any lookup
        return 0
    bits = mode & stat.S_IWOTH
    if mode & stat.S_IWGRP and not _group_is_private(st):
        bits |= stat.S_IWGRP
    return bits


def insecure_why(st: os.stat_result) -> str | None:
    """Why another user could write the entry (`writable by every user`, `writable by group
    N`), or None when no one but its owner (and a private group) can."""
    bits = unsafe_write_bits(st)
    if bits & stat.S_IWOTH:
        return "writable by every user"
    if bits & stat.S_IWGRP:
        return f"writable by group {st.st_gid}"
    return None
