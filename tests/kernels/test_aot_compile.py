"""Every Triton kernel the project launches, compiled ahead of time for A100 (sm_80), H100/H200 (sm_90a) and B200
(sm_100a) at the launch configuration its launcher picks there, without a GPU: ptxas must report no register spill.

The compile runs in a subprocess because this process has TRITON_INTERPRET=1 (the interpreter replaces kernels by
Python functions). Its resource table (registers, spills, shared memory, resident CTAs per SM) is printed."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from megatron_mimesis.kernels.aot_check import KERNELS
from megatron_mimesis.kernels.launch_config import ARCHS, INTERPRETER, LAUNCHES

from megatron_mimesis.models.presets import PRESETS

KERNELS_DIR = Path(__file__).resolve().parents[2] / "kernels"


def test_every_launched_kernel_is_checked_and_configured():
    """A @triton.jit function launched as ``name[grid](...)`` anywhere in the package has an AOT signature, and
    every launch configuration has a column per architecture."""
    launched = set()
    for path in KERNELS_DIR.glob("*.py"):
        source = path.read_text()
        for name in re.findall(r"@triton\.jit\s*\ndef (\w+)", source):
            if any(re.search(rf"\b{name}\[", p.read_text()) for p in KERNELS_DIR.glob("*.py")):
                launched.add(f"{path.stem}.{name}")
    assert launched == set(KERNELS)
    assert {launch for launch, _, _ in KERNELS.values()} == set(LAUNCHES)
    for columns in LAUNCHES.values():
        assert set(columns) == {INTERPRETER, *ARCHS}
    # the check compiles the hidden size and row strides as multiples of 16: true of every model we build
    assert all(preset.hidden_size % 16 == 0 for preset in PRESETS.values())


@pytest.mark.slow
def test_no_kernel_spills_on_a100_h100_or_b200(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "resources.json"
    done = subprocess.run([sys.executable, "-m", "megatron_mimesis.kernels.aot_check", "--arch", "80", "90", "100",
                           "--json", str(out)], env=env, capture_output=True, text=True, timeout=900)
    print(done.stdout)
    rows = json.loads(out.read_text())
    assert {(r["kernel"], r["target"], r["sizes"]) for r in rows} == {
        (kernel, target, sizes) for kernel in KERNELS for target in ("sm_80", "sm_90a", "sm_100a") for sizes in ("x16", "any")}
    spilling = [r for r in rows if r["spill_stores"] or r["spill_loads"]]
    assert not spilling, spilling
    assert done.returncode == 0, done.stderr[-2000:]
    for r in rows:
        assert 0 < r["registers"] <= 255 and r["ctas_per_sm"] >= 1, r
