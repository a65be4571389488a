"""Training configuration: one dataclass, loadable from YAML, overridable with Megatron-style flags.

The paper's hyperparameters live in the stage YAML files under ``launch/configs/``; the defaults here are
those of the embedded CPU demo. ``validate`` runs before any process group starts (and on ``--dry-run``) and raises
:class:`ConfigError` with a one-line reason: every numeric option is range-checked against ``RANGES``, so a
negative ``lr`` or a zero ``log_interval`` never reaches megatron (where it would be an ``AssertionError`` or a
``ZeroDivisionError`` minutes later, after the model is built).
"""

import argparse
import dataclasses
import json
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import yaml

from megatron_mimesis.models.family import Preset
from megatron_mimesis.models.presets import PRESETS, TINY_PRESETS, get_preset
from megatron_mimesis.training.memory.gpus import DEFAULT_GPU, GPU_MEMORY_GIB

if typing.TYPE_CHECKING:
    from megatron_mimesis.models.config import ParallelConfig


class ConfigError(ValueError):
    """A configuration that cannot run; the message is the one-line reason."""


@dataclass(frozen=True)
class Range:
    """The values a numeric option may take: ``low`` <= value (< when ``low_open``), likewise ``high``."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def __contains__(self, value) -> bool:
        above = self.low is None or (value > self.low if self.low_open else value >= self.low)
        below = self.high is None or (value < self.high if self.high_open else value <= self.high)
        return above and below

    def __str__(self) -> str:
        if self.high is None:
            return f"{'greater than' if self.low_open else 'at least'} {self.low:g}"
        return f"in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}{')' if self.high_open else ']'}"


AT_LEAST_1 = Range(1)
NON_NEGATIVE = Range(0)
POSITIVE = Range(0, low_open=True)
FRACTION = Range(0, 1, high_open=True)  # Adam betas: 1 would never forget

MODEL_OVERRIDES = "model_overrides"

# A resumed run continues the schedule its checkpoint was saved in. These options define that schedule: the LR
# curve (megatron's scheduler state is restored from the checkpoint) and the data order (the blended dataset's
# shuffle is built for train_iters x global_batch_size samples from seed). Changing one on resume would silently
# keep the old LR curve and read the samples in another order, so it is refused; a new schedule from the same
# weights is a new stage: --load DIR --finetune.
RESUME_FIXED = ("train_iters", "global_batch_size", "seq_length", "seed", "lr", "min_lr", "lr_warmup_iters",
                "lr_decay_iters", "lr_decay_style")


@dataclass
class TrainConfig:
    # what to train
    stage: str = "midtrain"  # "midtrain" (user-side) or "sft" (thought-supervised); only names the run
    model: str = "tiny"  # preset name (megatron_mimesis.models.presets: its family and sizes)
    # parallel layout (Megatron-LM flag names)
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int | None = None
    context_parallel_size: int = 1
    sequence_parallel: bool = False
    # batch: global_batch_size sequences per step = micro_batch_size x data-parallel size x micro-batches
    seq_length: int = 256
    micro_batch_size: int = 1
    global_batch_size: int = 8
    # optimisation
    train_iters: int = 200
    lr: float = 3e-3
    min_lr: float = 3e-4
    lr_decay_style: str = "cosine"
    lr_warmup_iters: int = 10
    lr_decay_iters: int | None = None  # defaults to train_iters
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    bf16: bool = False
    use_distributed_optimizer: bool = True
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    recompute_granularity: str | None = None  # "selective" or "full"
    recompute_method: str | None = None  # with "full": "uniform" or "block"
    recompute_num_layers: int | None = None
    # data (a data_prep output directory: mixture.json + manifest.json + tokenizer/)
    data_path: str | None = None
    num_workers: int = 1
    eval_interval: int | None = None
    eval_iters: int = 4
    # initialisation and checkpoints
    pretrained_hf: str | None = None  # HF checkpoint directory to start from (of the model preset's architecture)
    load: str | None = None  # megatron checkpoint directory to resume from (its `latest`)
    finetune: bool = False  # with load: take only the weights, start at iteration 0 with a fresh optimizer
    # a model above the tiny presets starts from weights (pretrained_hf or load) unless this says it is meant not to
    from_scratch: bool = False
    save: str | None = None
    save_interval: int | None = None
    ckpt_format: str = "torch_dist"
    # write each checkpoint in a forked writer while training goes on (megatron-core's async save): a step pays only
    # the copy of its state to host memory; off: the step waits for the write
    async_save: bool = True
    keep_last_n: int | None = field(default=None, metadata={"help": (
        "keep only the newest N checkpoints in save: an older one is deleted once a newer one is published and "
        "verified (default: keep every checkpoint)")})
    keep_every: int | None = field(default=None, metadata={"help": (
        "with keep_last_n, also keep every checkpoint whose iteration is a multiple of this (e.g. for evaluation); "
        "a multiple of save_interval")})
    ckpt_write_gb_per_s: float = field(default=1.0, metadata={"help": (
        "the filesystem's sustained write rate per node, in GB/s, that the plan's checkpoint write time and the "
        "SLURM lead times assume (Lustre / GPFS clients sustain 1-5; the low end, for a filesystem the job shares)")})
    # logging
    log_dir: str = "runs/demo"
    log_interval: int = 1
    wandb_project: str | None = None
    progress: bool = field(default=True, metadata={"help": (
        "a progress bar where stderr is a terminal; off, or without a terminal (a SLURM job's slurm-*.out, a "
        "pipeline's stage log), one line every log_interval steps: step of total, loss, tokens/s, MFU, elapsed, ETA")})
    overwrite_save: bool = field(default=False, metadata={"help": (
        "start over in a save directory that already holds checkpoints, from the configured starting weights: the "
        "run's checkpoints replace those of the same iteration and `latest` moves to its own. Off by default: a "
        "save directory holding a checkpoint is resumed (a requeued or rerun job continues its own progress)")})
    # faults: a step with a non-finite loss or gradient is skipped; the run stops (without saving: the last checkpoint
    # stays the one to resume from) at the max_consecutive_skipped_iters-th skip in a row (a divergence), or at the
    # max_skipped_iters-th of the run (isolated skips that keep coming)
    max_consecutive_skipped_iters: int = 10
    max_skipped_iters: int = 100
    seed: int = 1234
    exit_signal_handler: bool = True  # SIGTERM / SIGUSR1: save a checkpoint, then exit for requeue
    exit_interval: int | None = None  # save and exit after an iteration divisible by this (scheduled stops)
    # how long a collective waits for a peer before it fails the job, for every process group: the world, megatron's
    # and the colocated vLLM's (Megatron-LM's --distributed-timeout-minutes); a wait in it outlasts nothing slower
    # than the slowest rank's work between two collectives
    distributed_timeout_minutes: int = 10
    # size overrides of the preset (the demo sets vocab_size from its tokenizer)
    model_overrides: dict = field(default_factory=dict)
    mtp_loss_scaling_factor: float = field(default=0.0, metadata={"help": (
        "for a model with a multi-token-prediction head (Qwen3.5's): 0 keeps the head frozen, saved and exported as "
        "the model was imported with; above 0 trains it with megatron's MTP loss at this weight (Megatron-LM's "
        "default is 0.1), so that the head the serving engine drafts with follows the trained model (docs/checkpoint_keys.md)")})
    # the memory plan that --dry-run prints and the launcher checks before any rank starts (training/memory/)
    gpu: str = field(default=DEFAULT_GPU, metadata={"help": (
        f"the GPU each rank runs on, whose memory the plan must fit: one of {sorted(GPU_MEMORY_GIB)}")})
    gpu_memory_gib: float | None = field(default=None, metadata={"help": (
        "the GPU's memory in GiB (what torch.cuda reports as total_memory), for a card not in that list; overrides "
        "the listed figure")})

    # every numeric option and its allowed values (tests/training/test_validation.py checks none is missing)
    RANGES: ClassVar[dict[str, Range]] = {
        "tensor_model_parallel_size": AT_LEAST_1, "pipeline_model_parallel_size": AT_LEAST_1,
        "virtual_pipeline_model_parallel_size": AT_LEAST_1, "context_parallel_size": AT_LEAST_1,
        "seq_length": AT_LEAST_1, "micro_batch_size": AT_LEAST_1, "global_batch_size": AT_LEAST_1,
        "train_iters": AT_LEAST_1, "lr": POSITIVE, "min_lr": NON_NEGATIVE, "lr_warmup_iters": NON_NEGATIVE,
        "lr_decay_iters": AT_LEAST_1, "weight_decay": NON_NEGATIVE, "adam_beta1": FRACTION, "adam_beta2": FRACTION,
        "adam_eps": POSITIVE, "clip_grad": NON_NEGATIVE, "recompute_num_layers": AT_LEAST_1,
        "num_workers": NON_NEGATIVE, "eval_interval": AT_LEAST_1, "eval_iters": AT_LEAST_1,
        "save_interval": AT_LEAST_1, "log_interval": AT_LEAST_1, "max_skipped_iters": AT_LEAST_1,
        "seed": NON_NEGATIVE, "exit_interval": AT_LEAST_1, "gpu_memory_gib": POSITIVE, "keep_last_n": AT_LEAST_1,
        "keep_every": AT_LEAST_1, "ckpt_write_gb_per_s": POSITIVE,
        "max_consecutive_skipped_iters": AT_LEAST_1, "distributed_timeout_minutes": AT_LEAST_1,
        "mtp_loss_scaling_factor": NON_NEGATIVE,
        # the preset's sizes, as model_overrides may set them (checked on the resolved preset, where its family has them)
        **{f"{MODEL_OVERRIDES}.{name}": AT_LEAST_1 for name in (
            "vocab_size", "hidden_size", "ffn_hidden_size", "num_layers", "num_attention_heads", "num_query_groups",
            "head_dim", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
            "linear_value_head_dim", "linear_conv_kernel_dim", "max_position_embeddings")},
        f"{MODEL_OVERRIDES}.rotary_base": POSITIVE, f"{MODEL_OVERRIDES}.rotary_percent": Range(0, 1, low_open=True),
        f"{MODEL_OVERRIDES}.rms_norm_eps": POSITIVE, f"{MODEL_OVERRIDES}.mtp_num_layers": NON_NEGATIVE,
    }

    # ------------------------------------------------------------------
    @property
    def preset(self) -> Preset:
        return get_preset(self.model).replace(**self.model_overrides)

    @property
    def parallel(self) -> "ParallelConfig":
        # megatron-core is imported only once a config is used: the entry points hide its CPU notices first
        from megatron_mimesis.models.config import ParallelConfig

        return ParallelConfig(
            tensor_model_parallel_size=self.tensor_model_parallel_size,
            pipeline_model_parallel_size=self.pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size=self.virtual_pipeline_model_parallel_size,
            context_parallel_size=self.context_parallel_size,
            sequence_parallel=self.sequence_parallel,
        )

    def model_parallel_size(self) -> int:
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.context_parallel_size

    def data_parallel_size(self, world_size: int) -> int:
        return world_size // self.model_parallel_size()

    def num_microbatches(self, world_size: int) -> int:
        return self.global_batch_size // (self.micro_batch_size * self.data_parallel_size(world_size))

    def validate(self, world_size: int) -> None:
        """Every check that needs no process group; raises ConfigError with a one-line reason."""
        self.validate_model_and_optimizer(world_size)
        if self.data_path is None:
            raise ConfigError("data_path: no dataset given (a data_prep output directory)")
        if not Path(self.data_path).exists():
            raise ConfigError(f"data_path: {self.data_path} does not exist")

    def check_ranges(self) -> None:
        """Each numeric option, and each size of the preset ``model_overrides`` may change, is a finite number of its
        field's type inside its ``RANGES`` entry (None where allowed)."""
        base = get_preset(self.model) if self.model in PRESETS else None
        if base is not None:
            unknown = sorted(set(self.model_overrides) - {f.name for f in dataclasses.fields(base)} - {"name"})
            if unknown:
                raise ConfigError(f"{MODEL_OVERRIDES}: unknown {base.family.title} preset field(s) {unknown}")
        hints = typing.get_type_hints(type(self))
        preset = base.replace(**self.model_overrides) if base is not None else None
        for name, allowed in self.RANGES.items():
            if name.startswith(f"{MODEL_OVERRIDES}."):
                field_name = name.split(".", 1)[1]
                if preset is None or not hasattr(preset, field_name):
                    continue
                hint, value = typing.get_type_hints(type(preset))[field_name], getattr(preset, field_name)
            else:
                hint, value = hints[name], getattr(self, name)
            if value is None and type(None) in typing.get_args(hint):
                continue
            kind = _flag_type(hint)
            if isinstance(value, bool) or not isinstance(value, int if kind is int else int | float):
                expected = "an integer" if kind is int else "a number"
                raise ConfigError(f"{name}: expected {expected}, got {value!r} ({type(value).__name__})")
            if not math.isfinite(value):
                raise ConfigError(f"{name} must be a finite number, got {value:g}")
            if value not in allowed:
                raise ConfigError(f"{name} must be {allowed}, got {value:g}")

    def validate_model_and_optimizer(self, world_size: int) -> None:
        """The checks every stage shares (the RL stages add their own on top)."""
        self.validate_without_files(world_size)
        if not (self.pretrained_hf or self.load or self.from_scratch or self.model in TINY_PRESETS):
            # checked here, not in validate_without_files: a memory plan of the config needs no weights
            raise ConfigError(f"pretrained_hf: the {self.model} model would train from random weights; give "
                              f"pretrained_hf (or load), or set from_scratch: true if that is the intent")
        if self.pretrained_hf is not None:
            self._check_pretrained_hf()
        if self.load:
            self._check_resume()

    def _check_pretrained_hf(self) -> None:
        """The HF checkpoint's own config (its family by ``model_type``) must be the model the run builds."""
        from megatron_mimesis.models.presets import architecture_differences, preset_from_hf_dir

        if not Path(self.pretrained_hf).exists():
            raise ConfigError(f"pretrained_hf: {self.pretrained_hf} does not exist")
        try:
            found = preset_from_hf_dir(self.pretrained_hf)
        except (FileNotFoundError, ValueError) as exc:
            raise ConfigError(f"pretrained_hf: {exc}") from None
        diff = architecture_differences(self.preset, found)
        if diff:
            raise ConfigError(f"pretrained_hf: {self.pretrained_hf} is not the model {self.model!r} (model vs "
                              f"checkpoint: {'; '.join(diff)}); set model to its preset (model_overrides for sizes)")

    def validate_without_files(self, world_size: int) -> None:
        """Every shared check that reads no file (model, layout, batch, schedule, options): what a memory plan of
        the config needs on a machine that has none of the run's data or checkpoints."""
        self.check_ranges()
        if self.min_lr > self.lr:
            raise ConfigError(f"min_lr {self.min_lr:g} is above lr {self.lr:g} (the schedule decays from lr to min_lr)")
        if self.model not in PRESETS:
            raise ConfigError(f"model: unknown preset {self.model!r}; choose one of {sorted(PRESETS)}")
        from megatron_mimesis.compat.fla_guard import refuse_known_miscompiles
        from megatron_mimesis.models.config import validate_layout

        try:
            preset = self.preset
            validate_layout(preset, self.parallel)
            refuse_known_miscompiles()
        except (ValueError, TypeError) as exc:
            raise ConfigError(str(exc)) from None
        if self.context_parallel_size > 1:
            from megatron_mimesis.models.layer_specs import select_backend

            if select_backend() != "te":
                raise ConfigError("context_parallel_size > 1 needs Transformer Engine attention (a GPU with [gpu])")
        if self.mtp_loss_scaling_factor and not getattr(preset, "mtp_num_layers", 0):
            raise ConfigError(f"mtp_loss_scaling_factor: the model {self.model!r} has no multi-token-prediction head "
                              f"(mtp_num_layers 0) to train; leave it 0")
        mp = self.model_parallel_size()
        if world_size % mp:
            raise ConfigError(f"world size {world_size} is not a multiple of TP*PP*CP = {mp}")
        dp = self.data_parallel_size(world_size)
        if self.global_batch_size % (self.micro_batch_size * dp):
            raise ConfigError(
                f"global_batch_size {self.global_batch_size} is not divisible by micro_batch_size "
                f"{self.micro_batch_size} x data-parallel size {dp}"
            )
        if self.virtual_pipeline_model_parallel_size and self.num_microbatches(world_size) % self.pipeline_model_parallel_size:
            raise ConfigError("interleaved pipelining needs micro-batches per step divisible by pipeline_model_parallel_size")
        if self.sequence_parallel and self.seq_length * self.micro_batch_size % self.tensor_model_parallel_size:
            raise ConfigError("sequence_parallel needs seq_length x micro_batch_size divisible by TP")
        if self.seq_length > preset.max_position_embeddings:
            raise ConfigError(f"seq_length {self.seq_length} exceeds max_position_embeddings {preset.max_position_embeddings}")
        if self.lr_decay_style not in ("cosine", "linear", "constant"):
            raise ConfigError(f"lr_decay_style must be cosine, linear or constant, not {self.lr_decay_style!r}")
        if self.lr_warmup_iters >= (self.lr_decay_iters or self.train_iters):
            raise ConfigError("lr_warmup_iters must be fewer than the decay iterations (lr_decay_iters or train_iters)")
        if self.recompute_granularity not in (None, "selective", "full"):
            raise ConfigError(f"recompute_granularity must be selective or full, not {self.recompute_granularity!r}")
        if self.recompute_granularity == "full" and self.recompute_method not in ("uniform", "block"):
            raise ConfigError("recompute_granularity=full needs recompute_method uniform or block")
        if self.ckpt_format != "torch_dist":
            raise ConfigError(f"ckpt_format must be torch_dist, not {self.ckpt_format!r}")
        if self.save_interval and not self.save:
            raise ConfigError("save_interval is set but save (the checkpoint directory) is not")
        if self.keep_last_n and not self.save:
            raise ConfigError("keep_last_n is set but save (the checkpoint directory) is not")
        if self.keep_every and not self.keep_last_n:
            raise ConfigError("keep_every keeps checkpoints that keep_last_n would delete: set keep_last_n too (without "
                              "it every checkpoint is kept)")
        if self.keep_every and (not self.save_interval or self.keep_every % self.save_interval):
            raise ConfigError(f"keep_every {self.keep_every} is not a multiple of save_interval {self.save_interval}: "
                              f"no periodic checkpoint would be kept by it")
        if self.gpu not in GPU_MEMORY_GIB and self.gpu_memory_gib is None:
            raise ConfigError(f"gpu: unknown GPU {self.gpu!r}; choose one of {sorted(GPU_MEMORY_GIB)} or give its "
                              f"memory with gpu_memory_gib")
        if self.finetune and not self.load:
            raise ConfigError("finetune needs load (the checkpoint whose weights to start from)")
        if self.pretrained_hf and self.load:
            raise ConfigError("give either pretrained_hf (start from HF weights) or load (resume), not both")

    def endpoints(self) -> list:
        """The HTTP endpoints the run calls (``training/endpoints.py``): none for mid-training and SFT."""
        return []

    def resolve_start(self) -> tuple["TrainConfig", str | None]:
        """Where the run starts, by one rule for every stage: a save directory holding a checkpoint resumes from it,
        whatever the config says about starting weights (``pretrained_hf``, ``load`` with ``finetune``), since the
        run that wrote it is this run, requeued or rerun; ``overwrite_save`` starts over instead. Decided before any
        process group starts (the launcher's check and every rank decide alike); returns the config to run and, on
        such a resume, the one line that says so."""
        from megatron_mimesis.checkpoint.reader import LATEST, CheckpointError, read_latest

        if not self.save or self.overwrite_save or not (Path(self.save) / LATEST).exists():
            return self, None
        try:
            iteration = read_latest(self.save)
        except CheckpointError as exc:
            raise ConfigError(f"save: {exc}") from None
        configured = [f"pretrained_hf {self.pretrained_hf}"] if self.pretrained_hf else []
        if self.load and (self.finetune or Path(self.load) != Path(self.save)):
            configured.append(f"{'the weights of ' if self.finetune else ''}{self.load}")
        line = f"resuming from {self.save} (iteration {iteration})"
        if configured:
            line += (f", not from {' and '.join(configured)} as configured: a save directory holding a checkpoint is "
                     f"resumed (--overwrite-save starts over)")
        return self.replace(load=self.save, finetune=False, pretrained_hf=None), line

    def _check_resume(self) -> None:
        """``load`` points at a checkpoint; a full resume must keep the schedule it was saved in (``RESUME_FIXED``)."""
        from megatron_mimesis.checkpoint.reader import RUN_CONFIG, CheckpointError, newest_complete

        try:
            path, _ = newest_complete(self.load)
        except CheckpointError as exc:
            raise ConfigError(f"load: {exc}") from None
        if self.finetune or not (path / RUN_CONFIG).is_file():
            return  # weights only; or not this project's checkpoint, which loading reports
        saved = json.loads((path / RUN_CONFIG).read_text()).get("train", {})
        changed = [f"{name} {saved[name]!r} -> {getattr(self, name)!r}" for name in RESUME_FIXED
                   if name in saved and saved[name] != getattr(self, name)]
        if changed and self.save and Path(self.load) == Path(self.save):
            raise ConfigError(
                f"save: {path} was saved by a run with other schedule options ({'; '.join(changed)}): a run resumes "
                f"its save directory with the checkpoint's LR schedule and data order, so resume with its values, "
                f"save elsewhere, or pass --overwrite-save to start over in it"
            )
        if changed:
            raise ConfigError(
                f"load: {path} was saved by a run with other schedule options ({'; '.join(changed)}): a resume "
                f"keeps the checkpoint's LR schedule and data order, so resume with its values, or start a new "
                f"schedule from its weights with --finetune"
            )
        if self.mtp_loss_scaling_factor and not saved.get("mtp_loss_scaling_factor", 0):
            raise ConfigError(
                f"load: {path} was saved with the MTP head frozen (mtp_loss_scaling_factor 0), so it holds no "
                f"optimizer state for the head a resume would train; start training the head from its weights with "
                f"--finetune, or resume with mtp_loss_scaling_factor 0"
            )

    def planned_saves(self) -> list[int]:
        """The iterations a run of this config (with ``save``) saves at when nothing stops it early: every
        ``save_interval``, and the end."""
        periodic = list(range(self.save_interval, self.train_iters + 1, self.save_interval)) if self.save_interval else []
        return periodic if periodic and periodic[-1] == self.train_iters else [*periodic, self.train_iters]

    # ------------------------------------------------------------------
    @classmethod
    def from_yaml(cls, path: str | Path) -> "TrainConfig":
        data = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a mapping of option: value")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"{path}: unknown option(s) {unknown}")
        return cls(**data)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def replace(self, **changes) -> "TrainConfig":
        return dataclasses.replace(self, **changes)


