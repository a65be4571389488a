"""One evaluation run: every simulator at every held-out position, then the metrics side by side.

Per simulator, in turn (one model in memory at a time): its reply at each position (cached, so a killed run
resumes), the teacher-forced likelihood of the human turns, the judge's verdicts when a judge is given, and the
agent's episodes against it when real-user outcomes are given. Failures are never scores: a failed generation
leaves that position out of the simulator's behaviour and judged metrics, a failed judge call out of that
judged metric, and each is counted by reason in ``results.json`` and under the table.
"""

from collections import Counter
from dataclasses import asdict, dataclass, field

from tqdm import tqdm

from megatron_mimesis.eval import metrics as M
from megatron_mimesis.eval import usi
from megatron_mimesis.eval.behaviour import features
from megatron_mimesis.eval.cache import cache_key
from megatron_mimesis.eval.calibration import calibration_row, task_difficulty, trial_difficulty_ece
from megatron_mimesis.eval.likelihood import LikelihoodUnavailable, score_renderings
from megatron_mimesis.eval.simulators import Reply
from megatron_mimesis.eval.usi import turn_signals

HUMAN = "human"


@dataclass
class RowResult:
    """Everything measured for one row (a simulator or the humans)."""

    name: str
    observations: list[dict] = field(default_factory=list)  # per answered position: its turn's features, verdicts
    likelihood: list[dict] = field(default_factory=list)  # per scored human turn: its NLL, tokens, bytes
    generation_errors: Counter = field(default_factory=Counter)
    judge_errors: Counter = field(default_factory=Counter)
    likelihood_note: str | None = None  # why the likelihood is n/a, when it is
    overlong_turns: int = 0
    calibration: dict | None = None


def human_observations(positions) -> list[dict]:
    return [{"unit": p.conversation, "key": p.key, "text": p.human, "ended": p.human_ended, "human_words": None,
             "usi": (signals := turn_signals(p.human)), "human_usi": signals, **features(p.human, p.last_assistant)}
            for p in positions]


def replies(simulator, spec_key: dict, positions, cache, seed: int, batch: int, progress: bool) -> list[Reply]:
    """The simulator's reply at every position; finished ones come from the cache, new ones go into it."""
    keys = [cache_key("reply", spec_key, seed, p.key) for p in positions]
    answers = {i: Reply(**cache.get(k)) for i, k in enumerate(keys) if k in cache}
    todo = [i for i in range(len(positions)) if i not in answers]
    with tqdm(total=len(positions), initial=len(answers), desc=f"{simulator.name}: replies", unit="turn",
              disable=not progress, dynamic_ncols=True) as bar:
        for start in range(0, len(todo), batch):
            chunk = todo[start:start + batch]
            for i, reply in zip(chunk, simulator.reply([positions[i] for i in chunk], seed), strict=True):
                answers[i] = reply
                if reply.error is None:  # a failure is not kept: a resumed run asks again
                    cache.put(keys[i], asdict(reply))
            bar.update(len(chunk))
    return [answers[i] for i in range(len(positions))]


def simulator_observations(row: RowResult, positions, answers: list[Reply]) -> None:
    for position, reply in zip(positions, answers, strict=True):
        if reply.error is not None:
            row.generation_errors[reply.error.split(":")[0]] += 1
            continue
        row.observations.append({"unit": position.conversation, "key": position.key, "text": reply.text,
                                 "ended": reply.ended, "human_words": len(features(position.human, "")["unigrams"]),
                                 "usi": turn_signals(reply.text), "human_usi": turn_signals(position.human),
                                 **features(reply.text, position.last_assistant)})


def add_likelihood(row: RowResult, simulator, held_out, seq_length: int) -> None:
    """NLL of every human turn (whether or not the simulator's own reply there succeeded)."""
    if simulator.tokenizer_dir is None:
        row.likelihood_note = "no tokenizer: a chat model has no log-probs of the human's text"
        return
    try:
        turns, row.overlong_turns = score_renderings(simulator.scorer, simulator.tokenizer_dir, held_out.renderings,
                                                     seq_length)
    except LikelihoodUnavailable as err:
        row.likelihood_note = str(err)
        return
    unit = {p.key: p.conversation for p in held_out.positions}
    row.likelihood = [{"unit": unit[t.key], **asdict(t)} for t in turns]


