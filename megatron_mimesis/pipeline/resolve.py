"""Every hand-off of a pipeline resolved and checked before any stage runs: a wrong hand-off is one line at launch,
not a stage failing hours into the chain.

Checked, in order of the stages: that what the user gives exists and is what it replaces; each training stage's
config (its ``stage`` the stage's kind, its options valid, its layout dividing the job) and its memory plan at the
job's size, from the same code as its ``--dry-run``; that each checkpoint it loads is the model its config builds
(family and sizes, from the producing stage's config or the given checkpoint's own record); that its data and the
checkpoint it loads share one tokenizer, and that the tokenizer fits the model's vocabulary; that a server's python
has vLLM. Then each stage's fingerprint (its kind, fields, arguments, config file and the fingerprints of the stages
it reads) is compared with what its directory records, so outputs made from other inputs are never mixed.
"""

import argparse
import functools
import hashlib
import json
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from megatron_mimesis.pipeline import manifest
from megatron_mimesis.pipeline.definition import INPUT, TRAINING, Definition, PipelineError, Stage
from megatron_mimesis.pipeline.stages import (
    CONFIG_CLASSES,
    Output,
    config_class,
    given_output,
    input_record,
    job_request,
    planned_output,
    request_layout,
    server_python,
    stage_dir,
    training_flags,
)


@dataclass
class Resolved:
    stage: Stage
    output: Output
    inputs: dict[str, Output]
    fingerprint: str
    config: object = None  # a training stage's parsed config
    layout: tuple[int, int] | None = None  # (nodes, processes per node) its plan was made for
    plan_line: str | None = None
    recorded: dict | None = None  # its directory's manifest, when it has one

    @property
    def done(self) -> bool:
        return self.stage.given is not None or self.stage.kind == INPUT or (
            self.recorded is not None and self.recorded.get("status") == "done")


@dataclass
class Resolution:
    definition: Definition
    stages: dict[str, Resolved] = field(default_factory=dict)


