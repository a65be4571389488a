"""What a pipeline shows at its end: one row per stage (its figures, its wall time) and the two evaluations' tables,
written to ``RUN_DIR/summary.md`` and printed.

A training stage's figures are the line its demo prints (``tools/plot_run.py --summary``: the curve's mean over the
first and the last 10 steps), from the same metrics file, so a stage of the pipeline compares with its demo like for
like; a stage that read a served simulator adds how many requests that server answered while the stage ran.
"""

import json
import subprocess
from pathlib import Path

from megatron_mimesis.pipeline.resolve import Resolution
from megatron_mimesis.pipeline.stages import REPO, stage_dir

PLOT_ARGS = {"midtrain": [], "sft": [], "rl_simulator": ["--metric", "reward_mean", "--speed", "rollout_time_s"],
             "rl_agent": ["--metric", "reward_mean", "--speed", "rollout_time_s"]}


def training_figures(kind: str, log_dir: Path, python: str) -> str:
    metrics = log_dir / "metrics.jsonl"
    result = subprocess.run([python, str(REPO / "tools" / "plot_run.py"), str(metrics), "-o",
                             str(log_dir / ("loss.png" if kind in ("midtrain", "sft") else "reward.png")), "--summary",
                             *PLOT_ARGS[kind]], capture_output=True, text=True)
    lines = (result.stdout or result.stderr).strip().splitlines()
    return lines[-1] if lines else f"no figures ({metrics})"


def wall_text(seconds) -> str:
    if seconds is None:
        return ""
    seconds = int(round(seconds))
    return f"{seconds // 60} min {seconds % 60} s"


def render(resolution: Resolution, total_wall_s: float | None = None) -> str:
    definition = resolution.definition
    rows = ["| stage | kind | status | figures | wall |", "| --- | --- | --- | --- | --- |"]
    tables = []
    for name, resolved in resolution.stages.items():
        stage = resolved.stage
        record = resolved.recorded or {}
        status = "given" if stage.given or stage.kind == "input" else record.get("status", "not run")
        figures = record.get("figures") or {}
        text = figures.get("line", "")
        if figures.get("user_requests"):
            text += ("; " if text else "") + ", ".join(f"{n:.0f} requests answered by {server}"
                                                       for server, n in figures["user_requests"].items())
        rows.append(f"| {name} | {stage.kind} | {status} | {text.replace('|', '/')} | "
                    f"{wall_text(record.get('wall_s'))} |")
        table = stage_dir(definition.run_dir, stage) / "report" / "table.md"
        if stage.kind.startswith("eval_") and table.is_file():
            tables.append(f"### {name} ({table})\n\n{table.read_text().strip()}")
        domains = table.with_name("domains.md")
        if stage.kind == "eval_agent" and domains.is_file():
            tables.append(f"### {name}, per domain ({domains})\n\n{domains.read_text().strip()}")
    head = f"## pipeline {definition.name} ({definition.run_dir})"
    if total_wall_s is not None:
        head += f": this run {wall_text(total_wall_s)}"
    return "\n\n".join([head, "\n".join(rows), *tables]) + "\n"


def write(resolution: Resolution, total_wall_s: float | None = None) -> str:
    text = render(resolution, total_wall_s)
    run_dir = resolution.definition.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "summary.md").write_text(text)
    (run_dir / "summary.json").write_text(json.dumps(
        {name: r.recorded for name, r in resolution.stages.items()}, indent=2, default=str) + "\n")
    return text