def add_judgements(row: RowResult, human: RowResult, judge, positions_by_key, progress: bool) -> None:
    observations = row.observations
    with tqdm(total=len(observations) * (2 if judge.taxonomy else 1), desc=f"{row.name}: judge", unit="call",
              disable=not progress, dynamic_ncols=True) as bar:
        def turing(o):
            result = judge.turing(positions_by_key[o["key"]], row.name, o["text"])
            bar.update()
            return result

        for o, verdict in zip(observations, judge.many(turing, observations), strict=True):
            o["turing"] = verdict.get("credit")
            o["turing_rating"] = verdict.get("rating")
            if "error" in verdict:
                row.judge_errors["turing: " + verdict["error"].split(":")[0]] += 1
        if not judge.taxonomy:
            return
        human_labels = {o["key"]: o.get("labels") for o in human.observations}

        def labels(o):
            result = judge.labels(positions_by_key[o["key"]], o["text"])
            bar.update()
            return result

        for o, verdict in zip(observations, judge.many(labels, observations), strict=True):
            o["labels"] = verdict.get("labels")
            o["human_labels"] = human_labels.get(o["key"])
            if "error" in verdict:
                row.judge_errors["labels: " + verdict["error"].split(":")[0]] += 1


def label_humans(human: RowResult, judge, positions_by_key, progress: bool) -> None:
    with tqdm(total=len(human.observations), desc="human: labels", unit="call", disable=not progress,
              dynamic_ncols=True) as bar:
        def labels(o):
            result = judge.labels(positions_by_key[o["key"]], o["text"])
            bar.update()
            return result

        for o, verdict in zip(human.observations, judge.many(labels, human.observations), strict=True):
            o["labels"] = o["human_labels"] = verdict.get("labels")
            if "error" in verdict:
                human.judge_errors["labels: " + verdict["error"].split(":")[0]] += 1


def metric_table(rows: list[RowResult], taxonomy: dict | None, judged: bool, n_boot: int, seed: int) -> dict:
    """{row: {metric name: {"value", "low", "high"}}} for every metric that applies to the run."""
    chosen = {**M.LIKELIHOOD, **M.BEHAVIOUR, **M.USI}
    if judged:
        chosen.update(M.TURING)
        if taxonomy:
            chosen.update(M.dice_metrics(list(taxonomy)))
    against_humans = {"turing_distance", *(m.name for m in M.USI)}  # undefined for the humans' own row
    table = {}
    for row in rows:
        cells = {}
        for metric, fn in chosen.items():
            if row.name == HUMAN and metric.name == "length_distance":
                value = (0.0, None, None)
            elif row.name == HUMAN and metric.name in against_humans:
                value = (None, None, None)
            else:
                obs = row.likelihood if metric.group == "likelihood" else row.observations
                value = M.bootstrap(obs, fn, n_boot, seed)
            cells[metric.name] = dict(zip(("value", "low", "high"), value, strict=True))
        if row.calibration is not None:
            for name in ("success_rate", "gap", "ece", "ece_difficulty"):
                cells[name] = {"value": row.calibration.get(name), "low": None, "high": None}
            dimensions = [cells[m.name]["value"] for m in M.USI]
            ece = row.calibration.get("ece_difficulty")
            cells["tau_usi"] = {"value": None if ece is None or None in dimensions else usi.tau_usi(dimensions, ece),
                                "low": None, "high": None}
        table[row.name] = cells
    return {"metrics": [asdict(m) for m in chosen], "cells": table}


def calibrate_difficulty(rows: list[RowResult], real: dict) -> None:
    """τ-USI's difficulty-binned ECE of every simulator row, once all of them have played: a task's difficulty is
    pooled over them all."""
    simulated = [row for row in rows if row.name != HUMAN and row.calibration is not None]
    difficulty = task_difficulty([row.calibration["trial_success"] for row in simulated])
    for row in simulated:
        row.calibration["ece_difficulty"] = trial_difficulty_ece(row.calibration["trial_success"], real, difficulty)
        row.calibration["difficulty_tasks"] = sum(t in difficulty for t in real)


def calibrate(row: RowResult, simulator, agent, suite, real: dict, settings, success_reward: float,
              progress: bool) -> list[dict]:
    """The agent's episodes against this simulator on the real users' tasks; returns the episode records."""
    from megatron_mimesis.eval.agents import play_pair, score_pair

    task_ids = sorted(real)
    if progress:
        tqdm.write(f"{row.name}: {len(task_ids) * settings.trials} agent episodes")
    records = play_pair(agent, simulator.user_model(), suite, task_ids, settings, ("agent", row.name))
    pair = score_pair("agent", row.name, records, task_ids, suite)
    row.calibration = {**calibration_row(pair, real, success_reward), "failures": pair["failures"]}
    return records
