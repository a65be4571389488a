"""Reading the model tensors of a megatron torch_dist checkpoint with no process group and no model.

A megatron dist checkpoint stores every parameter as one *global* tensor, whatever the TP/PP layout that
wrote it: the TP=1 megatron layout. Two things differ from a model's own parameter names:

* the layers of a block whose layers are all alike (a dense model: Qwen3) are stacked along a leading axis under one
  key without the layer number (``decoder.layers.mlp.linear_fc1.weight`` of shape ``[layers, ...]``, see megatron-core's
  ``TransformerBlock.sharded_state_dict``); a hybrid block (Qwen3.5) keeps one key per layer
  (``decoder.layers.3.mlp.linear_fc1.weight``). The reader reads one layer's slice of a stacked tensor;
* two fused tensors of the Gated DeltaNet are saved as named parts (``in_proj.weight.query|key|value|z|beta|alpha``
  and ``conv1d.weight.query|key|value``, see megatron-core's ``_GDNBase.sharded_state_dict``); the reader
  concatenates those back.

Tensors are loaded one at a time, so memory stays at the size of the tensor asked for.
"""

import json
import re
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader, load
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from megatron_mimesis.checkpoint.integrity import (
    FILES,
    METADATA,
    RUN_CONFIG,
    CheckpointError,
    UnsafeCheckpointError,
    check_checkpoint,
    install_restricted_reader,
)
from megatron_mimesis.models.presets import preset_from_record

install_restricted_reader()  # every reader of dist checkpoints imports this module: none reads a raw pickle

# megatron-core's split names, in the order its TP=1 fused tensors concatenate them
FUSED_PARTS = {
    "self_attention.in_proj.weight": ("query", "key", "value", "z", "beta", "alpha"),
    "self_attention.conv1d.weight": ("query", "key", "value"),
}


# megatron-core saves the inner layer of a GPT MTP layer (``mtp.layers.N.mtp_model_layer.``) under its former module
# name, ``transformer_layer`` (``MultiTokenPredictionLayer.sharded_state_dict``), so that older checkpoints load
MTP_LAYER, MTP_LAYER_STORED = ".mtp_model_layer.", ".transformer_layer."


def stored_name(name: str) -> str:
    """A model parameter's name -> the checkpoint key megatron saves it under (before any stacking or fused parts)."""
    return name.replace(MTP_LAYER, MTP_LAYER_STORED, 1) if name.startswith("mtp.") else name


def parameter_name(key: str) -> str:
    """The inverse of :func:`stored_name`."""
    return key.replace(MTP_LAYER_STORED, MTP_LAYER, 1) if key.startswith("mtp.") else key


LAYERS = "decoder.layers."
_LAYER = re.compile(rf"^{re.escape(LAYERS)}(\d+)\.(.+)$")


def stacked_key(name: str) -> tuple[str, int] | None:
    """``decoder.layers.N.rest`` -> (``decoder.layers.rest``, N): where a homogeneous block stores that layer."""
    match = _LAYER.match(name)
    return (LAYERS + match.group(2), int(match.group(1))) if match else None


def is_stacked(key: str) -> bool:
    """A checkpoint key of stacked layers (``decoder.layers.`` not followed by a layer number)."""
    return key.startswith(LAYERS) and not key[len(LAYERS):].split(".", 1)[0].isdigit()


def layer_name(key: str, layer: int) -> str:
    """A stacked key's parameter name in layer ``layer``."""
    return f"{LAYERS}{layer}.{key[len(LAYERS):]}"


def chunk_of(full: torch.Tensor, offsets: tuple, sizes: tuple) -> torch.Tensor:
    """The chunk of a global tensor at ``offsets`` of ``sizes``."""
    for dim, (offset, size) in enumerate(zip(offsets, sizes, strict=True)):
        full = full.narrow(dim, offset, size)
    return full


def fused_part_names(name: str) -> list[str] | None:
    """The checkpoint keys megatron stores the fused tensor ``name`` under, in concatenation order; None when it is
    stored whole."""
    for suffix, parts in FUSED_PARTS.items():
        if name.endswith(suffix):
            return [f"{name}.{p}" for p in parts]
    return None


