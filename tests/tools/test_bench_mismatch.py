"""tools/bench/bench_mismatch.py: the state-cache arithmetic by hand, where it may write, and its smallest run on real vLLM
(the engine keeps an fp32 recurrent state, every length and turn is measured, the mismatch is bf16-small)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tools.bench import bench_mismatch

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tools" / "bench" / "bench_mismatch.py"


def test_state_cache_sizes_of_the_9b_preset_by_hand():
    sizes = bench_mismatch._state_sizes("9b")
    # 24 DeltaNet layers x 32 value heads x 128 x 128; conv: (2 x 16 x 128 + 32 x 128) channels x 3 taps; KV: 8
    # attention layers x 4 KV heads x 256 x (k, v), bf16
    assert sizes["recurrent_fp32_bytes"] == 24 * 32 * 128 * 128 * 4 == 48 * 2**20
    assert sizes["recurrent_bf16_bytes"] == 24 * 2**20
    assert sizes["conv_bf16_bytes"] == 24 * 8192 * 3 * 2
    assert sizes["kv_bf16_bytes_per_token"] == 8 * 4 * 256 * 2 * 2 == 32 * 1024


def test_output_inside_the_repository_must_be_under_runs():
    done = subprocess.run([sys.executable, str(SCRIPT), "--output", str(REPO / "tools")], capture_output=True,
                          text=True)
    assert done.returncode == 1 and done.stderr.strip().endswith("is inside the repository but not under runs/")


@pytest.mark.vllm
@pytest.mark.slow
def test_the_smallest_run_measures_every_length_and_turn(tiny_dataset, tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), "--output", str(tmp_path / "out"), "--lengths", "80",
                           "--rollouts", "1", "--turns", "2", "--turn-tokens", "8", "--state-dtypes", "float32",
                           "--tokenizer", str(tiny_dataset / "tokenizer")], capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (result,) = json.loads((tmp_path / "out" / "mismatch.json").read_text())["results"].values()
    assert result["state"] == {"config": "float32", "conv": "bfloat16", "recurrent": "float32"}
    assert set(result["lengths"]["80"]) == {"all", "tail", "tokens_per_s"} and set(result["turns"]) == {"1", "2"}
    for cell in [result["lengths"]["80"]["all"], result["lengths"]["80"]["tail"], *result["turns"].values()]:
        # bf16 engine vs bf16 trainer, different kernels: the CPU runs measure KL ~5e-5 and max |delta| < 0.05
        assert 0.0 < cell["engine_kl"] < 1e-3 and 0.0 < cell["engine_logprob_abs_diff_max"] < 0.15, cell
    assert "| 80 tokens, last 64 |" in (tmp_path / "out" / "mismatch.md").read_text()
