"""The pipeline definition: the MIMESIS loop's stages in order, each naming the earlier stages it takes its inputs
from, read from one YAML file (``launch/pipelines/*.yaml``) that the CPU run and the SLURM chain share.

A stage is ``NAME: {kind: KIND, ...}``; its fields that name an earlier stage (``load: sft``) are its hand-offs, and
which output of that stage each one takes (a checkpoint, an HF export, a dataset, a served endpoint) is fixed by the
kind, so a hand-off to the wrong kind of stage fails when the file is read, naming the field. Any stage can be
replaced by something the user already has (``--given simulator_export=/path/to/hf``): it then becomes an input, of
what that stage would have produced.
"""

from dataclasses import dataclass, field
from pathlib import Path

import yaml

# what each kind of stage hands on: the fields of its output record (checkpoint and hf also carry a tokenizer)
PROVIDES = {
    "prep_midtrain": "data", "prep_sft": "data",
    "midtrain": "checkpoint", "sft": "checkpoint", "rl_simulator": "checkpoint", "rl_agent": "checkpoint",
    "export": "hf", "serve": "endpoint", "eval_simulator": "report", "eval_agent": "report",
}
TRAINING = ("midtrain", "sft", "rl_simulator", "rl_agent")
INPUT = "input"  # a stage the user provides: {kind: input, provides: one of INPUTS, path: ...}
# conversations: a file of human conversations (what eval_simulator --input reads, e.g. a held-out split);
# prompts: simulator RL's prompt records with their domains' rewards (python -m data_prep.rl_prompts)
INPUTS = ("checkpoint", "hf", "data", "endpoint", "conversations", "prompts")

# per kind: its fields, and for each hand-off field the outputs it accepts. A mapping field ({name: stage}) holds
# several hand-offs (eval's simulators, agents and users); "literal" lets a user field name a user model directly
# (scripted:toy, openai:URL@MODEL) instead of a stage.
_COMMON = {"kind", "args", "slurm"}  # slurm: the job's request, over its sbatch file's (stages.job_request)
# a slurm field's keys (stages.SLURM_KEYS names the sbatch option of each)
SLURM_FIELDS = ("nodes", "gpus_per_node", "ntasks_per_node", "time", "partition", "account")
FIELDS = {
    "prep_midtrain": set(), "prep_sft": {"tokenizer"},
    "midtrain": {"config", "data", "load"}, "sft": {"config", "data", "load"},
    "rl_simulator": {"config", "load", "prompts", "rollout"},
    "rl_agent": {"config", "load", "user", "user_options", "rollout"},
    "export": {"load"}, "serve": {"model", "name", "python", "start_timeout_s"},
    "eval_simulator": {"simulators", "heldout"}, "eval_agent": {"agents", "users", "tokenizer"},
    INPUT: {"provides", "path"},
}
HANDOFFS = {
    "tokenizer": ("data", "checkpoint", "hf"), "data": ("data",), "load": ("checkpoint", "hf"), "user": ("endpoint",),
    "model": ("hf",), "simulators": ("checkpoint", "hf"), "agents": ("hf", "endpoint"), "users": ("endpoint", "literal"),
    "heldout": ("conversations",), "prompts": ("prompts",), "rollout": ("endpoint",),
}
# a training stage starts from a checkpoint or from HF weights; an export is of a dist checkpoint
KIND_HANDOFFS = {("export", "load"): ("checkpoint",)}
REQUIRED = {"midtrain": {"config", "data"}, "sft": {"config", "data", "load"}, "rl_simulator": {"config", "load"},
            "rl_agent": {"config", "load", "user"}, "export": {"load"}, "serve": {"model", "name"},
            "eval_simulator": {"simulators"}, "eval_agent": {"agents", "users"}, INPUT: {"provides"}}


class PipelineError(ValueError):
    """A definition, a hand-off or a stage that cannot go on; the message is the one line printed."""


@dataclass
class Stage:
    name: str
    kind: str
    fields: dict
    where: str  # "FILE: stages.NAME", for messages
    given: str | None = None  # --given: the user's own output replaces the stage's

    @property
    def provides(self) -> str:
        return self.fields["provides"] if self.kind == INPUT else PROVIDES[self.kind]

    @property
    def args(self) -> list[str]:
        return [str(a) for a in self.fields.get("args") or []]

    def handoffs(self) -> dict[str, str]:
        """``{field (field.key for a mapping): stage name}``: the earlier stages this one reads."""
        out = {}
        for key in HANDOFFS:
            value = self.fields.get(key)
            if isinstance(value, str):
                out[key] = value
            elif isinstance(value, dict):
                out.update({f"{key}.{name}": ref for name, ref in value.items() if ":" not in str(ref)})
        return out