TOKENIZER_SUBDIR = "tokenizer"  # the trainer's copy of the tokenizer it trained with


LATEST = "latest"
OLD_SUFFIX = ".old"  # a checkpoint being replaced by a re-save of its iteration (writer.publish)
_ITER_NAME = re.compile(r"iter_(\d{7})(\.old)?")


def checkpoint_dir(root: str | Path, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}"


def read_latest(root: str | Path) -> int:
    """The iteration ``latest`` names; a clear error when it is missing or corrupt."""
    latest = Path(root) / LATEST
    if not latest.exists():
        raise CheckpointError(f"{latest}: no checkpoint here (missing 'latest')")
    text = latest.read_text().strip()
    if not text.isdigit():
        raise CheckpointError(f"{latest}: corrupt, expected an iteration number, found {text[:40]!r}")
    return int(text)


def iteration_dir(root: str | Path, iteration: int) -> Path:
    """The complete checkpoint of ``iteration``: ``iter_N``, or ``iter_N.old`` while a re-save of N is being
    published; a one-line error naming what is missing or damaged otherwise."""
    final = checkpoint_dir(root, iteration)
    candidates = [d for d in (final, final.with_name(final.name + OLD_SUFFIX)) if d.exists()]
    if not candidates:
        raise CheckpointError(f"{final}: missing")
    first_problem = None
    for directory in candidates:
        try:
            check_checkpoint(directory)
            return directory
        except UnsafeCheckpointError:
            raise
        except CheckpointError as exc:
            first_problem = first_problem or exc
    raise first_problem


def published_iterations(root: str | Path) -> list[int]:
    """The iterations with an ``iter_N`` directory under ``root`` (complete or not; not a ``.old`` one)."""
    return sorted(int(m.group(1)) for d in Path(root).iterdir()
                  if (m := _ITER_NAME.fullmatch(d.name)) and m.group(2) is None)


def newest_complete(root: str | Path) -> tuple[Path, list[str]]:
    """What ``--load root`` resumes from: the checkpoint ``latest`` names when it is complete, else the newest
    complete one; with the reasons for each checkpoint passed over (empty when ``latest``'s was taken). A crafted
    checkpoint is refused, not passed over."""
    latest = read_latest(root)
    found = {int(m.group(1)) for d in Path(root).iterdir() if (m := _ITER_NAME.fullmatch(d.name))} - {latest}
    skipped = []
    for iteration in [latest, *sorted(found, reverse=True)]:
        try:
            return iteration_dir(root, iteration), skipped
        except UnsafeCheckpointError:
            raise
        except CheckpointError as exc:
            skipped.append(str(exc))
    raise CheckpointError(f"{root}: no complete checkpoint ({'; '.join(skipped)})")


def resolve_checkpoint_dir(path: str | Path, iteration: int | None = None) -> Path:
    """A save root (with ``latest``) or one ``iter_N`` directory -> the verified ``iter_N`` directory to read."""
    path = Path(path)
    if (path / METADATA).exists() or (path / FILES).exists():
        check_checkpoint(path)
        return path
    return iteration_dir(path, read_latest(path) if iteration is None else iteration)


def checkpoint_iteration(directory: Path) -> int:
    match = _ITER_NAME.fullmatch(directory.name)
    if match is None:
        raise CheckpointError(f"{directory}: not an iter_NNNNNNN checkpoint directory")
    return int(match.group(1))


