"""Task-difficulty calibration: does a simulator make tasks as hard for an agent as real users did?

Input: a JSONL file of per-task real-user outcomes, ``{"task_id": str, "success": bool | number in [0, 1]}`` (a
number is the share of real users who succeeded). One agent plays every listed task against each simulator
(the shared episode machinery of :mod:`megatron_mimesis.eval.agents`, the env suites of agent RL). An episode
succeeds when its reward reaches ``success_reward``: 1 for tau2's 0/1 task reward; the toy env pays a point per
brief agent turn and one for the code, so there "brief and gave the code" is 2.

Per simulator: its success rate and the gap to the real users' (simulated - real, in points), and two expected
calibration errors:

* per task (``ece``): the simulator's per-task success rate read as a forecast of the real outcome, ECE = sum
  over 10 equal-width forecast bins of (tasks in bin / tasks) * |mean forecast - mean real outcome|;
* over difficulty bins (``ece_difficulty``, τ-USI's; :mod:`.usi` names the source): a task's difficulty is its
  success rate pooled over every simulator's scored episodes of it (tasks with fewer than 10 have none and are
  left out), tasks fall into 5 bins at 0.2 / 0.4 / 0.6 / 0.8, ECE = sum over bins of (tasks in bin / tasks) *
  |mean simulated success - mean real success|, computed per trial (each trial index a run of every task) and
  averaged over trials.

Tasks whose episodes could not be scored are left out and counted.
"""

from pathlib import Path

from data_prep.records import decode_json_line

ECE_BINS = 10
DIFFICULTY_CUTOFFS = (0.2, 0.4, 0.6, 0.8)
MIN_DIFFICULTY_EPISODES = 10


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


def difficulty_bin(difficulty: float) -> int:
    return next((i for i, cutoff in enumerate(DIFFICULTY_CUTOFFS) if difficulty < cutoff), len(DIFFICULTY_CUTOFFS))


def task_difficulty(trial_success: list[dict[str, list[float | None]]]) -> dict[str, float]:
    """Per task, the success rate pooled over the scored episodes of every simulator given (at least 10)."""
    pooled: dict[str, list[float]] = {}
    for trials in trial_success:
        for task_id, outcomes in trials.items():
            pooled.setdefault(task_id, []).extend(o for o in outcomes if o is not None)
    return {t: sum(o) / len(o) for t, o in pooled.items() if len(o) >= MIN_DIFFICULTY_EPISODES}


def difficulty_ece(simulated: dict[str, float], real: dict[str, float], difficulty: dict[str, float]) -> float | None:
    """ECE over the 5 difficulty bins of the tasks present in all three; None when there is none."""
    bins: dict[int, list[str]] = {}
    for task_id in simulated:
        if task_id in real and task_id in difficulty:
            bins.setdefault(difficulty_bin(difficulty[task_id]), []).append(task_id)
    total = sum(len(tasks) for tasks in bins.values())
    if not total:
        return None
    return sum(len(tasks) / total * abs(sum(simulated[t] for t in tasks) / len(tasks)
                                        - sum(real[t] for t in tasks) / len(tasks)) for tasks in bins.values())


def trial_difficulty_ece(trials: dict[str, list[float | None]], real: dict[str, float],
                         difficulty: dict[str, float]) -> float | None:
    """The difficulty-binned ECE of each trial index (the tasks scored in it), averaged over trials."""
    n_trials = max((len(outcomes) for outcomes in trials.values()), default=0)
    eces = [difficulty_ece({t: o[k] for t, o in trials.items() if k < len(o) and o[k] is not None}, real, difficulty)
            for k in range(n_trials)]
    eces = [e for e in eces if e is not None]
    return sum(eces) / len(eces) if eces else None


def task_success(pair: dict, success_reward: float) -> dict[str, float]:
    """Per task, the share of its scored episodes that succeeded (tasks with none scored are absent)."""
    rates = {}
    for task_id, rewards in pair["task_rewards"].items():
        scored = [r for r in rewards if r is not None]
        if scored:
            rates[task_id] = sum(r >= success_reward for r in scored) / len(scored)
    return rates


def trial_success(pair: dict, success_reward: float) -> dict[str, list[float | None]]:
    """Per task, each trial's success (1.0 / 0.0), None where that episode could not be scored."""
    return {task_id: [None if r is None else float(r >= success_reward) for r in rewards]
            for task_id, rewards in pair["task_rewards"].items()}


def calibration_row(pair: dict, real: dict[str, float], success_reward: float) -> dict:
    """The simulator's calibration row; ``ece_difficulty`` needs every simulator's episodes and is added by the
    caller (:func:`trial_difficulty_ece` over :func:`task_difficulty`)."""
    simulated = task_success(pair, success_reward)
    tasks = sorted(simulated)
    trials = trial_success(pair, success_reward)
    if not tasks:
        return {"tasks": 0, "unscored_tasks": len(real), "success_rate": None, "real_success_rate": None,
                "gap": None, "ece": None, "per_task": {}, "trial_success": trials}
    forecasts = [simulated[t] for t in tasks]
    outcomes = [real[t] for t in tasks]
    success, real_success = sum(forecasts) / len(tasks), sum(outcomes) / len(tasks)
    return {"tasks": len(tasks), "unscored_tasks": len(real) - len(tasks), "success_rate": success,
            "real_success_rate": real_success, "gap": 100.0 * (success - real_success),
            "ece": expected_calibration_error(forecasts, outcomes), "per_task": simulated, "trial_success": trials}

