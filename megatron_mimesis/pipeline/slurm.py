"""The pipeline as a chain of SLURM jobs: one job per stage, each waiting for the stages it reads
(``--dependency=afterok``), each running ``launch/pipeline.sh stage DEFINITION NAME`` so that a job does on the
cluster what the stage does here (its launcher then uses srun over the job's nodes).

A training stage's job takes the layout, time limit, pre-timeout signal and SHUTDOWN_TIMEOUT of its own sbatch file
(``launch/slurm/<stage>.sbatch``, the paper's layouts, which its plan was checked at); every other stage runs in
``launch/slurm/pipeline_stage.sbatch`` (one node). The server of the simulator is a job of its own: the stages that
read it start once it runs (``--dependency=after``) and wait for the address it records, up to the stage's
``start_timeout_s``; a last job cancels it once every stage that reads it has ended. A stage's ``slurm`` field
(``{nodes, gpus_per_node, time, partition, account}``) overrides its file's request.
"""

import re
import shlex
import subprocess
from pathlib import Path

from megatron_mimesis.pipeline.definition import PipelineError
from megatron_mimesis.pipeline.resolve import Resolution
from megatron_mimesis.pipeline.stages import CONFIG_CLASSES, REPO, sbatch_file

STAGE_SBATCH = REPO / "launch" / "slurm" / "pipeline_stage.sbatch"
# what a training stage's own file asks for that its pipeline job keeps (--output and --job-name are the chain's)
KEPT = ("nodes", "ntasks-per-node", "gpus-per-node", "exclusive", "time", "requeue", "signal", "open-mode")
OVERRIDES = {"nodes": "nodes", "gpus_per_node": "gpus-per-node", "time": "time", "partition": "partition",
             "account": "account"}


def _header(path: Path) -> dict[str, str | None]:
    options = {}
    for match in re.finditer(r"^#SBATCH --([a-z-]+)(?:=(\S+))?", path.read_text(), re.M):
        options[match.group(1)] = match.group(2)
    return options


def _shutdown_timeout(path: Path) -> str | None:
    match = re.search(r'SHUTDOWN_TIMEOUT="\$\{SHUTDOWN_TIMEOUT:-(\d+)\}"', path.read_text())
    return match.group(1) if match else None


def job_options(resolution: Resolution, name: str) -> list[str]:
    stage = resolution.stages[name].stage
    own = sbatch_file(stage.kind) if stage.kind in CONFIG_CLASSES else STAGE_SBATCH
    header = {k: v for k, v in _header(own).items() if k in KEPT}
    if stage.kind == "serve":  # a server is not resumed: it runs until the release job cancels it
        header = {k: v for k, v in header.items() if k not in ("signal", "requeue")}
    for key, option in OVERRIDES.items():
        if key in (stage.fields.get("slurm") or {}):
            header[option] = str(stage.fields["slurm"][key])
    options = [f"--{k}" if v is None else f"--{k}={v}" for k, v in header.items()]
    timeout = _shutdown_timeout(own)
    run_dir = resolution.definition.run_dir
    options += [f"--job-name=mimesis-{resolution.definition.name}-{name}", f"--output={run_dir}/{name}/slurm-%j.out"]
    if timeout:
        options.append(f"--export=ALL,SHUTDOWN_TIMEOUT={timeout}")
    return options


def stage_args(resolution: Resolution, name: str) -> list[str]:
    definition = resolution.definition
    given = [f"--given={n}={s.given}" for n, s in definition.stages.items() if s.given]
    return [str(definition.path.resolve()), name, f"--run-dir={definition.run_dir}", *given]


def submit(resolution: Resolution, dry_run: bool = False) -> int:
    definition = resolution.definition
    jobs: dict[str, str] = {}  # stage -> job id (or its placeholder in a dry run)
    readers: dict[str, list[str]] = {}
    print(f"pipeline {definition.name}: SLURM chain in {definition.run_dir}" + (" (dry run: nothing submitted)"
                                                                               if dry_run else ""))
    for name, resolved in resolution.stages.items():
        if resolved.done:
            print(f"== {name}: {'given' if resolved.stage.given or resolved.stage.kind == 'input' else 'done'}, "
                  f"no job")
            continue
        after_ok, after = [], []
        for ref in definition.needs_of(name):
            if ref not in jobs:
                continue
            if resolution.stages[ref].stage.kind == "serve":
                after.append(jobs[ref])
                readers.setdefault(ref, []).append(name)
            else:
                after_ok.append(jobs[ref])
        dependency = ",".join([*(f"afterok:{j}" for j in after_ok), *(f"after:{j}" for j in after)])
        argv = ["sbatch", "--parsable", *job_options(resolution, name),
                *([f"--dependency={dependency}", "--kill-on-invalid-dep=yes"] if dependency else []),
                str(STAGE_SBATCH), *stage_args(resolution, name)]
        jobs[name] = _submit(argv, name, dry_run)
        layout = next((o.split("=", 1)[1] for o in argv if o.startswith("--nodes=")), "1")
        gpus = next((o.split("=", 1)[1] for o in argv if o.startswith("--gpus-per-node=")), "0")
        print(f"== {name} ({resolved.stage.kind}): job {jobs[name]}, {layout} node(s) x {gpus} GPU(s)"
              + (f", after {dependency}" if dependency else ""))
        if resolved.plan_line:
            print(f"   memory plan: {resolved.plan_line}")
        print(f"   {shlex.join(argv)}")
    for server, names in readers.items():
        argv = ["sbatch", "--parsable", f"--job-name=mimesis-{definition.name}-{server}-release",
                f"--output={definition.run_dir}/{server}/slurm-release-%j.out",
                f"--dependency=afterany:{':'.join(jobs[n] for n in names)}", "--time=00:05:00",
                f"--wrap=scancel {jobs[server]}"]
        job = _submit(argv, f"{server}-release", dry_run)
        print(f"== {server} release: job {job}, cancels the server once {', '.join(names)} ended\n   {shlex.join(argv)}")
    if not dry_run:
        record = definition.run_dir / "slurm_jobs.txt"
        record.parent.mkdir(parents=True, exist_ok=True)
        record.write_text("".join(f"{name} {job}\n" for name, job in jobs.items()))
        print(f"job ids: {record}")
    return 0


def _submit(argv: list[str], name: str, dry_run: bool) -> str:
    if dry_run:
        return f"<{name}>"
    try:
        result = subprocess.run(argv, capture_output=True, text=True, check=False)
    except FileNotFoundError:
        raise PipelineError(f"{argv[0]}: not found (submit from a SLURM login node)") from None
    if result.returncode != 0:
        raise PipelineError(f"sbatch refused stage {name}: {result.stderr.strip() or result.stdout.strip()}")
    return result.stdout.strip().split(";")[0]
