"""Measuring a head on a worker: the one part of `verbs` every verb may share.

`calls` (a measured call, its record, the head's measured span, the judge applied to a
check), `warm` (warm a head and prove it resumes), `slots` (llama.cpp slot calls: a warm
that finds its slot, a pinned check) and `budget` (how much foreign traffic a cache
survives). Verdicts come from `prefixreg.core.judge` only.
"""