class DistCheckpointReader:
    def __init__(self, path: str | Path, iteration: int | None = None):
        self.dir = resolve_checkpoint_dir(path, iteration)
        config_path = self.dir / RUN_CONFIG
        if not config_path.exists():
            raise CheckpointError(f"{config_path}: missing (the model config is read from the checkpoint)")
        self.run_config = json.loads(config_path.read_text())
        try:
            self.preset = preset_from_record(self.run_config["preset"], str(config_path))
        except ValueError as exc:
            raise CheckpointError(str(exc)) from None
        self.padded_vocab_size = int(self.run_config["padded_vocab_size"])
        self.iteration = checkpoint_iteration(self.dir)
        metadata = FileSystemReader(str(self.dir)).read_metadata()
        self._stored = {
            k: v for k, v in metadata.state_dict_metadata.items()
            if isinstance(v, TensorStorageMetadata) and not k.startswith("optimizer.")
        }

    def stored_tensors(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Every stored model tensor (parts unmerged): name -> (shape, dtype)."""
        return {k: (tuple(v.size), v.properties.dtype) for k, v in self._stored.items()}

    def _pieces(self, name: str) -> list[tuple[str, int | None]]:
        """Where the parameter ``name`` is stored: (key, its layer in a stacked key or None) of the tensor, or of its
        named parts in concatenation order; empty when the checkpoint does not hold it."""
        for key, layer in [(stored_name(name), None), *([stacked_key(name)] if stacked_key(name) else [])]:
            if key in self._stored:
                return [(key, layer)]
            parts = fused_part_names(key)
            if parts is not None and all(p in self._stored for p in parts):
                return [(p, layer) for p in parts]
        return []

    def has(self, name: str) -> bool:
        return bool(self._pieces(name))

    def tensor(self, name: str) -> torch.Tensor:
        """The full TP=1 tensor of one megatron parameter."""
        pieces = self._pieces(name)
        if not pieces:
            raise CheckpointError(f"{self.dir}: no tensor {name!r} in the checkpoint")
        loaded = self._load(dict(pieces))
        return torch.cat([loaded[key] for key, _ in pieces], dim=0) if len(pieces) > 1 else loaded[pieces[0][0]]

    def _load(self, pieces: dict[str, int | None]) -> dict[str, torch.Tensor]:
        """Each key's tensor (one layer's slice of a stacked key)."""
        state = {}
        for key, layer in pieces.items():
            size = self._stored[key].size
            state[key] = torch.empty(size if layer is None else (1, *size[1:]), dtype=self._stored[key].properties.dtype)
        load(state, storage_reader=FileSystemReader(str(self.dir)), planner=_LayerSlicePlanner(pieces), no_dist=True)
        return {key: tensor if pieces[key] is None else tensor[0] for key, tensor in state.items()}


class _LayerSlicePlanner(DefaultLoadPlanner):
    """Loads the whole of a key, or one layer of a stacked key (the chunk at that layer's offset): DCP reads only the
    stored chunks that overlap it."""

    def __init__(self, layers: dict[str, int | None]):
        super().__init__(allow_partial_load=True)
        self._layers = layers

    def create_local_plan(self) -> LoadPlan:
        items = []
        for key, tensor in self.state_dict.items():
            stored = self.metadata.state_dict_metadata[key]
            offsets = [self._layers[key] or 0] + [0] * (len(stored.size) - 1)
            chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=tensor.shape)
            items += create_read_items_for_chunk_list(key, stored, [chunk])
        return LoadPlan(items)

    def lookup_tensor(self, index):
        return self.state_dict[index.fqn]


def saved_model(path: str | Path):
    """The model (a preset) and the tokenizer directory (None without one) of an HF checkpoint directory or of a dist
    checkpoint (a save root or one ``iter_N``), read from its files only."""
    from megatron_mimesis.models.presets import preset_from_hf_dir

    path = Path(path)
    if (path / "config.json").is_file():
        return preset_from_hf_dir(path), path if (path / "tokenizer.json").is_file() else None
    directory = resolve_checkpoint_dir(path)
    config_path = directory / RUN_CONFIG
    if not config_path.is_file():
        raise CheckpointError(f"{config_path}: missing (the model config is read from the checkpoint)")
    try:
        preset = preset_from_record(json.loads(config_path.read_text())["preset"], str(config_path))
    except ValueError as exc:
        raise CheckpointError(str(exc)) from None
    tokenizer = directory / TOKENIZER_SUBDIR
    return preset, tokenizer if (tokenizer / "tokenizer.json").is_file() else None
