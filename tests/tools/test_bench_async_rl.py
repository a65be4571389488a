"""``python tools/bench/bench_async_rl.py`` in its smallest form: simulator RL on the tiny preset, synchronous and with
a rollout worker that takes turns with the trainer (``max_staleness`` 0), three steps each through torchrun; the report
has both runs, and the worker's rewards are the synchronous run's to the bit."""

import json
import subprocess
import sys

import pytest

from tests.rl.test_simulator_rl import _prompts_file
from tests.training.conftest import REPO


@pytest.mark.slow
def test_the_smallest_run_reports_both_runs(tiny_dataset, tiny_hf_checkpoint, tmp_path, checkout_untouched):
    config = {"stage": "rl_simulator", "model": "tiny", "model_overrides": {"vocab_size": 512},
              "pretrained_hf": str(tiny_hf_checkpoint), "tokenizer": str(tiny_dataset / "tokenizer"),
              "prompts": [str(_prompts_file(tmp_path))], "domain_rewards": {"brief": "length_target"},
              "counterpart": "scripted", "counterpart_options": {"reply": "Tell me more."}, "thinking": False,
              "prompts_per_step": 2, "rollouts_per_prompt": 2, "max_turns": 1, "max_new_tokens": 4, "lr": 1e-2,
              "min_lr": 1e-2, "save": str(tmp_path / "never"), "save_interval": 1}
    (tmp_path / "config.yaml").write_text(json.dumps(config))
    done = subprocess.run([sys.executable, str(REPO / "tools" / "bench" / "bench_async_rl.py"), "--config",
                           str(tmp_path / "config.yaml"), "--steps", "3", "--warmup", "1", "--staleness", "sync", "0",
                           "--output", str(tmp_path / "out")], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    report = json.loads((tmp_path / "out" / "async_rl.json").read_text())
    sync, worker = report["runs"]["sync"], report["runs"]["staleness0"]
    assert sync["steps"] == worker["steps"] == 3 and sync["reward_mean"] == worker["reward_mean"]
    assert worker["staleness_mean"] == 0 and sync["staleness_mean"] is None
    assert 0 < sync["trainer_idle_frac"] < 1 and sync["step_time_s"] > 0
    assert "| staleness0 |" in done.stdout and not (tmp_path / "never").exists()  # a benchmark saves nothing
