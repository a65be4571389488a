"""``tools/bench/bench_eval_agent.py`` in its smallest form: the same evaluation through transformers and through a real
vLLM server of the same export, episodes per minute side by side with the ratio, the JSON under ``--output``."""

import json
import subprocess
import sys

import pytest

from tests.training.conftest import REPO

pytestmark = pytest.mark.vllm


def test_the_served_agent_is_measured_beside_the_transformers_one(tmp_path, tiny_hf_checkpoint, tiny_dataset,
                                                                   checkout_untouched):
    eval_args = ("--env toy --env-options '{\"num_tasks\": 4, \"max_words\": 3}' --trials 1 --max-agent-turns 2 "
                 "--max-new-tokens 4 --no-agent-thinking --user scripted=scripted:toy")
    done = subprocess.run([sys.executable, str(REPO / "tools" / "bench" / "bench_eval_agent.py"), "--export",
                           str(tiny_hf_checkpoint), "--tokenizer", str(tiny_dataset / "tokenizer"), "--eval-args",
                           eval_args, "--output", str(tmp_path / "out")], cwd=tmp_path, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads((tmp_path / "out" / "bench_eval_agent.json").read_text())["rows"]
    assert [row["agent"].split("=", 1)[1].split(":")[0] for row in rows] == ["hf", "openai"]
    assert rows[0]["episodes"] == rows[1]["episodes"] == 2  # the test split's 2 tasks, one trial each
    assert rows[1]["vs_hf"] == pytest.approx(rows[1]["episodes_per_min"] / rows[0]["episodes_per_min"], abs=0.01)
    table = done.stdout.splitlines()
    assert table[0] == "| agent | episodes | wall s | episodes/min | vs hf | score |"
    assert table[2].startswith("| hf | 2 |") and table[3].startswith("| openai | 2 |")