@dataclass
class Definition:
    path: Path
    name: str
    run_dir: Path
    stages: dict[str, Stage] = field(default_factory=dict)
    slurm: dict = field(default_factory=dict)  # every job's request, under each stage's own ``slurm``

    def needs_of(self, name: str) -> list[str]:
        return list(dict.fromkeys(self.stages[name].handoffs().values()))


def _check_stage(stage: Stage, earlier: dict[str, Stage]) -> None:
    kind = stage.kind
    if kind not in FIELDS:
        raise PipelineError(f"{stage.where}.kind: {kind!r} is not a stage kind ({', '.join([*PROVIDES, INPUT])})")
    unknown = sorted(set(stage.fields) - FIELDS[kind] - _COMMON)
    if unknown:
        raise PipelineError(f"{stage.where}: {unknown} are not fields of a {kind} stage "
                            f"({sorted(FIELDS[kind] | _COMMON)})")
    missing = sorted(REQUIRED.get(kind, set()) - set(stage.fields))
    if missing and not stage.given:
        raise PipelineError(f"{stage.where}: a {kind} stage needs {missing}")
    if kind == INPUT and stage.fields["provides"] not in INPUTS:
        raise PipelineError(f"{stage.where}.provides: {stage.fields['provides']!r} is not one of {', '.join(INPUTS)}")
    if not isinstance(stage.fields.get("args", []), list):
        raise PipelineError(f"{stage.where}.args: a list of command-line words, not {stage.fields['args']!r}")
    _check_slurm(stage.fields.get("slurm"), f"{stage.where}.slurm")
    if stage.given:
        return
    for key, accepts in HANDOFFS.items():
        accepts = KIND_HANDOFFS.get((kind, key), accepts)
        value = stage.fields.get(key)
        if value is None:
            continue
        refs = value.items() if isinstance(value, dict) else [(None, value)]
        for name, ref in refs:
            where = f"{stage.where}.{key}" + (f".{name}" if name else "")
            if "literal" in accepts and ":" in str(ref):
                continue
            if not isinstance(ref, str) or ref not in earlier:
                raise PipelineError(f"{where}: {ref!r} is not an earlier stage ({', '.join(earlier) or 'none'})")
            if earlier[ref].provides not in accepts:
                raise PipelineError(f"{where}: stage {ref!r} gives a {earlier[ref].provides}, not a "
                                    f"{' or '.join(a for a in accepts if a != 'literal')}")


def _check_slurm(value, where: str) -> None:
    if value is None:
        return
    if not isinstance(value, dict):
        raise PipelineError(f"{where}: a mapping of {', '.join(SLURM_FIELDS)}, not {value!r}")
    unknown = sorted(set(value) - set(SLURM_FIELDS))
    if unknown:
        raise PipelineError(f"{where}: {unknown} are not SLURM request fields ({', '.join(SLURM_FIELDS)})")
    for key in ("nodes", "gpus_per_node", "ntasks_per_node"):
        least = 0 if key == "gpus_per_node" else 1
        if key in value and (not isinstance(value[key], int) or value[key] < least):
            raise PipelineError(f"{where}.{key}: a whole number >= {least}, not {value[key]!r}")


def load(path: str | Path, run_dir: str | Path | None = None, given: dict[str, str] | None = None) -> Definition:
    """The definition at ``path``, its run directory (``run_dir`` overrides the file's) and the stages the user
    replaces with their own outputs (``given``: stage name -> path, or ``URL@MODEL`` for a served endpoint)."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise PipelineError(f"{path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise PipelineError(f"{path}: not YAML ({exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get("stages"), dict) or not data["stages"]:
        raise PipelineError(f"{path}: expected {{name, run_dir, stages: {{NAME: {{kind: ...}}}}}}")
    unknown = sorted(set(data) - {"name", "run_dir", "stages", "slurm"})
    if unknown:
        raise PipelineError(f"{path}: unknown field(s) {unknown} (name, run_dir, slurm, stages)")
    _check_slurm(data.get("slurm"), f"{path}: slurm")
    run_dir = Path(run_dir or data.get("run_dir") or f"runs/pipeline-{path.stem}").resolve()
    definition = Definition(path, str(data.get("name") or path.stem), run_dir, slurm=dict(data.get("slurm") or {}))
    given = dict(given or {})
    for name, fields in data["stages"].items():
        where = f"{path}: stages.{name}"
        if not isinstance(fields, dict) or "kind" not in fields:
            raise PipelineError(f"{where}: expected a mapping with a kind")
        stage = Stage(name, fields["kind"], dict(fields), where, given.pop(name, None))
        _check_stage(stage, definition.stages)
        definition.stages[name] = stage
    if given:
        raise PipelineError(f"--given: no stage {sorted(given)} in {path} (stages: {', '.join(definition.stages)})")
    return definition
