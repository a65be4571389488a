"""HF weights -> a weights-only megatron dist checkpoint, one tensor at a time.

Import used to build the whole megatron model, copy the HF weights into it and save it: memory grew with the
model (about 1.1 GiB of RSS per GiB of checkpoint). Here the model is built on the meta device, only for what
megatron-core saves (its keys, global shapes, chunks and objects), and :func:`~megatron_mimesis.checkpoint.writer
.dist_save_streamed` asks :class:`HFMegatronTensors` for each tensor as it writes it: one HF tensor is read, turned
into its megatron tensor by the one parameter mapping and written, so peak memory is a constant plus two copies of
the largest tensor (the embedding, as read and as padded), not the model.

The stored tensors are global (TP=1) ones, so the checkpoint loads at any TP/PP with ``--load DIR --finetune``;
the tensor-parallel size given to the import only sets the vocabulary padding (megatron pads it to a multiple of
64 x TP), which the training layout must share.
"""

import json
from collections.abc import Mapping
from pathlib import Path

import torch

from megatron_mimesis.checkpoint.reader import (
    RUN_CONFIG,
    chunk_of,
    fused_part_names,
    is_stacked,
    layer_name,
    parameter_name,
)
from megatron_mimesis.models.family import Preset
from megatron_mimesis.models.mapping import PerRankConcat
from megatron_mimesis.models.presets import preset_from_hf_dir, preset_record


class HFMegatronTensors:
    """Each chunk of a checkpoint key, computed from HF weights through the parameter mapping.

    A key is one parameter's global tensor, one of the named parts of a fused one (the Gated DeltaNet's ``in_proj``
    and ``conv1d``), or every layer of a homogeneous block stacked (``reader.is_stacked``), whose chunks are one layer
    each: each is computed from that layer's mapping entry alone. The last entry's tensor is kept until another entry
    is asked for, so a fused tensor's parts and a tensor's chunks are computed once.
    """

    def __init__(self, hf_state: Mapping[str, torch.Tensor], preset: Preset, padded_vocab: int):
        self._hf = hf_state
        self._title = preset.family.title
        self._entries = {m.megatron: m for m in preset.family.mapping(preset, padded_vocab)}
        self._last: tuple[str, torch.Tensor] | None = None

    def _megatron(self, name: str) -> torch.Tensor:
        if self._last is None or self._last[0] != name:
            self._last = None  # release the previous tensor before reading the next
            self._last = (name, self._entries[name].to_megatron(self._hf, 1)[0])
        return self._last[1]

    def __call__(self, key: str, offsets: tuple, sizes: tuple) -> torch.Tensor:
        if is_stacked(key):  # megatron's chunks of a stacked key are single layers
            full = self._global(layer_name(key, offsets[0])).unsqueeze(0)
            return chunk_of(full, (0, *offsets[1:]), sizes)
        return chunk_of(self._global(parameter_name(key)), offsets, sizes)

    def _global(self, key: str) -> torch.Tensor:
        if key in self._entries:
            return self._megatron(key)
        name = key.rsplit(".", 1)[0]
        parts = fused_part_names(name)
        entry = self._entries.get(name)
        if parts is None or key not in parts or not isinstance(entry, PerRankConcat) or len(entry.parts) != len(parts):
            raise KeyError(f"{key}: the model has this tensor, the {self._title} parameter mapping has no source for it")
        rows = [count for _, _, count in entry.parts]
        return torch.split(self._megatron(name), rows, dim=0)[parts.index(key)]


def import_worker(rank, world_size, hf_dir: str, out_dir: str, tp: int, dtype: torch.dtype, progress: bool):
    """One process (a gloo world of one): megatron's sharded state dict of the meta model, streamed to ``out_dir``."""
    from megatron_mimesis.compat import enable_cpu_compat

    enable_cpu_compat()  # before megatron-core is imported, whose import warns about the GPU-only packages
    from megatron.core import parallel_state

    from megatron_mimesis.checkpoint.writer import dist_save_streamed
    from megatron_mimesis.models.config import ParallelConfig, transformer_config
    from megatron_mimesis.models.hf_io import LazyHFState
    from megatron_mimesis.models.provider import ModelProvider

    parallel_state.initialize_model_parallel(1, 1)
    preset = preset_from_hf_dir(hf_dir)
    config = transformer_config(preset, ParallelConfig(), params_dtype=dtype, perform_initialization=False,
                                init_model_with_meta_device=True)
    provider = ModelProvider(preset, config, make_vocab_size_divisible_by=tp * ModelProvider.make_vocab_size_divisible_by)
    with torch.device("meta"):
        model = provider()
    source = HFMegatronTensors(LazyHFState(hf_dir), preset, provider.padded_vocab_size)
    dist_save_streamed({"model": model.sharded_state_dict()}, out_dir, source, progress)
    run_config = {"preset": preset_record(preset), "padded_vocab_size": provider.padded_vocab_size, "model_only": True,
                  "layout": {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": 1,
                             "data_parallel_size": 1},
                  "source": str(hf_dir)}
    (Path(out_dir) / RUN_CONFIG).write_text(json.dumps(run_config, indent=2, sort_keys=True))
