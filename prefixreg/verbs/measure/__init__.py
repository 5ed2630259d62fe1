"""Measuring a head on a worker, the one `verbs` package every verb may share: `calls` (a
measured call, its record and judgement, the head's measured span), `warm` (warm a head and
prove it resumes), `slots` (llama.cpp slot calls) and `budget` (how much foreign traffic a
cache survives). Verdicts come from `prefixreg.core.judge` only."""
