"""Benchmarks: each measures against a baseline run in the same invocation and writes JSON (and a table) under
``runs/``; ``python tools/bench/X.py`` from the repository."""
