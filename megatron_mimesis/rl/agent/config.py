"""Agent-RL configuration (GRPO + CSD against the frozen user simulator): the shared RL options plus the
environment, the user model, returns and the coach. Defaults are the paper's stage II (group 8, gamma 0.8,
100 steps, CSD alpha 0.01, beta 5.0)."""

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from megatron_mimesis.models.presets import TINY_PRESETS
from megatron_mimesis.rl.config import RLConfig
from megatron_mimesis.rl.envs import ENVS
from megatron_mimesis.training.config import AT_LEAST_1, NON_NEGATIVE, ConfigError, Range
from megatron_mimesis.training.endpoints import Endpoint

# "scripted": the toy env's scripted user; "local": a frozen megatron copy of the simulator in the training
# processes (it must share the agent's architecture and tokenizer; otherwise serve it and use "openai")
USER_MODELS = ("openai", "scripted", "local")
LOCAL_USER_OPTIONS = {"load", "thinking", "max_new_tokens", "temperature"}
USER_ENDPOINT_OPTIONS = {"base_url", "model", "api_key"}  # what an env that owns its user takes of user_model_options
COACHES = ("none", "openai", "policy", "scripted")  # "policy": the agent's own engine writes the notes
# "foldgrpo": each turn's reward-to-go against its group's statistics of G_0 (kernels.foldgrpo_advantages);
# "turn_credit": UserRL's multi-turn credit, the group z-score of G_0 spread over the turns by their reward-to-go
# (kernels.turn_credit_advantages), as the paper's agent scripts train
ADVANTAGES = ("foldgrpo", "turn_credit")


