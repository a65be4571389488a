"""Running the trainer under torchrun from tests, and reading what it logged."""

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
