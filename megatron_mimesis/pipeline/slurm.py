"""The pipeline as a chain of SLURM jobs: one job per stage, each waiting for the stages it reads
(``--dependency=afterok``), each running ``launch/pipeline.sh stage DEFINITION NAME`` so that a job does on the
cluster what the stage does here (its launcher then uses srun over the job's nodes).

A training stage's job takes the layout, time limit, pre-timeout signal and SHUTDOWN_TIMEOUT of its own sbatch file
(``launch/slurm/<stage>.sbatch``, the paper's layouts, which its plan was checked at); every other stage runs in
``launch/slurm/pipeline_stage.sbatch`` (one node). The server of the simulator is a job of its own: the stages that
read it start once it runs (``--dependency=after``) and wait for the address it records, up to the stage's
``start_timeout_s``; it starts no earlier than its readers could (``readers_wait``), and a last job cancels it once
every stage that reads it has ended. A stage's ``slurm`` field
(``{nodes, gpus_per_node, ntasks_per_node, time, partition, account}``) overrides its file's request, and the
definition's own ``slurm`` field sets it for every job (a CPU partition: ``gpus_per_node: 0``); the chain's plans are
made at the request as submitted. The server's time limit follows its readers (the sum of theirs); a reader that
starts with more time left than its server requeues the server (``runner.Runner._served_by_job``). Every job's
request is asked of SLURM before any is queued (``sbatch --test-only``), a job refused at submission all the same
cancels the ones already queued, and a chain whose last submission is still in the queue is not submitted again.
"""

import re
import shlex
import subprocess

from megatron_mimesis.pipeline import cluster
from megatron_mimesis.pipeline.definition import PipelineError
from megatron_mimesis.pipeline.resolve import Resolution
from megatron_mimesis.pipeline.stages import STAGE_SBATCH, job_file, job_request, stage_dir

JOBS = "slurm_jobs.txt"  # RUN_DIR/slurm_jobs.txt: "STAGE JOB" per line, the chain's last submission


def _shutdown_timeout(stage) -> str | None:
    match = re.search(r'SHUTDOWN_TIMEOUT="\$\{SHUTDOWN_TIMEOUT:-(\d+)\}"', job_file(stage).read_text())
    return match.group(1) if match else None


def readers(resolution: Resolution, server: str) -> list[str]:
    definition = resolution.definition
    return [name for name in definition.stages if server in definition.needs_of(name)]


def readers_wait(resolution: Resolution, server: str, jobs: dict[str, str]) -> list[str]:
    """The jobs that every reader of a server waits for besides the server (through the other servers it reads): the
    server starts when its first reader can. An agent the evaluation serves from a given checkpoint would otherwise
    hold a node from submission on, days before the evaluation runs, and its time limit would end before it."""
    definition = resolution.definition

    def waits(name: str, seen: set[str]) -> set[str]:
        found = set()
        for ref in definition.needs_of(name):
            if ref == server or ref in seen:
                continue
            if resolution.stages[ref].stage.kind == "serve":
                found |= waits(ref, seen | {ref})
            elif ref in jobs:
                found.add(ref)
        return found

    waited = [waits(reader, {reader}) for reader in readers(resolution, server)]
    return sorted(set.intersection(*waited) if waited else set(), key=list(definition.stages).index)


def server_time(resolution: Resolution, server: str) -> str | None:
    """A server's time limit follows its readers: the sum of theirs (they may run one after another) and its own start.
    None when one of them has no limit."""
    stage = resolution.stages[server].stage
    total = float(stage.fields.get("start_timeout_s", 0))
    for name in readers(resolution, server):
        limit = cluster.seconds(job_request(resolution.stages[name].stage, resolution.definition.slurm).get("time"))
        if limit is None:
            return None
        total += limit
    return cluster.time_text(total)


def job_options(resolution: Resolution, name: str) -> list[str]:
    stage = resolution.stages[name].stage
    request = job_request(stage, resolution.definition.slurm)
    if stage.kind == "serve" and "time" not in (stage.fields.get("slurm") or {}):
        request["time"] = server_time(resolution, name) or request.get("time")
    lead, limit = re.search(r"@(\d+)$", request.get("signal") or "@0"), cluster.seconds(request.get("time"))
    if limit is not None and int(lead.group(1)) >= limit:
        raise PipelineError(f"{stage.where}.slurm.time: {request['time']} is not longer than the {lead.group(1)} s "
                            f"before its end at which its job is told to stop (--signal={request['signal']}): the "
                            f"warning would come at once")
    options = [f"--{k}" if v is None else f"--{k}={v}" for k, v in request.items()]
    run_dir = resolution.definition.run_dir
    options += [f"--job-name=mimesis-{resolution.definition.name}-{name}", f"--output={run_dir}/{name}/slurm-%j.out"]
    timeout = _shutdown_timeout(stage)
    if timeout:
        options.append(f"--export=ALL,SHUTDOWN_TIMEOUT={timeout}")
    return options


