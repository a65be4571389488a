"""Parameters, gradients and optimizer states of one rank, exactly: megatron builds the rank's shard on fake tensors.

For each pipeline stage, :func:`stage_states` joins that stage's first rank in a fake world (``world.py``) and runs
the trainer's own construction under ``FakeTensorMode``: the model chunks of the provider (every preset and
layout, tied embeddings and their copy on the last stage, whatever layers the spec builds), megatron's DDP around
them (``model.wrap_in_ddp``: bf16 parameters and fp32 main gradients in its contiguous, padded buffers), and the
distributed optimizer's shard of each bucket (megatron's own range map), which carries the fp32 master weights of
bf16 parameters and Adam's two moments. Nothing is allocated. The same pass records what the activation plan needs
from each chunk (its layer kinds in order, whether it embeds, whether it computes the loss, its vocabulary rows) and
what the checkpoint plan needs: the size of each tensor the rank's weights are saved as (megatron's own sharded state
dict of the chunks, factories split into their parts), which megatron's fully parallel save spreads over the
data-parallel group.
"""

import contextlib
from dataclasses import dataclass

import torch

from megatron_mimesis.training.memory.world import rank_of_world

ADAM_MOMENTS_BYTES = 8  # exp_avg and exp_avg_sq, fp32 each
FP32_MASTER_BYTES = 4  # the fp32 copy the optimizer steps for a bf16 parameter


@dataclass(frozen=True)
class Chunk:
    """One (virtual) pipeline chunk of this rank, as the activation plan needs it."""

    layers: tuple[str, ...]  # layer kinds in order
    embeds: bool
    computes_loss: bool
    vocab_rows: int  # output-layer rows on this tensor-parallel rank (padded); 0 without the loss
    trained_mtp_layers: int = 0  # MTP layers megatron runs here (a run training the head; a frozen head runs none)


@dataclass(frozen=True)
class StageStates:
    """What a rank of one pipeline stage holds for the whole run."""

    pipeline_rank: int
    chunks: tuple[Chunk, ...]
    parameters: int  # elements of this rank's shard
    frozen_parameters: int  # of those, the ones that take no gradient (the MTP head): weights without optimizer state
    parameter_bytes: int  # as stored (DDP's padded buffer under the distributed optimizer)
    gradient_bytes: int  # fp32 main gradients
    optimizer_bytes: int  # fp32 master weights (for bf16 parameters) and Adam m, v of this rank's optimizer shard
    optimizer_elements: int  # elements of the optimizer shard
    model_parameters: int  # this stage's contribution to the whole model, counted once across TP, vocab unpadded
    in_flight: tuple[int, ...]  # chunk of each forward whose activations are held at the peak (megatron's schedule)
    weight_shard_bytes: tuple[int, ...]  # each tensor this rank's weights are saved as, in bytes

    @property
    def state_bytes(self) -> int:
        return self.parameter_bytes + self.gradient_bytes + self.optimizer_bytes


