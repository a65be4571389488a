"""Wall time per RL step, synchronous against a rollout worker ahead of the trainer: the numbers behind
``max_staleness``.

    python tools/bench/bench_async_rl.py --config launch/configs/demo_rl_agent.yaml [--steps 12] [--warmup 2]
                                   [--staleness sync 1 2] [--nproc 1] [--output runs/bench-async-rl] [-- FLAG ...]

Runs the config's RL stage (``stage:`` in it) once per ``--staleness`` entry, through torchrun, for ``--steps`` steps
with the same seed and tasks (``sync``: the synchronous loop; an integer: ``--max-staleness``), without saving; flags
after ``--`` go to every run (a served user model's ``--user-model-options``, a layout). From each run's metrics it
reports, over the steps after ``--warmup``:
- the median step time, and the synchronous run's divided by it (the speed-up, both measured in this invocation);
- each side's idle share: measured by the worker runs (the trainer waiting for a step's rollouts, the worker waiting
  for the trainer's weights); for the synchronous loop, where the two run one after the other, the rollout phase's
  share is the trainer's idle time and the rest the engine's;
- the mean staleness of the rows, rollout and training tokens/s, and the reward per step (the curves side by side).

Writes ``async_rl.json`` and ``async_rl.md`` under ``--output`` (refused inside the repository outside ``runs/``).
Timings on a shared CPU are noisy; the ratio is what carries over, measured on the same machine in one invocation.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

STAGE_MODULES = {"rl_agent": "megatron_mimesis.rl.agent_rl", "rl_simulator": "megatron_mimesis.rl.simulator_rl"}


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="an RL stage's YAML (stage: rl_agent or rl_simulator)")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the medians")
    parser.add_argument("--staleness", nargs="+", default=["sync", "1", "2"],
                        help="'sync' (the synchronous loop) or a max_staleness, per run")
    parser.add_argument("--nproc", type=int, default=1, help="ranks per run")
    parser.add_argument("--output", default="runs/bench-async-rl")
    parser.add_argument("flags", nargs="*", help="after --: flags for every run")
    args = parser.parse_args(argv)
    if args.warmup >= args.steps:
        parser.error(f"--warmup {args.warmup} leaves none of --steps {args.steps}")
    for entry in args.staleness:
        if entry != "sync" and not (entry.isdigit()):
            parser.error(f"--staleness: {entry!r} is neither 'sync' nor a non-negative integer")
    return args


def bench_config(config: Path, output: Path) -> tuple[str, Path]:
    """The stage's entry point, and the config without its checkpointing (a benchmark saves nothing)."""
    import yaml

    options = yaml.safe_load(config.read_text()) or {}
    if options.get("stage") not in STAGE_MODULES:
        raise SystemExit(f"error: {config}: stage {options.get('stage')!r} is not an RL stage "
                         f"({sorted(STAGE_MODULES)})")
    for name in ("save", "save_interval"):
        options.pop(name, None)
    copy = output / "config.yaml"
    copy.write_text(yaml.safe_dump(options, sort_keys=False))
    return STAGE_MODULES[options["stage"]], copy


def run(module: str, config: Path, args, entry: str, log_dir: Path) -> None:
    worker = [] if entry == "sync" else ["--max-staleness", entry]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}", "-m",
           module, "--config", str(config), "--no-progress", "--train-iters", str(args.steps),
           "--log-dir", str(log_dir), *worker, *args.flags]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    print(f"[{entry}] {' '.join(cmd[3:])}", flush=True)
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"error: the {entry} run failed ({done.returncode}):\n{done.stderr[-3000:]}")


def summary(records: list[dict], warmup: int) -> dict:
    steady = records[warmup:]

    def median(name, rows=steady):
        values = [r[name] for r in rows if r.get(name) is not None]
        return statistics.median(values) if values else None

    step = median("step_time_s")
    if "trainer_idle_frac" in steady[0]:
        trainer_idle, engine_idle = median("trainer_idle_frac"), median("rollout_idle_frac")
    else:  # one after the other: the trainer waits through the rollouts, the engine through the rest
        shares = [r["rollout_time_s"] / r["step_time_s"] for r in steady]
        trainer_idle, engine_idle = statistics.median(shares), 1 - statistics.median(shares)
    return {"steps": len(records), "step_time_s": step, "rollout_time_s": median("rollout_time_s"),
            "train_time_s": median("train_time_s"), "trainer_idle_frac": trainer_idle,
            "rollout_idle_frac": engine_idle, "staleness_mean": median("staleness_mean"),
            "rollout_tokens_per_s": median("rollout_tokens_per_s"), "train_tokens_per_s": median("train_tokens_per_s"),
            "reward_mean": [r.get("reward_mean") for r in records]}


def report(results: dict, args) -> str:
    sync = results.get("sync", {}).get("step_time_s")
    lines = [f"# Async RL: {args.config}, {args.steps} steps ({args.warmup} warm-up left out), {args.nproc} rank(s)",
             "", "| run | step s (median) | speed-up vs sync | trainer idle | rollout idle | staleness | rollout tok/s "
             "| train tok/s |", "|---|---|---|---|---|---|---|---|"]
    for entry, s in results.items():
        speedup = f"{sync / s['step_time_s']:.2f}x" if sync else "-"
        stale = "-" if s["staleness_mean"] is None else f"{s['staleness_mean']:.2f}"
        lines.append(f"| {entry} | {s['step_time_s']:.2f} | {speedup} | {s['trainer_idle_frac']:.0%} | "
                     f"{s['rollout_idle_frac']:.0%} | {stale} | {s['rollout_tokens_per_s']:.1f} | "
                     f"{s['train_tokens_per_s']:.0f} |")
    lines += ["", "Reward per step:", ""]
    for entry, s in results.items():
        lines.append(f"- {entry}: " + " ".join("-" if r is None else f"{r:.2f}" for r in s["reward_mean"]))
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    from tools.bench.bench_mismatch import output_dir

    args = parse_args(argv)
    output = output_dir(args.output)
    output.mkdir(parents=True, exist_ok=True)
    module, config = bench_config(Path(args.config), output)
    results = {}
    for entry in args.staleness:
        name = entry if entry == "sync" else f"staleness{entry}"
        log_dir = output / name
        run(module, config, args, entry, log_dir)
        records = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
        results[name] = summary([r for r in records if "iteration" in r], args.warmup)
    (output / "async_rl.json").write_text(json.dumps({"config": args.config, "steps": args.steps,
                                                      "warmup": args.warmup, "nproc": args.nproc,
                                                      "flags": args.flags, "runs": results}, indent=1))
    text = report(results, args)
    (output / "async_rl.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
