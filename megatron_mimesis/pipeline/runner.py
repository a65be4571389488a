"""Running a resolved pipeline's stages in order, here or as one job of a SLURM chain.

A stage whose record says done is skipped; the others run through their commands, each under a keeper. A serve
stage is a service, not a step: its server starts when the first stage that reads it is about to run and stops when
the pipeline ends (in a SLURM chain it is a job of its own, which records its address; the stages that read it wait
for that with the stage's ``start_timeout_s``). A signal to the pipeline goes to the running stage (its ranks save
and stop), the server is stopped and the stage is recorded as interrupted, to be resumed by the next run.
"""

import os
import signal
import sys
import time

from megatron_mimesis.pipeline import cluster, manifest, summary
from megatron_mimesis.pipeline.definition import TRAINING, PipelineError
from megatron_mimesis.pipeline.processes import (
    SERVER_GRACE_S,
    STOP_GRACE_S,
    Child,
    free_port,
    log_tail,
    served_requests,
    wait_ready,
)
from megatron_mimesis.pipeline.resolve import Resolution, Resolved, check_server_python
from megatron_mimesis.pipeline.stages import command, serve_command, stage_dir, takes_weight_updates

SERVE_TIMEOUT_S = 900  # a 9B export loads and warms up in minutes; the CPU tiny one in one
HANDLED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1)
_early: list[int] = []  # signals that came before a Runner took them over


def catch_signals_early() -> None:
    """From the start of the process until a Runner takes them over: a signal that comes while the pipeline imports
    and resolves (seconds; a job's pre-timeout warning can come then) is kept for the Runner, not fatal."""
    for signum in HANDLED:
        signal.signal(signum, lambda signum, _frame: _early.append(signum))


def ignore_late_warnings() -> None:
    """Once the pipeline's work is done, SLURM's pre-timeout warning (SIGUSR1) has nothing left to stop. Python's
    finalization puts back the default action of every signal it handles, and the default action of SIGUSR1 is to
    die: a warning that came while the process exited ended a finished stage's job FAILED (measured: a job whose
    warning fell 0.8 s after its stage was done), and SLURM cancelled the jobs after it. An ignored signal stays
    ignored through finalization."""
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)


def say(line: str) -> None:
    print(line, flush=True)


