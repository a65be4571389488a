"""The trainer end to end under torchrun: layouts agree, resume is exact, preemption saves."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from megatron_mimesis.checkpoint.reader import TOKENIZER_SUBDIR
from megatron_mimesis.models.presets import get_preset
from megatron_mimesis.training.config import TrainConfig
from megatron_mimesis.training.flops import train_flops_per_token
from megatron_mimesis.training.memory.plan import planned_checkpoint_bytes
from tests.training.conftest import REPO, SEQ_LENGTH, VOCAB, common_args, read_metrics, run_trainer, train_losses

pytestmark = pytest.mark.slow

LAYOUT_TOL = 5e-5  # fp32; measured differences between layouts are ~1e-6


def _final_tensors(ckpt_root, tmp_path) -> dict[str, torch.Tensor]:
    """Every tensor of the latest checkpoint, gathered: parameters and the optimizer's fp32 params and moments."""
    iteration = int((Path(ckpt_root) / "latest").read_text())
    out = tmp_path / f"flat-{Path(ckpt_root).parent.name}-{iteration}.pt"
    dcp_to_torch_save(str(Path(ckpt_root) / f"iter_{iteration:07d}"), str(out))
    state = torch.load(out, weights_only=False)
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


def test_parallel_layouts_and_recompute_train_like_one_process(tiny_dataset, tiny_hf_checkpoint, tmp_path):
    # 4 steps: with the tiny preset's head dims of 64 the second batch's loss is above the first's whatever the
    # layout, and the loss falls below the first step's from the fourth on
    init = ["--pretrained-hf", str(tiny_hf_checkpoint), "--train-iters", "4"]
    run_trainer(1, *common_args(tiny_dataset, tmp_path / "single", *init))
    run_trainer(2, *common_args(tiny_dataset, tmp_path / "tp2", *init, "--tensor-model-parallel-size", "2",
                                "--sequence-parallel"))
    run_trainer(2, *common_args(tiny_dataset, tmp_path / "pp2", *init, "--pipeline-model-parallel-size", "2"))
    run_trainer(2, *common_args(tiny_dataset, tmp_path / "vpp", *init, "--pipeline-model-parallel-size", "2",
                                "--virtual-pipeline-model-parallel-size", "2"))
    run_trainer(1, *common_args(tiny_dataset, tmp_path / "recompute", *init, "--recompute-granularity", "full",
                                "--recompute-method", "uniform", "--recompute-num-layers", "1"))
    single = train_losses(tmp_path / "single")
    assert len(single) == 4 and single[3] < single[0]  # it learns
    # MFU's FLOPs count attention within each packed document: the attended length, below the row's
    for record in read_metrics(tmp_path / "single"):
        assert 1 < record["attended_length"] < SEQ_LENGTH
        per_token = record["tflops_per_gpu"] * 1e12 / record["tokens_per_sec_per_gpu"]
        assert per_token == pytest.approx(train_flops_per_token(get_preset("tiny").replace(vocab_size=VOCAB),
                                                                record["attended_length"]))
    for layout in ("tp2", "pp2", "vpp", "recompute"):
        other = train_losses(tmp_path / layout)
        assert max(abs(a - b) for a, b in zip(single, other, strict=True)) <= LAYOUT_TOL, (layout, single, other)


def test_qwen3_trains_alike_in_every_layout_and_resumes_resharded(tiny_dataset, qwen3_hf_checkpoint, tmp_path):
    """The dense family through the same trainer: TP=2 with sequence parallelism and PP=2 follow the one-process
    curve, and its checkpoint (megatron stacks a homogeneous block's layers under one key) resumes at another TP."""
    model = ["--model", "qwen3-tiny", "--pretrained-hf", str(qwen3_hf_checkpoint), "--train-iters", "4"]
    run_trainer(1, *common_args(tiny_dataset, tmp_path / "single", *model, "--save", str(tmp_path / "ckpt"),
                                "--save-interval", "2"))
    run_trainer(2, *common_args(tiny_dataset, tmp_path / "tp2", *model, "--tensor-model-parallel-size", "2",
                                "--sequence-parallel"))
    run_trainer(2, *common_args(tiny_dataset, tmp_path / "pp2", *model, "--pipeline-model-parallel-size", "2"))
    single = train_losses(tmp_path / "single")
    assert len(single) == 4 and single[3] < single[0]
    for layout in ("tp2", "pp2"):
        other = train_losses(tmp_path / layout)
        assert max(abs(a - b) for a, b in zip(single, other, strict=True)) <= LAYOUT_TOL, (layout, single, other)
    (tmp_path / "ckpt" / "latest").write_text("2\n")
    run_trainer(2, *common_args(tiny_dataset, tmp_path / "resumed", "--model", "qwen3-tiny", "--train-iters", "4",
                                "--tensor-model-parallel-size", "2", "--load", str(tmp_path / "ckpt")))
    resumed = train_losses(tmp_path / "resumed")
    assert max(abs(x - y) for x, y in zip(resumed, single[2:], strict=True)) <= LAYOUT_TOL, (resumed, single)


