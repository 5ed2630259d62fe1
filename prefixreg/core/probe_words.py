"""The probe corpus's vocabulary, shared by the probe (which writes its built-in corpus from it)
and the simulator (whose tokenizer is calibrated on that corpus). Pure data.

The order of `PROBE_WORDS` is part of the corpus (a seeded choice over it): changing it changes
every probe slice, and the simulator's calibration with it.
"""

from __future__ import annotations

from typing import Final

PROBE_WORDS: Final = tuple(
    """agent repository module function test commit branch review patch refactor
error type value index cache prefix token worker server request response stream buffer config
option default parse render record measure verify hash object name journal lock write read
file path directory build release version schema field count state always never before after
when unless every each only the a of to in for with on keep check run report explain prefer
avoid return raise handle log retry fail close""".split()  # noqa: SIM905 -- prose, in order
)
PROBE_FILES: Final = ("store.py", "worker.py", "README.md", "tests/test_store.py", "pyproject.toml")
