"""Config loading, overriding and up-front validation (no process group is ever started here)."""

import json

import pytest

from megatron_mimesis.training.config import ConfigError, TrainConfig, parse_config
from megatron_mimesis.training.train import SkipGuard, check_data, main
from tests.training.memory.planning import trainer_dry_run


def _valid(tmp_path, **changes):
    return TrainConfig(data_path=str(tmp_path), **changes)


def test_yaml_then_flags_override(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model: tiny\nlr: 0.5\nglobal_batch_size: 16\nmodel_overrides: {vocab_size: 1024}\n")
    config, _ = parse_config(["--config", str(path), "--lr", "0.25", "--sequence-parallel",
                              "--tensor-model-parallel-size", "2", "--model-overrides", '{"hidden_size": 128}'])
    assert (config.lr, config.global_batch_size, config.sequence_parallel) == (0.25, 16, True)
    assert config.model_overrides == {"vocab_size": 1024, "hidden_size": 128}
    assert config.preset.hidden_size == 128 and config.preset.vocab_size == 1024


def test_an_empty_flag_unsets_an_optional_option_of_the_yaml(tmp_path):
    """What the pipeline hands a stage replaces the start its config names (--load '' where it starts from HF)."""
    path = tmp_path / "c.yaml"
    path.write_text("model: tiny\nload: runs/x/checkpoints\nfinetune: true\n")
    config, _ = parse_config(["--config", str(path), "--pretrained-hf", "/models/hf", "--load", "", "--no-finetune"])
    assert (config.load, config.pretrained_hf, config.finetune) == (None, "/models/hf", False)
    config, _ = parse_config(["--config", str(path), "--log-dir", ""])  # not optional: the empty value is kept
    assert config.log_dir == ""


def test_unknown_yaml_option_is_named(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("lr: 1.0\nlearning_rate: 2.0\n")
    with pytest.raises(ConfigError, match=r"unknown option\(s\) \['learning_rate'\]"):
        TrainConfig.from_yaml(path)


@pytest.mark.parametrize(("changes", "world", "reason"), [
    ({"global_batch_size": 6, "micro_batch_size": 4}, 1, "not divisible by micro_batch_size 4"),
    ({"tensor_model_parallel_size": 2}, 3, "not a multiple of TP\\*PP\\*CP = 2"),
    ({"tensor_model_parallel_size": 8}, 8, "must divide num_attention_heads"),
    ({"pipeline_model_parallel_size": 3}, 3, "must divide num_layers"),
    ({"recompute_granularity": "full"}, 1, "recompute_method uniform or block"),
    ({"save_interval": 10}, 1, "save \\(the checkpoint directory\\) is not"),
    ({"lr_warmup_iters": 500}, 1, "lr_warmup_iters must be fewer"),
    ({"lr_warmup_iters": 5, "train_iters": 5}, 1, "lr_warmup_iters must be fewer"),
    ({"seq_length": 10_000}, 1, "exceeds max_position_embeddings"),
    ({"model": "70b"}, 1, "unknown preset '70b'"),
    ({"context_parallel_size": 2}, 2, "needs Transformer Engine attention"),
    ({"model": "9b", "tensor_model_parallel_size": 4}, 4,
     "^pretrained_hf: the 9b model would train from random weights; give pretrained_hf \\(or load\\), or set "
     "from_scratch: true if that is the intent$"),
    ({"model": "qwen3-8b"}, 1, "^pretrained_hf: the qwen3-8b model would train from random weights"),
])
def test_invalid_configs_fail_with_one_line_reason(tmp_path, changes, world, reason):
    with pytest.raises(ConfigError, match=reason) as info:
        _valid(tmp_path, **changes).validate(world)
    assert "\n" not in str(info.value)


def test_missing_paths_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="data_path: .* does not exist"):
        TrainConfig(data_path=str(tmp_path / "nope")).validate(1)
    with pytest.raises(ConfigError, match="no dataset given"):
        TrainConfig().validate(1)


def test_batch_arithmetic_of_the_paper_layout(tmp_path):
    config = _valid(tmp_path, model="9b", tensor_model_parallel_size=4, pipeline_model_parallel_size=2,
                    sequence_parallel=True, global_batch_size=4096, seq_length=24576, from_scratch=True)
    config.validate(32)
    assert config.data_parallel_size(32) == 4
    assert config.num_microbatches(32) == 1024


def test_dataset_must_match_seq_length_and_vocab(tmp_path):
    (tmp_path / "manifest.json").write_text(json.dumps({"seq_length": 128, "tokenizer": {"vocab_size": 4096}}))
    with pytest.raises(ConfigError, match="rows are 128 tokens, seq_length is 256"):
        check_data(_valid(tmp_path, seq_length=256))
    with pytest.raises(ConfigError, match="tokenizer vocab 4096 does not fit the model vocab 512"):
        check_data(_valid(tmp_path, seq_length=128))
    check_data(_valid(tmp_path, seq_length=128, model_overrides={"vocab_size": 4096}))


def test_main_exits_2_with_reason_and_dry_run_prints_resolved_config(tmp_path, capsys, monkeypatch, planner):
    monkeypatch.setenv("WORLD_SIZE", "2")
    (tmp_path / "manifest.json").write_text(json.dumps({"seq_length": 256, "tokenizer": {"vocab_size": 500}}))
    assert main(["--data-path", str(tmp_path), "--pipeline-model-parallel-size", "3"]) == 2
    assert "must divide num_layers" in capsys.readouterr().err
    # the dry run plans the memory in fake worlds of its own: in the planning process, which has no process group
    status, out, err = planner.submit(trainer_dry_run, ["--data-path", str(tmp_path),
                                                        "--pipeline-model-parallel-size", "2"], 2).result()
    assert status == 0, err
    table, resolved = out[:out.index("{\n")], json.loads(out[out.index("{\n"):])
    assert table.startswith("memory plan per GPU: tiny, TP=1 PP=2 DP=1 on 2 GPUs; 1 x 256 tokens per micro-batch")
    assert resolved["num_microbatches"] == 8 and resolved["config"]["pipeline_model_parallel_size"] == 2
    assert resolved["memory_plan"]["columns"] == ["stage 0", "stage 1"] and resolved["memory_plan"]["fits"]


def test_the_nan_guard_stops_on_skips_in_a_row_or_on_too_many_in_the_run():
    isolated = SkipGuard(max_in_a_row=3, max_in_run=4)
    assert [isolated.record(s) for s in (True, False, True, False, True, False)] == [None] * 6
    assert isolated.record(True) == "4 skipped iterations in the run (max_skipped_iters)"
    resumed = SkipGuard(max_in_a_row=3, max_in_run=100, in_run=50)  # the run's count comes with the checkpoint
    assert [resumed.record(True) for _ in range(3)] == [None, None, "3 skipped iterations in a row "
                                                                    "(max_consecutive_skipped_iters)"]
    assert resumed.in_run == 53 and str(resumed) == "3/3 in a row, 53/100 in the run"