def stage_args(resolution: Resolution, name: str, jobs: dict[str, str]) -> list[str]:
    definition = resolution.definition
    given = [f"--given={n}={s.given}" for n, s in definition.stages.items() if s.given]
    servers = [f"--server-job={ref}={jobs[ref]}" for ref in definition.needs_of(name)
               if resolution.stages[ref].stage.kind == "serve" and ref in jobs]
    return [str(definition.path.resolve()), name, f"--run-dir={definition.run_dir}", *given, *servers]


def submitted_jobs(run_dir) -> dict[str, str]:
    """The chain's last submission: stage (or ``SERVER-release``) -> job id."""
    path = run_dir / JOBS
    if not path.is_file():
        return {}
    return dict(line.split() for line in path.read_text().splitlines() if len(line.split()) == 2)


def _refuse_a_chain_in_the_queue(run_dir) -> None:
    active = [f"{name} {job} {cluster.state(info)}" for name, job in submitted_jobs(run_dir).items()
              if cluster.state(info := cluster.job_info(job)) in cluster.ACTIVE]
    if active:
        raise PipelineError(f"{run_dir}: jobs of its last submission are still queued or running ({'; '.join(active)}):"
                            f" wait for them or scancel them before submitting again")


def submit(resolution: Resolution, dry_run: bool = False) -> int:
    definition = resolution.definition
    if not dry_run:
        _refuse_a_chain_in_the_queue(definition.run_dir)
    jobs: dict[str, str] = {}  # stage -> job id (or its placeholder in a dry run)
    print(f"pipeline {definition.name}: SLURM chain in {definition.run_dir}" + (" (dry run: nothing submitted)"
                                                                               if dry_run else ""))
    if not dry_run:
        _check_requests(resolution)
    try:
        _submit_chain(resolution, jobs, dry_run)
    except PipelineError as exc:
        if not jobs or dry_run:
            raise
        cluster.cancel(list(jobs.values()))
        raise PipelineError(f"{exc}; the {len(jobs)} job(s) already submitted were cancelled "
                            f"({', '.join(jobs.values())})") from None
    if not dry_run:
        record = definition.run_dir / JOBS
        record.write_text("".join(f"{name} {job}\n" for name, job in jobs.items()))
        print(f"job ids: {record}; bash launch/pipeline.sh status {definition.path} --run-dir {definition.run_dir}")
    return 0


def _submit_chain(resolution: Resolution, jobs: dict[str, str], dry_run: bool) -> None:
    definition = resolution.definition
    servers: list[str] = []
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
            else:
                after_ok.append(jobs[ref])
        if resolved.stage.kind == "serve":
            after_ok += [jobs[ref] for ref in readers_wait(resolution, name, jobs) if jobs[ref] not in after_ok]
        dependency = ",".join([*(f"afterok:{j}" for j in after_ok), *(f"after:{j}" for j in after)])
        options = job_options(resolution, name)
        argv = ["sbatch", "--parsable", *options,
                *([f"--dependency={dependency}", "--kill-on-invalid-dep=yes"] if dependency else []),
                str(STAGE_SBATCH), *stage_args(resolution, name, jobs)]
        if not dry_run:  # the job's --output lies there: SLURM fails a job at launch, logless, without it
            stage_dir(definition.run_dir, resolved.stage).mkdir(parents=True, exist_ok=True)
        jobs[name] = _submit(argv, name, dry_run)
        if resolved.stage.kind == "serve":
            servers.append(name)
        request = {o.split("=", 1)[0]: o.split("=", 1)[-1] for o in options}
        print(f"== {name} ({resolved.stage.kind}): job {jobs[name]}, {request.get('--nodes', '1')} node(s) x "
              f"{request.get('--gpus-per-node', '0')} GPU(s), time {request.get('--time', '-')}"
              + (f", after {dependency}" if dependency else ""))
        if resolved.plan_line:
            print(f"   memory plan: {resolved.plan_line}")
        print(f"   {shlex.join(argv)}")
    for server in servers:
        names = [n for n in readers(resolution, server) if n in jobs]
        if not names:
            continue
        argv = ["sbatch", "--parsable", f"--job-name=mimesis-{definition.name}-{server}-release",
                f"--output={definition.run_dir}/{server}/slurm-release-%j.out",
                f"--dependency=afterany:{':'.join(jobs[n] for n in names)}", "--time=00:05:00",
                *_partition(resolution, server), f"--wrap=scancel {jobs[server]}"]
        jobs[f"{server}-release"] = job = _submit(argv, f"{server}-release", dry_run)
        print(f"== {server} release: job {job}, cancels the server once {', '.join(names)} ended\n   {shlex.join(argv)}")


