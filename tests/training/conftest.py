"""Running the trainer from tests (on the tests' forked ranks, or under torchrun), and reading what it logged."""

import json
import os
import subprocess
import sys
from pathlib import Path

SEQ_LENGTH = 128
VOCAB = 512
REPO = Path(__file__).resolve().parents[2]


def run_trainer(nproc: int, *args: str, check: bool = True, timeout: int = 300,
                module: str = "megatron_mimesis.training.train") -> subprocess.CompletedProcess:
    """``module``'s run on ``nproc`` ranks forked by the tests' launcher (``tests/multiproc.py``: the entry point's
    ``main`` as torchrun starts it, without paying every rank's imports): for the tests of what a run computes."""
    from tests.multiproc import run_main

    return run_main(nproc, module, ["--no-progress", *args], check=check, timeout=timeout,
                    env={"OMP_NUM_THREADS": "1"})


def run_under_torchrun(nproc: int, *args: str, check: bool = True, timeout: int = 300,
                       module: str = "megatron_mimesis.training.train") -> subprocess.CompletedProcess:
    """The same run through torchrun, as a user starts it: for the tests of the launch path (its signals, its
    console output)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", module, "--no-progress", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"trainer failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


def common_args(dataset, log_dir, *extra):
    return ["--data-path", str(dataset), "--seq-length", str(SEQ_LENGTH), "--model-overrides",
            json.dumps({"vocab_size": VOCAB}), "--global-batch-size", "4", "--micro-batch-size", "1",
            "--lr", "1e-3", "--min-lr", "1e-4", "--lr-warmup-iters", "1", "--log-dir", str(log_dir), *extra]


def read_metrics(log_dir) -> list[dict]:
    lines = (Path(log_dir) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def train_losses(log_dir) -> list[float]:
    return [r["loss"] for r in read_metrics(log_dir) if r.get("split") != "valid"]
