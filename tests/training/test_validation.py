"""Inputs that are wrong are refused before any process group starts, each in one line naming the field; so are
the runs that would silently do something else than asked (issue 15, items 6 and 7)."""

import dataclasses
import json
import typing

import pytest

from megatron_mimesis.models.qwen3.presets import Qwen3Preset
from megatron_mimesis.models.qwen3_5.presets import Qwen35Preset
from megatron_mimesis.rl.agent.config import AgentRLConfig
from megatron_mimesis.rl.simulator.config import SimulatorRLConfig
from megatron_mimesis.training.config import RESUME_FIXED, ConfigError, TrainConfig, _flag_type, build_arg_parser
from megatron_mimesis.training.save_dir import check_save_dir, needs_check_here
from megatron_mimesis.training.train import TOKENIZER_SHA256, check_data, main
from tests.checkpoints import small_checkpoint
from tests.training.memory.planning import save_dir_refusal, trainer_dry_run


def _numeric_fields(cls, prefix: str = "") -> set[str]:
    hints = typing.get_type_hints(cls)
    return {prefix + f.name for f in dataclasses.fields(cls) if _flag_type(hints[f.name]) in (int, float)}


@pytest.mark.parametrize("cls", [TrainConfig, SimulatorRLConfig, AgentRLConfig])
def test_every_numeric_option_and_preset_size_has_a_range(cls):
    presets = _numeric_fields(Qwen35Preset, "model_overrides.") | _numeric_fields(Qwen3Preset, "model_overrides.")
    assert _numeric_fields(cls) | presets == set(cls.RANGES)


