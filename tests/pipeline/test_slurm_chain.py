"""The pipeline's chain submitted to a real SLURM (a private 4-node cluster: tests/slurm_cluster.py) as a user submits
it: ``bash launch/pipeline.sh submit`` of the CPU loop (launch/pipelines/demo.yaml, its own ``slurm`` fields: CPU
nodes, the training stages on 2), then ``bash launch/pipeline.sh status``.

The whole loop at a few steps per stage: every stage a job with ``afterok`` on what it reads, the simulator served by
a job of its own whose address (and job id) agent RL and the evaluation read, and the release job that cancels the
server. A stale ``serving`` record that an earlier submission's server left is not trusted; the server's time limit
is shorter than agent RL's, so agent RL requeues it before it trains and waits for its new address. A chain whose
training stage fails (its save directory turns read-only mid-run) cancels what reads it, ``status`` names the stage
and its logs, and the chain submitted again skips what is done and resumes the failed stage from its checkpoint. A
chain that asks for more nodes than the cluster has is refused at submit, in one line, with nothing queued (SLURM
itself would accept the job and leave it pending forever).
"""

import json
import re
import subprocess
import time

import pytest

from megatron_mimesis.pipeline import manifest
from tests.launch.test_failures import unwritable
from tests.pipeline.runs import FEW, LOOP, REPO, SMALL_EVALS, VENV_PYTHON, latest, small_definition
from tests.slurm_cluster import ENDED, ended, job_env, wait_job

pytestmark = [pytest.mark.slow, pytest.mark.slurm]


