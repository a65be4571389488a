"""What a newcomer meets first (issue 15, item 8): a config error from the launcher is one line, before torchrun
starts; GPUS_PER_NODE means processes per node here as on SLURM; the CLIs run from any directory once installed."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


@pytest.fixture
def local(tmp_path):
    """A machine without GPUs (nvidia-smi finds none), a dataset the trainer accepts and a one-process config."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\nexit 9\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    data = tmp_path / "data"
    data.mkdir()
    (data / "manifest.json").write_text(json.dumps({"seq_length": 256, "tokenizer": {"vocab_size": 8192}}))
    config = tmp_path / "run.yaml"
    config.write_text(f"model: tiny\nmodel_overrides: {{vocab_size: 8192}}\nseq_length: 256\ndata_path: {data}\n"
                      f"log_dir: {tmp_path / 'log'}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "NPROC", "GPUS_PER_NODE", "DATA_PATH"))}
    env.update(PATH=f"{bin_dir}:{env['PATH']}", PYTHON=sys.executable, CONFIG=str(config))
    return tmp_path, env


def launch(args, env):
    return subprocess.run(["bash", "launch/midtrain.sh", *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)


def test_a_config_error_is_one_line_and_no_rank_starts(local):
    tmp_path, env = local
    result = launch(["--lr=-1", "--micro-batch-size", "1"], {**env, "NPROC": "1"})
    assert result.returncode == 2
    assert result.stderr == "error: lr must be greater than 0, got -1\n"  # no torchrun report, no per-rank copy
    assert result.stdout == f"== midtrain: {env['CONFIG']} (from CONFIG)\n" and not (tmp_path / "log").exists()


def test_gpus_per_node_sets_the_local_process_count(local):
    _, env = local
    result = launch(["--dry-run"], {**env, "GPUS_PER_NODE": "1"})
    assert result.returncode == 0, result.stderr
    assert "--standalone --nnodes 1 --nproc-per-node 1 " in result.stdout
    assert "GPUS_PER_NODE=1" in result.stdout
    assert json.loads(result.stdout[result.stdout.index("{\n"):])["world_size"] == 1


@pytest.mark.parametrize("command", [
    [str(BIN / "mimesis-prep-midtrain"), "--help"],
    [str(BIN / "mimesis-prep-sft"), "--help"],
    [str(BIN / "mimesis-prep-bench"), "--help"],
    [str(BIN / "mimesis-inspect-checkpoint"), "--help"],
    [str(BIN / "mimesis-convert-checkpoint"), "export", "--help"],
    [str(BIN / "mimesis-plot-run"), "--help"],
    [str(BIN / "mimesis-eval-simulator"), "--help"],
    [str(BIN / "mimesis-eval-agent"), "--help"],
    [str(BIN / "mimesis-bench-convert"), "--help"],
    [sys.executable, "-m", "data_prep.midtrain", "--help"],
    [sys.executable, "-m", "megatron_mimesis.tools.plan", "--help"],
], ids=lambda command: Path(command[0]).name if len(command) == 2 or "export" in command else command[2])
def test_the_clis_run_from_any_directory(tmp_path, command):
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage:")
