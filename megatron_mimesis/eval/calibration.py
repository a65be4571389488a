"""Task-difficulty calibration: does a simulator make tasks as hard for an agent as real users did?

Input: a JSONL file of per-task real-user outcomes, ``{"task_id": str, "success": bool | number in [0, 1]}`` (a
number is the share of real users who succeeded). One agent plays every listed task against each simulator
(the shared episode machinery of :mod:`megatron_mimesis.eval.agents`, the env suites of agent RL). An episode
succeeds when its reward reaches ``success_reward``: 1 for tau2's 0/1 task reward; the toy env pays a point per
brief agent turn and one for the code, so there "brief and gave the code" is 2.

Per simulator: its success rate and the gap to the real users' (simulated - real, in points), and its expected
calibration error over tasks, reading the simulator's per-task success rate as a forecast of the real outcome:
ECE = sum over 10 equal-width forecast bins of (tasks in bin / tasks) * |mean forecast - mean real outcome|.
Tasks whose episodes could not be scored are left out of both and counted.
"""

from pathlib import Path

from data_prep.records import decode_json_line

ECE_BINS = 10


class OutcomeError(ValueError):
    """An outcomes file that cannot be used; the message names the file and line."""


def read_outcomes(path: Path) -> dict[str, float]:
    if not path.is_file():
        raise OutcomeError(f"--outcomes {path}: no such file")
    outcomes = {}
    with path.open("rb") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            location = f"{path}:{number}"
            try:
                record = decode_json_line(line, location)
            except ValueError as err:
                raise OutcomeError(str(err)) from None
            task_id = record.get("task_id") if isinstance(record, dict) else None
            success = record.get("success") if isinstance(record, dict) else None
            if not isinstance(task_id, str | int) or isinstance(task_id, bool):
                raise OutcomeError(f"{location}: task_id: expected a string")
            if isinstance(success, bool):
                success = float(success)
            if not isinstance(success, int | float) or not 0.0 <= success <= 1.0:
                raise OutcomeError(f"{location}: success: expected true/false or a number in [0, 1]")
            if str(task_id) in outcomes:
                raise OutcomeError(f"{location}: task_id {task_id!r} repeated")
            outcomes[str(task_id)] = float(success)
    if not outcomes:
        raise OutcomeError(f"--outcomes {path}: no outcomes")
    return outcomes


def expected_calibration_error(forecasts: list[float], outcomes: list[float], bins: int = ECE_BINS) -> float:
    members: dict[int, list[int]] = {}
    for i, p in enumerate(forecasts):
        members.setdefault(min(int(p * bins), bins - 1), []).append(i)
    total = len(forecasts)
    return sum(len(idx) / total * abs(sum(forecasts[i] for i in idx) / len(idx) - sum(outcomes[i] for i in idx) / len(idx))
               for idx in members.values())


def task_success(pair: dict, success_reward: float) -> dict[str, float]:
    """Per task, the share of its scored episodes that succeeded (tasks with none scored are absent)."""
    rates = {}
    for task_id, rewards in pair["task_rewards"].items():
        scored = [r for r in rewards if r is not None]
        if scored:
            rates[task_id] = sum(r >= success_reward for r in scored) / len(scored)
    return rates


def calibration_row(pair: dict, real: dict[str, float], success_reward: float) -> dict:
    simulated = task_success(pair, success_reward)
    tasks = sorted(simulated)
    if not tasks:
        return {"tasks": 0, "unscored_tasks": len(real), "success_rate": None, "real_success_rate": None,
                "gap": None, "ece": None, "per_task": {}}
    forecasts = [simulated[t] for t in tasks]
    outcomes = [real[t] for t in tasks]
    success, real_success = sum(forecasts) / len(tasks), sum(outcomes) / len(tasks)
    return {"tasks": len(tasks), "unscored_tasks": len(real) - len(tasks), "success_rate": success,
            "real_success_rate": real_success, "gap": 100.0 * (success - real_success),
            "ece": expected_calibration_error(forecasts, outcomes), "per_task": simulated}

