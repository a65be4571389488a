"""Agent RL (GRPO + CSD) end to end on CPU: the tiny model as the agent on the toy env, the env's scripted user
as the frozen simulator, a scripted coach; CSD changes the update and its gate statistics are logged."""

import json
import re
import shutil

import pytest

from data_prep.tokenizer import copy_tokenizer
from megatron_mimesis.checkpoint.reader import TOKENIZER_SUBDIR
from megatron_mimesis.rl.agent.config import AgentRLConfig
from megatron_mimesis.training.config import ConfigError
from tests.rl.fakes import FakeOpenAIServer
from tests.training.conftest import read_metrics, run_trainer

AGENT_RL = "megatron_mimesis.rl.agent_rl"


def _agent_args(tiny_dataset, tiny_hf_checkpoint, log_dir, *extra):
    return ["--tokenizer", str(tiny_dataset / "tokenizer"), "--env", "toy", "--user-model", "scripted",
            "--coach", "scripted", "--coach-options", json.dumps({"note": "Answer in two words."}),
            "--no-thinking", "--model-overrides", json.dumps({"vocab_size": 512}),
            "--pretrained-hf", str(tiny_hf_checkpoint), "--tasks-per-step", "2", "--rollouts-per-prompt", "4",
            "--max-agent-turns", "2", "--max-new-tokens", "8", "--lr", "1e-2", "--min-lr", "1e-2",
            "--log-dir", str(log_dir), *extra]


@pytest.mark.slow
def test_csd_changes_the_update_and_logs_its_gate(tiny_dataset, tiny_hf_checkpoint, tmp_path):
    # one step each: every assertion is about the first update (the same rollouts, a different gradient)
    for name, alpha in (("csd", "0.5"), ("grpo", "0")):
        coach = [] if alpha != "0" else ["--coach", "none"]
        run_trainer(2, *_agent_args(tiny_dataset, tiny_hf_checkpoint, tmp_path / name, "--train-iters", "1",
                                    "--tensor-model-parallel-size", "2", "--csd-alpha", alpha, *coach),
                    module=AGENT_RL, timeout=600)
    csd, grpo = read_metrics(tmp_path / "csd"), read_metrics(tmp_path / "grpo")
    first_csd, first_grpo = csd[0], grpo[0]
    # identical rollouts (same seeds, same weights before the first update), so the same GRPO term...
    assert first_csd["reward_mean"] == first_grpo["reward_mean"] and first_csd["rows"] == first_grpo["rows"]
    assert abs(first_csd["pg_loss"] - first_grpo["pg_loss"]) < 1e-6
    # ...but a different update: the CSD term moved the gradient
    assert abs(first_csd["grad_norm"] - first_grpo["grad_norm"]) > 1e-4 * first_grpo["grad_norm"]
    assert first_csd["csd_turns"] == first_csd["rows"] and first_csd["coach_failures"] == 0
    assert 0.0 < first_csd["csd_gate_mean"] < 1.0 and first_csd["csd_tokens"] > 0
    assert "csd_gate_mean" not in first_grpo
    # the longest wait a preemption signal could meet: at least the update, at most the whole step
    assert 0 < first_csd["train_time_s"] <= first_csd["longest_phase_s"] < 600
    samples = [json.loads(line) for line in (tmp_path / "csd" / "csd_samples.jsonl").read_text().splitlines()]
    assert samples and all(s["note"] == "Answer in two words." for s in samples)
    assert all("# Coach's note\nAnswer in two words." in s["teacher_context"] for s in samples)


@pytest.mark.slow
def test_a_qwen3_agent_trains_in_its_own_chat_format(tiny_dataset, qwen3_tokenizer, qwen3_hf_checkpoint, tmp_path):
    """The dense family as the agent at TP=2: contexts rendered by Qwen3's own template with thinking on, CSD's
    teacher re-scoring the same tokens, a KL reference of the same family, and the tool-call parse counted."""
    args = _agent_args(tiny_dataset, qwen3_hf_checkpoint, tmp_path / "run", "--model", "qwen3-tiny", "--thinking",
                       "--tokenizer", str(qwen3_tokenizer), "--train-iters", "2", "--tensor-model-parallel-size", "2",
                       "--csd-alpha", "0.5", "--kl-coef", "0.1", "--kl-reference", str(qwen3_hf_checkpoint))
    run_trainer(2, *args, module=AGENT_RL, timeout=600)
    records = read_metrics(tmp_path / "run")
    assert len(records) == 2 and all(r["rows"] > 0 and r["update_applied"] is not False for r in records)
    assert records[0]["kl_ref"] < 1e-6 < records[1]["kl_ref"]  # the reference is the starting weights
    assert all(0.0 < r["csd_gate_mean"] < 1.0 and r["csd_turns"] == r["rows"] for r in records)
    assert all("unparsed_tool_calls" in r for r in records)
    samples = [json.loads(line) for line in (tmp_path / "run" / "csd_samples.jsonl").read_text().splitlines()]
    assert all(s["teacher_context"].count("<|im_start|>assistant\n") >= 1 for s in samples)
    assert all("# Tools\n\nYou may call one or more functions" in s["teacher_context"] for s in samples)