def test_resume_continues_the_same_curve_and_reshards(tiny_dataset, tiny_hf_checkpoint, tmp_path):
    """Data parallel 2 with the distributed optimizer, each rank saving its own optimizer shard: a resume at the same
    layout is bit-exact, and the checkpoint continues the same curve with one data-parallel rank and at TP=2."""
    init = ["--pretrained-hf", str(tiny_hf_checkpoint)]
    # 4 steps straight, checkpoints at 2 and 4
    run_trainer(2, *common_args(tiny_dataset, tmp_path / "full", *init, "--train-iters", "4",
                                "--save", str(tmp_path / "full" / "ckpt"), "--save-interval", "2"))
    # the same run killed after 2 steps (same schedule: train_iters stays 4), then resumed
    run_trainer(2, *common_args(tiny_dataset, tmp_path / "part", *init, "--train-iters", "4",
                                "--save", str(tmp_path / "part" / "ckpt"), "--save-interval", "2",
                                "--exit-interval", "2"))
    assert (tmp_path / "part" / "ckpt" / "latest").read_text().strip() == "2"
    run_trainer(2, *common_args(tiny_dataset, tmp_path / "part", "--train-iters", "4",
                                "--load", str(tmp_path / "part" / "ckpt"), "--save", str(tmp_path / "part" / "ckpt")))
    full, part = train_losses(tmp_path / "full"), train_losses(tmp_path / "part")
    assert part == full, (full, part)  # bit-identical loss curve
    a, b = _final_tensors(tmp_path / "full" / "ckpt", tmp_path), _final_tensors(tmp_path / "part" / "ckpt", tmp_path)
    assert a.keys() == b.keys() and any(k.startswith("optimizer.state.exp_avg_sq.") for k in a)
    for name in a:
        assert torch.equal(a[name], b[name]), name  # Adam state (incl. its step count) restored exactly
    # the DP=2 checkpoint at step 2 resumed with one data-parallel rank, and at TP=2, continues the same curve
    latest = tmp_path / "full" / "ckpt" / "latest"
    latest.write_text("2\n")
    for name, nproc, layout in (("dp1", 1, []), ("tp2", 2, ["--tensor-model-parallel-size", "2"])):
        (tmp_path / name).mkdir()
        run_trainer(nproc, *common_args(tiny_dataset, tmp_path / name, "--train-iters", "4", *layout,
                                        "--load", str(tmp_path / "full" / "ckpt")))
        resharded = train_losses(tmp_path / name)
        assert max(abs(x - y) for x, y in zip(resharded, full[2:], strict=True)) <= LAYOUT_TOL, (name, resharded, full)