@dataclass
class AgentRLConfig(RLConfig):
    stage: str = "rl_agent"
    train_iters: int = 100
    log_dir: str = "runs/rl-agent"
    # the environment: "tau2" takes {"domain": "retail" | "airline" | "telecom" | "mock", ...}
    env: str = "tau2"
    env_options: dict = field(default_factory=dict)
    train_split: str = "train"
    tasks_per_step: int = 16
    max_agent_turns: int = 30  # agent generations per episode, tool calls included
    thinking: bool = True  # the agent's own thinking (its family's thinking template: enable_thinking)
    gamma: float = 0.8  # reward-to-go discount over agent turns
    advantage: str = "foldgrpo"
    # the frozen user simulator. openai: OpenAIUserModel keyword arguments (e.g. a `vllm serve` of the simulator);
    # local: {"load": HF or dist checkpoint directory, "thinking", "max_new_tokens", "temperature"}; it ends with
    # the trained end marker (data_prep.render.END_MARKER). For an env that owns its user (userrl), openai's
    # base_url and model are the endpoint its gyms call, through the run's per-episode proxy
    user_model: str = "openai"
    user_model_options: dict = field(default_factory=dict)
    # CSD
    coach: str = "openai"
    coach_options: dict = field(default_factory=dict)  # OpenAICoach keyword arguments; scripted: {"note": text}
    coach_max_new_tokens: int = 256  # "policy" coach
    csd_alpha: float = 0.01
    csd_beta: float = 5.0
    csd_placebo: bool = False  # teacher(note) - teacher(placebo note) + student, removing the note's generic shift
    placebo_note: str = "Keep helping the user."
    csd_log_samples: int = 4  # coach notes (with thoughts and teacher context) written to csd_samples.jsonl per step
    # a step whose coach failed more of its notes than this stops the run: CSD is never silently off
    max_coach_failure_fraction: float = 0.5

    RANGES: ClassVar[dict[str, Range]] = {
        **RLConfig.RANGES, "tasks_per_step": AT_LEAST_1, "max_agent_turns": AT_LEAST_1, "gamma": Range(0, 1),
        "coach_max_new_tokens": AT_LEAST_1, "csd_alpha": NON_NEGATIVE, "csd_beta": NON_NEGATIVE,
        "csd_log_samples": NON_NEGATIVE, "max_coach_failure_fraction": Range(0, 1),
    }

    @property
    def rollouts_per_step(self) -> int:
        return self.tasks_per_step * self.rollouts_per_prompt

    @property
    def groups_per_step(self) -> int:
        return self.tasks_per_step

    def endpoints(self) -> list[Endpoint]:
        named = (("user_model_options", self.user_model, self.user_model_options),
                 ("coach_options", self.coach, self.coach_options))
        return [Endpoint.from_options(where, options) for where, kind, options in named
                if kind == "openai" and {"base_url", "model"} <= set(options)]

    def validate_without_files(self, world_size: int) -> None:
        super().validate_without_files(world_size)
        if self.user_model == "local" and self.model not in TINY_PRESETS:
            raise ConfigError(f"user_model=local decodes the simulator with the local engine (no KV cache, full "
                              f"[tokens, vocab] logits per token): tiny presets only {TINY_PRESETS}, not "
                              f"{self.model!r}; serve the simulator (vllm serve) and use user_model=openai")
        model_parallel = self.tensor_model_parallel_size * self.pipeline_model_parallel_size > 1
        if self.max_staleness is not None and model_parallel:
            for name, value, why in (("user_model", "local", "samples the simulator with the trainer's process "
                                      "groups from the rollout worker's thread"),
                                     ("coach", "policy", "samples the notes from the rollout engine on the "
                                      "trainer's thread while the worker samples from it")):
                if getattr(self, name) == value:
                    raise ConfigError(f"{name}={value} with max_staleness at model-parallel size > 1: it {why}; "
                                      f"serve it (openai) or keep max_staleness unset")

    def _check_local_user_model(self, load: str) -> None:
        """A local user model runs in the agent's processes with the agent's architecture, layout and tokenizer:
        a simulator of another family, or with another tokenizer, is served (user_model=openai) instead."""
        from data_prep.tokenizer import tokenizer_sha256
        from megatron_mimesis.checkpoint.reader import CheckpointError, saved_model
        from megatron_mimesis.models.presets import architecture_differences

        try:
            preset, tokenizer = saved_model(load)
        except (CheckpointError, FileNotFoundError, ValueError) as exc:
            raise ConfigError(f"user_model_options.load: {exc}") from None
        serve = "serve it (vllm serve) and use user_model=openai"
        diff = architecture_differences(self.preset, preset)
        if diff:
            raise ConfigError(f"user_model_options.load: {load} is another model than the agent's (agent vs user "
                              f"model: {'; '.join(diff)}); {serve}")
        if tokenizer is None:
            if os.environ.get("RANK", "0") == "0":
                print(f"warning: user_model_options.load: {load} carries no tokenizer; it is trusted to use the "
                      f"agent's ({self.tokenizer})", file=sys.stderr)
        elif tokenizer_sha256(Path(tokenizer)) != tokenizer_sha256(Path(self.tokenizer)):
            raise ConfigError(f"user_model_options.load: {load} has another tokenizer ({tokenizer}) than the agent's "
                              f"({self.tokenizer}); {serve}")

    def _check_userrl(self) -> None:
        """The gyms load (installed, their data present, the options theirs) and their user is an endpoint."""
        from megatron_mimesis.rl.envs import build_suite
        from megatron_mimesis.rl.envs.userrl import UserRLError

        if self.user_model != "openai":
            raise ConfigError(f"env=userrl: the gyms call their user themselves, an OpenAI-compatible endpoint: "
                              f"user_model must be openai (the served simulator), not {self.user_model!r}")
        extra = sorted(set(self.user_model_options) - USER_ENDPOINT_OPTIONS)
        if extra:
            raise ConfigError(f"user_model_options: {extra} do not apply to env=userrl, whose gyms sample their user "
                              f"themselves (set a gym's own fields in env_options.gyms.NAME.config); only "
                              f"{sorted(USER_ENDPOINT_OPTIONS)}")
        try:
            build_suite(self.env, self.env_options).task_ids(self.train_split)
        except (UserRLError, ImportError, KeyError) as exc:
            raise ConfigError(f"env_options: {exc.args[0] if exc.args else exc}") from None
        except TypeError as exc:
            raise ConfigError(f"env_options do not fit the userrl env: {exc}") from None

    def validate(self, world_size: int) -> None:
        self.validate_rl(world_size)
        if self.env not in ENVS:
            raise ConfigError(f"env must be one of {ENVS}, not {self.env!r}")
        if self.env == "tau2" and "domain" not in self.env_options:
            raise ConfigError("env=tau2 needs env_options {\"domain\": ...}")
        if self.advantage not in ADVANTAGES:
            raise ConfigError(f"advantage must be one of {ADVANTAGES}, not {self.advantage!r}")
        if self.env == "userrl":
            self._check_userrl()
        if self.user_model not in USER_MODELS:
            raise ConfigError(f"user_model must be one of {USER_MODELS}, not {self.user_model!r}")
        if self.user_model == "scripted" and self.env != "toy":
            raise ConfigError("user_model=scripted is the toy env's scripted user; use openai for tau2")
        if self.user_model == "openai" and not {"base_url", "model"} <= set(self.user_model_options):
            raise ConfigError("user_model=openai needs user_model_options with base_url and model")
        if self.user_model == "local":
            unknown = sorted(set(self.user_model_options) - LOCAL_USER_OPTIONS)
            if unknown:
                raise ConfigError(f"user_model_options: {unknown} are not options of user_model=local "
                                  f"{sorted(LOCAL_USER_OPTIONS)}")
            load = self.user_model_options.get("load")
            if not load or not Path(load).exists():
                raise ConfigError(f"user_model=local needs user_model_options.load: a checkpoint directory, not {load!r}")
            self._check_local_user_model(load)
        if self.coach not in COACHES:
            raise ConfigError(f"coach must be one of {COACHES}, not {self.coach!r}")
        if self.coach == "openai" and not {"base_url", "model"} <= set(self.coach_options):
            raise ConfigError("coach=openai needs coach_options with base_url and model")
        if self.coach == "scripted" and not isinstance(self.coach_options.get("note"), str):
            raise ConfigError("coach=scripted needs coach_options {\"note\": \"...\"}")
        if self.coach == "none" and self.csd_alpha:
            raise ConfigError("coach=none trains plain GRPO: set csd_alpha to 0")
        dp = self.data_parallel_size(world_size)
        if self.tasks_per_step % dp:
            raise ConfigError(f"tasks_per_step {self.tasks_per_step} is not divisible by data-parallel size {dp}")
