"""No process outlives a pipeline, on the three paths (a signal, a kill -9 of the pipeline, a stage that fails), and a
run stopped by a signal resumes where it stopped, then does nothing once done. The chain here is the demo's first
stages (data, mid-training through its launcher and torchrun, an export); tests/pipeline/test_loop.py runs the whole
loop with its vLLM server."""

import json
import os
import re
import signal
import subprocess
import sys

import pytest

from tests.pipeline.runs import REPO, PipelineRun, given_definition, latest, small_definition

pytestmark = pytest.mark.slow
STEPS = ["--train-iters", "12", "--save-interval", "1", "--eval-interval", "100", "--lr-warmup-iters", "2"]
GONE_S = 90  # the ranks finish the step they are in and save before they exit


@pytest.fixture
def data(pipeline_data):
    return pipeline_data


@pytest.fixture
def definition(tmp_path):
    return small_definition(tmp_path / "chain.yaml", {"midtrain_data": {}, "midtrain": {}, "agent_before": {}},
                            {"midtrain": STEPS})


def record(run_dir, stage):
    return json.loads((run_dir / stage / "stage.json").read_text())


def test_a_signal_stops_the_stage_it_reaches_and_the_next_run_resumes_it_then_does_nothing(tmp_path, definition,
                                                                                           data):
    run_dir = tmp_path / "run"
    run = PipelineRun(definition, run_dir, "--given", f"midtrain_data={data}")
    try:
        run.start().wait_until(lambda: latest(run_dir / "midtrain" / "checkpoints") >= 1, "a first checkpoint")
        run.proc.send_signal(signal.SIGTERM)
        assert run.wait(GONE_S) == 128 + signal.SIGTERM, run.output()
        assert not run.wait_gone(GONE_S), run.processes()
        assert record(run_dir, "midtrain")["status"] == "interrupted"
        stopped = latest(run_dir / "midtrain" / "checkpoints")
        assert 1 <= stopped < 12 and "pipeline: SIGTERM: stopping stage midtrain" in run.output(), run.output()

        assert run.start().wait() == 0, run.output()
        out = run.output()
        assert "to run: midtrain, agent_before" in out and "stage midtrain: resuming" in out, out
        stage_log = (run_dir / "midtrain" / "stage.log").read_text()
        assert f"resuming from {run_dir / 'midtrain' / 'checkpoints'} (iteration {stopped})" in stage_log
        done = record(run_dir, "midtrain")
        assert done["status"] == "done" and [a["exit"] for a in done["history"]] == [128 + signal.SIGTERM, 0], done
        assert done["wall_s"] == sum(a["wall_s"] for a in done["history"]), done  # both attempts' time
        assert done["figures"]["line"].endswith("(12 steps)"), done
        assert (run_dir / "agent_before" / "hf" / "config.json").is_file()

        assert run.start().wait() == 0
        out = run.output()
        assert "every stage is done, nothing to run" in out and not re.search("^stage ", out, re.M), out
    finally:
        run.kill_leftovers()


def test_a_kill_9_of_the_pipeline_leaves_no_process(tmp_path, definition, data):
    run_dir = tmp_path / "run"
    run = PipelineRun(definition, run_dir, "--given", f"midtrain_data={data}")
    try:
        run.start().wait_until(lambda: latest(run_dir / "midtrain" / "checkpoints") >= 1, "a first checkpoint")
        before = run.processes()
        assert len(before) >= 5, before  # keeper, launcher, torchrun, 2 ranks (and their helpers)
        os.kill(run.proc.pid, signal.SIGKILL)
        run.wait()
        assert not run.wait_gone(GONE_S), run.processes()
    finally:
        run.kill_leftovers()


def test_a_stage_that_fails_ends_the_pipeline_with_its_reason_and_no_process(tmp_path, data):
    definition = small_definition(tmp_path / "chain.yaml", {"midtrain_data": {}, "midtrain": {}, "agent_before": {}},
                                  {"midtrain": [*STEPS, "--data-path", str(tmp_path / "no-such-data")]})
    run_dir = tmp_path / "run"
    run = PipelineRun(definition, run_dir, "--given", f"midtrain_data={data}")
    try:
        status = run.start().wait()
        out = run.output()
        assert status == 2 and "stage midtrain: failed (exit 2); last lines of" in out, out
        assert f"error: data_path: {tmp_path / 'no-such-data'}" in out, out
        assert record(run_dir, "midtrain")["status"] == "failed"
        assert "| agent_before | export | not run |" in (run_dir / "summary.md").read_text()
        assert not run.wait_gone(10), run.processes()
    finally:
        run.kill_leftovers()


def test_a_signal_while_the_server_starts_stops_the_pipeline_before_the_stage_that_reads_it(tmp_path, data,
                                                                                           demo_vocab_export):
    """SIGTERM while the simulator's server is starting for agent RL: the server is stopped, agent RL never starts
    (the signal is not lost in the wait for the server), and nothing is left."""
    if not (REPO / ".venv-vllm" / "bin" / "python").exists():
        pytest.skip("the server runs in .venv-vllm (make venv-vllm; make test builds it)")
    definition = given_definition(tmp_path / "serve.yaml", {"simulator_export": demo_vocab_export,
                                                           "agent_before": demo_vocab_export},
                                  ["simulator_server", "agent_rl"], {"agent_rl": {"args": ["--train-iters", "1"]}})
    run_dir = tmp_path / "run"
    run = PipelineRun(definition, run_dir)
    try:
        run.start().wait_until(lambda: any("vllm.entrypoints.openai.api_server" in p["cmdline"]
                                           for p in run.processes().values()), "the server's start")
        run.proc.send_signal(signal.SIGTERM)
        assert run.wait(GONE_S) == 128 + signal.SIGTERM, run.output()
        out = run.output()
        assert "stopped by a signal while waiting for stage simulator_server's server" in out, out
        assert "stage agent_rl:" not in out and not (run_dir / "agent_rl" / "stage.json").exists(), out
        assert not run.wait_gone(GONE_S), run.processes()
    finally:
        run.kill_leftovers()


@pytest.mark.parametrize("done", [False, True])
def test_a_pre_timeout_warning_after_the_work_is_done_does_not_fail_the_job(done):
    """SLURM's SIGUSR1 that comes while a finished stage job's Python exits: Python's finalization had put back the
    default action of the pipeline's handled signals, SIGUSR1's is to die, and SLURM counted the job FAILED. Here the
    process replaces itself with a shell that signals itself, which is where a Python-level handler is gone as at
    finalization: the signal kills it, unless the Runner finished (``ignore_late_warnings``), whose ignored
    disposition outlives Python's handlers."""
    code = ("import os\n"
            "from megatron_mimesis.pipeline.runner import catch_signals_early, ignore_late_warnings\n"
            "catch_signals_early()\n"
            + ("ignore_late_warnings()\n" if done else "")
            + "os.execv('/bin/sh', ['sh', '-c', 'kill -USR1 $$; exit 0'])\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == (0 if done else -signal.SIGUSR1), proc.stderr
