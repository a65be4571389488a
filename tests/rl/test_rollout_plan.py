"""The rollout side of a split layout, planned: the 9B server's cache by hand, a dense family's (no DeltaNet state),
and mimesis-plan printing both sides of an agent-RL config with engine=served."""

import json
import subprocess
import sys

import pytest

from megatron_mimesis.models.family import parameter_count
from megatron_mimesis.models.presets import get_preset
from megatron_mimesis.rl.agent.config import AgentRLConfig
from megatron_mimesis.rl.rollout_plan import SERVER_ALLOWANCE_GIB, rollout_server_plan
from megatron_mimesis.training.memory.gpus import GPU_MEMORY_GIB
from megatron_mimesis.training.memory.plan import GIB
from tests.training.conftest import REPO

SERVED = {"base_url": "http://rollout:8000/v1", "model": "policy", "weights_dir": "/shared/weights"}


def _rows(plan) -> dict:
    return {row.term: row.values["vLLM server"] for row in plan.rows}


def test_the_9b_server_holds_what_its_cache_fits_by_hand():
    config = AgentRLConfig(model="9b", engine="served", engine_options=SERVED, tasks_per_step=16,
                           rollouts_per_prompt=8)
    plan = rollout_server_plan(config, gpus=8, tensor_parallel=2, max_model_len=32768, utilization=0.9)
    rows = _rows(plan)
    weights = 2 * parameter_count(get_preset("9b")) / 2
    assert rows["weights (bf16, 1/TP)"] == weights
    cache = 0.9 * GPU_MEMORY_GIB["A100-80GB"] * GIB - weights - SERVER_ALLOWANCE_GIB * GIB
    assert rows["KV and recurrent-state cache"] == pytest.approx(cache)
    # per GPU at TP=2: 8 attention layers x 4 KV heads x 256 x (k, v) x 2 bytes / 2 per token; 24 DeltaNet layers x 32
    # value heads x 128 x 128 fp32 states plus their bf16 conv taps / 2 per sequence
    assert rows["KV cache per token (attention layers, bf16, 1/TP)"] == 16
    state = (24 * 32 * 128 * 128 * 4 + 24 * 8192 * 3 * 2) / 2
    assert rows["recurrent state per sequence (float32 state, bf16 conv, 1/TP)"] == state / 2**20
    held = rows["sequences of 32768 tokens held at once, per instance"]
    assert held == int(cache // (32768 * 16 * 1024 + state)) == 112
    assert rows["episodes one step plays (groups x rollouts per prompt)"] == 128
    assert plan.fits and "448 sequences of 32768 tokens at once over 4 instance(s)" in plan.notes[0]


def test_a_dense_agent_has_no_deltanet_state_and_a_too_long_sequence_is_named():
    preset = get_preset("qwen3-8b")
    sizes = preset.family.engine_cache_sizes(preset)
    assert sizes["recurrent_fp32_bytes"] == sizes["conv_bf16_bytes"] == 0
    assert sizes["kv_bf16_bytes_per_token"] == 2 * 36 * 8 * 128 * 2
    config = AgentRLConfig(model="qwen3-8b", engine="served", engine_options=SERVED)
    plan = rollout_server_plan(config, gpus=8, tensor_parallel=1, max_model_len=2_000_000)
    assert plan.notes == ["one sequence of 2000000 tokens does not fit an instance's cache: raise its TP"]
    with pytest.raises(ValueError, match="8 rollout GPUs do not split into instances of tensor parallel 3"):
        rollout_server_plan(config, gpus=8, tensor_parallel=3, max_model_len=1024)


@pytest.mark.slow
def test_mimesis_plan_prints_both_sides_of_a_split_agent_config():
    args = [sys.executable, "tools/plan.py", "--config", "launch/configs/rl_agent_9b.yaml", "--nodes", "1",
            "--engine", "served", "--engine-options", json.dumps(SERVED), "--max-staleness", "1",
            "--recompute-num-layers", "6", "--rollout-tensor-parallel", "2"]
    table = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert table.returncode == 0, table.stderr[-2000:]
    trainer, server = table.stdout.split("\n\nrollout side per GPU: ")
    assert "TP=4 (SP) PP=1 DP=2 on 8 GPUs" in trainer.splitlines()[0] and "vLLM" not in trainer
    assert server.startswith("9b served by vLLM on 8 GPUs, 4 instance(s) of TP=2")
    as_json = subprocess.run([*args, "--json"], cwd=REPO, capture_output=True, text=True, timeout=300)
    plans = json.loads(as_json.stdout)
    assert plans["memory_plan"]["fits"] and plans["rollout_plan"]["fits"]
