"""Checkpoint conversion: HF -> dist checkpoint (any layout) -> HF, bit-exact; trainer checkpoints to
transformers; the original multimodal layout kept with --hf-reference; bad input refused."""

import json
import shutil
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint import FileSystemReader

from data_prep.tokenizer import ENDOFTEXT, IM_END, TextEncoder
from megatron_mimesis.checkpoint.conversion import ConversionError, export_to_hf, import_from_hf
from megatron_mimesis.checkpoint.reader import CheckpointError, DistCheckpointReader
from megatron_mimesis.checkpoint.serving import simulator_chat_template, special_token_ids
from megatron_mimesis.models.presets import get_preset, preset_record
from tests.models.harness import REPO, hf_reference, init_single_process_megatron

PRESET = get_preset("tiny")


def _hf_dir(tmp_path, model, tokenizer, name="hf"):
    out = tmp_path / name
    model.save_pretrained(out)
    for path in tokenizer.iterdir():
        shutil.copy2(path, out / path.name)
    return out


def _tensors(directory):
    state = {}
    for f in sorted(directory.glob("*.safetensors")):
        state.update(load_file(str(f)))
    return state


@pytest.fixture(scope="module")
def hf_model():
    return hf_reference(seed=3)


@pytest.fixture(scope="module")
def imported(hf_model, tiny_dataset, tmp_path_factory):
    """The HF model, saved with the tiny dataset's tokenizer and imported (fp32) once for the tests below."""
    tmp_path = tmp_path_factory.mktemp("imported")
    src = _hf_dir(tmp_path, hf_model, tiny_dataset / "tokenizer")
    import_from_hf(src, tmp_path / "mcore", dtype="fp32", progress=False)
    return src, tmp_path / "mcore"


@pytest.mark.slow
def test_import_then_export_is_bit_exact(imported, tmp_path):
    src, mcore = imported
    reader = DistCheckpointReader(mcore)
    assert reader.run_config["model_only"] and reader.preset.num_layers == 4
    _assert_key_table_holds("tiny", reader.stored_tensors())
    export_to_hf(mcore, tmp_path / "back", dtype="fp32", progress=False)
    original, back = _tensors(src), _tensors(tmp_path / "back")
    assert set(back) == set(original)
    for name, tensor in original.items():
        assert torch.equal(back[name], tensor), name
    assert (tmp_path / "back" / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5ForCausalLM"]
    assert config["mamba_ssm_dtype"] == "float32"  # vLLM keeps the DeltaNet state in fp32, as the trainer does


@pytest.mark.slow
def test_streamed_import_is_what_megatron_saves_from_the_loaded_model(hf_model, imported, tmp_path):
    """Same keys, chunks, dtypes, objects and bits as megatron-core's own save of a model holding the HF weights."""
    from megatron_mimesis.checkpoint.writer import dist_save
    from megatron_mimesis.models.config import ParallelConfig
    from tests.models.harness import build_megatron_from_hf

    init_single_process_megatron()
    model, _, _ = build_megatron_from_hf(hf_model.state_dict(), ParallelConfig())
    (tmp_path / "megatron").mkdir()
    dist_save({"model": model.sharded_state_dict()}, tmp_path / "megatron")
    ours = FileSystemReader(str(imported[1] / "iter_0000000")).read_metadata().state_dict_metadata
    theirs = FileSystemReader(str(tmp_path / "megatron")).read_metadata().state_dict_metadata
    assert set(ours) == set(theirs)
    for key, meta in theirs.items():
        assert type(ours[key]) is type(meta), key
        if hasattr(meta, "chunks"):
            assert (ours[key].size, ours[key].chunks, ours[key].properties) == (meta.size, meta.chunks,
                                                                                meta.properties), key
    streamed, saved = _dist_tensors(imported[1] / "iter_0000000"), _dist_tensors(tmp_path / "megatron")
    assert set(streamed) == set(saved)
    for key, tensor in saved.items():
        assert torch.equal(streamed[key], tensor), key


def _assert_key_table_holds(preset_name, stored):
    """Every dist checkpoint key of the family's key table (docs/checkpoint_keys.md) is in a real checkpoint of it
    (``N`` some layer of its kind; named parts each; the output layer unless tied), and every stored key of the model
    is one of the table's."""
    from megatron_mimesis.tools.inspect_checkpoint import key_rows

    layers = range(get_preset(preset_name).num_layers)
    stored = {k for k in stored if "_extra_state" not in k}
    table = []
    for _, key, _, _ in key_rows(preset_name)[1]:
        base, _, parts = key.partition(".{")
        names = [f"{base}.{p}" for p in parts.rstrip("}").split(",")] if parts else [base]
        table.append({n.replace(".N.", f".{i}.") for n in names for i in layers} if ".N." in key else set(names))
    missing = [row for row in table if not row & stored and row != {"output_layer.weight"}]
    assert not missing and stored <= set().union(*table), (missing, stored - set().union(*table))


def _dist_tensors(directory):
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = FileSystemReader(str(directory)).read_metadata().state_dict_metadata
    state = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in metadata.items()
             if isinstance(v, TensorStorageMetadata)}
    dcp.load(state, storage_reader=FileSystemReader(str(directory)), no_dist=True)
    return state