class Runner:
    def __init__(self, resolution: Resolution, python: str = sys.executable, slurm: bool = False,
                 server_jobs: dict[str, str] | None = None):
        self.resolution = resolution
        self.python = python
        self.slurm = slurm
        self.server_jobs = server_jobs or {}  # a chain's server stage -> its job id (what the stage reads is its)
        self.servers: dict[str, Child] = {}
        self.current: Child | None = None
        self._current_name: str | None = None
        self.signalled: int | None = None
        self.usr1_pending = False  # SLURM's pre-timeout warning before the training stage's launcher started

    # ------------------------------------------------------------------ signals
    def _on_signal(self, signum, _frame):
        if signum != signal.SIGUSR1:
            self.signalled = signum
        say(f"pipeline: {signal.Signals(signum).name}: stopping stage {self._current_name or '-'} "
            f"(it saves and stops; the next run resumes it)")
        # SIGUSR1 (SLURM's pre-timeout warning) is for a training stage's launcher, which saves and requeues; any
        # other stage would die of it, and its job ends at the limit either way
        if self.current is not None and (signum != signal.SIGUSR1 or self._current_name in self._training):
            self.current.signal(signum)
        elif signum == signal.SIGUSR1:
            self.usr1_pending = True

    @property
    def _training(self) -> set[str]:
        return {n for n, r in self.resolution.stages.items() if r.stage.kind in TRAINING}

    # ------------------------------------------------------------------ services
    def _endpoint(self, resolved: Resolved) -> None:
        """The served simulator this stage reads: started here, or (a SLURM chain) waited for."""
        stage, output = resolved.stage, resolved.output
        if output.endpoint is not None:
            return
        timeout = float(stage.fields.get("start_timeout_s", SERVE_TIMEOUT_S))
        model = str(stage.fields["name"])
        directory = stage_dir(self.resolution.definition.run_dir, stage)
        if self.slurm:
            output.endpoint = (self._served_by_job(resolved, timeout), model)
            return
        port = free_port()
        url = f"http://127.0.0.1:{port}/v1"
        argv = serve_command(stage, resolved.inputs["model"], "127.0.0.1", port)
        say(f"stage {stage.name}: serving {resolved.inputs['model'].path} as {model} at {url} (log {directory}/stage.log)")
        started = time.monotonic()
        env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"),
               **takes_weight_updates(self.resolution.definition, stage.name)}
        child = Child(argv, env, directory / "stage.log", SERVER_GRACE_S)
        self.servers[stage.name] = child
        wait_ready(url, model, timeout, child, what=f"stage {stage.name}'s server", stopped=self._stopped)
        output.endpoint = (url, model)
        resolved.recorded = manifest.write(directory, {
            "stage": stage.name, "kind": stage.kind, "fingerprint": resolved.fingerprint, "status": "serving",
            "outputs": output.record(), "command": argv, "ready_s": round(time.monotonic() - started, 1)})
        say(f"stage {stage.name}: ready in {time.monotonic() - started:.0f} s")

    def _stopped(self) -> bool:
        return self.signalled is not None

    def _served_by_job(self, resolved: Resolved, timeout: float) -> str:
        """A chain's reader of a server: the address that the server's own job (``--server-job``) recorded, once that
        job serves. A record that another job left (a server of an earlier submission, since killed) is not
        trusted; a server job that ended fails the stage at once. A server with less time left than this job is
        requeued (it restarts with its whole time limit) and waited for again."""
        stage = resolved.stage
        directory = stage_dir(self.resolution.definition.run_dir, stage)
        job = self.server_jobs.get(stage.name)
        if job is None:
            raise PipelineError(f"stage {stage.name}: no --server-job {stage.name}=JOB given (pipeline.sh submit "
                                f"passes it to the stages that read a server)")
        restarted = 0  # a record of an earlier start of the job (before a requeue) is not this start's
        while True:
            say(f"stage {stage.name}: waiting up to {timeout:.0f} s for server job {job} to serve")
            record = self._job_record(directory, resolved.fingerprint, job, restarted, timeout)
            url = record["outputs"]["endpoint"][0]
            wait_ready(url, str(stage.fields["name"]), timeout, what=f"stage {stage.name}'s server (job {job})",
                       stopped=self._stopped)
            server = cluster.job_info(job)
            own, theirs = cluster.remaining_s(cluster.job_info(os.environ.get("SLURM_JOB_ID"))), cluster.remaining_s(server)
            if theirs is None or own is None or theirs >= own:
                return url
            limit = cluster.seconds(server.get("TimeLimit"))
            if restarted or limit < own:  # a restart would not give it the time this job has
                raise PipelineError(f"stage {stage.name}: server job {job} has a time limit of {server['TimeLimit']}, "
                                    f"less than the {cluster.time_text(own)} this job has left: give the server a "
                                    f"longer slurm time (without one it is the sum of its readers')")
            say(f"stage {stage.name}: server job {job} has {cluster.time_text(theirs)} left, less than this job's "
                f"{cluster.time_text(own)}: requeueing it (it restarts with its whole time limit)")
            refused = cluster.requeue(job)
            if refused:
                raise PipelineError(f"stage {stage.name}: server job {job} would end before this job and cannot be "
                                    f"requeued ({refused}): give it a longer time (its slurm field)")
            restarted = int(record.get("restart", 0)) + 1

    def _job_record(self, directory, fingerprint: str, job: str, restart: int, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            if self._stopped():
                raise PipelineError(f"stopped by a signal while waiting for server job {job}")
            record = manifest.read(directory) or {}
            if record.get("status") == "serving" and record.get("fingerprint") == fingerprint and \
                    str(record.get("job")) == str(job) and int(record.get("restart", 0)) >= restart:
                return record
            info = cluster.job_info(job)
            if cluster.state(info) not in cluster.ACTIVE:
                raise PipelineError(f"server job {job} ended ({cluster.state(info)}) without serving; its log: "
                                    f"{directory}/slurm-{job}.out")
            if time.monotonic() > deadline:
                raise PipelineError(f"server job {job} did not serve within {timeout:.0f} s "
                                    f"({cluster.state(info)}; log {directory}/slurm-{job}.out)")
            time.sleep(5)

    def serve_forever(self, name: str) -> int:
        """A SLURM server job: serve on this node, record the address (and this job) for the stages that read it,
        until the job ends or a signal comes."""
        resolved = self.resolution.stages[name]
        stage = resolved.stage
        directory = stage_dir(self.resolution.definition.run_dir, stage)
        job = {"job": os.environ.get("SLURM_JOB_ID"), "restart": int(os.environ.get("SLURM_RESTART_COUNT") or 0)}
        record = {"stage": name, "kind": stage.kind, "fingerprint": resolved.fingerprint, **job}
        self._install_signals()
        try:
            check_server_python(stage)
            port = int(os.environ.get("MIMESIS_SERVE_PORT") or free_port())  # a port of its own on a shared node
            url = f"http://{cluster.node_address()}:{port}/v1"
            argv = serve_command(stage, resolved.inputs["model"], "0.0.0.0", port)
            child = self.current = Child(argv, takes_weight_updates(self.resolution.definition, name),
                                         directory / "stage.log", SERVER_GRACE_S)
            wait_ready(f"http://127.0.0.1:{port}/v1", str(stage.fields["name"]),
                       float(stage.fields.get("start_timeout_s", SERVE_TIMEOUT_S)), child,
                       what=f"stage {name}'s server", stopped=self._stopped)
        except PipelineError as exc:
            say(f"error: {exc}")
            if self.current is not None:
                self.current.stop()
            manifest.write(directory, {**record, "status": "failed", "error": str(exc)})
            return 128 + self.signalled if self.signalled else 2
        resolved.output.endpoint = (url, str(stage.fields["name"]))
        manifest.write(directory, {**record, "status": "serving", "outputs": resolved.output.record(), "command": argv})
        say(f"stage {name}: serving at {url} (job {job['job']}, start {job['restart'] + 1})")
        status = child.wait()
        manifest.write(directory, {**record, "status": "stopped", "outputs": resolved.output.record(), "exit": status})
        return 0 if self.signalled else status

    def _stop_servers(self) -> None:
        for name, child in self.servers.items():
            resolved = self.resolution.stages[name]
            served = served_requests(resolved.output.endpoint[0]) if resolved.output.endpoint else None
            child.stop()
            directory = stage_dir(self.resolution.definition.run_dir, resolved.stage)
            record = manifest.read(directory) or {}
            line = f"ready in {record.get('ready_s', 0):.0f} s" + (f", {served:.0f} requests answered" if served else "")
            resolved.recorded = manifest.write(directory, {**record, "status": "done", "figures": {"line": line}})
            say(f"stage {name}: server stopped")
        self.servers.clear()

    def _install_signals(self) -> None:
        for signum in HANDLED:
            signal.signal(signum, self._on_signal)
        while _early:
            self._on_signal(_early.pop(0), None)

    # ------------------------------------------------------------------ stages
    def _pending(self, only: list[str] | None) -> list[str]:
        stages = self.resolution.stages
        pending = [n for n, r in stages.items() if not r.done and r.stage.kind != "serve" and (not only or n in only)]
        for name in pending if only else []:  # one job of a chain: what it reads must be there (a server: serving)
            missing = [ref for ref in self.resolution.definition.needs_of(name)
                       if not stages[ref].done and stages[ref].stage.kind != "serve"]
            if missing:
                raise PipelineError(f"stage {name} reads {', '.join(missing)}, which did not finish (their records in "
                                    f"{self.resolution.definition.run_dir})")
        return pending

    def _finished(self, resolved: Resolved) -> str | None:
        """None when a training stage reached its last iteration, else why not."""
        from megatron_mimesis.checkpoint.reader import CheckpointError, read_latest

        if resolved.stage.kind not in TRAINING:
            return None
        try:
            iteration = read_latest(resolved.output.path)
        except (CheckpointError, OSError):
            return "it saved no checkpoint"
        if iteration < resolved.config.train_iters:
            return f"it stopped at iteration {iteration} of {resolved.config.train_iters}"
        return None

    def _figures(self, resolved: Resolved, counted: dict) -> dict:
        figures = {}
        if resolved.stage.kind in TRAINING:
            figures["line"] = summary.training_figures(resolved.stage.kind, resolved.output.log_dir, self.python)
        requests = {}
        for server, before in counted.items():
            after = served_requests(self.resolution.stages[server].output.endpoint[0])
            if before is not None and after is not None:
                requests[server] = after - before
        if requests:
            figures["user_requests"] = requests
        return figures

    def _run_stage(self, resolved: Resolved) -> int:
        stage = resolved.stage
        directory = stage_dir(self.resolution.definition.run_dir, stage)
        servers = [ref for ref in self.resolution.definition.needs_of(stage.name)
                   if self.resolution.stages[ref].stage.kind == "serve"]
        for server in servers:
            if self.resolution.stages[server].stage.given is None:
                self._endpoint(self.resolution.stages[server])
        if self._stopped():  # a signal while its server started: the stage does not start
            raise PipelineError(f"stage {stage.name}: not started (a signal came while its inputs were made ready)")
        counted = {s: served_requests(self.resolution.stages[s].output.endpoint[0]) for s in servers}
        argv, env = command(stage, self.resolution.definition.run_dir, resolved.inputs, self.python)
        earlier = resolved.recorded or {}
        attempts, history = earlier.get("attempts", 0) + 1, earlier.get("history") or []  # attempts that ended
        record = {"stage": stage.name, "kind": stage.kind, "fingerprint": resolved.fingerprint,
                  "inputs": {key: {"stage": ref, "fingerprint": self.resolution.stages[ref].fingerprint,
                                   **resolved.inputs[key].record()} for key, ref in stage.handoffs().items()},
                  "outputs": resolved.output.record(), "command": argv, "env": env, "attempts": attempts,
                  "history": history}
        resolved.recorded = manifest.write(directory, {**record, "status": "running"})
        log = directory / "stage.log"
        say(f"stage {stage.name}: {'resuming' if attempts > 1 else 'running'} ({stage.kind}; log {log})")
        started = time.monotonic()
        self._current_name = stage.name
        self.current = Child(argv, env, log, STOP_GRACE_S)
        if self.signalled:  # it came while the child started: the handler had no child to pass it to
            self.current.signal(self.signalled)
        elif self.usr1_pending and stage.kind in TRAINING:  # the launcher, warned early, requeues the job as it is
            self.current.signal(signal.SIGUSR1)
        status = self.current.wait()
        self.current = self._current_name = None
        wall = round(time.monotonic() - started, 1)
        previous_wall = sum(a["wall_s"] for a in history)
        record["history"] = history = [*history, {"attempt": attempts, "exit": status, "wall_s": wall}]
        unfinished = self._finished(resolved) if status == 0 else None
        if status != 0 or unfinished or self.signalled:
            state = "interrupted" if self.signalled or unfinished else "failed"
            resolved.recorded = manifest.write(directory, {**record, "status": state, "exit": status})
            tail = log_tail(log, 15)
            if state == "failed":
                say(f"stage {stage.name}: failed (exit {status}); last lines of {log}:\n{tail}")
            else:
                say(f"stage {stage.name}: interrupted ({unfinished or 'stopped by a signal'}); the next run resumes it")
            return status or 1
        figures = self._figures(resolved, counted)
        resolved.recorded = manifest.write(directory, {**record, "status": "done", "figures": figures,
                                                       "wall_s": previous_wall + wall})
        say(f"stage {stage.name}: done in {summary.wall_text(previous_wall + wall)}"
            + (f": {figures['line']}" if figures.get("line") else ""))
        return 0

    def run(self, only: list[str] | None = None) -> int:
        started = time.monotonic()
        try:
            pending = self._pending(only)
        except PipelineError as exc:
            say(f"error: {exc}")
            return 2
        definition = self.resolution.definition
        say(f"pipeline {definition.name}: {len(self.resolution.stages)} stages in {definition.run_dir}; "
            + (f"to run: {', '.join(pending)}" if pending else "every stage is done, nothing to run"))
        self._install_signals()
        status = 0
        try:
            for name in pending:
                if self.signalled:  # it came before the stage (while the pipeline started): the stage does not start
                    break
                status = self._run_stage(self.resolution.stages[name])
                if status or self.signalled:
                    break
        except PipelineError as exc:
            say(f"error: {exc}")
            status = 2
        finally:
            self._stop_servers()
        if self.signalled:
            return 128 + self.signalled
        # a chain's stage job writes the summary of what is recorded so far: the last one's is the chain's
        text = summary.write(self.resolution, time.monotonic() - started if pending and not only else None)
        if not only:
            say(text)
        ignore_late_warnings()
        return status
