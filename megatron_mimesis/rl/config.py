"""The RL configuration both stages share: the trainer's model / parallel / optimizer / checkpoint options plus
the RL ones.

``RLConfig`` holds what both RL stages share (the rollout engine, sampling, the clipped policy update), so each
default lives once; ``SimulatorRLConfig`` (FoldGRPO, stage I, ``simulator/config.py``) and ``AgentRLConfig``
(GRPO + CSD, stage II, ``agent/config.py``) add their own. Defaults are the paper's; the CPU demos and tests
override them in YAML. Validated up front like the trainer's, with one-line reasons.
"""

from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from megatron_mimesis.training.config import AT_LEAST_1, NON_NEGATIVE, POSITIVE, ConfigError, Range, TrainConfig

ENGINES = ("local", "vllm")


@dataclass
class RLConfig(TrainConfig):
    lr: float = 1e-6
    min_lr: float = 1e-6
    lr_warmup_iters: int = 0
    lr_decay_style: str = "constant"
    # the policy's tokenizer (an HF directory); its special tokens drive the chat template
    tokenizer: str | None = None
    # rollouts: "local" decodes with the training model itself (CPU, tests); "vllm" runs vLLM colocated in the
    # training processes, asleep while the trainer steps, its weights synced after every update
    engine: str = "local"
    engine_options: dict = field(default_factory=dict)  # vLLM engine keyword arguments (rl/engines/vllm.py)
    generation_timeout_s: float | None = None  # a generate call running longer is a hard error, not a hang
    rollouts_per_prompt: int = 8  # the GRPO group size
    max_new_tokens: int = 512
    temperature: float = 1.0
    top_p: float = 1.0
    # the update
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    dual_clip_c: float | None = None
    max_tokens_per_microbatch: int = 32768
    min_valid_rollouts: int = 2  # a group with fewer scored rollouts contributes no gradient (counted)
    # KL to a frozen reference model (off, as in the paper): kl_coef * k3 KL(policy || reference) per token;
    # kl_reference is its weights, an HF directory or a dist checkpoint directory (weights only are read)
    kl_coef: float = 0.0
    kl_reference: str | None = None

    RANGES: ClassVar[dict[str, Range]] = {
        **TrainConfig.RANGES,
        "generation_timeout_s": POSITIVE,
        "rollouts_per_prompt": Range(2),  # group statistics need two rollouts
        "max_new_tokens": AT_LEAST_1,
        "temperature": NON_NEGATIVE,  # 0: greedy
        "top_p": Range(0, 1, low_open=True),
        "clip_eps_low": Range(0, 1, high_open=True),  # the ratio's lower clip 1 - eps_low stays positive
        "clip_eps_high": NON_NEGATIVE,
        "dual_clip_c": Range(1, low_open=True),
        "max_tokens_per_microbatch": AT_LEAST_1,
        "min_valid_rollouts": Range(2),
        "kl_coef": NON_NEGATIVE,
    }

    def validate_rl(self, world_size: int) -> None:
        self.validate_model_and_optimizer(world_size)
        if not self.tokenizer or not (Path(self.tokenizer) / "tokenizer.json").exists():
            raise ConfigError(f"tokenizer: {self.tokenizer!r} is not an HF tokenizer directory (tokenizer.json)")
        if self.kl_coef and not (self.kl_reference and Path(self.kl_reference).exists()):
            raise ConfigError(f"kl_coef > 0 needs kl_reference: an HF or dist checkpoint directory, not "
                              f"{self.kl_reference!r}")

    def validate_without_files(self, world_size: int) -> None:
        super().validate_without_files(world_size)
        if self.engine not in ENGINES:
            raise ConfigError(f"engine must be one of {ENGINES}, not {self.engine!r}")
        if self.engine == "local" and self.model != "tiny":
            raise ConfigError(f"engine=local decodes with the training model itself, with no KV cache and full "
                              f"[tokens, vocab] logits per decoded token: the tiny preset's CPU engine, not one for "
                              f"{self.model!r}; use engine=vllm")
        if self.engine == "vllm":
            from megatron_mimesis.rl.engines.vllm import check_vllm_config

            check_vllm_config(self)