@contextlib.contextmanager
def _fake_shard(config, world_size: int, pipeline_rank: int):
    """This pipeline stage's model chunks of ``config`` (a TrainConfig), on fake tensors, in its rank's world."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from megatron_mimesis.models.provider import ModelProvider
    from megatron_mimesis.training.model import model_chunks, model_config

    with rank_of_world(config, world_size, pipeline_rank), FakeTensorMode(allow_non_fake_inputs=True):
        tf_config = model_config(config, perform_initialization=False)
        yield tf_config, model_chunks(ModelProvider(config.preset, tf_config, backend="local"), config)


def model_parameters(config, world_size: int, pipeline_rank: int) -> int:
    """What pipeline stage ``pipeline_rank`` adds to the whole model (see :func:`_whole_model_share`)."""
    with _fake_shard(config, world_size, pipeline_rank) as (_, chunks):
        return sum(_whole_model_share(chunk, config.preset, config.tensor_model_parallel_size) for chunk in chunks)


def stage_states(config, world_size: int, pipeline_rank: int, microbatches: int) -> StageStates:
    """Build pipeline stage ``pipeline_rank`` of ``config`` (a TrainConfig) on fake tensors and count it; the
    schedule runs ``microbatches`` micro-batches per step."""
    from megatron_mimesis.training.model import wrap_in_ddp

    with _fake_shard(config, world_size, pipeline_rank) as (tf_config, chunks):
        ddp = wrap_in_ddp(config, tf_config, chunks)
        buffers = [buffer for model in ddp for buffer in model.buffers + model.expert_parallel_buffers]
        parameters = sum(p.numel() for chunk in chunks for p in chunk.parameters())
        # a frozen parameter (the MTP head, ``models/provider.py``) is in no DDP buffer and has no optimizer state
        frozen = [p for chunk in chunks for p in chunk.parameters() if not p.requires_grad]
        frozen_bytes = sum(p.numel() * p.element_size() for p in frozen)
        if config.use_distributed_optimizer:
            parameter_bytes = sum(b.param_data.numel() * b.param_data.element_size() for b in buffers) + frozen_bytes
            optimizer_elements = sum(_shard_elements(b) for b in buffers)
        else:
            parameter_bytes = sum(p.numel() * p.element_size() for chunk in chunks for p in chunk.parameters())
            optimizer_elements = parameters - sum(p.numel() for p in frozen)
        master = FP32_MASTER_BYTES if tf_config.params_dtype != torch.float32 else 0
        return StageStates(
            pipeline_rank=pipeline_rank,
            chunks=tuple(_chunk(chunk, config.preset) for chunk in chunks),
            parameters=parameters,
            frozen_parameters=sum(p.numel() for p in frozen),
            parameter_bytes=parameter_bytes,
            gradient_bytes=sum(b.grad_data.numel() * b.grad_data.element_size() for b in buffers),
            optimizer_bytes=optimizer_elements * (master + ADAM_MOMENTS_BYTES),
            optimizer_elements=optimizer_elements,
            model_parameters=sum(_whole_model_share(chunk, config.preset, config.tensor_model_parallel_size)
                                 for chunk in chunks),
            in_flight=_forwards_in_flight(microbatches, len(chunks), tf_config.microbatch_group_size_per_vp_stage),
            weight_shard_bytes=_weight_shard_bytes(chunks),
        )


def _weight_shard_bytes(chunks) -> tuple[int, ...]:
    """The bytes of each tensor the chunks' weights are saved as: megatron's sharded state dict, its factories built
    (a fused projection is saved as its parts), in order."""
    import math

    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    sizes = []
    for chunk in chunks:
        state = chunk.sharded_state_dict()
        apply_factories(state)
        sizes += [math.prod(t.local_shape) * t.dtype.itemsize for t in nested_values(state)
                  if isinstance(t, ShardedTensor)]
    return tuple(sizes)


def _forwards_in_flight(microbatches: int, num_chunks: int, group_size: int) -> tuple[int, ...]:
    """The model chunk of each forward pass whose activations this rank holds when its first backward pass starts:
    megatron's warm-up forwards for this pipeline rank plus the one it pairs with its first backward (1F1B, and the
    interleaved order of ``group_size`` micro-batches per chunk)."""
    from megatron.core.pipeline_parallel.schedules import get_pp_rank_microbatches

    total, _, warmup, _ = get_pp_rank_microbatches(microbatches, num_chunks, group_size)
    return tuple((k // group_size) % num_chunks for k in range(min(warmup + 1, total)))


def _shard_elements(buffer) -> int:
    """Parameter elements in this data-parallel rank's shard of every bucket (megatron's own ranges)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return sum(ranges["param"].size
               for buckets in DistributedOptimizer._build_gbuf_range_map(buffer).values()
               for bucket in buckets for ranges in bucket["param_map"].values())


def _chunk(chunk, preset) -> Chunk:
    kinds = preset.family.layer_kind_of(preset)
    layers = tuple(kinds[layer.layer_number - 1] for layer in chunk.decoder.layers)
    rows = _output_weight(chunk).shape[0] if chunk.post_process else 0
    mtp = len(chunk.mtp.layers) if chunk.mtp_process else 0
    return Chunk(layers=layers, embeds=chunk.pre_process, computes_loss=chunk.post_process, vocab_rows=rows,
                 trained_mtp_layers=mtp)


def _whole_model_share(chunk, preset, tp: int) -> int:
    """Elements this chunk adds to the whole model: tensor-parallel shards times TP, replicated tensors once, the
    vocabulary without megatron's padding rows, and a tied output layer's copy on a later stage and the frozen MTP
    head (not run; HF's causal LM has none) not at all."""
    total = 0
    vocab_weights = set()
    if chunk.pre_process:
        vocab_weights.add(id(chunk.embedding.word_embeddings.weight))
    if chunk.post_process:
        vocab_weights.add(id(_output_weight(chunk)))
    for p in chunk.parameters():
        if getattr(p, "shared", False) or not p.requires_grad:  # megatron marks the later stage's tied copy so
            continue
        if id(p) in vocab_weights:
            total += preset.vocab_size * p.shape[1]
        else:
            total += p.numel() * (tp if getattr(p, "tensor_model_parallel", False) else 1)
    return total


def _output_weight(chunk):
    """The output layer's weight, which is the embedding's when they are tied on one stage."""
    weight = chunk.output_layer.weight
    return weight if weight is not None else chunk.shared_embedding_or_output_weight()