def _flag_type(annotation):
    """argparse type for a field annotation (``int | None`` -> int, ``list[str]`` -> list)."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        annotation = args[0]
    return typing.get_origin(annotation) or annotation


def build_arg_parser(config_cls=TrainConfig, prog: str = "python -m megatron_mimesis.training.train",
                     description: str = "User-side mid-training / thought-supervised SFT on megatron-core."
                     ) -> argparse.ArgumentParser:
    """``--config FILE`` plus one Megatron-style flag per field (``--tensor-model-parallel-size 2``)."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--config", help="YAML file of options; flags given here override it")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the memory plan per GPU and the resolved config and exit; a layout that does not "
                             "fit the GPU exits 2 with what to change (the launchers run this before any rank)")
    parser.add_argument("--check-save-dir", action="store_true",
                        help="with --dry-run: also refuse (exit 2) a save directory without room for the checkpoints "
                             "the run keeps, from the plan's checkpoint size (the launchers' pre-check; the ranks "
                             "then skip it)")
    parser.add_argument("--check-endpoints", action="store_true",
                        help="with --dry-run: also ask every endpoint the run will call (an RL stage's user model, "
                             "coach, judge, counterpart) and refuse (exit 2) one that does not answer or does not "
                             "serve its model (the launchers' pre-check; rank 0 asks again as the run starts)")
    parser.add_argument("--check-shutdown-timeout", type=int, metavar="S",
                        help="with --dry-run: also refuse (exit 2) a job whose ranks get S seconds to stop and save "
                             "(its SHUTDOWN_TIMEOUT) when the run needs more (training/lead_times.py; the launchers' "
                             "pre-check under SLURM)")
    hints = typing.get_type_hints(config_cls)
    for f in dataclasses.fields(config_cls):
        flag = "--" + f.name.replace("_", "-")
        kind = _flag_type(hints[f.name])
        help_text = f.metadata.get("help")
        if kind is bool:
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        elif kind in (dict, list):
            parser.add_argument(flag, dest=f.name, type=json.loads, default=None,
                                help=help_text or f"JSON {kind.__name__}")
        else:
            parser.add_argument(flag, dest=f.name, type=kind, default=None, help=help_text)
    return parser


def parse_config(argv: list[str] | None = None, config_cls=TrainConfig, **parser_kwargs):
    args = build_arg_parser(config_cls, **parser_kwargs).parse_args(argv)
    config = config_cls.from_yaml(args.config) if args.config else config_cls()
    overrides = {f.name: getattr(args, f.name) for f in dataclasses.fields(config_cls)
                 if getattr(args, f.name) is not None}
    # an empty value unsets an optional field the YAML sets (--pretrained-hf '' where the run starts from --load)
    hints = typing.get_type_hints(config_cls)
    overrides.update({name: None for name, value in overrides.items()
                      if value == "" and type(None) in typing.get_args(hints[name])})
    if "model_overrides" in overrides:
        overrides["model_overrides"] = {**config.model_overrides, **overrides["model_overrides"]}
    return config.replace(**overrides), args
