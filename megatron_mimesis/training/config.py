"""Training configuration: one dataclass, loadable from YAML, overridable with Megatron-style flags.

The paper's hyperparameters live in the stage YAML files under ``launch/configs/``; the defaults here are
those of the embedded CPU demo. ``validate`` runs before any process group starts and raises
:class:`ConfigError` with a one-line reason.
"""

import argparse
import dataclasses
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from megatron_mimesis.compat.fla_guard import refuse_known_miscompiles
from megatron_mimesis.models.config import ParallelConfig, validate_layout
from megatron_mimesis.models.presets import PRESETS, Qwen35Preset, get_preset


class ConfigError(ValueError):
    """A configuration that cannot run; the message is the one-line reason."""


@dataclass
class TrainConfig:
    # what to train
    stage: str = "midtrain"  # "midtrain" (user-side) or "sft" (thought-supervised); only names the run
    model: str = "tiny"  # preset name (megatron_mimesis.models.presets)
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
    pretrained_hf: str | None = None  # HF Qwen3.5 checkpoint directory to start from
    load: str | None = None  # megatron checkpoint directory to resume from (its `latest`)
    finetune: bool = False  # with load: take only the weights, start at iteration 0 with a fresh optimizer
    save: str | None = None
    save_interval: int | None = None
    ckpt_format: str = "torch_dist"
    # logging
    log_dir: str = "runs/demo"
    log_interval: int = 1
    wandb_project: str | None = None
    progress: bool = True
    # faults
    max_skipped_iters: int = 10  # non-finite loss: skip the step, stop after this many
    seed: int = 1234
    exit_signal_handler: bool = True  # SIGTERM / SIGUSR1: save a checkpoint, then exit for requeue
    exit_interval: int | None = None  # save and exit after an iteration divisible by this (scheduled stops)
    # size overrides of the preset (the demo sets vocab_size from its tokenizer)
    model_overrides: dict = field(default_factory=dict)

    # ------------------------------------------------------------------
    @property
    def preset(self) -> Qwen35Preset:
        return get_preset(self.model).replace(**self.model_overrides)

    @property
    def parallel(self) -> ParallelConfig:
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

    def validate_model_and_optimizer(self, world_size: int) -> None:
        """The checks every stage shares (the RL stages add their own on top)."""
        if self.model not in PRESETS:
            raise ConfigError(f"model: unknown preset {self.model!r}; choose one of {sorted(PRESETS)}")
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
        if self.pretrained_hf is not None and not Path(self.pretrained_hf).exists():
            raise ConfigError(f"pretrained_hf: {self.pretrained_hf} does not exist")
        if self.load:
            from megatron_mimesis.models.dist_ckpt_reader import CheckpointError, newest_complete

            try:
                newest_complete(self.load)
            except CheckpointError as exc:
                raise ConfigError(f"load: {exc}") from None
        if self.finetune and not self.load:
            raise ConfigError("finetune needs load (the checkpoint whose weights to start from)")
        if self.pretrained_hf and self.load:
            raise ConfigError("give either pretrained_hf (start from HF weights) or load (resume), not both")

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
                     description: str = "User-side mid-training / thought-supervised SFT of Qwen3.5 on megatron-core."
                     ) -> argparse.ArgumentParser:
    """``--config FILE`` plus one Megatron-style flag per field (``--tensor-model-parallel-size 2``)."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--config", help="YAML file of options; flags given here override it")
    parser.add_argument("--dry-run", action="store_true", help="print the resolved config and exit")
    hints = typing.get_type_hints(config_cls)
    for f in dataclasses.fields(config_cls):
        flag = "--" + f.name.replace("_", "-")
        kind = _flag_type(hints[f.name])
        if kind is bool:
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None)
        elif kind in (dict, list):
            parser.add_argument(flag, dest=f.name, type=json.loads, default=None, help=f"JSON {kind.__name__}")
        else:
            parser.add_argument(flag, dest=f.name, type=kind, default=None)
    return parser


def parse_config(argv: list[str] | None = None, config_cls=TrainConfig, **parser_kwargs):
    args = build_arg_parser(config_cls, **parser_kwargs).parse_args(argv)
    config = config_cls.from_yaml(args.config) if args.config else config_cls()
    overrides = {f.name: getattr(args, f.name) for f in dataclasses.fields(config_cls)
                 if getattr(args, f.name) is not None}
    if "model_overrides" in overrides:
        overrides["model_overrides"] = {**config.model_overrides, **overrides["model_overrides"]}
    return config.replace(**overrides), args
