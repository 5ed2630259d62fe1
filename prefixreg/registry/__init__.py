"""The registry and its disk: the pure layout of on-disk format v1, the no-follow file
primitives, the store, and the lifecycle verbs that touch nothing but a registry (verify, gc,
migrate, location).

Invariant: only this package opens, lists, writes or deletes a path under a registry root, and
it never follows a symlink there. It imports `core` only, never the server layer.
"""

from __future__ import annotations
