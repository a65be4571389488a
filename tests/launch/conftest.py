import json
import os
import sys

import pytest

from megatron_mimesis.checkpoint.conversion import import_from_hf
from tests.launch.slurm import FAKE_SCONTROL, FAKE_SRUN, write_exe


@pytest.fixture
def fake(tmp_path):
    """PATH with fake scontrol/srun and an nvidia-smi that finds no GPU; datasets the trainer accepts."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    write_exe(bin_dir / "scontrol", FAKE_SCONTROL)
    write_exe(bin_dir / "srun", FAKE_SRUN)
    write_exe(bin_dir / "nvidia-smi", "#!/bin/sh\nexit 9\n")
    log = tmp_path / "log"
    log.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "CONFIG", "DATA_PATH", "NPROC"))}
    env.update(PATH=f"{bin_dir}:{env['PATH']}", FAKE_LOG=str(log), PYTHON=sys.executable)
    for name, seq, vocab in (("data9b", 24576, 248320), ("demo", 256, 8192)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "manifest.json").write_text(json.dumps({"seq_length": seq, "tokenizer": {"vocab_size": vocab}}))
    return tmp_path, env


@pytest.fixture(scope="session")
def imported(tiny_hf_checkpoint, tmp_path_factory):
    """The tiny HF model as a dist checkpoint (weights only): what sft_9b.yaml and rl_simulator_9b.yaml load."""
    out = tmp_path_factory.mktemp("imported") / "ckpt"
    import_from_hf(tiny_hf_checkpoint, out, dtype="fp32", progress=False)
    return out
