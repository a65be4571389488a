"""The rollout side of a split layout (``engine: served``), planned per GPU: a vLLM server of the policy, what its
KV and state cache holds at the rollouts' length, and what a weight update moves through the shared directory.

vLLM sizes its own memory: it takes ``gpu_memory_utilization`` of each GPU, holds the weights (bf16, 1/TP each) and its
activations and graphs, and gives the rest to the cache. So this side's plan is arithmetic over the preset, not a
measurement: how many sequences of ``max_model_len`` tokens one server instance (TP GPUs) holds at once, against the
episodes one step plays. The trainer side is the trainer's memory plan (``rl/memory.py``) with no engine on its GPUs.
"""

import math

from megatron_mimesis.training.memory.plan import GIB, MemoryPlan, Row, gpu_capacity_bytes

# vLLM's activations (its profile run at max_num_batched_tokens), CUDA graphs and NCCL buffers: an allowance, as the
# trainer's plan keeps one for its context and workspaces
SERVER_ALLOWANCE_GIB = 4.0


def rollout_server_plan(config, gpus: int, tensor_parallel: int, max_model_len: int,
                        utilization: float = 0.9) -> MemoryPlan:
    """The server of ``config``'s policy on ``gpus`` GPUs of the config's kind, as instances of ``tensor_parallel``."""
    from megatron_mimesis.models.family import parameter_count

    if gpus % tensor_parallel:
        raise ValueError(f"{gpus} rollout GPUs do not split into instances of tensor parallel {tensor_parallel}")
    preset, capacity = config.preset, gpu_capacity_bytes(config)
    instances = gpus // tensor_parallel
    sizes = preset.family.engine_cache_sizes(preset)
    state_dtype = config.engine_deltanet_state_dtype
    state = sizes[f"recurrent_{'fp32' if state_dtype == 'float32' else 'bf16'}_bytes"] + sizes["conv_bf16_bytes"]
    weights = 2 * parameter_count(preset) / tensor_parallel
    allowance = SERVER_ALLOWANCE_GIB * GIB
    cache = utilization * capacity - weights - allowance
    per_sequence = (max_model_len * sizes["kv_bf16_bytes_per_token"] + state) / tensor_parallel
    held = max(int(cache // per_sequence), 0)
    episodes = config.groups_per_step * config.rollouts_per_prompt
    column = "vLLM server"
    plan = MemoryPlan(
        title=f"rollout side per GPU: {preset.name} served by vLLM on {gpus} GPUs, {instances} instance(s) of TP="
              f"{tensor_parallel}, gpu_memory_utilization {utilization:g}, sequences up to {max_model_len} tokens",
        gpu=config.gpu, capacity_bytes=capacity, columns=[column])
    plan.rows += [
        Row("weights (bf16, 1/TP)", {column: weights}, "arithmetic: the preset's parameters x 2 bytes / TP", "parameters"),
        Row("activations, CUDA graphs, NCCL", {column: allowance}, "allowance: vLLM's profile run and graphs",
            "allowance"),
        Row("KV and recurrent-state cache", {column: max(cache, 0.0)},
            f"vLLM: the rest of its {utilization:g} share", "engine"),
        Row("KV cache per token (attention layers, bf16, 1/TP)", {column: sizes["kv_bf16_bytes_per_token"] /
                                                                   tensor_parallel / 1024},
            "arithmetic: 2 x attention layers x KV heads x head dim x 2 bytes", "engine", unit="KiB", counts=False),
        Row(f"recurrent state per sequence ({state_dtype} state, bf16 conv, 1/TP)",
            {column: state / tensor_parallel / 2**20}, "arithmetic: engine_deltanet_state_dtype", "engine", unit="MiB",
            counts=False),
        Row(f"sequences of {max_model_len} tokens held at once, per instance", {column: held},
            "arithmetic: the cache over one sequence's KV and state", "engine", unit="seqs", counts=False),
        Row("episodes one step plays (groups x rollouts per prompt)", {column: episodes},
            f"the config: {config.groups_per_step} x {config.rollouts_per_prompt}", "engine", unit="episodes",
            counts=False),
        Row("weight update per version (bf16, written once, read by every instance)",
            {column: 2 * parameter_count(preset)}, "arithmetic: the preset's parameters x 2 bytes", "engine",
            counts=False),
        Row(f"weight update write at {config.ckpt_write_gb_per_s:g} GB/s", {column: round(
            2 * parameter_count(preset) / 1e9 / config.ckpt_write_gb_per_s, 1)},
            "arithmetic: ckpt_write_gb_per_s, the shared storage's rate", "engine", unit="s", counts=False),
    ]
    if held == 0:
        plan.notes.append(f"one sequence of {max_model_len} tokens does not fit an instance's cache: raise its TP")
    else:
        waves = math.ceil(episodes / (held * instances))
        plan.notes.append(f"{held * instances} sequences of {max_model_len} tokens at once over {instances} "
                          f"instance(s): the step's {episodes} episodes at full length in {waves} wave(s)")
    return plan