def _sha(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _file_sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


@functools.cache
def _visible_gpus() -> int:
    """GPUs counted as ``launch/common.sh`` counts them (torch's count is the CPU shim's once megatron is loaded)."""
    try:
        listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        listing = ""
    return sum(line.startswith("GPU") for line in listing.splitlines())


def _layout(stage: Stage, definition: Definition, slurm: bool) -> tuple[int, int]:
    """The job size a training stage's plan is made for: in a chain, the request its job is submitted with (its SLURM
    file's, under the definition's and the stage's ``slurm`` fields); else this machine's launch (NPROC, else the
    GPUs, else 2 CPU processes), as its launcher would start it."""
    if slurm:
        return request_layout(job_request(stage, definition.slurm))
    return int(os.environ.get("NNODES", 1)), int(os.environ.get("NPROC") or _visible_gpus() or 2)


def _training_config(stage: Stage, run_dir: Path, inputs: dict[str, Output], layout: tuple[int, int]):
    from megatron_mimesis.training.config import ConfigError, parse_config

    config_path = Path(stage.fields["config"])
    where = f"{stage.where}.config"
    if not config_path.is_file():
        raise PipelineError(f"{where}: {config_path}: no such file")
    cls = config_class(stage.kind)
    try:
        config, _ = parse_config(["--config", str(config_path), *training_flags(stage, run_dir, inputs)], cls,
                                 prog=stage.name)
    except SystemExit:
        raise PipelineError(f"{stage.where}.args: {stage.args} are not flags of {stage.kind} "
                            f"(python -m {CONFIG_CLASSES[stage.kind].split(':')[0]} --help)") from None
    except ConfigError as exc:
        raise PipelineError(f"{where}: {exc}") from None
    if config.stage != stage.kind and not (stage.kind == "midtrain" and config.stage in ("midtrain", "pretrain")):
        raise PipelineError(f"{where}: {config_path} is a {config.stage} config, not a {stage.kind} one")
    try:
        config.validate_without_files(layout[0] * layout[1])
    except ConfigError as exc:
        raise PipelineError(f"{stage.where} ({layout[0]}x{layout[1]}): {exc}") from None
    return config


def _memory_plan(stage: Stage, config, layout: tuple[int, int]) -> str:
    from megatron_mimesis.training.memory.plan import GIB, plan_training

    world = layout[0] * layout[1]
    if stage.kind.startswith("rl_"):
        from megatron_mimesis.rl.memory import plan_rl

        plan, refusal = plan_rl(config, world)
    else:
        plan, refusal = plan_training(config, world)
    if refusal:
        raise PipelineError(f"{stage.where} ({layout[0]}x{layout[1]}): {refusal}")
    peak = plan.total(plan.worst_column) / GIB
    return (f"{peak:.2f} GiB per GPU of {plan.capacity_bytes / GIB:.1f} ({plan.gpu}), "
            f"{plan.usable_bytes / GIB - peak:.1f} GiB to spare")


def _check_model(stage: Stage, key: str, source: Output, preset) -> None:
    from megatron_mimesis.models.presets import architecture_differences

    if source.preset is None or preset is None:
        return
    diff = architecture_differences(preset, source.preset)
    if diff:
        raise PipelineError(f"{stage.where}.{key}: {source.path or 'its checkpoint'} is another model than the stage's "
                            f"config builds (config vs checkpoint: {'; '.join(diff)})")


def _check_tokenizers(stage: Stage, inputs: dict[str, Output], preset) -> None:
    data, load = inputs.get("data"), inputs.get("load")
    if data and load and data.tokenizer_origin != load.tokenizer_origin:
        raise PipelineError(f"{stage.where}: its data's tokenizer ({data.tokenizer_origin}) is not the tokenizer of "
                            f"the checkpoint it loads ({load.tokenizer_origin}): token ids would mean other words")
    if "load" in inputs and stage.kind.startswith("rl_") and not load.tokenizer:
        raise PipelineError(f"{stage.where}.load: {load.path} carries no tokenizer (export or train it with one)")
    for key, source in inputs.items():
        if preset is None or source.tokenizer is None or not (source.tokenizer / "tokenizer.json").is_file():
            continue
        size = _tokenizer_size(source.tokenizer)
        if size > preset.vocab_size:
            raise PipelineError(f"{stage.where}.{key}: tokenizer {source.tokenizer} has {size} tokens, more than the "
                                f"{preset.vocab_size} of model {preset.name}: a tokenizer of another model")


@functools.cache
def _tokenizer_size(directory: Path) -> int:
    """Tokens of a tokenizer, read once per directory (a chain's stages share one; Qwen's takes seconds to load)."""
    from transformers import PreTrainedTokenizerFast

    return len(PreTrainedTokenizerFast(tokenizer_file=str(directory / "tokenizer.json")))


def check_server_python(stage: Stage) -> None:
    python = server_python(stage)
    try:
        found = subprocess.run([python, "-c", "import importlib.util, sys; sys.exit(not importlib.util.find_spec('vllm'))"],
                               capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        found = False
    if not found:
        raise PipelineError(f"{stage.where}.python: {python} has no vLLM (make venv-vllm on CPU; pip install vllm)")


def _eval_env(stage: Stage) -> tuple[str, dict, str]:
    """The env, options and task split an eval_agent stage's args name (as tools/eval_agent.py reads them; a gym suite
    is scored with its evaluation reward there)."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--env")
    parser.add_argument("--env-options", default="{}")
    parser.add_argument("--split", default="test")
    known, _ = parser.parse_known_args(stage.args)
    if known.env is None:
        raise PipelineError(f"{stage.where}.args: no --env (tools/eval_agent.py --help)")
    from megatron_mimesis.eval.agents import EvalError, parse_env_options

    try:
        return known.env, parse_env_options(known.env_options), known.split
    except EvalError as exc:
        raise PipelineError(f"{stage.where}.args: {exc}") from None


def _check_env(stage: Stage, env: str, options: dict, split: str) -> None:
    """The env a stage plays loads here, when the chain is submitted rather than hours later on a node: UserRL's gyms
    installed, importable and with their keys set (SearchGym's SERPER_API_KEY), their tasks there."""
    from megatron_mimesis.rl.envs import build_suite

    try:
        if not build_suite(env, options).task_ids(split):
            raise ValueError(f"split {split!r} has no tasks")
    except (ImportError, ValueError, KeyError, TypeError) as exc:  # userrl's UserRLError is a ValueError
        raise PipelineError(f"{stage.where}: its {env} env does not load: {exc.args[0] if exc.args else exc}") from None


def resolve(definition: Definition, slurm: bool = False, plans: bool = True) -> Resolution:
    """Every stage's hand-offs, outputs and fingerprint, checked; raises :class:`PipelineError` with one line."""
    resolution = Resolution(definition)
    run_dir = definition.run_dir
    for name, stage in definition.stages.items():
        inputs = {key: resolution.stages[ref].output for key, ref in stage.handoffs().items()}
        config = layout = plan_line = None
        value = input_record(stage)
        if stage.kind == INPUT and value is None:
            raise PipelineError(f"{stage.where}.path: not set; give it in the file or as --given {name}=PATH")
        if value is not None:
            output = given_output(stage, value)
            fingerprint = _sha({"given": value, "output": output.record(),
                                "stamp": _stamp(output)})
        else:
            if stage.kind in TRAINING:
                layout = _layout(stage, definition, slurm)
                config = _training_config(stage, run_dir, inputs, layout)
                if "load" in inputs:
                    _check_model(stage, "load", inputs["load"], config.preset)
                _check_tokenizers(stage, inputs, config.preset)
                if plans:
                    plan_line = _memory_plan(stage, config, layout)
            if stage.kind == "serve" and not slurm:  # a chain's server job checks its node's python itself
                check_server_python(stage)
            if stage.kind == "rl_agent":
                _check_env(stage, config.env, config.env_options, config.train_split)
            if stage.kind == "eval_agent":
                _check_env(stage, *_eval_env(stage))
            output = planned_output(run_dir, stage, inputs, config.preset if config else None)
            fields = {k: v for k, v in stage.fields.items() if k not in stage.handoffs()}
            fingerprint = _sha({"kind": stage.kind, "fields": fields,
                                "config": _file_sha(Path(stage.fields["config"])) if "config" in stage.fields else None,
                                "inputs": {key: resolution.stages[ref].fingerprint
                                           for key, ref in stage.handoffs().items()}})
        recorded = manifest.read(stage_dir(run_dir, stage))
        if value is None and recorded is not None and recorded.get("fingerprint") != fingerprint:
            raise PipelineError(f"stage {name}: {stage_dir(run_dir, stage)} was made from other inputs (its config, "
                                f"fields or an earlier stage changed since); remove it and the stages after it, or "
                                f"run with another --run-dir")
        resolution.stages[name] = Resolved(stage, output, inputs, fingerprint, config, layout, plan_line, recorded)
    return resolution


def _stamp(output: Output):
    """What changes when a given checkpoint is replaced in place: its ``latest`` or its config's mtime."""
    if output.path is None:
        return None
    for marker in ("latest", "config.json", "manifest.json"):
        if (output.path / marker).is_file():
            return (output.path / marker).stat().st_mtime_ns
    return None
