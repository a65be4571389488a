"""A pipeline run as a user starts it (``bash launch/pipeline.sh run DEFINITION``), marked with an environment
variable so that a test finds every process of it (keepers, launchers, torchrun, ranks, the vLLM server and its
engine) and only those; the pipeline itself runs in ``.venv`` (its server, in ``.venv-vllm``, as the demo's)."""

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import yaml

from tests.multiproc import kill_all, processes_with_env

REPO = Path(__file__).resolve().parents[2]
MARKER = "MIMESIS_TEST_PIPELINE"
VENV_PYTHON = REPO / ".venv" / "bin" / "python"
# the whole demo loop (launch/pipelines/demo.yaml), at a few steps per stage and small evaluations
LOOP = ["midtrain_data", "midtrain", "sft_data", "sft", "simulator_rl", "simulator_export", "simulator_server",
        "agent_before", "agent_rl", "agent_export", "simulator_eval", "agent_eval"]
FEW = {"midtrain": ["--train-iters", "10", "--eval-interval", "100", "--lr-warmup-iters", "2"],
       "sft": ["--train-iters", "4", "--lr-warmup-iters", "2"], "simulator_rl": ["--train-iters", "2"],
       "agent_rl": ["--train-iters", "3", "--save-interval", "1"]}
SMALL_EVALS = {"simulator_eval": {"args": ["--seq-length", "256", "--max-new-tokens", "16", "--max-conversations", "4",
                                           "--bootstrap", "50"]},
               "agent_eval": {"args": ["--env", "toy", "--trials", "1", "--tasks", "2", "--max-agent-turns", "2",
                                       "--max-new-tokens", "8", "--user-max-new-tokens", "16", "--no-agent-thinking"]}}


def small_definition(path: Path, stages: dict, changes: dict[str, list[str]], **fields) -> Path:
    """A copy of some of the demo's stages, each given the extra ``args`` in ``changes`` (fewer steps)."""
    demo = yaml.safe_load((REPO / "launch" / "pipelines" / "demo.yaml").read_text())["stages"]
    chosen = {name: {**demo[name], **stages.get(name, {})} for name in stages}
    for name, args in changes.items():
        chosen[name]["args"] = [*chosen[name].get("args", []), *args]
    path.write_text(yaml.safe_dump({"name": path.stem, "stages": chosen, **fields}, sort_keys=False))
    return path


def given_definition(path: Path, given: dict[str, Path], stages: list[str], changes: dict[str, dict]) -> Path:
    """Some of the demo's ``stages`` (with the fields in ``changes`` over theirs) after inputs that stand in for the
    stages before them (``given``: stage -> a data_prep output or an HF directory, as ``kind: input`` stages)."""
    demo = yaml.safe_load((REPO / "launch" / "pipelines" / "demo.yaml").read_text())["stages"]
    chosen = {name: {"kind": "input", "provides": "data" if demo[name]["kind"].startswith("prep_") else "hf",
                     "path": str(value)} for name, value in given.items()}
    for name in stages:
        chosen[name] = {**demo[name], **changes.get(name, {})}
    path.write_text(yaml.safe_dump({"name": path.stem, "stages": chosen}, sort_keys=False))
    return path


class PipelineRun:
    def __init__(self, definition: Path, run_dir: Path, *extra: str, python: Path | str = sys.executable):
        self.definition, self.run_dir, self.extra = definition, run_dir, [str(e) for e in extra]
        self.marker = uuid.uuid4().hex
        self.env = {**{k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "NPROC"))},
                    "PYTHON": str(python), "PYTHONUNBUFFERED": "1", MARKER: self.marker}
        self.proc = None
        self.logs: list[Path] = []

    def start(self) -> "PipelineRun":
        log = self.run_dir.parent / f"{self.run_dir.name}-pipeline-{len(self.logs)}.log"
        self.logs.append(log)
        self.out = open(log, "w")
        self.proc = subprocess.Popen(["bash", str(REPO / "launch" / "pipeline.sh"), "run", str(self.definition),
                                      "--run-dir", str(self.run_dir), *self.extra], cwd=REPO, env=self.env,
                                     stdout=self.out, stderr=subprocess.STDOUT)
        return self

    def wait(self, timeout: float = 900) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            self.out.close()

    def output(self) -> str:
        return self.logs[-1].read_text()

    def wait_until(self, predicate, what: str, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if self.proc.poll() is not None:
                raise AssertionError(f"the pipeline exited ({self.proc.returncode}) before {what}:\n{self.output()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"no {what} after {timeout} s:\n{self.output()}")
            time.sleep(0.5)

    def processes(self) -> dict[int, dict]:
        return {pid: info for pid, info in processes_with_env(MARKER, self.marker).items() if pid != os.getpid()}

    def wait_gone(self, timeout: float) -> dict[int, dict]:
        """The run's processes still alive after ``timeout`` seconds (none, when everything ended)."""
        deadline = time.monotonic() + timeout
        while (alive := self.processes()) and time.monotonic() < deadline:
            time.sleep(0.5)
        return alive

    def kill_leftovers(self) -> None:
        kill_all(self.processes())


def latest(save: Path) -> int:
    try:
        return int((save / "latest").read_text().strip().removeprefix("iter_"))
    except (OSError, ValueError):
        return 0
