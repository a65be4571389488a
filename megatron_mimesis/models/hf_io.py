"""Reading and writing Hugging Face checkpoint directories (safetensors, sharded or not).

A text-only causal LM (``Qwen3ForCausalLM``, an exported ``Qwen3_5ForCausalLM``) names its tensors ``model.*``,
``lm_head.weight`` and, with a multi-token-prediction head, ``mtp.*``. A multimodal one (the released
``Qwen3_5ForConditionalGeneration``) keeps the decoder's weights under ``model.language_model.*`` beside a vision
tower (``model.visual.*``) and the same ``mtp.*``. Training is text-only, so reading yields the text model under the
causal LM's names, the names the parameter mappings use, and remembers which layout the directory had. Both
directions stream: a tensor is read when asked for, and written shards are flushed at a size bound, so a 9B model is
never held twice.
"""

import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

CONDITIONAL_TEXT_PREFIX = "model.language_model."
TEXT_PREFIX = "model."
MTP_PREFIX = "mtp."
VISION_PREFIX = "model.visual."


def safetensors_files(directory: str | Path) -> list[Path]:
    directory = Path(directory)
    index = directory / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [directory / n for n in names]
    else:
        files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{directory}: no safetensors weights (model.safetensors or an index)")
    missing = [str(f) for f in files if not f.exists()]
    if missing:
        raise FileNotFoundError(f"{directory}: shard(s) listed in the index are missing: {missing}")
    return files


def text_model_name(name: str) -> str | None:
    """Checkpoint tensor name -> the text-only causal LM's name, or None for what is not the text model (vision)."""
    if name.startswith(CONDITIONAL_TEXT_PREFIX):
        return TEXT_PREFIX + name[len(CONDITIONAL_TEXT_PREFIX):]
    if name == "lm_head.weight" or name.startswith(MTP_PREFIX):
        return name
    if name.startswith(TEXT_PREFIX) and not name.startswith(VISION_PREFIX):
        return name
    return None


def stored_name(text_name: str, multimodal: bool) -> str:
    """The inverse of :func:`text_model_name`: where a directory of that layout keeps a text-model tensor."""
    if multimodal and text_name.startswith(TEXT_PREFIX):
        return CONDITIONAL_TEXT_PREFIX + text_name[len(TEXT_PREFIX):]
    return text_name


class LazyHFState(Mapping):
    """The text-model tensors of an HF checkpoint directory under the causal LM's names, read on access;
    ``multimodal`` says whether the directory keeps them under ``model.language_model.``."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self._where: dict[str, tuple[Path, str]] = {}
        self.other: dict[str, tuple[Path, str]] = {}  # the vision tower: everything the text model is not
        self.multimodal = False
        for path in safetensors_files(directory):
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    text_name = text_model_name(name)
                    self.multimodal |= name.startswith(CONDITIONAL_TEXT_PREFIX)
                    if text_name is None:
                        self.other[name] = (path, name)
                    else:
                        self._where[text_name] = (path, name)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.read_stored(self._where[name])

    def stored(self) -> dict[str, tuple[Path, str]]:
        """Every tensor of the directory under its stored name: the text model's and the others."""
        return {**{stored: (path, stored) for path, stored in self._where.values()}, **self.other}

    @staticmethod
    def read_stored(where: tuple[Path, str]) -> torch.Tensor:
        path, stored = where
        with safe_open(str(path), framework="pt") as f:
            return f.get_tensor(stored)

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


class ShardedSafetensorsWriter:
    """Writes tensors as they come into ``model-0000i-of-0000n.safetensors`` shards of at most ``max_shard_bytes``
    (a tensor larger than that gets a shard of its own) plus ``model.safetensors.index.json``."""

    def __init__(self, directory: str | Path, max_shard_bytes: int = 2 * 2**30):
        self.directory = Path(directory)
        self.max_shard_bytes = max_shard_bytes
        self._buffer: dict[str, torch.Tensor] = {}
        self._buffered_bytes = 0
        self._shards: list[list[str]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self._buffer and self._buffered_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        self._buffer[name] = tensor.contiguous()
        self._buffered_bytes += nbytes
        self.total_bytes += nbytes

    def _flush(self) -> None:
        index = len(self._shards) + 1
        save_file(self._buffer, str(self.directory / f"shard-{index:05d}.tmp"), metadata={"format": "pt"})
        self._shards.append(list(self._buffer))
        self._buffer, self._buffered_bytes = {}, 0

    def close(self) -> None:
        if self._buffer or not self._shards:
            self._flush()
        count = len(self._shards)
        if count == 1:
            os.replace(self.directory / "shard-00001.tmp", self.directory / "model.safetensors")
            return
        weight_map = {}
        for i, names in enumerate(self._shards, start=1):
            final = f"model-{i:05d}-of-{count:05d}.safetensors"
            os.replace(self.directory / f"shard-{i:05d}.tmp", self.directory / final)
            weight_map.update(dict.fromkeys(names, final))
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
        (self.directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