@pytest.mark.slow
def test_the_seed_reaches_the_rollouts_sampling(tiny_dataset, tiny_hf_checkpoint, tmp_path):
    """One toy task, so --seed cannot act through the task order: seeds 1 and 2 sample other agent turns from the
    first step on, and seed 1 again samples the same, to the bit."""
    def first_step(name, seed):
        run_trainer(1, *_agent_args(tiny_dataset, tiny_hf_checkpoint, tmp_path / name, "--train-iters", "1",
                                    "--seed", str(seed), "--env-options", json.dumps({"num_tasks": 2}),
                                    "--tasks-per-step", "1", "--max-new-tokens", "12"), module=AGENT_RL)
        (record,) = read_metrics(tmp_path / name)
        samples = [json.loads(line)["agent_message"] for line in (tmp_path / name / "csd_samples.jsonl").open()]
        return {k: record[k] for k in ("pg_loss", "grad_norm", "response_tokens_per_turn")}, samples

    one, two, again = first_step("one", 1), first_step("two", 2), first_step("again", 1)
    assert again == one
    assert two[1] != one[1] and two[0] != one[0]


def test_agent_config_is_validated_before_anything_starts(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{}")
    config = AgentRLConfig(tokenizer=str(tmp_path), env="tau2")
    with pytest.raises(ConfigError, match="env=tau2 needs env_options"):
        config.validate(1)
    config = config.replace(env="toy", user_model="openai")
    with pytest.raises(ConfigError, match="user_model=openai needs user_model_options"):
        config.validate(1)
    config = config.replace(user_model="scripted", coach="none")
    with pytest.raises(ConfigError, match="coach=none trains plain GRPO"):
        config.validate(1)
    with pytest.raises(ConfigError, match="gamma must be in"):
        config.replace(csd_alpha=0.0, gamma=1.5).validate(1)
    config.replace(csd_alpha=0.0).validate(1)
    for changes, message in (
            ({"optimizer_steps_per_batch": 3, "tasks_per_step": 4},
             "optimizer_steps_per_batch 3 does not divide the 4 groups of a step"),
            ({"advantage": "gae"}, "advantage must be one of ('foldgrpo', 'turn_credit')")):
        with pytest.raises(ConfigError, match=re.escape(message)):
            config.replace(csd_alpha=0.0, **changes).validate(1)


def test_userrl_configs_are_refused_in_one_line_before_anything_starts(tmp_path):
    pytest.importorskip("functiongym", reason="UserRL's gyms: make venv installs them from ../shared/third_party")
    (tmp_path / "tokenizer.json").write_text("{}")
    endpoint = {"base_url": "http://127.0.0.1:9/v1", "model": "sim"}
    config = AgentRLConfig(tokenizer=str(tmp_path), env="userrl", env_options={"gyms": {"FunctionGym": {}}},
                           user_model="openai", user_model_options=endpoint, coach="none", csd_alpha=0.0)
    config.validate(1)
    for changes, message in (
            ({"user_model": "scripted"}, "env=userrl: the gyms call their user themselves, an OpenAI-compatible "
                                         "endpoint: user_model must be openai"),
            ({"user_model_options": {**endpoint, "temperature": 0.5}},
             "user_model_options: ['temperature'] do not apply to env=userrl"),
            ({"env_options": {"gyms": {"ChessGym": {}}}}, "env_options: env_options.gyms: ['ChessGym'] are not gyms"),
            ({"env_options": {"gyms": {"FunctionGym": {}}, "colour": 1}}, "env_options do not fit the userrl env"),
            ({"env_options": {"gyms": {"TravelGym": {}}}}, "env_options: TravelGym: its tasks do not load")):
        with pytest.raises(ConfigError, match=re.escape(message)):
            config.replace(**changes).validate(1)


def test_a_local_user_model_of_another_family_or_tokenizer_is_refused_in_one_line(tiny_dataset, tmp_path):
    """A local user model runs beside the agent with its architecture and tokenizer; a Qwen3.5 simulator for a Qwen3
    agent (or any other tokenizer) is served instead."""
    import shutil

    from megatron_mimesis.models.presets import get_preset
    from tests.rl.fakes import char_tokenizer

    def hf_dir(name, preset_name, tokenizer):
        preset = get_preset(preset_name).replace(vocab_size=512)
        preset.family.hf_config(preset).save_pretrained(tmp_path / name)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp_path / name) if hasattr(tokenizer, "save_pretrained") else \
                shutil.copytree(tokenizer, tmp_path / name, dirs_exist_ok=True)
        return str(tmp_path / name)

    agent = AgentRLConfig(env="toy", user_model="local", coach="none", csd_alpha=0.0, model="qwen3-tiny",
                          model_overrides={"vocab_size": 512}, tokenizer=str(tiny_dataset / "tokenizer"))
    simulator = hf_dir("simulator", "tiny", tiny_dataset / "tokenizer")
    with pytest.raises(ConfigError, match=r"^user_model_options.load: .*simulator is another model than the agent's "
                                          r"\(agent vs user model: family: Qwen3 vs Qwen3.5\); serve it"):
        agent.replace(user_model_options={"load": simulator}).validate(1)
    other = hf_dir("other-tokenizer", "qwen3-tiny", char_tokenizer())
    with pytest.raises(ConfigError, match=r"^user_model_options.load: .*other-tokenizer has another tokenizer"):
        agent.replace(user_model_options={"load": other}).validate(1)
    same = hf_dir("same", "qwen3-tiny", tiny_dataset / "tokenizer")
    agent.replace(user_model_options={"load": same}).validate(1)


