"""Per-step records of a run: one JSON line each (``metrics.jsonl``), TensorBoard scalars, optional W&B, and what a
person reads: a progress bar on a terminal, else (a SLURM job's ``slurm-*.out``, a pipeline's stage log) one line per
logged step with the step of total, the headline figures, throughput, elapsed time and ETA. Only the rank that calls
it with ``enabled=True`` (rank 0) writes anything.

A W&B run is resumed across requeues: its id is kept in the run config that every checkpoint saves
(``run_config.json``), and a run that resumes a checkpoint continues the W&B run that checkpoint names.

A run that starts at iteration N (a resume from the checkpoint of step N, or N = 0: a fresh start) owns the log from
step N + 1 on: records of later steps left by an earlier attempt (it crashed after its last checkpoint) are removed
from ``metrics.jsonl`` and purged from TensorBoard, so every step appears once, as the run that continued logged it.
"""

import json
import math
import os
import signal
import sys
import time
from pathlib import Path

from tqdm import tqdm

EXIT_RECORD = "exit.json"  # the launcher reads it (launch/common.sh); a launch removes the previous one


def write_exit_record(log_dir: str | Path, record: dict) -> None:
    """How the run ended, for the launcher (``launch/common.sh``: ``launch_status``), written atomically."""
    tmp = Path(log_dir) / (EXIT_RECORD + ".tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, Path(log_dir) / EXIT_RECORD)


class RunLog:
    """``resumed_from``: the checkpoint directory the run continues (its W&B run is continued), None for a start.
    ``progress``: a bar where stderr is a terminal; without one (or with ``progress`` off) a line per logged step."""

    def __init__(self, log_dir: str | Path, total_iters: int, start_iter: int, *, enabled: bool,
                 progress: bool = True, wandb_project: str | None = None, run_config: dict | None = None,
                 headline: tuple[str, ...] = ("loss", "lr"), resumed_from: str | Path | None = None):
        self.enabled = enabled
        self.headline = headline  # record keys shown on the progress bar and the lines
        self.dir = Path(log_dir)
        self.total_iters, self.start_iter = total_iters, start_iter
        self._started = time.monotonic()
        self._jsonl = self._tb = self._wandb = self._bar = None
        if not enabled:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        metrics = self.dir / "metrics.jsonl"
        _truncate_after(metrics, start_iter)
        self._jsonl = metrics.open("a", buffering=1)
        from torch.utils.tensorboard import SummaryWriter

        self._tb = SummaryWriter(str(self.dir / "tensorboard"), purge_step=start_iter + 1)
        if wandb_project:
            self._wandb = _wandb_run(wandb_project, run_config if run_config is not None else {}, self.dir,
                                     resumed_from)
        if progress and sys.stderr.isatty():
            self._bar = tqdm(total=total_iters, initial=start_iter, desc="train", dynamic_ncols=True)

    def step(self, record: dict) -> None:
        if not self.enabled:
            return
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        self._jsonl.write(json.dumps(clean) + "\n")
        iteration = record["iteration"]
        prefix = "valid/" if record.get("split") == "valid" else "train/"
        for key, value in record.items():
            if isinstance(value, int | float) and key not in ("iteration",):
                self._tb.add_scalar(prefix + key, value, iteration)
        if self._wandb is not None:
            self._wandb.log({prefix + k: v for k, v in clean.items() if k != "split"}, step=iteration)
        if self._bar is not None and record.get("split") != "valid":
            self._bar.update(iteration - self._bar.n)
            self._bar.set_postfix({k: _short(record.get(k)) for k in self.headline})
        elif self._bar is None:
            print(self.line(record), flush=True)

    def line(self, record: dict) -> str:
        """One step as a line: ``step 120/4837 | loss 2.314 | lr 3e-05 | 41.2k tokens/s | MFU 38.1% | elapsed 1h02m |
        ETA 2d03h`` (a validation record: its loss), the ETA from this attempt's mean step time."""
        iteration = record["iteration"]
        if record.get("split") == "valid":
            return f"step {iteration}/{self.total_iters} | valid loss {_short(record.get('loss'))}"
        parts = [f"step {iteration}/{self.total_iters}"]
        parts += [f"{key} {_short(record[key])}" for key in self.headline if record.get(key) is not None]
        if record.get("tokens_per_sec") is not None:
            parts.append(f"{_si(record['tokens_per_sec'])} tokens/s")
        if record.get("mfu") is not None:
            parts.append(f"MFU {100 * record['mfu']:.1f}%")
        elapsed = time.monotonic() - self._started
        parts.append(f"elapsed {_duration(elapsed)}")
        done = iteration - self.start_iter
        if done > 0 and iteration < self.total_iters:
            parts.append(f"ETA {_duration(elapsed / done * (self.total_iters - iteration))}")
        return " | ".join(parts)

    def stopped_for_requeue(self, iteration: int, signum: int | None, saved: bool) -> None:
        """Record in ``exit.json`` that the run stopped at ``iteration`` on a preemption signal, with its checkpoint
        ``saved``: torchrun reports any signal as a failure, and the launcher reads this to exit 0 for a handled
        preemption (``launch/common.sh``)."""
        if not self.enabled:
            return
        name = signal.Signals(signum).name if signum else None
        write_exit_record(self.dir, {"stopped": "signal", "signal": name, "iteration": iteration, "saved": saved})

    def message(self, text: str) -> None:
        if self.enabled:
            (self._bar.write if self._bar is not None else print)(text)

    def close(self) -> None:
        if not self.enabled:
            return
        for closer in (self._bar, self._tb, self._jsonl):
            if closer is not None:
                closer.close()
        if self._wandb is not None:
            self._wandb.finish()


def _truncate_after(path: Path, iteration: int) -> None:
    """Keep the records of steps up to ``iteration`` (atomically: a crash here leaves the old file)."""
    if not path.exists():
        return
    text = path.read_text()
    lines = text.splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        lines.pop()  # the half-written record of a crash
    kept = "".join(line for line in lines if json.loads(line)["iteration"] <= iteration)
    if kept == text:
        return
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(kept)
    os.replace(tmp, path)


def _wandb_run(project: str, run_config: dict, directory: Path, resumed_from):
    """The W&B run of this training run: the one the resumed checkpoint names, else a new one. Its id goes into
    ``run_config``, which every checkpoint saves, so that a requeued job finds it."""
    try:
        import wandb
    except ImportError:
        raise ImportError("wandb_project is set but wandb is not installed: pip install 'megatron-mimesis[wandb]'") \
            from None
    run_id = saved_wandb_id(resumed_from) if resumed_from else None
    resume = {"id": run_id, "resume": "allow"} if run_id else {}
    run = wandb.init(project=project, config=run_config, dir=str(directory), **resume)
    run_config["wandb_run_id"] = run.id
    return run


def saved_wandb_id(checkpoints: str | Path) -> str | None:
    """The W&B run id that the checkpoint ``latest`` names under ``checkpoints`` saved, if any (every checkpoint of a
    run saves the same one)."""
    from megatron_mimesis.checkpoint.reader import RUN_CONFIG, CheckpointError, checkpoint_dir, read_latest

    try:
        saved = json.loads((checkpoint_dir(checkpoints, read_latest(checkpoints)) / RUN_CONFIG).read_text())
    except (CheckpointError, OSError, ValueError):
        return None
    return saved.get("wandb_run_id") if isinstance(saved, dict) else None


def _short(value) -> str:
    return f"{value:.4g}" if isinstance(value, int | float) else "-"


def _si(value: float) -> str:
    for factor, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.1f}{suffix}"
    return f"{value:.1f}"


def _duration(seconds: float) -> str:
    """``45s``, ``12m05s``, ``3h07m``, ``2d03h``."""
    seconds = int(seconds)
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d{hours:02d}h"
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"
