"""``make bench-engines`` (``tools/bench/bench_engines.py`` in the vLLM environment) in its smallest form: both engines
run, the table has a row per engine with its ratio to the local engine, and the JSON goes under ``runs/``."""

import json
import subprocess
import sys

import pytest

from tests.training.conftest import REPO

pytestmark = pytest.mark.vllm


def test_both_engines_are_measured_beside_each_other(tmp_path, checkout_untouched):
    done = subprocess.run([sys.executable, str(REPO / "tools" / "bench" / "bench_engines.py"), "--prompts", "2",
                           "--prompt-tokens", "4", "--new-tokens", "4", "--repeats", "1"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    table = lines[lines.index(next(line for line in lines if line.startswith("engine"))):][:3]
    assert table[0].split() == ["engine", "sync", "s", "x", "local", "tokens/s", "x", "local", "|dlogp|", "mean", "max"]
    assert table[1].split()[0] == "local" and table[1].split()[2] == table[1].split()[4] == "1.00"
    assert table[2].split()[0] == "vllm"
    results = json.loads((tmp_path / "runs" / "bench-engines" / "bench_engines.json").read_text())
    for name in ("local", "vllm"):
        engine = results["engines"][name]
        assert engine["tokens"] == 2 * 4 and engine["rollout_tokens_per_s"] == engine["tokens"] / engine["rollout_s"]
        assert engine["logprob_abs_diff_max"] < 0.15  # gpu_check's bound for the engine against the trainer
    vllm_ratio = float(table[2].split()[4])
    assert vllm_ratio == pytest.approx(results["engines"]["vllm"]["rollout_tokens_per_s"]
                                       / results["engines"]["local"]["rollout_tokens_per_s"], abs=0.01)
