"""Megatron dist checkpoints <-> Hugging Face directories, through the checkpoint family's one parameter mapping.

Export streams: one megatron tensor is read from the dist checkpoint (any TP/PP that wrote it, no process
group), turned into its HF tensors and appended to a size-bounded safetensors shard, so peak memory is
about one layer plus one output shard. With the original directory as reference, the output keeps its
architecture, config and key names (a multimodal ``Qwen3_5ForConditionalGeneration``'s ``model.language_model.*``)
and whatever else it holds (a vision tower; the MTP head when the checkpoint has none) is copied unchanged; without
it, the output is the family's text-only causal LM (``Qwen3_5ForCausalLM``, ``Qwen3ForCausalLM``). Either way the
export is a servable user simulator (:mod:`.serving`: its chat template, generation config and token ids). Import
streams too (:mod:`megatron_mimesis.checkpoint.hf_import`): one HF tensor is read, mapped and written into a
weights-only dist checkpoint that the trainer loads at any layout with
``--load DIR --finetune``. Both write into a temporary directory renamed at the end.
"""

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from tqdm import tqdm

from data_prep.tokenizer import ENDOFTEXT, TOKENIZER_FILES, copy_tokenizer
from megatron_mimesis.checkpoint.hf_import import import_worker
from megatron_mimesis.checkpoint.integrity import record_files
from megatron_mimesis.checkpoint.model_card import write_card
from megatron_mimesis.checkpoint.reader import TOKENIZER_SUBDIR, DistCheckpointReader
from megatron_mimesis.checkpoint.serving import make_servable, special_token_ids
from megatron_mimesis.models.family import Preset
from megatron_mimesis.models.hf_io import LazyHFState, ShardedSafetensorsWriter, stored_name
from megatron_mimesis.models.presets import architecture_differences, preset_from_hf_dir

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class ConversionError(RuntimeError):
    pass


def _fresh_output(out: Path, overwrite: bool) -> Path:
    if out.exists() and not overwrite:
        raise ConversionError(f"{out}: exists; pass --overwrite to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))


def _publish(tmp: Path, out: Path) -> None:
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)


def _reference_config(reference: Path, preset: Preset) -> dict:
    path = reference / "config.json"
    if not path.exists():
        raise ConversionError(f"{path}: missing; --hf-reference must be an HF checkpoint directory")
    config = json.loads(path.read_text())
    try:
        ref = preset_from_hf_dir(reference)
    except ValueError as exc:
        raise ConversionError(str(exc)) from None
    diff = architecture_differences(ref, preset)
    if diff:
        raise ConversionError(f"{path}: does not match the checkpoint's model (reference vs checkpoint: "
                              f"{'; '.join(diff)})")
    return config


def _tokenizer_source(reader: DistCheckpointReader, reference: Path | None, tokenizer: str | None) -> Path | None:
    """--tokenizer, else the reference's, else the copy the trainer saved with the checkpoint."""
    if tokenizer:
        return Path(tokenizer)
    if reference is not None:
        return reference
    saved = reader.dir / TOKENIZER_SUBDIR
    return saved if saved.exists() else None