def test_a_local_user_simulator_is_refused_above_the_tiny_preset():
    config = AgentRLConfig(env="toy", user_model="local", coach="none", csd_alpha=0.0)
    with pytest.raises(ConfigError, match=r"^user_model=local decodes the simulator with the local engine.*not '4b'; "
                                          r"serve the simulator \(vllm serve\) and use user_model=openai$"):
        config.replace(model="4b", engine="vllm", bf16=True).validate_without_files(1)
    config.validate_without_files(1)


@pytest.mark.slow
def test_tau2_mock_step_with_a_local_tiny_simulator_and_the_policy_as_coach(tiny_dataset, tiny_hf_checkpoint,
                                                                             tmp_path):
    args = _agent_args(tiny_dataset, tiny_hf_checkpoint, tmp_path / "run", "--train-iters", "1",
                       "--tasks-per-step", "1", "--rollouts-per-prompt", "2", "--max-new-tokens", "6")
    for flag, value in (("--env", "tau2"), ("--user-model", "local"), ("--coach", "policy")):
        args[args.index(flag) + 1] = value
    del args[args.index("--coach-options"):args.index("--coach-options") + 2]
    args += ["--env-options", json.dumps({"domain": "mock"}), "--user-model-options",
             json.dumps({"load": str(tiny_hf_checkpoint), "max_new_tokens": 6, "thinking": False}),
             "--coach-max-new-tokens", "4"]
    run_trainer(1, *args, module=AGENT_RL, timeout=600)
    (record,) = read_metrics(tmp_path / "run")
    assert record["rollouts"] == 2 and record["score_failures"] == 0
    assert record["scored_rollouts"] == 2 and record["reward_mean"] == 0.0  # tau2's evaluator: not solved
    assert record["rows"] >= 2 and record["update_applied"]
    # the policy coached itself: every coached turn was re-scored by the teacher (or counted as a failure)
    assert record["csd_turns"] + record["coach_failures"] == record["rows"]


@pytest.mark.slow
def test_several_optimizer_steps_per_batch_clip_from_the_second_on(tiny_dataset, tiny_hf_checkpoint, tmp_path):
    """The paper's protocol: a batch of 4 tasks x 2 rollouts in 4 mini-batches of one task, each an optimizer step
    against the rollouts' old log-probs. The first step is on-policy (the local engine sampled with these weights, so
    no ratio leaves the clip band); the later ones move away and clip."""
    def run(name, *extra):
        run_trainer(1, *_agent_args(tiny_dataset, tiny_hf_checkpoint, tmp_path / name, "--train-iters", "1",
                                    "--tasks-per-step", "4", "--rollouts-per-prompt", "2", *extra), module=AGENT_RL,
                    timeout=600)
        (record,) = read_metrics(tmp_path / name)
        return record

    one, four = run("one"), run("four", "--optimizer-steps-per-batch", "4")
    assert four["reward_mean"] == one["reward_mean"] and four["rows_trained"] == one["rows_trained"]
    assert four["optimizer_steps"] == 4 and "optimizer_steps" not in one
    clipped = [low + high for low, high in zip(four["clip_frac_low_per_step"], four["clip_frac_high_per_step"],
                                               strict=True)]
    assert clipped[0] == 0.0 and max(clipped[1:]) > 0.0, clipped
    assert one["clip_frac_low"] + one["clip_frac_high"] == 0.0
    assert four["clip_frac_high"] == pytest.approx(sum(four["clip_frac_high_per_step"]) / 4)


