"""Checkpoint conversion: HF -> dist checkpoint (any layout) -> HF, bit-exact; trainer checkpoints to
transformers; the original multimodal layout kept with --hf-reference; bad input refused."""

import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_mimesis.checkpoint.conversion import ConversionError, export_to_hf, import_from_hf
from megatron_mimesis.checkpoint.reader import CheckpointError, DistCheckpointReader
from megatron_mimesis.models.presets import get_preset
from tests.models.harness import REPO, hf_reference, init_single_process_megatron

PRESET = get_preset("tiny")


def _hf_dir(tmp_path, model, name="hf"):
    out = tmp_path / name
    model.save_pretrained(out)
    (out / "tokenizer.json").write_text("{}")  # a stand-in file: conversion copies tokenizer files verbatim
    return out


def _tensors(directory):
    state = {}
    for f in sorted(directory.glob("*.safetensors")):
        state.update(load_file(str(f)))
    return state


@pytest.fixture(scope="module")
def hf_model():
    return hf_reference(seed=3)


@pytest.mark.slow
def test_import_at_tp2_pp2_then_export_is_bit_exact(hf_model, tmp_path):
    src = _hf_dir(tmp_path, hf_model)
    import_from_hf(src, tmp_path / "mcore", tp=2, pp=2, dtype="fp32")
    reader = DistCheckpointReader(tmp_path / "mcore")
    assert reader.run_config["model_only"] and reader.preset.num_layers == 4
    export_to_hf(tmp_path / "mcore", tmp_path / "back", dtype="fp32", progress=False)
    original, back = _tensors(src), _tensors(tmp_path / "back")
    assert set(back) == set(original)
    for name, tensor in original.items():
        assert torch.equal(back[name], tensor), name
    assert (tmp_path / "back" / "tokenizer.json").exists()
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5ForCausalLM"]
    assert config["mamba_ssm_dtype"] == "float32"  # vLLM keeps the DeltaNet state in fp32, as the trainer does


def test_exported_dir_loads_in_transformers_with_the_same_logits(hf_model, tmp_path):
    """A dist checkpoint saved from a live megatron model, exported, then run by transformers."""
    from megatron.core import dist_checkpointing
    from transformers import AutoModelForCausalLM

    from megatron_mimesis.models.config import ParallelConfig
    from tests.models.harness import build_megatron_from_hf

    init_single_process_megatron()
    model, _, provider = build_megatron_from_hf(hf_model.state_dict(), ParallelConfig())
    with torch.no_grad():  # move away from the HF weights so the test sees the checkpoint, not the source
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    ckpt = tmp_path / "saved" / "iter_0000007"
    ckpt.mkdir(parents=True)
    dist_checkpointing.save({"model": model.sharded_state_dict()}, str(ckpt))
    (ckpt / "run_config.json").write_text(json.dumps({"preset": vars(PRESET),
                                                      "padded_vocab_size": provider.padded_vocab_size}))
    (tmp_path / "saved" / "latest").write_text("7\n")
    tokenizer = tmp_path / "tok"
    tokenizer.mkdir()
    (tokenizer / "tokenizer.json").write_text("{}")
    export_to_hf(tmp_path / "saved", tmp_path / "hf", dtype="fp32", tokenizer=str(tokenizer), progress=False)
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
    ids = torch.randint(0, PRESET.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(ids, torch.arange(40).unsqueeze(0), None)
        theirs = exported(ids).logits
    assert (ours - theirs).abs().max().item() <= 1e-4


@pytest.mark.slow
def test_hf_reference_keeps_vision_tower_mtp_and_layout(tmp_path):
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    torch.manual_seed(0)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=PRESET.hidden_size,
                  num_position_embeddings=64, patch_size=4, temporal_patch_size=2)
    reference = _hf_dir(tmp_path, Qwen3_5ForConditionalGeneration(
        Qwen3_5Config(text_config=PRESET.to_hf_config().to_dict(), vision_config=vision)), "reference")
    weights = load_file(str(reference / "model.safetensors"))
    weights["mtp.fc.weight"] = torch.randn(PRESET.hidden_size, 2 * PRESET.hidden_size)
    save_file(weights, str(reference / "model.safetensors"), metadata={"format": "pt"})
    import_from_hf(reference, tmp_path / "mcore", dtype="fp32")
    export_to_hf(tmp_path / "mcore", tmp_path / "out", hf_reference=reference, dtype="fp32", progress=False)
    out = _tensors(tmp_path / "out")
    assert set(out) == set(weights)
    for name, tensor in weights.items():
        assert torch.equal(out[name], tensor), name
    assert json.loads((tmp_path / "out" / "config.json").read_text()) == \
        json.loads((reference / "config.json").read_text())


def test_bad_inputs_are_refused_and_nothing_is_half_written(hf_model, tmp_path):
    with pytest.raises(CheckpointError, match="no 'latest'|missing 'latest'"):
        export_to_hf(tmp_path, tmp_path / "x", progress=False)
    (tmp_path / "exists").mkdir()
    src = _hf_dir(tmp_path, hf_model)
    with pytest.raises(ConversionError, match="exists; pass --overwrite"):
        import_from_hf(src, tmp_path / "exists")
    missing = tmp_path / "broken"
    shutil.copytree(src, missing)
    (missing / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "model-2.safetensors"}}))
    with pytest.raises(FileNotFoundError, match="missing"):
        import_from_hf(missing, tmp_path / "never")
    assert not (tmp_path / "never").exists() and not list(tmp_path.glob(".never.partial-*"))


def test_reference_of_another_architecture_is_refused(tmp_path):
    from megatron_mimesis.checkpoint.conversion import _reference_config

    ref = tmp_path / "llama"
    ref.mkdir()
    (ref / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ConversionError, match="llama' is not a Qwen3.5 architecture"):
        _reference_config(ref, PRESET)


def test_cli_reports_one_line_errors(tmp_path):
    proc = subprocess.run([sys.executable, "tools/convert_checkpoint.py", "export", "--load", str(tmp_path),
                           "--out", str(tmp_path / "o")], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("error: ") and "latest" in proc.stderr