def _load_at_layout_and_compare(rank, world_size, ckpt, hf_dir, preset=PRESET, save_to=None):
    """On each rank of TP=2 x PP=2: the imported checkpoint, loaded the way --finetune loads it, equals this rank's
    shard of the HF weights put in by load_hf_weights; with ``save_to``, megatron then saves it at this layout."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_mimesis.checkpoint.trainer_state import load_model_weights
    from megatron_mimesis.compat import enable_cpu_compat
    from megatron_mimesis.models.config import ParallelConfig, transformer_config
    from megatron_mimesis.models.hf_io import LazyHFState
    from megatron_mimesis.models.hf_weights import load_hf_weights
    from megatron_mimesis.models.provider import ModelProvider

    enable_cpu_compat()
    parallel_state.initialize_model_parallel(2, 2)
    model_parallel_cuda_manual_seed(0)
    provider = ModelProvider(preset, transformer_config(preset, ParallelConfig(tensor_model_parallel_size=2,
                                                                              pipeline_model_parallel_size=2)))
    expected, loaded = provider(), provider()
    load_hf_weights(expected, LazyHFState(hf_dir), preset, provider.padded_vocab_size)
    load_model_weights(ckpt, [loaded], preset)
    theirs = dict(expected.named_parameters())
    if save_to is not None:
        from megatron_mimesis.checkpoint.writer import dist_save

        dist_save({"model": loaded.sharded_state_dict()}, save_to)
    return sorted(name for name, p in loaded.named_parameters() if not torch.equal(p, theirs[name]))


@pytest.mark.slow
def test_imported_checkpoint_loads_at_tp2_pp2_as_the_hf_weights(imported):
    from tests.multiproc import run_distributed

    src, mcore = imported
    assert run_distributed(_load_at_layout_and_compare, 4, str(mcore), str(src)) == [[], [], [], []]


def test_exported_dir_loads_in_transformers_with_the_same_logits(hf_model, tiny_dataset, tmp_path):
    """A dist checkpoint saved from a live megatron model, exported, then run by transformers; the export carries
    the simulator's chat template and the generation and token-id fields of a released Qwen3.5."""
    from megatron.core import dist_checkpointing
    from transformers import AutoModelForCausalLM, AutoTokenizer

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
    (ckpt / "run_config.json").write_text(json.dumps({"preset": preset_record(PRESET),
                                                      "padded_vocab_size": provider.padded_vocab_size}))
    (tmp_path / "saved" / "latest").write_text("7\n")
    tokenizer = tiny_dataset / "tokenizer"
    export_to_hf(tmp_path / "saved", tmp_path / "hf", dtype="fp32", tokenizer=str(tokenizer), progress=False)
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
    ids = torch.randint(0, PRESET.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(ids, torch.arange(40).unsqueeze(0), None)
        theirs = exported(ids).logits
    assert (ours - theirs).abs().max().item() <= 1e-4
    special = TextEncoder(tokenizer).special
    assert (exported.config.bos_token_id, exported.config.eos_token_id) == (special[ENDOFTEXT], special[ENDOFTEXT])
    assert exported.generation_config.eos_token_id == [special[IM_END], special[ENDOFTEXT]]
    assert AutoTokenizer.from_pretrained(tmp_path / "hf").chat_template == simulator_chat_template(thinking=False)


MTP_PRESET = PRESET.replace(mtp_num_layers=1)


def _released_layout(tmp_path, tokenizer, preset, name: str):
    """A Qwen3_5ForConditionalGeneration of ``preset`` as Qwen releases it: a vision tower, the text model under
    ``model.language_model.``, and the MTP head when the preset has one (``tests/models/hf_mtp.py``)."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    from tests.models.hf_mtp import hf_mtp_tensors

    torch.manual_seed(0)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=preset.hidden_size,
                  num_position_embeddings=64, patch_size=4, temporal_patch_size=2)
    directory = _hf_dir(tmp_path, Qwen3_5ForConditionalGeneration(
        Qwen3_5Config(text_config=preset.family.hf_config(preset).to_dict(), vision_config=vision)), tokenizer, name)
    weights = load_file(str(directory / "model.safetensors"))
    if preset.mtp_num_layers:
        weights |= hf_mtp_tensors(preset)
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory, weights


def _assert_same_tensors(directory, weights):
    out = _tensors(directory)
    assert set(out) == set(weights), set(out) ^ set(weights)
    for name, tensor in weights.items():
        assert torch.equal(out[name], tensor), name


@pytest.mark.slow
def test_hf_reference_keeps_vision_tower_and_layout_and_an_mtp_head_the_checkpoint_lacks(tiny_dataset, tmp_path):
    reference, weights = _released_layout(tmp_path, tiny_dataset / "tokenizer", PRESET, "reference")
    weights["mtp.fc.weight"] = torch.randn(PRESET.hidden_size, 2 * PRESET.hidden_size)  # not the model's: copied
    save_file(weights, str(reference / "model.safetensors"), metadata={"format": "pt"})
    import_from_hf(reference, tmp_path / "mcore", dtype="fp32", progress=False)
    export_to_hf(tmp_path / "mcore", tmp_path / "out", hf_reference=reference, dtype="fp32", progress=False)
    _assert_same_tensors(tmp_path / "out", weights)
    assert json.loads((tmp_path / "out" / "config.json").read_text()) == \
        json.loads((reference / "config.json").read_text())


@pytest.mark.slow
def test_the_mtp_head_goes_through_import_a_tp2_pp2_save_and_export_bit_exact(tiny_dataset, tmp_path):
    """A released layout with its MTP head: imported, the head is in the dist checkpoint under megatron's
    (Megatron-Bridge's) names; loaded at TP=2 x PP=2 it equals the mapping's shards of the HF tensors; saved there and
    exported, all 15 of its tensors come back bit for bit, with the config's ``mtp_num_hidden_layers``, in the
    released layout (with the reference) and in the text-only one (without)."""
    from megatron_mimesis.checkpoint.integrity import record_files
    from megatron_mimesis.checkpoint.reader import stored_name
    from tests.multiproc import run_distributed

    reference, weights = _released_layout(tmp_path, tiny_dataset / "tokenizer", MTP_PRESET, "reference")
    assert sum(name.startswith("mtp.") for name in weights) == 15
    import_from_hf(reference, tmp_path / "mcore", dtype="fp32", progress=False)
    stored = DistCheckpointReader(tmp_path / "mcore").stored_tensors()
    head = [m.megatron for m in MTP_PRESET.family.mapping(MTP_PRESET, 512) if m.megatron.startswith("mtp.")]
    assert len(head) == 12 and {stored_name(n) for n in head} <= set(stored), sorted(stored)
    assert "mtp.layers.0.transformer_layer.self_attention.linear_qkv.weight" in stored  # megatron-core's own key

    saved = tmp_path / "tp2pp2" / "iter_0000001"
    saved.mkdir(parents=True)
    assert run_distributed(_load_at_layout_and_compare, 4, str(tmp_path / "mcore"), str(reference), MTP_PRESET,
                           str(saved)) == [[], [], [], []]
    shutil.copy2(tmp_path / "mcore" / "iter_0000000" / "run_config.json", saved / "run_config.json")
    record_files(saved)
    (saved.parent / "latest").write_text("1\n")
    export_to_hf(saved.parent, tmp_path / "released", hf_reference=reference, dtype="fp32", progress=False)
    _assert_same_tensors(tmp_path / "released", weights)
    export_to_hf(saved.parent, tmp_path / "text", tokenizer=str(tiny_dataset / "tokenizer"), dtype="fp32",
                 progress=False)
    text_only = {n.replace("model.language_model.", "model."): t for n, t in weights.items()
                 if not n.startswith("model.visual.")}
    _assert_same_tensors(tmp_path / "text", text_only)
    config = json.loads((tmp_path / "text" / "config.json").read_text())
    assert (config["architectures"], config["mtp_num_hidden_layers"]) == (["Qwen3_5ForCausalLM"], 1)


@pytest.mark.slow
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_qwen3_round_trip_is_bit_exact_and_the_export_runs_in_transformers(tiny_dataset, tmp_path, tied):
    """A Qwen3ForCausalLM (untied as Qwen3-8B, tied as the 0.6B-4B) -> dist checkpoint -> HF: every tensor back bit for
    bit, the family read from the checkpoint on both ways (no flag), the export a Qwen3ForCausalLM with the source's
    logits; with the source as --hf-reference its config.json is kept as it is."""
    from transformers import AutoModelForCausalLM

    preset = get_preset("qwen3-tiny").replace(tie_word_embeddings=tied)
    source = hf_reference(seed=5, preset=preset)
    src = _hf_dir(tmp_path, source, tiny_dataset / "tokenizer")
    import_from_hf(src, tmp_path / "mcore", dtype="fp32", progress=False)
    reader = DistCheckpointReader(tmp_path / "mcore")
    assert reader.run_config["preset"]["family"] == "qwen3" and reader.preset == preset.replace(name="hf")
    assert "output_layer.weight" not in reader.stored_tensors() if tied else "output_layer.weight" in \
        reader.stored_tensors()
    _assert_key_table_holds("qwen3-tiny", reader.stored_tensors())
    export_to_hf(tmp_path / "mcore", tmp_path / "back", dtype="fp32", progress=False)
    original, back = _tensors(src), _tensors(tmp_path / "back")
    assert set(back) == set(original) and ("lm_head.weight" in back) is not tied
    for name, tensor in original.items():
        assert torch.equal(back[name], tensor), name
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert (config["architectures"], config["model_type"], config["tie_word_embeddings"]) == (
        ["Qwen3ForCausalLM"], "qwen3", tied)
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "back", attn_implementation="eager").eval()
    assert type(exported).__name__ == "Qwen3ForCausalLM"
    ids = torch.randint(0, preset.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(exported(ids).logits, source(ids).logits)
    export_to_hf(tmp_path / "mcore", tmp_path / "ref", hf_reference=src, dtype="fp32", progress=False)
    assert json.loads((tmp_path / "ref" / "config.json").read_text()) == json.loads((src / "config.json").read_text())
    assert set(_tensors(tmp_path / "ref")) == set(original)


def test_a_reference_of_another_family_is_refused_naming_it(tiny_dataset, tmp_path):
    from megatron_mimesis.checkpoint.conversion import _reference_config

    qwen3 = get_preset("qwen3-tiny")
    qwen3.family.hf_config(qwen3).save_pretrained(tmp_path / "qwen3")
    with pytest.raises(ConversionError, match=r"does not match the checkpoint's model \(reference vs checkpoint: "
                                              r"family: Qwen3 vs Qwen3.5\)"):
        _reference_config(tmp_path / "qwen3", PRESET)


def test_bad_inputs_are_refused_and_nothing_is_half_written(hf_model, tiny_dataset, tmp_path):
    with pytest.raises(CheckpointError, match="no 'latest'|missing 'latest'"):
        export_to_hf(tmp_path, tmp_path / "x", progress=False)
    (tmp_path / "exists").mkdir()
    src = _hf_dir(tmp_path, hf_model, tiny_dataset / "tokenizer")
    with pytest.raises(ConversionError, match="exists; pass --overwrite"):
        import_from_hf(src, tmp_path / "exists")
    missing = tmp_path / "broken"
    shutil.copytree(src, missing)
    (missing / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "model-2.safetensors"}}))
    with pytest.raises(FileNotFoundError, match="missing"):
        import_from_hf(missing, tmp_path / "never")
    assert not (tmp_path / "never").exists() and not list(tmp_path.glob(".never.partial-*"))
    lacking = tmp_path / "lacking"
    shutil.copytree(src, lacking)
    weights = load_file(str(lacking / "model.safetensors"))
    del weights["model.layers.2.linear_attn.in_proj_z.weight"]
    save_file(weights, str(lacking / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ConversionError, match=r"lacks 1 tensors .*model\.layers\.2\.linear_attn\.in_proj_z"):
        import_from_hf(lacking, tmp_path / "never")
    assert not (tmp_path / "never").exists() and not list(tmp_path.glob(".never.partial-*"))


def test_an_export_needs_a_tokenizer_with_the_chat_tokens(tmp_path):
    """The template and the stop ids are made of them; a stand-in or foreign tokenizer is refused in one line."""
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ValueError, match="tokenizer.json: not a tokenizer"):
        special_token_ids(tmp_path)


def test_reference_of_another_architecture_is_refused(tmp_path):
    from megatron_mimesis.checkpoint.conversion import _reference_config

    ref = tmp_path / "llama"
    ref.mkdir()
    (ref / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ConversionError, match="model_type 'llama' is not a supported family"):
        _reference_config(ref, PRESET)


def test_cli_reports_one_line_errors(tmp_path):
    proc = subprocess.run([sys.executable, "tools/convert_checkpoint.py", "export", "--load", str(tmp_path),
                           "--out", str(tmp_path / "o")], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("error: ") and "latest" in proc.stderr