@pytest.mark.parametrize(("changes", "reason"), [
    ({"lr": -1e-3}, "lr must be greater than 0, got -0.001"),
    ({"min_lr": 1e-2, "lr": 1e-3}, "min_lr 0.01 is above lr 0.001"),
    ({"log_interval": 0}, "log_interval must be at least 1, got 0"),
    ({"micro_batch_size": 0}, "micro_batch_size must be at least 1, got 0"),
    ({"global_batch_size": -8}, "global_batch_size must be at least 1, got -8"),
    ({"adam_beta2": 1.0}, r"adam_beta2 must be in \[0, 1\), got 1"),
    ({"eval_iters": 0}, "eval_iters must be at least 1, got 0"),
    ({"save_interval": 0, "save": "ckpt"}, "save_interval must be at least 1, got 0"),
    ({"max_skipped_iters": 0}, "max_skipped_iters must be at least 1, got 0"),
    ({"num_workers": -1}, "num_workers must be at least 0, got -1"),
    ({"lr": "1e-3"}, r"lr: expected a number, got '1e-3' \(str\)"),  # YAML 1.1 reads 1e-3 as a string
    ({"train_iters": 2.5}, r"train_iters: expected an integer, got 2.5 \(float\)"),
    ({"seed": True}, r"seed: expected an integer, got True \(bool\)"),
    ({"lr": float("inf")}, "lr must be a finite number, got inf"),
    ({"clip_grad": float("nan")}, "clip_grad must be a finite number, got nan"),
    ({"max_consecutive_skipped_iters": 0}, "max_consecutive_skipped_iters must be at least 1, got 0"),
    ({"keep_last_n": 0, "save": "ckpt"}, "keep_last_n must be at least 1, got 0"),
    ({"ckpt_write_gb_per_s": 0.0}, "ckpt_write_gb_per_s must be greater than 0, got 0"),
    ({"keep_last_n": 2}, r"keep_last_n is set but save \(the checkpoint directory\) is not"),
    ({"keep_every": 100, "save": "ckpt", "save_interval": 50}, "keep_every keeps checkpoints that keep_last_n would "
                                                               "delete: set keep_last_n too"),
    ({"keep_every": 120, "keep_last_n": 2, "save": "ckpt", "save_interval": 50},
     "keep_every 120 is not a multiple of save_interval 50: no periodic checkpoint would be kept by it"),
    ({"model_overrides": {"num_layers": 0}}, "model_overrides.num_layers must be at least 1, got 0"),
    ({"model_overrides": {"hidden_size": 0}}, "model_overrides.hidden_size must be at least 1, got 0"),
    ({"model_overrides": {"rms_norm_eps": float("inf")}}, "model_overrides.rms_norm_eps must be a finite number"),
    ({"model_overrides": {"rotary_percent": 1.5}}, r"model_overrides.rotary_percent must be in \(0, 1\], got 1.5"),
    ({"model_overrides": {"head_dim": "64"}}, r"model_overrides.head_dim: expected an integer, got '64' \(str\)"),
    ({"model_overrides": {"num_heads": 8}}, r"model_overrides: unknown Qwen3.5 preset field\(s\) \['num_heads'\]"),
    ({"model": "qwen3-tiny", "model_overrides": {"linear_num_key_heads": 8}},
     r"model_overrides: unknown Qwen3 preset field\(s\) \['linear_num_key_heads'\]"),
    ({"mtp_loss_scaling_factor": -0.1}, "mtp_loss_scaling_factor must be at least 0, got -0.1"),
    ({"mtp_loss_scaling_factor": 0.1}, "mtp_loss_scaling_factor: the model 'tiny' has no multi-token-prediction head "
                                       r"\(mtp_num_layers 0\) to train; leave it 0"),
    ({"model": "qwen3-tiny", "mtp_loss_scaling_factor": 0.1}, "mtp_loss_scaling_factor: the model 'qwen3-tiny' has no"),
])
def test_numeric_options_out_of_range_are_refused_in_one_line(tmp_path, changes, reason):
    with pytest.raises(ConfigError, match=f"^{reason}") as info:
        TrainConfig(data_path=str(tmp_path), **changes).validate(1)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(("cls", "changes", "reason"), [
    (SimulatorRLConfig, {"top_p": 0.0}, r"top_p must be in \(0, 1\], got 0"),
    (SimulatorRLConfig, {"temperature": -1.0}, "temperature must be at least 0, got -1"),
    (SimulatorRLConfig, {"clip_eps_low": 1.0}, r"clip_eps_low must be in \[0, 1\), got 1"),
    (SimulatorRLConfig, {"dual_clip_c": 1.0}, "dual_clip_c must be greater than 1, got 1"),
    (SimulatorRLConfig, {"prompts_per_step": 0}, "prompts_per_step must be at least 1, got 0"),
    (SimulatorRLConfig, {"rollouts_per_prompt": 1}, "rollouts_per_prompt must be at least 2, got 1"),
    (AgentRLConfig, {"gamma": 1.5}, r"gamma must be in \[0, 1\], got 1.5"),
    (AgentRLConfig, {"lr": 0.0}, "lr must be greater than 0, got 0"),
    (AgentRLConfig, {"csd_alpha": -0.01}, "csd_alpha must be at least 0, got -0.01"),
    (SimulatorRLConfig, {"mtp_loss_scaling_factor": 0.1, "model_overrides": {"mtp_num_layers": 1}},
     "mtp_loss_scaling_factor: the RL stages keep the multi-token-prediction head frozen as loaded"),
])
def test_rl_options_out_of_range_are_refused(cls, changes, reason):
    with pytest.raises(ConfigError, match=f"^{reason}"):
        cls(**changes).validate(1)


def test_a_generate_call_must_end_before_the_collective_timeout_of_the_replicas_waiting_for_it():
    with pytest.raises(ConfigError, match=r"^generation_timeout_s 1800 is not below distributed_timeout_minutes 30 x 60: "
                                          r".*; raise distributed_timeout_minutes$"):
        SimulatorRLConfig(generation_timeout_s=1800, distributed_timeout_minutes=30).validate_without_files(1)
    SimulatorRLConfig(generation_timeout_s=1799, distributed_timeout_minutes=30).validate_without_files(1)
    AgentRLConfig(generation_timeout_s=None, distributed_timeout_minutes=1).validate_without_files(1)  # no limit: nothing to compare
    with pytest.raises(ConfigError, match="^distributed_timeout_minutes must be at least 1, got 0"):
        TrainConfig(distributed_timeout_minutes=0).validate_without_files(1)


