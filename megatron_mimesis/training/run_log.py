"""Per-step records of a run: one JSON line each (``metrics.jsonl``), TensorBoard scalars, optional wandb,
and a progress bar. Only the rank that calls it with ``enabled=True`` (rank 0) writes anything.

A run that starts at iteration N (a resume from the checkpoint of step N, or N = 0: a fresh start) owns the log from
step N + 1 on: records of later steps left by an earlier attempt (it crashed after its last checkpoint) are removed
from ``metrics.jsonl`` and purged from TensorBoard, so every step appears once, as the run that continued logged it.
"""

import json
import math
import os
import signal
from pathlib import Path

from tqdm import tqdm

EXIT_RECORD = "exit.json"  # the launcher reads it (launch/common.sh); a launch removes the previous one


def write_exit_record(log_dir: str | Path, record: dict) -> None:
    """How the run ended, for the launcher (``launch/common.sh``: ``launch_status``), written atomically."""
    tmp = Path(log_dir) / (EXIT_RECORD + ".tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, Path(log_dir) / EXIT_RECORD)


class RunLog:
    def __init__(self, log_dir: str | Path, total_iters: int, start_iter: int, *, enabled: bool,
                 progress: bool = True, wandb_project: str | None = None, run_config: dict | None = None,
                 headline: tuple[str, ...] = ("loss", "lr")):
        self.enabled = enabled
        self.headline = headline  # record keys shown on the progress bar
        self.dir = Path(log_dir)
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
            try:
                import wandb
            except ImportError:
                raise ImportError("wandb_project is set but wandb is not installed: pip install wandb") from None
            self._wandb = wandb.init(project=wandb_project, config=run_config, dir=str(self.dir))
        if progress:
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


def _short(value) -> str:
    return f"{value:.4g}" if isinstance(value, int | float) else "-"