def _check_requests(resolution: Resolution) -> None:
    """Every job's request asked of SLURM before any is queued (``sbatch --test-only``): one the cluster can never run
    (more nodes than the partition has, GPUs where it has none, an unknown partition) is refused in one line, with
    nothing submitted; SLURM itself would accept many such jobs and leave them pending forever."""
    for name, resolved in resolution.stages.items():
        if resolved.done:
            continue
        argv = ["sbatch", "--test-only", *job_options(resolution, name), str(STAGE_SBATCH),
                *stage_args(resolution, name, {})]
        try:
            result = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=120)
        except FileNotFoundError:
            raise PipelineError("sbatch: not found (submit from a SLURM login node)") from None
        if result.returncode != 0:
            said = " ".join((result.stderr + " " + result.stdout).split())
            raise PipelineError(f"sbatch refused stage {name} (nothing submitted): {said}")


def _partition(resolution: Resolution, name: str) -> list[str]:
    request = job_request(resolution.stages[name].stage, resolution.definition.slurm)
    return [f"--{key}={request[key]}" for key in ("partition", "account") if request.get(key)]


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


FAILED = {"FAILED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "PREEMPTED"}


def status(definition) -> int:
    """``pipeline.sh status``: each stage's job of the last submission, its state on the cluster and its record,
    then the stages that failed with their logs. Exit 1 when one failed."""
    from megatron_mimesis.pipeline import manifest

    run_dir = definition.run_dir
    jobs = submitted_jobs(run_dir)
    print(f"pipeline {definition.name} in {run_dir}: "
          + (f"{len(jobs)} job(s) of the last submission ({run_dir / JOBS})" if jobs else "never submitted"))
    rows, failed = [("stage", "job", "on the cluster", "record", "log")], []
    for name in [*definition.stages, *(n for n in jobs if n not in definition.stages)]:
        stage = definition.stages.get(name)
        directory = run_dir / (name.removesuffix("-release") if stage is None else stage.name)
        record = (manifest.read(directory) or {}) if stage is not None else {}
        job = jobs.get(name)
        info = cluster.job_info(job) if job else None
        state = cluster.state(info) if job else "-"
        shown = state
        if info and state == "PENDING":
            shown += f" ({info.get('Reason', '?')})"
        elif info and info.get("ExitCode") not in (None, "0:0"):
            shown += f" (exit {info['ExitCode']})"
        kept = "given" if stage is not None and (stage.given or stage.kind == "input") else record.get("status", "-")
        log = directory / (f"slurm-release-{job}.out" if stage is None else f"slurm-{job}.out") if job else None
        rows.append((name, job or "-", shown, kept, str(log) if log else "-"))
        if state in FAILED or (kept == "failed" and state not in cluster.ACTIVE):
            logs = [str(log)] if log else []
            if (directory / "stage.log").is_file():
                logs.append(f"stage log {directory / 'stage.log'}")
            failed.append(f"{name} (job {job}, {shown}): {'; '.join(logs) or 'no log'}")
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row[:4], widths, strict=True)) + "  " + row[4])
    for line in failed:
        print(f"failed: {line}")
    cancelled = [n for n, j in jobs.items() if n in definition.stages and
                 cluster.state(cluster.job_info(j)) == "CANCELLED"]
    if failed:
        if cancelled:
            print(f"cancelled with it: {', '.join(cancelled)} (what they read did not finish)")
        print(f"submit again once mended: bash launch/pipeline.sh submit {definition.path} --run-dir {run_dir} "
              f"(done stages are skipped; an interrupted or failed training stage resumes from its checkpoint)")
        return 1
    return 0