def _manifest(path, sha="a" * 64):
    path.mkdir(exist_ok=True)
    tokenizer = {"vocab_size": 500, "sha256": sha, "path": str(path / "tokenizer")}
    (path / "manifest.json").write_text(json.dumps({"seq_length": 256, "tokenizer": tokenizer}))
    return path


def test_dry_run_catches_a_negative_lr_from_the_command_line_and_from_yaml(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    data = _manifest(tmp_path / "data")
    assert main(["--data-path", str(data), "--lr=-1e-3", "--dry-run"]) == 2
    assert capsys.readouterr().err == "error: lr must be greater than 0, got -0.001\n"
    config = tmp_path / "c.yaml"
    config.write_text(f"data_path: {data}\nlr: 1e-3\n")  # a string to YAML: no dot before the exponent
    assert main(["--config", str(config), "--dry-run"]) == 2
    assert capsys.readouterr().err == "error: lr: expected a number, got '1e-3' (str)\n"


def _checkpoint(root, iteration=5, train=None, **run_config):
    path = small_checkpoint(root, iteration)
    (path / "run_config.json").write_text(json.dumps({"train": train or {}, **run_config}))
    return root


@pytest.mark.parametrize("start", [
    {"pretrained_hf": "HF"},  # midtrain_9b (PRETRAINED_HF), rl_agent_9b.yaml
    {"load": "SOURCE", "finetune": True},  # sft_9b.yaml, rl_simulator_9b.yaml
    {"pretrained_hf": "HF", "load": "", "finetune": False},  # sft_9b.yaml's documented start from an HF export
    {},
], ids=["pretrained_hf", "load-finetune", "sft-from-hf", "fresh"])
def test_a_save_directory_holding_a_checkpoint_is_resumed_whatever_the_starting_weights(tmp_path, start):
    _hf_config(tmp_path / "HF", "tiny")
    source = _checkpoint(tmp_path / "SOURCE", iteration=3)
    paths = {"HF": str(tmp_path / "HF"), "SOURCE": str(source)}
    start = {k: paths.get(v, v) for k, v in start.items()}
    save = tmp_path / "ckpt"
    config = TrainConfig(data_path=str(tmp_path), save=str(save), **start)
    assert config.resolve_start() == (config, None)  # nothing saved yet: starts as configured
    config.validate(1)
    _checkpoint(save, train=config.to_dict())
    resumed, line = config.resolve_start()
    assert (resumed.load, resumed.finetune, resumed.pretrained_hf) == (str(save), False, None)
    configured = " and ".join([f"pretrained_hf {start.get('pretrained_hf')}"] * bool(start.get("pretrained_hf"))
                              + [f"the weights of {source}"] * bool(start.get("finetune")))
    assert line == f"resuming from {save} (iteration 5)" + (
        f", not from {configured} as configured: a save directory holding a checkpoint is resumed (--overwrite-save "
        f"starts over)" if configured else "")
    resumed.validate(1)
    assert config.replace(overwrite_save=True).resolve_start()[1] is None  # starts over, as configured
    with pytest.raises(ConfigError, match=rf"^save: {save}/iter_0000005 was saved by a run with other schedule "
                                          r"options \(train_iters 200 -> 400\): .* or pass --overwrite-save"):
        config.replace(train_iters=400).resolve_start()[0].validate(1)
    help_text = " ".join(build_arg_parser().format_help().split())
    assert "--overwrite-save, --no-overwrite-save start over in a save directory that already holds" in help_text


def _hf_config(directory, preset_name: str):
    """An HF directory's config.json of a preset (what pretrained_hf's check reads)."""
    from megatron_mimesis.models.presets import get_preset

    preset = get_preset(preset_name)
    preset.family.hf_config(preset).save_pretrained(directory)
    return directory


@pytest.mark.parametrize(("model", "hf", "reason"), [
    ("tiny", "qwen3-tiny", r"model vs checkpoint: family: Qwen3.5 vs Qwen3"),
    ("qwen3-8b", "qwen3-tiny", r"model vs checkpoint: vocab_size: 151936 vs 512; hidden_size: 4096 vs 64"),
])
def test_pretrained_hf_of_another_model_is_refused_naming_the_difference(tmp_path, model, hf, reason):
    """The family of pretrained_hf is read from its config.json (model_type): a checkpoint that is not the model the
    run builds fails validation in one line, before anything starts."""
    hf_dir = _hf_config(tmp_path / "HF", hf)
    with pytest.raises(ConfigError, match=rf"^pretrained_hf: {hf_dir} is not the model '{model}' \({reason}"):
        TrainConfig(data_path=str(tmp_path), model=model, pretrained_hf=str(hf_dir)).validate(1)
    TrainConfig(data_path=str(tmp_path), model=hf, pretrained_hf=str(hf_dir)).validate(1)


def test_resume_with_another_schedule_is_refused_with_the_reason(tmp_path):
    saved = TrainConfig(data_path=str(tmp_path))
    root = _checkpoint(tmp_path / "ckpt", train=saved.to_dict())
    saved.replace(load=str(root)).validate(1)  # same schedule: resumes
    with pytest.raises(ConfigError, match=r"other schedule options \(train_iters 200 -> 400\): a resume keeps the "
                                          r"checkpoint's LR schedule and data order") as info:
        saved.replace(load=str(root), train_iters=400).validate(1)
    assert "--finetune" in str(info.value)
    with pytest.raises(ConfigError, match=r"lr 0.003 -> 0.001; min_lr 0.0003 -> 0.0001"):
        saved.replace(load=str(root), lr=1e-3, min_lr=1e-4).validate(1)
    saved.replace(load=str(root), train_iters=400, finetune=True).validate(1)  # a new stage from the weights
    assert {"train_iters", "lr", "global_batch_size", "seed"} <= set(RESUME_FIXED)


def test_a_resume_that_would_start_training_a_frozen_mtp_head_is_refused(tmp_path):
    """A checkpoint saved with the head frozen has no optimizer state for it (megatron's load fails on the missing
    keys, far from the cause); the other way round the head just stops training."""
    frozen = TrainConfig(data_path=str(tmp_path), model_overrides={"mtp_num_layers": 1})
    root = _checkpoint(tmp_path / "ckpt", train=frozen.to_dict())
    with pytest.raises(ConfigError, match=r"^load: .* was saved with the MTP head frozen \(mtp_loss_scaling_factor "
                                          r"0\), so it holds no optimizer state .* with --finetune"):
        frozen.replace(load=str(root), mtp_loss_scaling_factor=0.1).validate(1)
    frozen.replace(load=str(root), mtp_loss_scaling_factor=0.1, finetune=True).validate(1)  # weights only
    trained = _checkpoint(tmp_path / "trained", train=frozen.replace(mtp_loss_scaling_factor=0.1).to_dict())
    frozen.replace(load=str(trained)).validate(1)


def test_data_of_another_tokenizer_than_the_checkpoint_is_refused_on_load(tmp_path, capsys):
    data = _manifest(tmp_path / "data", sha="b" * 64)
    same = _checkpoint(tmp_path / "same", **{TOKENIZER_SHA256: "b" * 64})
    other = _checkpoint(tmp_path / "other", **{TOKENIZER_SHA256: "c" * 64})
    config = TrainConfig(data_path=str(data), model_overrides={"vocab_size": 512})
    check_data(config.replace(load=str(same)))
    with pytest.raises(ConfigError, match=r"prepared with another tokenizer \(sha256 bbbbbbbbbbbb\) than the "
                                          r"checkpoint .*other/iter_0000005 \(cccccccccccc\)"):
        check_data(config.replace(load=str(other), finetune=True))
    check_data(config.replace(load=str(_checkpoint(tmp_path / "imported"))))  # records none: said, not refused
    assert "records no tokenizer" in capsys.readouterr().err


def test_save_directory_is_checked_writable_and_with_room_at_start(tmp_path, planner):
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match=r"save: .*/file is not a directory"):
        check_save_dir(TrainConfig(save=str(tmp_path / "file" / "ckpt")), 1)
    config = TrainConfig(model_overrides={"vocab_size": 512}, save=str(tmp_path / "new" / "ckpt"))
    assert planner.submit(save_dir_refusal, config, 1, 2**30).result() is None  # created at the first save
    # the tiny model at vocab 512 (0.43M parameters, fp32: 16 bytes each), in readable units; one save, at the end
    assert planner.submit(save_dir_refusal, config, 1, 3 * 2**20).result() == (
        f"save: no space left for the checkpoints of this run in {tmp_path}: 3.0 MiB free, 6.6 MiB needed "
        f"(1 checkpoint of about 6.6 MiB on disk at once)")
    # every 20 of 200 steps: 10 checkpoints kept, or 3 at once with keep_last_n 2 (the next before the oldest goes)
    config = config.replace(save_interval=20)
    assert planner.submit(save_dir_refusal, config, 1, 30 * 2**20).result() == (
        f"save: no space left for the checkpoints of this run in {tmp_path}: 30.0 MiB free, 66.3 MiB needed "
        f"(10 checkpoints of about 6.6 MiB on disk at once): keep fewer with keep_last_n")
    assert planner.submit(save_dir_refusal, config.replace(keep_last_n=2), 1, 30 * 2**20).result() is None
    assert planner.submit(save_dir_refusal, config.replace(keep_last_n=2), 1, 19 * 2**20).result() == (
        f"save: no space left for the checkpoints of this run in {tmp_path}: 19.0 MiB free, 19.9 MiB needed "
        f"(3 checkpoints of about 6.6 MiB on disk at once)")
    # a resumed run's checkpoints already there count towards what it keeps
    (tmp_path / "new" / "ckpt" / "iter_0000020").mkdir(parents=True)
    (tmp_path / "new" / "ckpt" / "iter_0000020" / "__0_0.distcp").write_bytes(bytes(10 * 2**20))
    assert planner.submit(save_dir_refusal, config.replace(keep_last_n=2), 1, 13 * 2**20).result() is None