def _pipeline(cluster, *args, timeout: float = 300) -> subprocess.CompletedProcess:
    env = job_env(cluster, PYTHON=str(VENV_PYTHON))
    return subprocess.run(["bash", "launch/pipeline.sh", *map(str, args)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


def _jobs(run_dir) -> dict[str, str]:
    return dict(line.split() for line in (run_dir / "slurm_jobs.txt").read_text().splitlines())


def _states(cluster, jobs: dict[str, str]) -> dict[str, str]:
    return {name: cluster.job(job).get("JobState", "UNKNOWN") for name, job in jobs.items()}


def _wait_all_ended(cluster, run_dir, timeout: float) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    while True:
        states = _states(cluster, _jobs(run_dir))
        if all(state in ENDED for state in states.values()):
            return states
        if time.monotonic() > deadline:
            logs = "\n".join(f"{p}: {p.read_text()[-1500:]}" for p in run_dir.glob("*/slurm-*.out"))
            raise AssertionError(f"jobs still running after {timeout} s: {states}\n{logs}")
        time.sleep(3)


def _record(run_dir, stage) -> dict:
    return json.loads((run_dir / stage / "stage.json").read_text())


@pytest.fixture(scope="module")
def venvs():
    if not VENV_PYTHON.exists() or not (REPO / ".venv-vllm" / "bin" / "python").exists():
        pytest.skip("the chain runs in .venv and serves from .venv-vllm (make venv venv-vllm; make test builds both)")


def test_the_cpu_chain_runs_every_stage_as_a_job_and_agent_rl_reads_the_served_simulator(
        slurm_cluster, venvs, tmp_path):
    stages = {name: SMALL_EVALS.get(name, {}) for name in LOOP}
    # the server's limit is agent RL's, but it started first (agent RL is held until it serves: SLURM may otherwise
    # start both in one scheduling pass): agent RL finds it with less time left than itself and requeues it before it
    # trains (once: restarted, the server has more time left than agent RL)
    stages["simulator_server"] = {"slurm": {"time": "00:25:00"}}
    stages["agent_rl"] = {"slurm": {"nodes": 2, "time": "00:25:00"}}
    # past its file's 900 s warning, which then comes 5 min after the job starts (at 16 min it came at 60 s, while a
    # loaded machine's job was still exiting)
    stages["agent_eval"] = {**stages["agent_eval"], "slurm": {"time": "00:20:00"}}
    definition = small_definition(tmp_path / "chain.yaml", stages, FEW, slurm={"gpus_per_node": 0})
    run_dir = tmp_path / "run"
    stale = _plant_a_stale_server_record(definition, run_dir)

    started = time.monotonic()
    submitted = _pipeline(slurm_cluster, "submit", definition, "--run-dir", run_dir)
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    jobs = _jobs(run_dir)
    assert set(jobs) == {*LOOP, "simulator_server-release"}, jobs
    assert all((run_dir / name).is_dir() for name in LOOP)  # each job's --output directory exists before it runs
    for name in ("midtrain", "sft", "simulator_rl", "agent_rl"):  # planned exactly as submitted: 2 nodes x 1 rank
        assert re.search(rf"^== {name} \(\w+\): job {jobs[name]}, 2 node\(s\) x 0 GPU\(s\)", submitted.stdout, re.M)
    slurm_cluster.command("scontrol", "hold", jobs["agent_rl"])
    server = wait_job(slurm_cluster, jobs["simulator_server"],
                      lambda info: ended(info) or _serving(run_dir, jobs["simulator_server"]), "serving", timeout=900)
    assert not ended(server), (server, manifest.read(run_dir / "simulator_server"))
    slurm_cluster.command("scontrol", "release", jobs["agent_rl"])
    states = _wait_all_ended(slurm_cluster, run_dir, timeout=1500)
    wall = time.monotonic() - started
    logs = {name: "".join(p.read_text() for p in (run_dir / name).glob("slurm-*.out")) for name in LOOP}
    assert states == {**dict.fromkeys(LOOP, "COMPLETED"), "simulator_server": "CANCELLED",
                      "simulator_server-release": "COMPLETED"}, (states, logs)

    server = _record(run_dir, "simulator_server")
    # its own job, requeued by agent RL; on a loaded machine agent RL runs long enough that the evaluation, starting
    # after it, finds the server with less time left than itself too and requeues it again: every restart is a
    # reader's, said in that reader's log
    requeued = {name: logs[name].count(f"server job {jobs['simulator_server']} has ") for name in ("agent_rl",
                                                                                                  "agent_eval")}
    assert server["job"] == jobs["simulator_server"] and requeued["agent_rl"] == 1, (server, requeued)
    assert server["restart"] == sum(requeued.values()), (server, requeued)
    assert server["outputs"]["endpoint"] != stale["outputs"]["endpoint"]
    agent = _record(run_dir, "agent_rl")
    requests = agent["figures"]["user_requests"]["simulator_server"]
    assert requests >= 3 * 2 * 4, agent  # >= 1 user turn per episode (3 steps x 2 tasks x 4 rollouts)
    options = json.loads(agent["command"][agent["command"].index("--user-model-options") + 1])
    # the server says each start's address: agent RL used the one its requeue made, the record holds the last
    starts = re.findall(rf"serving at (\S+) \(job {jobs['simulator_server']}, start (\d+)\)", logs["simulator_server"])
    assert [int(n) for _, n in starts] == list(range(1, server["restart"] + 2)), logs["simulator_server"]
    assert options["base_url"] == starts[1][0] and server["outputs"]["endpoint"][0] == starts[-1][0], (options, starts)
    summary = (run_dir / "summary.md").read_text()
    for name in LOOP:
        if name != "simulator_server":
            assert re.search(rf"^\| {name} \| \w+ \| done \|", summary, re.M), summary
    assert "NLL/token" in summary and re.search(r"^\| before \| [\d.]+ \| [\d.]+ \|", summary, re.M), summary  # both tables
    status = _pipeline(slurm_cluster, "status", definition, "--run-dir", run_dir)
    assert status.returncode == 0 and "failed:" not in status.stdout, status.stdout + status.stderr
    assert re.search(rf"^agent_rl +{jobs['agent_rl']} +COMPLETED +done ", status.stdout, re.M), status.stdout
    print(f"CPU chain on a 4-node SLURM: {wall:.0f} s from submit to the last job's end; {requests:.0f} requests "
          f"answered by the served simulator during agent RL; states {states}")


def _serving(run_dir, job: str) -> bool:
    record = manifest.read(run_dir / "simulator_server") or {}
    return (record.get("job"), record.get("status")) == (job, "serving")


def _plant_a_stale_server_record(definition, run_dir) -> dict:
    """What a killed server job of an earlier submission leaves: ``serving``, at an address nothing answers."""
    from megatron_mimesis.pipeline import definition as definitions
    from megatron_mimesis.pipeline.resolve import resolve

    resolution = resolve(definitions.load(definition, run_dir), slurm=True, plans=False)
    fingerprint = resolution.stages["simulator_server"].fingerprint
    return manifest.write(run_dir / "simulator_server", {
        "stage": "simulator_server", "kind": "serve", "fingerprint": fingerprint, "job": "1", "restart": 0,
        "status": "serving", "outputs": {"kind": "endpoint", "endpoint": ["http://127.0.0.1:9/v1", "mimesis-sim"]}})


def test_a_failed_stage_cancels_its_readers_status_names_it_and_the_chain_resubmitted_resumes_it(
        slurm_cluster, venvs, tmp_path, pipeline_data):
    definition = small_definition(tmp_path / "chain.yaml", {"midtrain_data": {}, "midtrain": {}, "agent_before": {}},
                                  {"midtrain": ["--train-iters", "6", "--save-interval", "1", "--eval-interval",
                                                "100", "--lr-warmup-iters", "2"]}, slurm={"gpus_per_node": 0})
    run_dir = tmp_path / "run"
    given = ["--given", f"midtrain_data={pipeline_data}"]
    submitted = _pipeline(slurm_cluster, "submit", definition, "--run-dir", run_dir, *given)
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    assert "== midtrain_data: given, no job" in submitted.stdout
    first = _jobs(run_dir)
    checkpoints = run_dir / "midtrain" / "checkpoints"
    deadline = time.monotonic() + 600
    while latest(checkpoints) < 2:
        assert time.monotonic() < deadline and _states(slurm_cluster, first)["midtrain"] not in ENDED, first
        time.sleep(1)
    with unwritable(checkpoints):  # the next save of midtrain fails: the stage fails, agent_before cannot run
        states = _wait_all_ended(slurm_cluster, run_dir, timeout=600)
    saved = latest(checkpoints)
    assert states == {"midtrain": "FAILED", "agent_before": "CANCELLED"}, states
    status = _pipeline(slurm_cluster, "status", definition, "--run-dir", run_dir, *given)
    assert status.returncode == 1, status.stdout + status.stderr
    failed = [line for line in status.stdout.splitlines() if line.startswith("failed:")]
    assert len(failed) == 1 and re.fullmatch(
        rf"failed: midtrain \(job {first['midtrain']}, FAILED \(exit \d+:0\)\): {run_dir}/midtrain/slurm-"
        rf"{first['midtrain']}\.out; stage log {run_dir}/midtrain/stage\.log", failed[0]), status.stdout
    assert "cancelled with it: agent_before" in status.stdout, status.stdout
    assert "save of iteration" in (run_dir / "midtrain" / "stage.log").read_text()

    again = _pipeline(slurm_cluster, "submit", definition, "--run-dir", run_dir, *given)
    assert again.returncode == 0, again.stdout + again.stderr
    second = _jobs(run_dir)
    assert set(second) == {"midtrain", "agent_before"} and second["midtrain"] != first["midtrain"]
    assert _wait_all_ended(slurm_cluster, run_dir, timeout=600) == {"midtrain": "COMPLETED",
                                                                   "agent_before": "COMPLETED"}
    stage_log = (run_dir / "midtrain" / "stage.log").read_text()
    assert f"resuming from {checkpoints} (iteration {saved})" in stage_log, stage_log[-3000:]
    assert _record(run_dir, "midtrain")["status"] == "done" and latest(checkpoints) == 6
    assert _pipeline(slurm_cluster, "status", definition, "--run-dir", run_dir, *given).returncode == 0


def test_a_chain_asking_for_more_nodes_than_the_cluster_has_is_refused_with_nothing_left_queued(
        slurm_cluster, venvs, tmp_path, pipeline_data):
    definition = small_definition(tmp_path / "chain.yaml", {"midtrain_data": {}, "sft_data": {},
                                                            "midtrain": {"slurm": {"nodes": 8}}}, {},
                                  slurm={"gpus_per_node": 0})
    run_dir = tmp_path / "run"
    before = set(slurm_cluster.command("squeue", "--noheader", "--format=%i").split())
    result = _pipeline(slurm_cluster, "submit", definition, "--run-dir", run_dir, "--given",
                       f"midtrain_data={pipeline_data}")
    assert result.returncode == 2, result.stdout + result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: sbatch refused stage midtrain (nothing submitted): "), line
    assert "Requested node configuration is not available" in line, line
    assert set(slurm_cluster.command("squeue", "--noheader", "--format=%i").split()) == before
    assert not (run_dir / "slurm_jobs.txt").exists()
