"""Moving Hugging Face weights into (and out of) a live, possibly TP/PP-sharded megatron model.

Pure tensor layout lives in :mod:`mapping`; this module only knows which shard and which layers the
calling rank holds.
"""

from collections.abc import Mapping

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_mimesis.models.family import Preset
from megatron_mimesis.models.mapping import Replicated, for_gradients, localize_layer_names


def _layer_offset(model) -> int:
    layers = model.decoder.layers
    return layers[0].layer_number - 1 if len(layers) else 0


def _stage_names(model, table) -> dict[str, str]:
    """Global names of the table -> this chunk's names, for the parameters this chunk holds."""
    offset = _layer_offset(model)
    local = localize_layer_names([m.megatron for m in table], offset)
    held = {name for name, _ in model.named_parameters()}
    return {g: n for g, n in local.items() if n in held}


def load_hf_weights(model, hf_state: Mapping[str, torch.Tensor], preset: Preset, padded_vocab: int) -> None:
    """Copy HF tensors into this rank's parameters of one model chunk, one entry at a time (``hf_state`` may read
    lazily, so a large model is never held twice); every parameter must be covered."""
    table = preset.family.mapping(preset, padded_vocab)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    rank = parallel_state.get_tensor_model_parallel_rank()
    names = _stage_names(model, table)
    params = dict(model.named_parameters())
    sources = {names[m.megatron]: m for m in table if m.megatron in names}
    if preset.tie_word_embeddings and model.post_process and not model.pre_process:
        sources["output_layer.weight"] = table[0]  # the last stage's own copy of the tied embedding
    uncovered = sorted(set(params) - set(sources))
    if uncovered:
        raise KeyError(f"parameters with no HF source: {uncovered}")
    missing = sorted({n for m in sources.values() for n in m.hf_names()} - set(hf_state))
    if missing:
        raise KeyError(f"HF checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")
    with torch.no_grad():
        for name, mapping in sources.items():
            shard = mapping.to_megatron(hf_state, tp)[rank]
            param = params[name]
            if param.shape != shard.shape:
                raise ValueError(f"{name}: model shape {tuple(param.shape)} != mapped {tuple(shard.shape)}")
            param.copy_(shard)


def iter_hf_tensors(model, preset: Preset, padded_vocab: int, *, grads: bool = False):
    """Yield ``(hf_name, full tensor)`` for the layers this pipeline stage holds, one mapping entry at a time:
    each entry's TP shards are all-gathered (collective over the TP group, every TP rank gets the tensors), so
    memory stays at one parameter's full size. This is what weight sync to an inference engine streams.

    With ``grads`` the parameters' gradients (megatron DDP's ``main_grad`` when present) instead of their values, for
    the parameters that take one (not the frozen MTP head).
    """
    table = preset.family.mapping(preset, padded_vocab)
    if grads:
        table = for_gradients(table)
    names = _stage_names(model, table)
    params = dict(model.named_parameters())
    tp_group = parallel_state.get_tensor_model_parallel_group()
    tp = dist.get_world_size(tp_group)
    for entry in table:
        if entry.megatron not in names:
            continue
        param = params[names[entry.megatron]]
        if grads and not param.requires_grad:
            continue
        local = (param.main_grad if grads and getattr(param, "main_grad", None) is not None
                 else param.grad if grads else param).detach()
        if tp == 1 or isinstance(entry, Replicated):
            shards = [local]
        else:
            shards = [torch.empty_like(local) for _ in range(tp)]
            dist.all_gather(shards, local.contiguous(), group=tp_group)
        yield from entry.to_hf(shards).items()


def gather_hf_tensors(model, preset: Preset, padded_vocab: int, *, grads: bool = False) -> dict[str, torch.Tensor]:
    """All of :func:`iter_hf_tensors` at once, for tests and small models."""
    return {name: tensor.clone() for name, tensor in iter_hf_tensors(model, preset, padded_vocab, grads=grads)}
