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

from megatron_mimesis.kernels.reference import ROLLOUT_CORRECTION_LEVELS, ROLLOUT_CORRECTIONS
from megatron_mimesis.models.presets import TINY_PRESETS
from megatron_mimesis.training.config import AT_LEAST_1, NON_NEGATIVE, POSITIVE, ConfigError, Range, TrainConfig

ENGINES = ("local", "vllm", "served")
OFF_POLICY_LOSSES = ("decoupled", "behaviour")
DELTANET_STATE_DTYPES = ("float32", "bfloat16")


@dataclass
class RLConfig(TrainConfig):
    lr: float = 1e-6
    min_lr: float = 1e-6
    lr_warmup_iters: int = 0
    lr_decay_style: str = "constant"
    # the policy's tokenizer (an HF directory); its special tokens drive the chat template. Unset with `load`: the
    # tokenizer saved with that checkpoint (its latest iteration), so a config names no iteration
    tokenizer: str | None = None
    # rollouts: "local" decodes with the training model itself (CPU, tests); "vllm" runs vLLM colocated in the
    # training processes, asleep while the trainer steps, its weights synced after every update; "served" sends them
    # to a vLLM server of the policy on devices of its own (a split layout), its weights updated through a shared
    # directory after every update (rl/engines/served.py)
    engine: str = "local"
    # vllm: vLLM engine keyword arguments (rl/engines/vllm.py); served: base_url, model, weights_dir (served.OPTIONS)
    engine_options: dict = field(default_factory=dict)
    generation_timeout_s: float | None = None  # a generate call running longer is a hard error, not a hang
    # the vLLM engine's Gated DeltaNet recurrent state (its mamba_ssm_cache_dtype), for a family with one (Qwen3.5):
    # float32 as the trainer keeps it and the released configs ask. bfloat16 halves the state cache and its decode traffic, at the cost of a
    # state rounded to bf16 at every decoded token; tools/bench/bench_mismatch.py prints both sizes for a preset and
    # measures the mismatch each gives
    engine_deltanet_state_dtype: str = "float32"
    # Asynchronous RL (rl/rollout_worker.py). None: the synchronous loop, the engine asleep while the trainer steps.
    # An integer: a worker thread plays the next steps on the engine's own copy of the policy while the trainer
    # trains, at most this many policy versions (updates) ahead of the weights that train on its rows; 0 takes turns
    # with the trainer and equals the synchronous loop bit for bit. Typical bounds are 1-4 (AReaL's eta <= 4
    # lost no accuracy; prime-rl's default is 8).
    max_staleness: int | None = None
    # The loss on rows sampled by other weights than the trainer's (vLLM's numerics, an older version): "decoupled"
    # (AReaL's decoupled PPO, the default) clips the ratio to the trainer's own policy before the update (the old
    # log-probs recomputed) and weighs every token by the rollout correction of that policy against the sampler's,
    # which covers the engine's numerics and the staleness alike; "behaviour" (veRL's bypass mode,
    # use_rollout_log_probs) takes the sampler's log-probs as the old ones: the clip bounds the update against the
    # policy that sampled, with no recompute pass and no correction weights
    off_policy_loss: str = "decoupled"
    rollouts_per_prompt: int = 8  # the GRPO group size
    max_new_tokens: int = 512
    temperature: float = 1.0
    top_p: float = 1.0
    # the update
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    dual_clip_c: float | None = None
    max_tokens_per_microbatch: int = 32768
    # optimizer steps per rollout batch: the batch is cut by group into that many mini-batches (PPO's), each an
    # optimizer step against the rollouts' old log-probs, so that from the second on the clip acts. 1 (the default)
    # makes a batch one on-policy step; the paper's agent scripts take 8 (mini-batches of 8 of 64 tasks)
    optimizer_steps_per_batch: int = 1
    min_valid_rollouts: int = 2  # a group with fewer scored rollouts contributes no gradient (counted)
    # KL to a frozen reference model (off, as in the paper): kl_coef * k3 KL(policy || reference) per token;
    # kl_reference is its weights, an HF directory or a dist checkpoint directory (weights only are read)
    kl_coef: float = 0.0
    kl_reference: str | None = None
    # Rollout correction, when another engine (vLLM) sampled the rows: every sampled token's loss is weighed by
    # rho = pi_trainer / pi_engine of that token (kernels/reference.py, rollout_correction_weights). "tis" truncates
    # rho at the cap, "mis" masks tokens with rho outside [1/cap, cap], "off" only logs the statistics; the level
    # is the token or the row (geometric mean over its tokens). With the local engine rho is 1 and nothing runs.
    # Default: token-level TIS with cap 2 (slime's default, veRL's token-IS preset). At the paper's scale (9B,
    # rollouts of thousands of tokens over several turns) it keeps every token, so no group loses its signal to a
    # mask, and bounds every weight by 2; token level because a recurrent state's drift concentrates on the tokens
    # where it diverged, which a row's geometric mean over thousands of tokens would average back to 1.
    rollout_correction: str = "tis"
    rollout_correction_level: str = "token"
    rollout_correction_cap: float = 2.0
    # a warning line when more than this share of a step's sampled tokens is truncated (tis) or masked (mis):
    # numerics alone (bf16 kernels) leave every ratio within a few percent of 1; a broken sync moves most of them
    rollout_correction_warn_frac: float = 0.01

    RANGES: ClassVar[dict[str, Range]] = {
        **TrainConfig.RANGES,
        "generation_timeout_s": POSITIVE,
        "max_staleness": NON_NEGATIVE,
        "rollouts_per_prompt": Range(2),  # group statistics need two rollouts
        "max_new_tokens": AT_LEAST_1,
        "temperature": NON_NEGATIVE,  # 0: greedy
        "top_p": Range(0, 1, low_open=True),
        "clip_eps_low": Range(0, 1, high_open=True),  # the ratio's lower clip 1 - eps_low stays positive
        "clip_eps_high": NON_NEGATIVE,
        "dual_clip_c": Range(1, low_open=True),
        "max_tokens_per_microbatch": AT_LEAST_1,
        "optimizer_steps_per_batch": AT_LEAST_1,
        "min_valid_rollouts": Range(2),
        "kl_coef": NON_NEGATIVE,
        "rollout_correction_cap": Range(1, low_open=True),  # the band [1/cap, cap] must contain 1
        "rollout_correction_warn_frac": Range(0, 1),
    }

    def resolve_start(self) -> tuple["RLConfig", str | None]:
        """The trainer's start, and an unset tokenizer read from the checkpoint the run loads (on a resume its own,
        which carries the same tokenizer files)."""
        config, line = super().resolve_start()
        if config.tokenizer is None and config.load:
            from megatron_mimesis.checkpoint.reader import TOKENIZER_SUBDIR, CheckpointError, resolve_checkpoint_dir

            try:
                saved = resolve_checkpoint_dir(config.load) / TOKENIZER_SUBDIR
            except CheckpointError as exc:
                raise ConfigError(f"load: {exc}") from None
            if not (saved / "tokenizer.json").is_file():
                raise ConfigError(f"tokenizer: not given, and {saved} (the one saved with the checkpoint load names) "
                                  f"is not an HF tokenizer directory")
            config = config.replace(tokenizer=str(saved))
        return config, line

    def validate_rl(self, world_size: int) -> None:
        self.validate_model_and_optimizer(world_size)
        if self.groups_per_step % self.optimizer_steps_per_batch:
            raise ConfigError(f"optimizer_steps_per_batch {self.optimizer_steps_per_batch} does not divide the "
                              f"{self.groups_per_step} groups of a step: its mini-batches split the batch by group")
        if not self.tokenizer or not (Path(self.tokenizer) / "tokenizer.json").exists():
            raise ConfigError(f"tokenizer: {self.tokenizer!r} is not an HF tokenizer directory (tokenizer.json)")
        if self.kl_coef and not (self.kl_reference and Path(self.kl_reference).exists()):
            raise ConfigError(f"kl_coef > 0 needs kl_reference: an HF or dist checkpoint directory, not "
                              f"{self.kl_reference!r}")

    def validate_without_files(self, world_size: int) -> None:
        super().validate_without_files(world_size)
        if self.mtp_loss_scaling_factor:
            raise ConfigError("mtp_loss_scaling_factor: the RL stages keep the multi-token-prediction head frozen as "
                              "loaded (its loss is a language-model loss on given text, not a policy's); leave it 0")
        if self.generation_timeout_s is not None and self.generation_timeout_s >= self.distributed_timeout_minutes * 60:
            raise ConfigError(
                f"generation_timeout_s {self.generation_timeout_s:g} is not below distributed_timeout_minutes "
                f"{self.distributed_timeout_minutes} x 60: data-parallel replicas wait in a collective for each other's "
                f"rollouts, so a generate call running to its limit would fail the job as a collective timeout on "
                f"the other ranks first; raise distributed_timeout_minutes")
        if self.engine not in ENGINES:
            raise ConfigError(f"engine must be one of {ENGINES}, not {self.engine!r}")
        if self.engine == "local" and self.model not in TINY_PRESETS:
            raise ConfigError(f"engine=local decodes with the training model itself, with no KV cache and full "
                              f"[tokens, vocab] logits per decoded token: the tiny presets' CPU engine "
                              f"{TINY_PRESETS}, not one for {self.model!r}; use engine=vllm")
        if self.engine == "served":
            from megatron_mimesis.rl.engines.served import OPTIONS, REQUIRED

            missing = [name for name in REQUIRED if not self.engine_options.get(name)]
            unknown = sorted(set(self.engine_options) - set(OPTIONS))
            if missing or unknown:
                raise ConfigError(f"engine_options of engine=served: {'missing ' + str(missing) if missing else ''}"
                                  f"{'; ' if missing and unknown else ''}{'unknown ' + str(unknown) if unknown else ''}"
                                  f" (it takes {', '.join(f'{k}: {v}' for k, v in OPTIONS.items())})")
        if self.max_staleness is not None:
            if self.engine == "vllm":
                raise ConfigError("max_staleness: the rollout worker needs an engine of its own beside the trainer: "
                                  "engine=local (its own copy of the policy) or engine=served (a vLLM server on other "
                                  "devices); the colocated vLLM engine shares the trainer's devices and processes")
            if self.engine == "local" and self.tensor_model_parallel_size * self.pipeline_model_parallel_size > 1:
                raise ConfigError(
                    f"max_staleness with engine=local: the worker's copy of the policy would run its tensor- and "
                    f"pipeline-parallel collectives on the trainer's process groups from another thread; it runs "
                    f"at tensor and pipeline parallel size 1, not {self.tensor_model_parallel_size} x "
                    f"{self.pipeline_model_parallel_size} (engine=served takes any layout)")
        for name, allowed in (("engine_deltanet_state_dtype", DELTANET_STATE_DTYPES),
                              ("off_policy_loss", OFF_POLICY_LOSSES),
                              ("rollout_correction", ROLLOUT_CORRECTIONS),
                              ("rollout_correction_level", ROLLOUT_CORRECTION_LEVELS)):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"{name} must be one of {allowed}, not {getattr(self, name)!r}")
        if self.engine == "vllm":
            from megatron_mimesis.rl.engines.vllm import check_vllm_config

            check_vllm_config(self)
