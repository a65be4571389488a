"""A small packed dataset and a tiny HF checkpoint, built once per test session, and a trainer runner."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SEQ_LENGTH = 128
VOCAB = 512
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def tiny_dataset(tmp_path_factory):
    from data_prep.midtrain import build

    out = tmp_path_factory.mktemp("data") / "chitchat-tiny"
    build(output=str(out), seq_length=SEQ_LENGTH, max_conversations=300, vocab_size=VOCAB, progress=False)
    return out


@pytest.fixture(scope="session")
def tiny_hf_checkpoint(tmp_path_factory):
    from transformers import Qwen3_5ForCausalLM

    from megatron_mimesis.models.presets import get_preset

    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(get_preset("tiny").replace(vocab_size=VOCAB).to_hf_config())
    out = tmp_path_factory.mktemp("hf") / "tiny"
    model.save_pretrained(out)
    return out


def run_trainer(nproc: int, *args: str, check: bool = True, timeout: int = 300) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "megatron_mimesis.training.train", "--no-progress", *args]
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
