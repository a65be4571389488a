"""The loop's second half through ``bash launch/pipeline.sh``: a real ``vllm serve`` of the simulator -> agent RL whose
user is that server (3 steps) -> the agent's export -> its evaluation against the served simulator. Killed with
SIGKILL during agent RL, it leaves no process (the server and its engine included); run again, it resumes agent RL
from its checkpoint and skips everything before; run a third time, it does nothing.

The simulator and the agent's start are given (the tiny model at random, as HF directories), so that the run reaches
agent RL in a minute; the whole loop, every stage from the data on, is submitted to a private SLURM cluster by
tests/pipeline/test_slurm_chain.py. The pipeline runs in ``.venv`` as the demo's does (its server in ``.venv-vllm``,
where this module runs)."""

import json
import os
import re
import signal

import pytest

from tests.pipeline.runs import FEW, SMALL_EVALS, VENV_PYTHON, PipelineRun, given_definition, latest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
GONE_S = 120
STAGES = ["simulator_server", "agent_rl", "agent_export", "agent_eval"]


@pytest.fixture(scope="module")
def loop(tmp_path_factory, pipeline_data, demo_vocab_export):
    if not VENV_PYTHON.exists():
        pytest.skip("the pipeline runs in .venv (make venv)")
    root = tmp_path_factory.mktemp("loop")
    definition = given_definition(
        root / "loop.yaml", {"midtrain_data": pipeline_data, "simulator_export": demo_vocab_export,
                             "agent_before": demo_vocab_export},
        STAGES, {"agent_rl": {"args": FEW["agent_rl"]}, "agent_eval": SMALL_EVALS["agent_eval"]})
    run = PipelineRun(definition, root / "run", python=VENV_PYTHON)
    yield run
    run.kill_leftovers()


def record(run, stage):
    return json.loads((run.run_dir / stage / "stage.json").read_text())


def test_a_kill_9_during_agent_rl_leaves_no_process_and_the_next_run_resumes_agent_rl(loop):
    checkpoints = loop.run_dir / "agent_rl" / "checkpoints"
    loop.start().wait_until(lambda: latest(checkpoints) >= 1, "agent RL's first checkpoint", timeout=1200)
    alive = loop.processes()
    assert any("vllm.entrypoints.openai.api_server" in p["cmdline"] for p in alive.values()), alive
    os.kill(loop.proc.pid, signal.SIGKILL)
    loop.wait()
    assert not loop.wait_gone(GONE_S), loop.processes()
    stopped = latest(checkpoints)
    assert record(loop, "agent_rl")["status"] == "running"  # what a killed pipeline leaves; the next run resumes it

    assert loop.start().wait(1200) == 0, loop.output()
    out = loop.output()
    assert "to run: agent_rl, agent_export, agent_eval" in out, out
    assert "stage agent_rl: resuming" in out, out
    log = (loop.run_dir / "agent_rl" / "stage.log").read_text()
    assert f"resuming from {checkpoints} (iteration {stopped})" in log, log[-3000:]
    assert not loop.wait_gone(30), loop.processes()


def test_the_agent_was_trained_against_the_served_simulator_and_the_summary_says_so(loop):
    agent = record(loop, "agent_rl")
    assert agent["status"] == "done" and len(agent["history"]) == 1, agent  # the killed attempt left no history
    requests = agent["figures"]["user_requests"]["simulator_server"]
    assert requests >= 3 * 2 * 4, agent  # >= 1 user turn per episode of the resumed steps (2 tasks x 4 rollouts)
    options = json.loads(agent["command"][agent["command"].index("--user-model-options") + 1])
    served = record(loop, "simulator_server")
    assert options["base_url"] == served["outputs"]["endpoint"][0] and options["model"] == "mimesis-sim", agent
    simulator = loop.definition.read_text().split("simulator_export:", 1)[1].split("path: ", 1)[1].split()[0]
    assert served["command"][served["command"].index("--model") + 1] == simulator, served
    summary = (loop.run_dir / "summary.md").read_text()
    assert re.search(r"^\| agent_rl \| rl_agent \| done \| reward_mean .* \(3 steps\); \d+ requests answered by "
                     r"simulator_server \|", summary, re.M), summary
    assert re.search(r"^\| before \| [\d.]+ \| [\d.]+ \|", summary, re.M), summary  # the agents x users table
    results = json.loads((loop.run_dir / "agent_eval" / "report" / "results.json").read_text())
    assert {"before", "after"} <= set(json.dumps(results).split('"')), results


def test_a_run_after_completion_does_nothing(loop):
    assert loop.start().wait(300) == 0
    out = loop.output()
    assert "every stage is done, nothing to run" in out and not re.search("^stage ", out, re.M), out
    assert not loop.wait_gone(5), loop.processes()
