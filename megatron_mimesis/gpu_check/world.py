"""The one-rank megatron world the model stages build in."""

import os


def init_one_rank_megatron() -> None:
    """A world of one rank (NCCL on the GPU; gloo through the CPU adaptation where there is none, which is how the
    vLLM stage is tested here), with the rank variables vLLM's ``external_launcher`` reads."""
    import socket

    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_mimesis.compat import enable_cpu_compat

    cpu = enable_cpu_compat()
    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
        if not cpu:
            torch.cuda.set_device(0)
        dist.init_process_group("gloo" if cpu else "nccl", rank=0, world_size=1)
        parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(0)
