"""One rank of a job's world, in this process, with no peers: megatron-core's process groups over torch's ``fake``
backend, so the real model code builds exactly that rank's shard.

torch's fake process group (``torch.testing._internal.distributed.fake_pg``, what torchtitan's memory estimator
uses) joins a world of any size alone: every group megatron's ``parallel_state`` creates reports the sizes and
ranks of the real job, and its collectives return at once without data. The tensors built under it are the rank's
own: a column-parallel weight is ``out / TP`` rows, the pipeline stage builds its layers and no others, DDP pads its
buffers for the data-parallel size. Values that would have arrived through a collective are never read by the plan.
"""

import contextlib

import torch.distributed as dist

from megatron_mimesis.training.config import ConfigError


@contextlib.contextmanager
def rank_of_world(config, world_size: int, pipeline_rank: int = 0):
    """The first tensor- and data-parallel rank of pipeline stage ``pipeline_rank`` in a world of ``world_size``
    ranks laid out by ``config`` (megatron's order: TP fastest, PP slowest); torn down on exit."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise ConfigError("the memory plan builds its own one-rank world and needs a process without a process group; "
                          "run it before (or outside) the job")
    ranks_per_stage = world_size // config.pipeline_model_parallel_size
    dist.init_process_group("fake", rank=pipeline_rank * ranks_per_stage, world_size=world_size, store=FakeStore())
    try:
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=config.tensor_model_parallel_size,
            pipeline_model_parallel_size=config.pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size=config.virtual_pipeline_model_parallel_size,
            context_parallel_size=config.context_parallel_size,
            create_gloo_process_groups=False,
        )
        model_parallel_cuda_manual_seed(0)  # the tensor-parallel RNG streams that sequence-parallel regions fork
        yield
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
