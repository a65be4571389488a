"""What the RL stages add to the memory plan (``training/memory``): the policy loss on packed micro-batches of up to
``max_tokens_per_microbatch`` tokens, the frozen copies some configurations hold (the local rollout worker's copy of the
policy among them), and the colocated vLLM engine, asleep while the trainer steps and holding its
``gpu_memory_utilization`` share while it samples. A served engine (a split layout) holds nothing on the trainer's GPUs;
its own side is ``rollout_plan.py``'s."""

import math
from dataclasses import dataclass

import torch

from megatron_mimesis.training.memory.plan import (
    GIB,
    Engine,
    MemoryPlan,
    Workload,
    gpu_capacity_bytes,
    plan_and_refusal,
)

# vLLM's own default when engine_options sets no gpu_memory_utilization
VLLM_DEFAULT_UTILIZATION = 0.9
# What a colocated vLLM keeps on the GPU at sleep level 1 (weights offloaded, KV cache dropped): its CUDA graph
# pools, its NCCL communicator and allocator bookkeeping. An allowance; gpu_check's vllm stage reports the share that
# sleep frees.
VLLM_ASLEEP_GIB = 2.0


@dataclass(frozen=True)
class PolicyHead:
    """The last stage's GRPO (+ CSD, + KL) loss on hidden states, as ``update/policy_step.py`` computes it."""

    csd: bool
    kl: bool
    weighted: bool  # the rollout correction's per-token weights (rows sampled by another engine than the trainer)

    def __call__(self, hidden_states, output_layer, config, tokens: int):
        from megatron_mimesis.rl.update.policy_step import TOKEN_FIELDS, PolicyLossConfig, _policy_output_processor

        integer_fields = ("tokens", "labels", "position_ids")
        batch = {name: torch.zeros(1, tokens, dtype=torch.long if name in integer_fields else torch.float32)
                 for name in TOKEN_FIELDS}
        loss_config = PolicyLossConfig(csd_alpha=0.01 if self.csd else 0.0, kl_coef=0.1 if self.kl else 0.0)
        loss, _ = _policy_output_processor(loss_config, self.weighted, batch, hidden_states=hidden_states,
                                           output_layer=output_layer, output_weight=None, config=config)
        return loss


def rl_workload(config) -> Workload:
    """One update of an RL config: packed micro-batches of up to max_tokens_per_microbatch tokens (padded to a
    multiple of TP under sequence parallelism), as many as fill the pipeline."""
    tp = config.tensor_model_parallel_size
    tokens = math.ceil(config.max_tokens_per_microbatch / tp) * tp if config.sequence_parallel else \
        config.max_tokens_per_microbatch
    pipeline = config.pipeline_model_parallel_size * (config.virtual_pipeline_model_parallel_size or 1)
    frozen = (("KL reference",) if config.kl_coef else ()) + \
        (("local user simulator",) if getattr(config, "user_model", None) == "local" else ()) + \
        (("rollout worker's copy of the policy",) if config.engine == "local" and config.max_staleness is not None
         else ())
    return Workload(tokens=tokens, microbatches=2 * pipeline,
                    description=f"packed micro-batches of up to {tokens} tokens",
                    head=PolicyHead(csd=bool(getattr(config, "csd_alpha", 0.0)), kl=bool(config.kl_coef),
                                    weighted=config.engine != "local" and config.rollout_correction != "off"),
                    frozen_copies=frozen, engine=_engine(config))


def _engine(config) -> Engine | None:
    if config.engine != "vllm":
        return None  # the local engine samples with the training model itself (tiny preset only)
    utilization = config.engine_options.get("gpu_memory_utilization", VLLM_DEFAULT_UTILIZATION)
    return Engine(
        name="vLLM", awake_bytes=utilization * gpu_capacity_bytes(config), asleep_bytes=VLLM_ASLEEP_GIB * GIB,
        awake_source=f"vLLM's share: gpu_memory_utilization {utilization:g} x the GPU (its weights, KV cache and "
                     f"activations)",
        asleep_source="allowance: what vLLM keeps at sleep level 1 (CUDA graphs, communicators)")


def smaller_token_budgets(config) -> list[dict]:
    """max_tokens_per_microbatch candidates, largest first, down to the longest row the engine can produce (its
    max_model_len: a row is one prompt and its response)."""
    longest = config.engine_options.get("max_model_len") if config.engine == "vllm" else None
    if longest is None:
        return []
    budgets = []
    budget = config.max_tokens_per_microbatch // 2
    while budget >= longest:
        budgets.append(budget)
        budget //= 2
    if longest < config.max_tokens_per_microbatch and longest not in budgets:
        budgets.append(longest)
    return [{"max_tokens_per_microbatch": b} for b in budgets]


def plan_rl(config, world_size: int) -> tuple[MemoryPlan, str | None]:
    """``plan_and_refusal`` of a simulator- or agent-RL config."""
    return plan_and_refusal(config, world_size, rl_workload, smaller_token_budgets)
