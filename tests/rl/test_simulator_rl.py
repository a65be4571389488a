"""Simulator RL end to end on CPU: FoldGRPO with the local engine at TP=2 raises a toy domain's reward."""

import json

import pytest

from megatron_mimesis.rl.simulator.config import SimulatorRLConfig
from megatron_mimesis.training.config import ConfigError
from tests.training.conftest import read_metrics, run_trainer

TOY_PROMPTS = [
    {"id": f"short-{i}", "domain": "brief", "prompt": "You are a user who answers in very few words.",
     "opening": opening, "reference": 2}
    for i, opening in enumerate(["Hi! How are you today?", "What did you do this weekend?",
                                 "Do you like music?", "Where are you from?"])
]


def _prompts_file(tmp_path):
    path = tmp_path / "toy.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in TOY_PROMPTS))
    return path


def _rl_args(tiny_dataset, tiny_hf_checkpoint, tmp_path, *extra):
    return ["--tokenizer", str(tiny_dataset / "tokenizer"), "--prompts", json.dumps([str(_prompts_file(tmp_path))]),
            "--domain-rewards", json.dumps({"brief": "length_target"}), "--counterpart", "scripted",
            "--counterpart-options", json.dumps({"reply": "Tell me more."}), "--no-thinking",
            "--model-overrides", json.dumps({"vocab_size": 512}), "--pretrained-hf", str(tiny_hf_checkpoint),
            "--prompts-per-step", "4", "--rollouts-per-prompt", "4", "--max-turns", "2", "--max-new-tokens", "10",
            "--lr", "1e-2", "--min-lr", "1e-2", "--log-dir", str(tmp_path / "run"), *extra]


@pytest.mark.slow
def test_foldgrpo_raises_the_toy_reward_at_tp2(tiny_dataset, tiny_hf_checkpoint, tmp_path):
    run_trainer(2, *_rl_args(tiny_dataset, tiny_hf_checkpoint, tmp_path, "--tensor-model-parallel-size", "2",
                             "--train-iters", "20"), module="megatron_mimesis.rl.simulator_rl", timeout=900)
    records = read_metrics(tmp_path / "run")
    rewards = [r["reward_mean"] for r in records]
    first, last = sum(rewards[:10]) / 10, sum(rewards[10:]) / 10  # measured: 0.42 -> 0.59 (0.62 over steps 21-30)
    assert last > first + 0.1, rewards
    assert all(r["approx_kl"] < 1e-6 for r in records)  # on-policy: the engine's log-probs are the trainer's
    assert all(r["rollouts"] == 16 and r["rows"] >= 16 for r in records)  # several turns fold into several rows


def test_rl_config_is_validated_before_anything_starts(tmp_path):
    config = SimulatorRLConfig(tokenizer=str(tmp_path), prompts=["nope.jsonl"])
    with pytest.raises(ConfigError, match="tokenizer"):
        config.validate(1)
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ConfigError, match="prompts: nope.jsonl does not exist"):
        config.validate(1)
    config = config.replace(prompts=[str(_prompts_file(tmp_path))], domain_rewards={"brief": "length_target"},
                            counterpart="scripted")
    with pytest.raises(ConfigError, match="counterpart=scripted needs"):
        config.validate(1)
    with pytest.raises(ConfigError, match="prompts_per_step 64 is not divisible by data-parallel size 3"):
        config.replace(counterpart_options={"reply": "ok"}, global_batch_size=3).validate(3)


def test_the_local_engine_is_refused_above_the_tiny_preset():
    """It decodes with the training model, no KV cache, full-vocabulary logits per token: a CPU engine for tiny."""
    with pytest.raises(ConfigError, match=r"^engine=local decodes with the training model itself.*not one for '9b'; use "
                                          r"engine=vllm$"):
        SimulatorRLConfig(model="9b", engine="local").validate_without_files(1)
    SimulatorRLConfig(model="tiny", engine="local").validate_without_files(1)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["tiny", "qwen3-tiny"])
def test_kl_to_the_reference_starts_at_zero_and_grows_as_the_policy_moves(tiny_dataset, tiny_hf_checkpoint,
                                                                          qwen3_hf_checkpoint, tmp_path, model):
    """For each family: a policy and its frozen reference from the same HF weights, FoldGRPO with a KL term."""
    checkpoint = tiny_hf_checkpoint if model == "tiny" else qwen3_hf_checkpoint
    run_trainer(1, *_rl_args(tiny_dataset, checkpoint, tmp_path, "--model", model, "--train-iters", "4",
                             "--max-new-tokens", "6", "--prompts-per-step", "2", "--rollouts-per-prompt", "2",
                             "--kl-coef", "0.5", "--kl-reference", str(checkpoint)),
                module="megatron_mimesis.rl.simulator_rl")
    records = read_metrics(tmp_path / "run")
    kl = [r["kl_ref"] for r in records]
    assert kl[0] < 1e-6  # the policy starts from the reference's weights
    assert kl[-1] > 1e-4, kl  # lr 1e-2 moves it away within a few steps
    assert all(r["kl_loss"] == pytest.approx(r["kl_ref"]) for r in records)  # token means of the same k3 values
