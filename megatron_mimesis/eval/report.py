"""The run's outputs: tables a person reads, files a program reads, plots a person would rather look at.

``table.md`` (one table per metric group, each cell ``value [95% CI]``, the humans as the first row, then what
was left out and why), ``table.csv`` (long form: row, metric, value, CI), ``results.json`` (config, cells,
counts, calibration), ``items.jsonl`` (one line per row and position: the text, its features and verdicts),
``lengths.png`` (turn-length histograms, humans against each simulator) and ``metrics.png`` (one bar chart per
metric, with the intervals).
"""

import csv
import json
import math
from pathlib import Path

from megatron_mimesis.eval.calibration import MIN_DIFFICULTY_EPISODES

GROUP_TITLES = {"likelihood": "Likelihood of the human turns (teacher-forced; lower is better)",
                "behaviour": "Behaviour statistics (no LLM; closer to the human row is better)",
                "usi": "τ-USI, the MIMESIS paper's user-simulator index (no LLM: Dice x 100 of each dimension's "
                       "features against the human turns; τ-USI adds (1 - ECE₅) x 100; higher is better)",
                "judged": "Judged metrics (Turing distance: lower is better; Dice: higher is better)",
                "calibration": "Task-difficulty calibration (gap: simulated - real success, points; ECE per task "
                               "and ECE₅ over 5 difficulty bins: lower is better)"}
CALIBRATION_METRICS = [{"name": "success_rate", "label": "success", "group": "calibration",
                        "what": "share of tasks the agent solved (real users: their outcomes)"},
                       {"name": "gap", "label": "gap", "group": "calibration",
                        "what": "simulated - real success rate, points"},
                       {"name": "ece", "label": "ECE", "group": "calibration",
                        "what": "expected calibration error of per-task success over the real outcomes"},
                       {"name": "ece_difficulty", "label": "ECE₅", "group": "calibration",
                        "what": "τ-USI's ECE: |simulated - real success| over 5 task-difficulty bins, per trial"},
                       {"name": "tau_usi", "label": "τ-USI", "group": "usi",
                        "what": "(D1 + D2 + D3 + D4 + (1 - ECE₅) x 100) / 5"}]


def _number(value: float | None) -> str:
    if value is None:
        return "n/a"
    return f"{value:.3f}" if abs(value) < 100 else f"{value:.1f}"


def cell_text(cell: dict) -> str:
    text = _number(cell["value"])
    if cell["value"] is not None and cell["low"] is not None:
        text += f" [{_number(cell['low'])}, {_number(cell['high'])}]"
    return text


def all_metrics(table: dict, calibrated: bool) -> list[dict]:
    return table["metrics"] + (CALIBRATION_METRICS if calibrated else [])


def floor_warning(counts: dict, floor: int) -> str | None:
    """The warning for a table whose rows rest on fewer conversations than ``floor`` (--min-conversations)."""
    fewest = min((c["conversations"] for c in counts.values()), default=0)
    if fewest >= floor:
        return None
    return (f"warning: a row rests on {fewest} conversations, fewer than --min-conversations {floor}: its intervals "
            f"are wide and differences between rows may be noise; give more held-out conversations (--input, a "
            f"larger --max-conversations)")


def markdown(table: dict, counts: dict, calibrated: bool, skipped_records: dict, warnings: list[str]) -> str:
    rows = list(table["cells"])
    metrics = all_metrics(table, calibrated)
    lines = ["### Measured on", "", "| | conversations | positions | likelihood turns |", "|---|---:|---:|---:|"]
    lines += [f"| {row} | {c['conversations']} | {c['observations']} | {c['likelihood_turns'] or 'n/a'} |"
              for row, c in counts.items()]
    lines += ["", "A conversation is one rendering of one held-out conversation (the bootstrap's unit; where both "
                  "speakers play the user, one per speaker); a position is a human turn the row answered.", ""]
    for warning in warnings:  # floor_warning's, the training overlap's
        lines += [warning, ""]
    for group, title in GROUP_TITLES.items():
        chosen = [m for m in metrics if m["group"] == group]
        if not chosen:
            continue
        lines += [f"### {title}", "", "| | " + " | ".join(m["label"] for m in chosen) + " |",
                  "|---|" + "---:|" * len(chosen)]
        for row in rows:
            lines.append(f"| {row} | " + " | ".join(cell_text(table["cells"][row].get(m["name"], _NA))
                                                     for m in chosen) + " |")
        lines.append("")
    notes = []
    if skipped_records:
        reasons = ", ".join(f"{k}: {v}" for k, v in sorted(skipped_records.items()))
        notes.append(f"- {sum(skipped_records.values())} bad input records skipped ({reasons})")
    for row, count in counts.items():
        for what in ("generation_errors", "judge_errors"):
            if count.get(what):
                reasons = ", ".join(f"{k}: {v}" for k, v in sorted(count[what].items()))
                notes.append(f"- {row}: {sum(count[what].values())} {what.replace('_', ' ')} left out ({reasons})")
        if count.get("overlong_turns"):
            notes.append(f"- {row}: {count['overlong_turns']} human turns longer than --seq-length not scored")
        if count.get("likelihood_note"):
            notes.append(f"- {row}: likelihood n/a ({count['likelihood_note']})")
        if count.get("unscored_tasks"):
            notes.append(f"- {row}: {count['unscored_tasks']} tasks without a scored episode left out")
        if count.get("difficulty_tasks") is not None and count["difficulty_tasks"] < count.get("tasks", 0):
            notes.append(f"- {row}: ECE₅ over the {count['difficulty_tasks']} of {count['tasks']} tasks with "
                         f"{MIN_DIFFICULTY_EPISODES}+ scored episodes pooled over the simulators (a difficulty)")
    if notes:
        lines += ["Left out:", *notes, ""]
    if not calibrated:
        lines.append("τ-USI needs its calibration term: --outcomes, --agent and --env.")
    lines.append("Intervals: 95% percentile bootstrap over conversations.")
    return "\n".join(lines) + "\n"


