"""The model a run of a config builds: its megatron ``TransformerConfig``, this rank's chunks and megatron's DDP
around them, in one place below both the trainer (``train.py``) and the memory plan (``memory/states.py``), which
must build the same model."""

import torch

from megatron_mimesis.training.config import TrainConfig


def model_config(config: TrainConfig, **overrides):
    """The megatron ``TransformerConfig`` a run of ``config`` trains with (the memory plan builds the same)."""
    from megatron_mimesis.models.config import transformer_config

    recompute = {}
    if config.recompute_granularity:
        recompute = dict(recompute_granularity=config.recompute_granularity, recompute_method=config.recompute_method,
                         recompute_num_layers=config.recompute_num_layers)
    mtp = {}
    if config.mtp_loss_scaling_factor:  # megatron runs and trains the head (models/provider.py)
        mtp = dict(mtp_num_layers=config.preset.mtp_num_layers, mtp_loss_scaling_factor=config.mtp_loss_scaling_factor)
    return transformer_config(config.preset, config.parallel,
                              params_dtype=torch.bfloat16 if config.bf16 else torch.float32,
                              calculate_per_token_loss=True, **{**recompute, **mtp, **overrides})


def model_chunks(provider, config: TrainConfig) -> list:
    """This rank's model chunks, one per virtual pipeline stage (one when there is no interleaving), where the
    provider puts them."""
    vpp = config.virtual_pipeline_model_parallel_size
    return [provider(vp_stage=i) for i in range(vpp)] if vpp else [provider()]


def wrap_in_ddp(config: TrainConfig, tf_config, chunks) -> list:
    """megatron's DDP around each model chunk, as the trainer runs it: fp32 main grads in contiguous buffers
    (bucketed for the first chunk only), sharded by the distributed optimizer when it is on."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=config.overlap_grad_reduce,
        overlap_param_gather=config.overlap_param_gather, use_distributed_optimizer=config.use_distributed_optimizer,
    )
    return [DistributedDataParallel(config=tf_config, ddp_config=ddp_config, module=chunk, disable_bucketing=(i > 0))
            for i, chunk in enumerate(chunks)]
