"""A CPU run shows one line about the GPU-only packages it runs without, instead of every rank's copy of the
third-party notices about them (issue 15, item 8)."""

import re
import subprocess
import sys

import pytest
import torch

from megatron_mimesis.compat.cpu import CPU_NOTICE
from tests.training.conftest import common_args, run_under_torchrun

NOISE = re.compile(r"Warning|warnings\.warn|DEPRECATED|deprecated|^[WE]\d{4} ")
IMPORT_MEGATRON = "import megatron.core.optimizer, megatron.core.models.mimo"
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine these notices are shown")


def _stderr_of(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300).stderr


PREPARED = "from megatron_mimesis.compat import prepare_cpu_process; prepare_cpu_process(); "
COMPILED = ("import sys; from megatron.core.fusions import fused_bias_swiglu as f; "
            "print(hasattr(f.bias_swiglu, '_torchdynamo_orig_callable'), 'torch._dynamo' in sys.modules, "
            "file=sys.stderr)")


def test_megatron_import_notices_are_hidden_on_cpu():
    assert "Transformer Engine and Apex are not installed" in _stderr_of(IMPORT_MEGATRON)  # what there is to hide
    assert _stderr_of(PREPARED + IMPORT_MEGATRON) == ""


def test_megatron_imports_without_torchdynamo_and_its_fusions_stay_plain_functions_on_cpu():
    """megatron-core applies torch.compile to its fusions as it is imported; that imported TorchDynamo and Inductor
    (~3 s of CPU in every rank) for wrappers that ran eagerly anyway."""
    assert _stderr_of(COMPILED).splitlines()[-1] == "True True"
    assert _stderr_of(PREPARED + COMPILED).splitlines()[-1] == "False False"


@pytest.mark.slow
def test_a_two_rank_run_prints_the_cpu_notice_once_and_no_third_party_notice(tiny_dataset, tmp_path):
    proc = run_under_torchrun(2, *common_args(tiny_dataset, tmp_path, "--pipeline-model-parallel-size", "2",
                                              "--train-iters", "2", "--eval-interval", "2", "--eval-iters", "1",
                                              "--save", str(tmp_path / "ckpt")))
    lines = (proc.stdout + proc.stderr).splitlines()
    assert lines.count(CPU_NOTICE) == 1
    assert [line for line in lines if NOISE.search(line)] == []