_NA = {"value": None, "low": None, "high": None}


def write_csv(path: Path, table: dict, calibrated: bool) -> None:
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["row", "metric", "value", "ci_low", "ci_high"])
        for row, cells in table["cells"].items():
            for metric in all_metrics(table, calibrated):
                cell = cells.get(metric["name"], _NA)
                writer.writerow([row, metric["name"],
                                 *("" if cell[k] is None else f"{cell[k]:.6g}" for k in ("value", "low", "high"))])


def write_json(path: Path, payload: dict) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=2, ensure_ascii=False) + "\n")
    tmp.replace(path)


def plot_lengths(path: Path, observations: dict[str, list[dict]]) -> None:
    plt = _pyplot()
    simulators = [name for name in observations if name != "human"]
    human = [o["words"] for o in observations["human"]]
    fig, axes = plt.subplots(1, max(1, len(simulators)), figsize=(4.5 * max(1, len(simulators)), 3.4),
                             squeeze=False, sharey=True)
    top = max([*human, *(o["words"] for name in simulators for o in observations[name])], default=1)
    bins = list(range(0, min(top, 80) + 2, max(1, min(top, 80) // 20)))
    def clipped(values):  # turns longer than the last edge are counted in the last bin, not dropped
        return [min(v, bins[-1] - 0.5) for v in values]

    for ax, name in zip(axes[0], simulators or ["human"], strict=False):
        ax.hist(clipped(human), bins=bins, alpha=0.55, label="human", density=True, color="tab:gray")
        if name != "human":
            ax.hist(clipped([o["words"] for o in observations[name]]), bins=bins, alpha=0.55, label=name,
                    density=True, color="tab:blue")
        ax.set_title(f"turn length: human vs {name}" if name != "human" else "turn length: human")
        ax.set_xlabel("words (longer turns in the last bin)" if top > 80 else "words")
        ax.legend()
    axes[0][0].set_ylabel("share of turns")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_metrics(path: Path, table: dict, calibrated: bool) -> None:
    plt = _pyplot()
    rows = list(table["cells"])
    metrics = [m for m in all_metrics(table, calibrated)
               if any(table["cells"][r].get(m["name"], _NA)["value"] is not None for r in rows)]
    columns = min(4, len(metrics))
    lines = math.ceil(len(metrics) / columns)
    fig, axes = plt.subplots(lines, columns, figsize=(3.6 * columns, 2.9 * lines), squeeze=False)
    for ax in axes.flat[len(metrics):]:
        ax.axis("off")
    for ax, metric in zip(axes.flat, metrics, strict=False):
        cells = [table["cells"][r].get(metric["name"], _NA) for r in rows]
        values = [math.nan if c["value"] is None else c["value"] for c in cells]
        # a percentile interval need not contain the estimate (e.g. a rate of 0 in most resamples)
        errors = [[0 if c["low"] is None else max(0.0, c["value"] - c["low"]) for c in cells],
                  [0 if c["high"] is None else max(0.0, c["high"] - c["value"]) for c in cells]]
        ax.bar(range(len(rows)), values, yerr=errors, capsize=3,
               color=["tab:gray" if r == "human" else "tab:blue" for r in rows])
        ax.set_xticks(range(len(rows)), rows, rotation=30, ha="right", fontsize=8)
        ax.set_title(metric["label"], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