def export_to_hf(checkpoint: str | Path, out: str | Path, *, iteration: int | None = None,
                 hf_reference: str | Path | None = None, tokenizer: str | None = None, dtype: str = "bf16",
                 max_shard_bytes: int = 2 * 2**30, overwrite: bool = False, progress: bool = True) -> Path:
    reader = DistCheckpointReader(checkpoint, iteration)
    preset, out = reader.preset, Path(out)
    reference = Path(hf_reference) if hf_reference else None
    ref_config = _reference_config(reference, preset) if reference else None
    ref_state = LazyHFState(reference) if reference else None
    table = preset.family.mapping(preset, reader.padded_vocab_size)
    missing = [m.megatron for m in table if not reader.has(m.megatron)]
    if missing:
        raise ConversionError(f"{reader.dir}: checkpoint lacks {len(missing)} model tensors, e.g. {missing[:3]}")
    tmp = _fresh_output(out, overwrite)
    try:
        writer = ShardedSafetensorsWriter(tmp, max_shard_bytes)
        cast = DTYPES[dtype]
        multimodal = ref_state is not None and ref_state.multimodal
        written = set()
        for entry in tqdm(table, desc="export", unit="tensor", disable=not progress):
            for name, tensor in entry.to_hf([reader.tensor(entry.megatron)]).items():
                name = stored_name(name, multimodal)
                written.add(name)
                writer.add(name, tensor.to(cast))
        if ref_state is not None:
            rest = {name: where for name, where in ref_state.stored().items() if name not in written}
            for name in tqdm(sorted(rest), desc="copy the reference's other tensors", disable=not progress):
                writer.add(name, ref_state.read_stored(rest[name]))
        writer.close()
        source = _tokenizer_source(reader, reference, tokenizer)
        if source is None:
            raise ConversionError(f"{reader.dir}: no tokenizer saved with the checkpoint; pass --tokenizer DIR")
        _copy_tokenizer(source, tmp)
        special = special_token_ids(tmp)
        _write_model_config(tmp, preset, ref_config, dtype, special)
        make_servable(tmp, reader.run_config, special)
        write_card(tmp, out.name, reader.dir.resolve(), reader.run_config, preset, dtype)
        _publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _copy_tokenizer(source: Path, dest: Path) -> None:
    try:
        copy_tokenizer(source, dest)
    except FileNotFoundError as error:
        raise ConversionError(str(error)) from None


def _write_model_config(out: Path, preset: Preset, ref_config: dict | None, dtype: str,
                        special: dict[str, int]) -> None:
    """The reference's config.json as it is, else the preset's text-only causal LM with the tokenizer's ids."""
    if ref_config is not None:
        (out / "config.json").write_text(json.dumps(ref_config, indent=2))
        return
    family = preset.family
    family.hf_config(preset, architectures=[family.hf_architecture], dtype=str(DTYPES[dtype]).removeprefix("torch."),
                        bos_token_id=special[ENDOFTEXT], eos_token_id=special[ENDOFTEXT],
                        pad_token_id=None).save_pretrained(out)


def import_from_hf(hf_dir: str | Path, out: str | Path, *, tp: int = 1, dtype: str = "bf16",
                   overwrite: bool = False, progress: bool = True) -> Path:
    """HF directory -> ``out/iter_0000000`` (weights only) + ``out/latest``; loadable at any TP/PP whose vocabulary
    padding is that of ``tp`` (see :mod:`megatron_mimesis.checkpoint.hf_import`)."""
    from megatron_mimesis.gloo import run_gloo_processes

    hf_dir, out = Path(hf_dir), Path(out)
    state = LazyHFState(hf_dir)  # fail early, naming the directory, when there are no weights
    try:
        preset = preset_from_hf_dir(hf_dir)
    except (FileNotFoundError, ValueError) as exc:
        raise ConversionError(str(exc)) from None
    missing = [n for m in preset.family.mapping(preset, preset.vocab_size) for n in m.hf_names() if n not in state]
    if missing:
        raise ConversionError(f"{hf_dir}: lacks {len(missing)} tensors of the text model, e.g. {missing[:3]}")
    tmp = _fresh_output(out, overwrite)
    try:
        iter_dir = tmp / "iter_0000000"
        iter_dir.mkdir()
        run_gloo_processes(import_worker, 1, str(hf_dir), str(iter_dir), tp, DTYPES[dtype], progress)
        if any((hf_dir / name).exists() for name in TOKENIZER_FILES):
            _copy_tokenizer(hf_dir, iter_dir / TOKENIZER_SUBDIR)
        record_files(iter_dir)
        (tmp / "latest").write_text("0\n")
        _publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