def test_sigterm_saves_a_checkpoint_and_exits_cleanly(tiny_dataset, tmp_path):
    ckpt = tmp_path / "ckpt"
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": "29533", "OMP_NUM_THREADS": "1"}
    args = common_args(tiny_dataset, tmp_path, "--train-iters", "100000", "--save", str(ckpt), "--no-progress")
    proc = subprocess.Popen([sys.executable, "-m", "megatron_mimesis.training.train", *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 240
    while not (tmp_path / "metrics.jsonl").exists() or not (tmp_path / "metrics.jsonl").read_text().strip():
        assert proc.poll() is None and time.time() < deadline, proc.stdout.read() if proc.poll() is not None else "timeout"
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, output[-3000:]
    iteration = int((ckpt / "latest").read_text())
    assert iteration == read_metrics(tmp_path)[-1]["iteration"] >= 1
    assert (ckpt / f"iter_{iteration:07d}" / "metadata.json").exists()
    assert not list(ckpt.glob("*.tmp"))
    assert json.loads((ckpt / f"iter_{iteration:07d}" / "run_config.json").read_text())["preset"]["name"] == "tiny"


def test_finetune_starts_from_the_weights_at_another_layout(tiny_dataset, tiny_hf_checkpoint, tmp_path, planner):
    """--finetune takes the weights only (iteration 0, fresh optimizer), here from PP=2 into TP=2 and into bf16
    (whose fp32 main params are separate copies that must start from the loaded weights)."""
    source = tmp_path / "source" / "ckpt"
    run_trainer(2, *common_args(tiny_dataset, tmp_path / "source", "--pretrained-hf", str(tiny_hf_checkpoint),
                                "--pipeline-model-parallel-size", "2", "--train-iters", "2", "--save", str(source)))
    # one step at a negligible learning rate: the saved weights must still be the loaded ones
    run_trainer(2, *common_args(tiny_dataset, tmp_path / "ft", "--tensor-model-parallel-size", "2",
                                "--train-iters", "1", "--lr", "1e-12", "--min-lr", "0", "--lr-warmup-iters", "0",
                                "--load", str(source), "--finetune", "--bf16", "--save", str(tmp_path / "ft" / "ckpt")))
    assert [r["iteration"] for r in read_metrics(tmp_path / "ft")] == [1]
    for directory, layout in ((source, {"pipeline_model_parallel_size": 2}),
                              (tmp_path / "ft" / "ckpt", {"tensor_model_parallel_size": 2, "bf16": True})):
        config = TrainConfig(model_overrides={"vocab_size": VOCAB}, **layout)
        saved = directory / f"iter_{int((directory / 'latest').read_text()):07d}"
        written = sum(f.stat().st_size for f in saved.rglob("*")
                      if f.is_file() and TOKENIZER_SUBDIR not in f.parts)
        # the --dry-run row: every tensor; what it leaves out (metadata, RNG states, run config) is a fixed ~0.6 MiB
        assert 0 < written - planner.submit(planned_checkpoint_bytes, config, 2).result() < 2**20, (layout, written)
    before, after = _final_tensors(source, tmp_path), _final_tensors(tmp_path / "ft" / "ckpt", tmp_path)
    weights = [k for k in before if not k.startswith("optimizer.")]
    assert len(weights) > 20
    for name in weights:
        assert torch.allclose(before[name], after[name].float(), rtol=1e-2, atol=1e-2), name


def test_imported_checkpoint_trains_and_exports_to_transformers(tiny_dataset, tiny_hf_checkpoint, tmp_path):
    """HF -> import -> trainer (TP=2, --finetune) -> export -> transformers: same logits as megatron."""
    from megatron.core import dist_checkpointing
    from transformers import AutoModelForCausalLM

    from megatron_mimesis.checkpoint.conversion import export_to_hf, import_from_hf
    from megatron_mimesis.models.config import ParallelConfig, transformer_config
    from megatron_mimesis.models.provider import ModelProvider
    from megatron_mimesis.training.config import TrainConfig
    from tests.models.harness import init_single_process_megatron

    import_from_hf(tiny_hf_checkpoint, tmp_path / "imported", dtype="fp32")
    trained = tmp_path / "run" / "ckpt"
    run_trainer(2, *common_args(tiny_dataset, tmp_path / "run", "--tensor-model-parallel-size", "2",
                                "--train-iters", "2", "--load", str(tmp_path / "imported"), "--finetune",
                                "--save", str(trained)))
    export_to_hf(trained, tmp_path / "hf", dtype="fp32", progress=False)
    assert (tmp_path / "hf" / "tokenizer.json").exists()  # the trainer saved its tokenizer with the checkpoint

    init_single_process_megatron()
    preset = TrainConfig(model_overrides={"vocab_size": 512}).preset
    provider = ModelProvider(preset, transformer_config(preset, ParallelConfig()))
    model = provider()
    state = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(trained / "iter_0000002"))
    model.load_state_dict(state["model"])
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
    ids = torch.randint(0, 512, (1, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(ids, torch.arange(48).unsqueeze(0), None)
        theirs = exported(ids).logits
    assert (ours - theirs).abs().max().item() <= 1e-4


def test_diverging_run_skips_non_finite_steps_then_stops(tiny_dataset, tmp_path):
    """It stops at skip 2 of --max-skipped-iters 2, and no checkpoint is written of a skipped step's weights."""
    ckpt = tmp_path / "ckpt"
    args = common_args(tiny_dataset, tmp_path, "--train-iters", "40", "--max-skipped-iters", "2", "--save", str(ckpt),
                       "--save-interval", "1")
    args[args.index("--lr") + 1] = "1e4"  # diverges within a few steps
    args[args.index("--min-lr") + 1] = "1e4"
    proc = run_trainer(1, *args, "--clip-grad", "0", check=False)
    records = read_metrics(tmp_path)
    assert proc.returncode != 0 and records, (proc.returncode, proc.stdout[-2000:], proc.stderr[-4000:])
    assert records[-1]["skipped_iters"] == 2 and records[-1]["iteration"] < 40
    assert "2 skipped iterations in the run (max_skipped_iters); stopping" in proc.stdout + proc.stderr
    assert any(r["loss"] is None for r in records)  # non-finite losses are logged as null, not dropped
    skipped = {r["iteration"] for before, r in zip([{"skipped_iters": 0}, *records[:-1]], records, strict=True)
               if r["skipped_iters"] > before["skipped_iters"]}
    saved = {int(path.name.removeprefix("iter_")) for path in ckpt.glob("iter_*")}
    assert len(skipped) == 2 and saved and not saved & skipped, (skipped, saved)
    assert int((ckpt / "latest").read_text()) == max(saved) < max(skipped)


def _group_timeouts(rank, world_size):
    """The timeout of each of megatron's groups, after the trainer made them (the world's group is the tests'
    launcher's here, made before the trainer)."""
    from megatron.core import parallel_state

    from megatron_mimesis.training.config import TrainConfig
    from megatron_mimesis.training.train import Trainer

    Trainer(TrainConfig(distributed_timeout_minutes=7, tensor_model_parallel_size=2), tokenizer_dir="unused")
    groups = {"tp": parallel_state.get_tensor_model_parallel_group(),
              "pp": parallel_state.get_pipeline_model_parallel_group(), "dp": parallel_state.get_data_parallel_group(),
              "dp-gloo": parallel_state.get_data_parallel_group_gloo()}
    return {name: group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
            for name, group in groups.items()}


def test_distributed_timeout_minutes_reaches_megatrons_groups():
    from tests.multiproc import run_distributed

    for timeouts in run_distributed(_group_timeouts, 2):
        assert timeouts == dict.fromkeys(("tp", "pp", "dp", "dp-gloo"), 7 * 60.0)


def _with_mtp_head(hf_checkpoint, directory):
    """The tiny HF checkpoint with an MTP head added: the model overrides, the preset, its tensors, its directory."""
    import shutil

    from safetensors.torch import load_file, save_file

    from tests.models.hf_mtp import hf_mtp_tensors

    overrides = {"vocab_size": VOCAB, "mtp_num_layers": 1}
    preset = get_preset("tiny").replace(**overrides)
    shutil.copytree(hf_checkpoint, directory)
    weights = load_file(str(directory / "model.safetensors")) | hf_mtp_tensors(preset)
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return overrides, preset, weights, directory


def test_the_mtp_head_is_trained_past_frozen_and_saved_as_imported(tiny_dataset, tiny_hf_checkpoint, tmp_path,
                                                                   planner):
    """A Qwen3.5 started from HF weights with an MTP head, trained 3 steps at PP=2 with interleaving (the head on the
    last virtual stage): the checkpoint holds the head exactly as the HF tensors give it and no optimizer state for
    it, the decoder moved, and the plan's checkpoint bytes are what was written."""
    from megatron_mimesis.checkpoint.reader import DistCheckpointReader

    overrides, preset, weights, hf = _with_mtp_head(tiny_hf_checkpoint, tmp_path / "hf")
    ckpt = tmp_path / "ckpt"
    args = common_args(tiny_dataset, tmp_path, "--pretrained-hf", str(hf), "--pipeline-model-parallel-size", "2",
                       "--virtual-pipeline-model-parallel-size", "2", "--train-iters", "3", "--save", str(ckpt))
    args[args.index("--model-overrides") + 1] = json.dumps(overrides)
    run_trainer(2, *args)

    reader = DistCheckpointReader(ckpt)
    table = {m.megatron: m for m in preset.family.mapping(preset, reader.padded_vocab_size)}
    head = [name for name in table if name.startswith("mtp.")]
    assert len(head) == 12
    for name in head:
        assert torch.equal(reader.tensor(name), table[name].to_megatron(weights, 1)[0]), name
    moved = "decoder.layers.3.mlp.linear_fc2.weight"
    assert not torch.equal(reader.tensor(moved), table[moved].to_megatron(weights, 1)[0])
    optimizer = _optimizer_keys(reader.dir)  # optimizer.state.{param,exp_avg,exp_avg_sq}.<parameter>
    assert f"optimizer.state.exp_avg.{moved}" in optimizer and not [k for k in optimizer if ".mtp." in k], optimizer
    written = sum(f.stat().st_size for f in reader.dir.rglob("*") if f.is_file() and TOKENIZER_SUBDIR not in f.parts)
    config = TrainConfig(model_overrides=overrides, pipeline_model_parallel_size=2,
                         virtual_pipeline_model_parallel_size=2)
    assert 0 < written - planner.submit(planned_checkpoint_bytes, config, 2).result() < 2**20, written


def test_a_trained_mtp_head_trains_alike_in_one_process_and_at_pp2_vpp2(tiny_dataset, tiny_hf_checkpoint, tmp_path,
                                                                        planner):
    """mtp_loss_scaling_factor > 0: megatron runs the head and trains it with the fused MTP loss. One process and
    PP=2 with interleaving (the head and its copy of the word embedding on the last virtual stage, the copy's gradient
    summed with the first stage's) follow the same losses, MTP losses and gradient norms; the checkpoint holds the
    moved head with its optimizer state, in the bytes the plan gives, and the interleaved run resumes from it exactly
    (virtual chunks share module names: their state dicts were once merged, losing all but the last chunk's)."""
    from megatron_mimesis.checkpoint.reader import DistCheckpointReader

    overrides, preset, weights, hf = _with_mtp_head(tiny_hf_checkpoint, tmp_path / "hf")
    runs = {"single": (1, []), "vpp": (2, ["--pipeline-model-parallel-size", "2",
                                           "--virtual-pipeline-model-parallel-size", "2"])}
    for name, (nproc, layout) in runs.items():
        args = common_args(tiny_dataset, tmp_path / name, "--pretrained-hf", str(hf), "--train-iters", "3",
                           "--mtp-loss-scaling-factor", "0.3", "--save", str(tmp_path / name / "ckpt"),
                           "--save-interval", "2", *layout)
        args[args.index("--model-overrides") + 1] = json.dumps(overrides)
        run_trainer(nproc, *args)
    single, vpp = (read_metrics(tmp_path / name) for name in runs)
    for key in ("loss", "mtp_1_loss", "grad_norm"):
        ours, theirs = [r[key] for r in single], [r[key] for r in vpp]
        assert len(ours) == 3 and max(abs(a - b) for a, b in zip(ours, theirs, strict=True)) <= LAYOUT_TOL, key
    assert single[2]["mtp_1_loss"] < single[0]["mtp_1_loss"]  # the head learns

    reader = DistCheckpointReader(tmp_path / "vpp" / "ckpt")
    table = {m.megatron: m for m in preset.family.mapping(preset, reader.padded_vocab_size)}
    moved = "mtp.layers.0.eh_proj.weight"
    assert not torch.equal(reader.tensor(moved), table[moved].to_megatron(weights, 1)[0])
    assert f"optimizer.state.exp_avg.{moved}" in _optimizer_keys(reader.dir)
    written = sum(f.stat().st_size for f in reader.dir.rglob("*") if f.is_file() and TOKENIZER_SUBDIR not in f.parts)
    config = TrainConfig(model_overrides=overrides, pipeline_model_parallel_size=2,
                         virtual_pipeline_model_parallel_size=2, mtp_loss_scaling_factor=0.3)
    assert 0 < written - planner.submit(planned_checkpoint_bytes, config, 2).result() < 2**20, written
    (tmp_path / "vpp" / "ckpt" / "latest").write_text("2\n")
    args = common_args(tiny_dataset, tmp_path / "resumed", "--train-iters", "3", "--mtp-loss-scaling-factor", "0.3",
                       "--load", str(tmp_path / "vpp" / "ckpt"), *runs["vpp"][1])
    args[args.index("--model-overrides") + 1] = json.dumps(overrides)
    run_trainer(2, *args)
    resumed = read_metrics(tmp_path / "resumed")
    assert [r["iteration"] for r in resumed] == [3]
    for key in ("loss", "mtp_1_loss", "grad_norm"):
        assert abs(resumed[0][key] - vpp[2][key]) <= LAYOUT_TOL, (key, resumed, vpp)


def _optimizer_keys(directory) -> list[str]:
    from torch.distributed.checkpoint import FileSystemReader

    return [k for k in FileSystemReader(str(directory)).read_metadata().state_dict_metadata
            if k.startswith("optimizer.")]
