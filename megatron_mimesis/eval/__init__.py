"""Evaluation of user simulators (and of agents against them): held-out likelihood, behaviour statistics,
judged metrics and task-difficulty calibration. ``tools/eval_simulator.py`` and ``tools/eval_agent.py`` are
the entry points."""
