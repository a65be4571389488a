"""Simulator-RL configuration (FoldGRPO, stage I): the shared RL options plus the prompts, their rewards and the
counterpart the simulator talks to. Defaults are the paper's (64 prompts x 8 rollouts, 500 steps)."""

from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from megatron_mimesis.rl.config import RLConfig
from megatron_mimesis.training.config import AT_LEAST_1, ConfigError, Range
from megatron_mimesis.training.endpoints import Endpoint

COUNTERPARTS = ("openai", "scripted")


@dataclass
class SimulatorRLConfig(RLConfig):
    stage: str = "rl_simulator"
    train_iters: int = 500
    log_dir: str = "runs/rl-simulator"
    # prompts and rewards
    prompts: list[str] = field(default_factory=list)  # JSONL files of megatron_mimesis.rl.simulator.prompts records
    domain_rewards: dict = field(default_factory=dict)  # domain -> registered reward name
    reward_options: dict = field(default_factory=dict)  # reward name -> its factory's options (e.g. the judge)
    domain_weights: dict | None = None  # domain -> sampling weight (default: by prompt count)
    prompts_per_step: int = 64
    max_turns: int = 4
    thinking: bool = True
    counterpart: str = "openai"
    # OpenAICounterpart's keyword arguments, or for "scripted" {"reply": text}: a fixed answer (toy domains, tests)
    counterpart_options: dict = field(default_factory=dict)

    RANGES: ClassVar[dict[str, Range]] = {**RLConfig.RANGES, "prompts_per_step": AT_LEAST_1, "max_turns": AT_LEAST_1}

    @property
    def rollouts_per_step(self) -> int:
        return self.prompts_per_step * self.rollouts_per_prompt

    @property
    def groups_per_step(self) -> int:
        return self.prompts_per_step

    def endpoints(self) -> list[Endpoint]:
        """The counterpart, and each judge a used reward's options name (``reward_options.NAME[.KEY]``)."""
        found = []
        if self.counterpart == "openai" and {"base_url", "model"} <= set(self.counterpart_options):
            found.append(Endpoint.from_options("counterpart_options", self.counterpart_options))
        for name in sorted(set(self.domain_rewards.values())):
            options = self.reward_options.get(name) or {}
            candidates = {f"reward_options.{name}": options, **{f"reward_options.{name}.{key}": value
                                                               for key, value in options.items()}}
            found += [Endpoint.from_options(where, value) for where, value in candidates.items()
                      if isinstance(value, dict) and {"base_url", "model"} <= set(value)]
        return found

    def validate(self, world_size: int) -> None:
        self.validate_rl(world_size)
        if not self.prompts:
            raise ConfigError("prompts: no prompt files given")
        for path in self.prompts:
            if not Path(path).exists():
                raise ConfigError(f"prompts: {path} does not exist")
        if not self.domain_rewards:
            raise ConfigError("domain_rewards: map each prompt domain to a reward name")
        if self.counterpart not in COUNTERPARTS:
            raise ConfigError(f"counterpart must be one of {COUNTERPARTS}, not {self.counterpart!r}")
        if self.counterpart == "scripted" and not isinstance(self.counterpart_options.get("reply"), str):
            raise ConfigError("counterpart=scripted needs counterpart_options {\"reply\": \"...\"}")
        dp = self.data_parallel_size(world_size)
        if self.prompts_per_step % dp:
            raise ConfigError(f"prompts_per_step {self.prompts_per_step} is not divisible by data-parallel size {dp}")
