"""A real training run through ``launch/midtrain.sh``'s local torchrun line (no SLURM, no GPU), on the tiny
dataset, marked with an environment variable so that the test finds every process of it and only those."""

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

from tests.multiproc import kill_all, processes_with_env
from tests.training.conftest import REPO, SEQ_LENGTH, VOCAB

MARKER = "MIMESIS_TEST_RUN"


class LocalRun:
    """``bash launch/midtrain.sh`` with a config of its own; ``start`` may be called again to resume."""

    def __init__(self, tmp_path: Path, dataset: Path, **config):
        self.dir = tmp_path
        self.save = tmp_path / "ckpt"
        self.marker = uuid.uuid4().hex
        settings = {"model": "tiny", "model_overrides": {"vocab_size": VOCAB}, "seq_length": SEQ_LENGTH,
                    "micro_batch_size": 1, "global_batch_size": 4, "lr": 1e-3, "min_lr": 1e-4,
                    "lr_warmup_iters": 1, "data_path": str(dataset), "save": str(self.save),
                    "log_dir": str(tmp_path), "progress": False, **config}
        self.config = tmp_path / "run.yaml"
        self.config.write_text(json.dumps(settings))  # JSON is YAML
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir(exist_ok=True)
        (bin_dir / "nvidia-smi").write_text("#!/bin/sh\nexit 9\n")  # a machine without GPUs, whatever this one has
        (bin_dir / "nvidia-smi").chmod(0o755)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "CONFIG", "DATA_PATH", "NPROC"))}
        self.env = {**env, "PATH": f"{bin_dir}:{env['PATH']}", "CONFIG": str(self.config), "PYTHON": sys.executable,
                    "NPROC": "2", "PYTHONUNBUFFERED": "1", MARKER: self.marker}
        self.proc = None
        self.log = None

    def start(self, *args: str) -> subprocess.Popen:
        self.log = (self.dir / f"launch-{time.monotonic_ns()}.log").open("w")
        self.proc = subprocess.Popen(["bash", "launch/midtrain.sh", *args], cwd=REPO, env=self.env,
                                     stdout=self.log, stderr=subprocess.STDOUT, text=True)
        return self.proc

    def output(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return Path(self.log.name).read_text()

    def wait(self, timeout: float = 600) -> int:
        self.proc.wait(timeout=timeout)
        self.log.close()
        return self.proc.returncode

    def processes(self) -> dict[int, dict]:
        return processes_with_env(MARKER, self.marker)

    def torchrun(self) -> int:
        (pid,) = [p for p, info in self.processes().items() if "-m megatron_mimesis.torchrun" in info["cmdline"]]
        return pid

    def ranks(self) -> list[int]:
        torchrun = self.torchrun()
        return [p for p, info in self.processes().items() if info["ppid"] == torchrun]

    def wait_until(self, condition, timeout: float = 400, what: str = "") -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            assert self.proc.poll() is None, f"the run ended before {what}:\n{self.output()[-4000:]}"
            assert time.monotonic() < deadline, f"timed out waiting for {what}:\n{self.output()[-4000:]}"
            time.sleep(0.5)

    def iterations(self) -> list[int]:
        """Training iterations logged so far (a line being written is not read yet)."""
        path = self.dir / "metrics.jsonl"
        if not path.exists():
            return []
        lines = path.read_text().split("\n")[:-1]
        return [r["iteration"] for r in map(json.loads, lines) if r.get("split") != "valid"]

    def kill_leftovers(self) -> None:
        """SIGKILL whatever of this run is still alive."""
        kill_all(self.processes())

    def latest(self) -> int | None:
        path = self.save / "latest"
        return int(path.read_text()) if path.exists() else None