def test_the_trainer_checks_the_save_directory_before_any_work(tmp_path, capsys, monkeypatch, planner):
    monkeypatch.setenv("WORLD_SIZE", "1")
    data = _manifest(tmp_path / "data")
    (tmp_path / "file").write_text("")
    args = ["--data-path", str(data), "--model-overrides", '{"vocab_size": 512}', "--log-dir", str(tmp_path / "log")]
    # a dry run writes nothing (it plans the memory in fake worlds, in the planning process)
    status, _, err = planner.submit(trainer_dry_run, [*args, "--save", str(tmp_path / "file" / "ckpt")], 1).result()
    assert status == 0, err
    assert main([*args, "--save", str(tmp_path / "file" / "ckpt")]) == 2  # before the process group and the model
    assert capsys.readouterr().err == f"error: save: {tmp_path / 'file'} is not a directory\n"
    # the launchers' pre-check: the dry run that plans the checkpoint also checks the directory, once for the job,
    # and the ranks it starts (MIMESIS_SAVE_DIR_CHECKED) do not plan it again; without a launcher rank 0 checks
    status, _, err = planner.submit(trainer_dry_run, [*args, "--save", str(tmp_path / "file" / "ckpt"),
                                                      "--check-save-dir"], 1).result()
    assert status == 2 and err.splitlines()[-1] == f"error: save: {tmp_path / 'file'} is not a directory"
    monkeypatch.setenv("RANK", "1")
    assert not needs_check_here()
    monkeypatch.setenv("RANK", "0")
    assert needs_check_here()
    monkeypatch.setenv("MIMESIS_SAVE_DIR_CHECKED", "1")
    assert not needs_check_here()
