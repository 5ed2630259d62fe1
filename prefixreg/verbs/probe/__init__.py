"""`probe`: measure a worker's cache (legs A1/A2/B/C, checks, Cmax, survival)."""