@pytest.mark.slow
def test_a_step_whose_rollouts_all_failed_trains_nothing_and_still_saves(tiny_dataset, tiny_hf_checkpoint, tmp_path,
                                                                         request):
    """The user model failing every request from the start (its server lists the model, then answers 500): every
    episode of both steps ends as a counted error, no update is applied, and the checkpoints of both steps are written and resume. The save before
    the first update used to fail in megatron's distributed optimizer (torch Adam without state: ``assert len(steps)
    == 1``), ending the run.

    The tokenizer is the agent's own model directory, as the pipeline and the agent configs name it: each
    checkpoint carries its tokenizer files, not its weights (a copy of the whole directory was ~16 GB at Qwen3-8B)."""
    agent_dir = tmp_path / "agent"
    shutil.copytree(tiny_hf_checkpoint, agent_dir)
    tokenizer_files = copy_tokenizer(tiny_dataset / "tokenizer", agent_dir)
    user = FakeOpenAIServer(models=["nobody"]).__enter__()
    user.broken = True
    request.addfinalizer(lambda: user.__exit__(None, None, None))
    args = _agent_args(tiny_dataset, tiny_hf_checkpoint, tmp_path / "run", "--train-iters", "2", "--save-interval", "1",
                       "--save", str(tmp_path / "ckpt"), "--user-model", "openai", "--user-model-options",
                       json.dumps({"base_url": user.base_url, "model": "nobody", "max_retries": 0}),
                       "--tokenizer", str(agent_dir))
    run_trainer(2, *args, module=AGENT_RL, timeout=600)
    records = read_metrics(tmp_path / "run")
    assert [(r["iteration"], r["update_applied"], r["errors"], r["rows"]) for r in records] == [(1, False, 8, 0),
                                                                                             (2, False, 8, 0)]
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "2"
    saved = tmp_path / "ckpt" / "iter_0000002" / TOKENIZER_SUBDIR
    assert sorted(p.name for p in saved.iterdir()) == sorted(tokenizer_files)
    assert {p.name for p in agent_dir.glob("*.safetensors")} and not list(saved.glob("*.safetensors"))
    for p in saved.iterdir():
        assert p.read_bytes() == (agent_dir / p.name).read_bytes()
    shutil.rmtree(tmp_path / "ckpt" / "iter_0000002")  # requeued after step 1: resumes a fresh optimizer's checkpoint
    (tmp_path / "ckpt" / "latest").write_text("1\n")
    run_trainer(2, *args, module=AGENT_RL, timeout=600)
    assert [r["iteration"] for r in read_metrics(tmp_path / "run")] == [1, 2]
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "2"


@pytest.mark.slow
def test_a_coach_that_does_not_answer_stops_the_run_instead_of_turning_csd_off(tiny_dataset, tiny_hf_checkpoint,
                                                                               tmp_path):
    """Rank 0 asks the coach before anything starts (a server that does not serve the model: exit 2, one line); a
    coach that answers its model list but fails its notes stops the run at the first step past
    max_coach_failure_fraction, naming the error, where it used to train plain GRPO with a counter going up."""
    with FakeOpenAIServer(models=["coach"]) as coach:
        def agent_rl(model, name):
            options = {"base_url": coach.base_url, "model": model, "max_retries": 0}
            return run_trainer(1, *_agent_args(tiny_dataset, tiny_hf_checkpoint, tmp_path / name, "--train-iters", "2",
                                               "--coach", "openai", "--coach-options", json.dumps(options)),
                               module=AGENT_RL, check=False, timeout=600)

        unserved = agent_rl("COACH_MODEL", "unserved")
        coach.broken = True
        broken = agent_rl("coach", "broken")
    assert unserved.returncode == 2, unserved.stderr[-3000:]
    assert unserved.stderr.strip().splitlines()[-1] == (
        f"error: coach_options: {coach.base_url} serves ['coach'], not the model 'COACH_MODEL'")
    assert broken.returncode == 1, broken.stderr[-3000:]
    assert re.search(r"the coach failed (\d+) of \1 notes at iteration 1, more than max_coach_failure_fraction 0\.5: CSD "
                     r"would be off; first error: InternalServerError", broken.stderr), broken.stderr[-3000:]
    assert not (tmp_path / "broken" / "metrics.jsonl").exists() or not read_metrics(tmp_path / "broken")
