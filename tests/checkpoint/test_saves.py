"""The trainer's saves at scale's failure points: the weights written are the step's even with megatron's overlapped
parameter all-gather, and a kill -9 at any phase of a save (asynchronous or not) leaves ``latest`` on a complete
checkpoint that loads, with the forked writer gone too."""

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from megatron_mimesis.checkpoint.reader import DistCheckpointReader, newest_complete
from tests.checkpoint.kill_during_save import MARKED, PHASES
from tests.multiproc import processes_with_env
from tests.training.conftest import REPO, common_args, run_trainer, train_losses

pytestmark = pytest.mark.slow

MARKER = "MIMESIS_TEST_SAVE"


def _tensors(directory: Path, out: Path) -> dict[str, torch.Tensor]:
    dcp_to_torch_save(str(directory), str(out))
    return {k: v for k, v in torch.load(out, weights_only=False).items() if isinstance(v, torch.Tensor)}


def test_overlapped_param_gather_saves_the_weights_of_the_step(tiny_dataset, tmp_path):
    """2 data-parallel ranks, distributed optimizer, 3 steps: with both overlaps on (and the save in a forked writer)
    the checkpoint equals that of the same run with the overlaps off (saved synchronously). Before the forced
    all-gather, 35 of 62 model tensors differed by about one Adam step."""
    saved = {}
    for name, flags in (("overlapped", ["--overlap-grad-reduce", "--overlap-param-gather", "--async-save"]),
                        ("plain", ["--no-overlap-grad-reduce", "--no-overlap-param-gather", "--no-async-save"])):
        run_trainer(2, *common_args(tiny_dataset, tmp_path / name, "--train-iters", "3", "--use-distributed-optimizer",
                                    "--save", str(tmp_path / name / "ckpt"), *flags))
        saved[name] = _tensors(tmp_path / name / "ckpt" / "iter_0000003", tmp_path / f"{name}.pt")
    assert train_losses(tmp_path / "overlapped") == train_losses(tmp_path / "plain")
    overlapped, plain = saved["overlapped"], saved["plain"]
    model = [k for k in plain if not k.startswith("optimizer.")]
    assert overlapped.keys() == plain.keys() and len(model) > 50
    differing = [k for k in plain if not torch.equal(overlapped[k], plain[k])]
    assert not differing, differing


@pytest.mark.parametrize("phase", PHASES)
def test_kill_9_at_each_phase_of_a_save_leaves_latest_loadable(tmp_path, phase):
    root = tmp_path / "ckpt"
    marker = uuid.uuid4().hex
    env = {**os.environ, "OMP_NUM_THREADS": "1", MARKER: marker}
    output = tmp_path / "output.txt"
    try:
        with output.open("w") as out:  # not a pipe: a writer that outlived the rank would hold it open
            status = subprocess.run([sys.executable, "-m", "tests.checkpoint.kill_during_save", phase, str(root)],
                                    cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=300).returncode
        assert status == -signal.SIGKILL, output.read_text()[-3000:]
        deadline = time.monotonic() + 5
        while processes_with_env(MARKER, marker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not processes_with_env(MARKER, marker)  # the forked writer died with its rank
    finally:
        for pid in processes_with_env(MARKER, marker):
            os.kill(pid, signal.SIGKILL)
    assert (tmp_path / "writer.pid").read_text().isdigit() == (phase == "async-writing")
    assert newest_complete(root) == (root / "iter_0000001", [])
    reader = DistCheckpointReader(root)
    assert reader.iteration == 1 and torch.equal(reader.tensor(MARKED), torch.zeros_like(reader.tensor(MARKED)))
