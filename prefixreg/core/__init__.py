"""Pure building blocks every layer shares: errors, sha256 digests and build ids, canonical
JSON, frozen records and the verified `Prefix`.

Invariant: nothing here opens a file, a socket or a process; it imports only the standard
library, orjson and blake3.
"""

from __future__ import annotations
