"""Plot a training run's loss and throughput from the trainer's ``<log_dir>/metrics.jsonl``.

``python tools/plot_run.py runs/demo-midtrain/metrics.jsonl -o runs/demo-midtrain/loss.png``

Train records carry ``iteration``, ``loss`` and ``tokens_per_sec`` (any may be null); eval records add
``"split": "valid"``. A person checking a run wants the loss curve, not the JSON, so this draws train and
valid loss on one axis and throughput on a second panel, and prints where the PNG went. ``--summary`` adds the
curve in one line: the metric's mean over the first and the last ``SUMMARY_STEPS`` logged steps (and the last
valid value), the figures the README quotes for the demos, so a run compares with them like for like.
"""

import argparse
import json
import sys
from pathlib import Path

SUMMARY_STEPS = 10


class PlotError(Exception):
    """A metrics file that cannot be plotted; the message is the one line printed."""


def read_records(path: Path) -> list[dict]:
    if not path.is_file():
        raise PlotError(f"{path}: no such file")
    records = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise PlotError(f"{path}: malformed line {number}: {err.msg}") from None
        if not isinstance(record, dict):
            raise PlotError(f"{path}: malformed line {number}: expected a JSON object")
        records.append(record)
    if not records:
        raise PlotError(f"{path}: no records")
    return records


def _series(records: list[dict], key: str) -> tuple[list[float], list[float]]:
    points = [(r["iteration"], r[key]) for r in records if r.get("iteration") is not None and r.get(key) is not None]
    return [p[0] for p in points], [p[1] for p in points]


def summarize(records: list[dict], metric: str = "loss") -> str:
    """``loss 9.02 over the first 10 steps, 5.86 over the last 10 (200 steps), valid 5.91 at step 200``."""
    _, values = _series([r for r in records if r.get("split", "train") == "train"], metric)
    if not values:
        raise PlotError(f"no train record has a {metric!r} value")
    window = min(SUMMARY_STEPS, len(values))
    first, last = sum(values[:window]) / window, sum(values[-window:]) / window
    line = (f"{metric} {first:.3f} over the first {window} steps, {last:.3f} over the last {window} "
            f"({len(values)} steps)")
    steps, valid = _series([r for r in records if r.get("split") == "valid"], metric)
    return line + (f", valid {valid[-1]:.3f} at step {steps[-1]}" if valid else "")


def plot(records: list[dict], out: Path, title: str, metric: str = "loss", speed: str = "tokens_per_sec") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [r for r in records if r.get("split", "train") == "train"]
    valid = [r for r in records if r.get("split") == "valid"]
    fig, (loss_ax, speed_ax) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    loss_ax.plot(*_series(train, metric), label="train")
    if valid:
        loss_ax.plot(*_series(valid, metric), "o-", label="valid")
    loss_ax.set_ylabel(metric)
    loss_ax.legend()
    loss_ax.set_title(title)
    speed_ax.plot(*_series(train, speed), color="tab:green")
    speed_ax.set_ylabel(speed)
    speed_ax.set_xlabel("iteration")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Plot loss and throughput from a metrics.jsonl.")
    parser.add_argument("metrics", type=Path, help="the trainer's <log_dir>/metrics.jsonl")
    parser.add_argument("-o", "--output", type=Path, help="PNG to write (default: loss.png next to the metrics)")
    parser.add_argument("--metric", default="loss", help="record key for the top panel (RL runs: reward_mean)")
    parser.add_argument("--speed", default="tokens_per_sec", help="record key for the bottom panel (RL: rollout_time_s)")
    parser.add_argument("--summary", action="store_true",
                        help=f"also print the metric's first-{SUMMARY_STEPS} / last-{SUMMARY_STEPS} step means")
    args = parser.parse_args(argv)
    out = args.output or args.metrics.with_name("loss.png")
    try:
        records = read_records(args.metrics)
        summary = summarize(records, args.metric) if args.summary else None
        plot(records, out, title=str(args.metrics.parent), metric=args.metric, speed=args.speed)
    except PlotError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(out)
    if summary:
        print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
