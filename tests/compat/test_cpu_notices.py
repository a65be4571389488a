"""A CPU run shows one line about the GPU-only packages it runs without, instead of every rank's copy of the
third-party notices about them (issue 15, item 8)."""

import re
import subprocess
import sys

import pytest
import torch

from megatron_mimesis.compat.cpu import CPU_NOTICE
from tests.training.conftest import common_args, run_trainer

NOISE = re.compile(r"Warning|warnings\.warn|DEPRECATED|deprecated|^[WE]\d{4} ")
IMPORT_MEGATRON = "import megatron.core.optimizer, megatron.core.models.mimo"
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine these notices are shown")


def _stderr_of(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300).stderr


def test_megatron_import_notices_are_hidden_on_cpu():
    assert "Transformer Engine and Apex are not installed" in _stderr_of(IMPORT_MEGATRON)  # what there is to hide
    hidden = _stderr_of(f"from megatron_mimesis.compat import hide_cpu_notices; hide_cpu_notices(); {IMPORT_MEGATRON}")
    assert hidden == ""


@pytest.mark.slow
def test_a_two_rank_run_prints_the_cpu_notice_once_and_no_third_party_notice(tiny_dataset, tmp_path):
    proc = run_trainer(2, *common_args(tiny_dataset, tmp_path, "--pipeline-model-parallel-size", "2",
                                       "--train-iters", "2", "--eval-interval", "2", "--eval-iters", "1",
                                       "--save", str(tmp_path / "ckpt")))
    lines = (proc.stdout + proc.stderr).splitlines()
    assert lines.count(CPU_NOTICE) == 1
    assert [line for line in lines if NOISE.search(line)] == []
