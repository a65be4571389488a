"""Agent RL on a split layout through ``bash launch/pipeline.sh``: a serve stage of the agent's starting weights (real
``vllm serve``, dev mode) as the stage's ``rollout``, beside the served simulator as its user; agent RL at TP=2 samples
from it a version ahead and updates its weights after every step; the pipeline stops both servers at the end."""

import json

import pytest
import yaml

from tests.pipeline.runs import FEW, VENV_PYTHON, PipelineRun, given_definition

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_agent_rl_samples_from_a_served_policy_that_takes_its_weights(tmp_path, pipeline_data, demo_vocab_export):
    if not VENV_PYTHON.exists():
        pytest.skip("the pipeline runs in .venv (make venv)")
    path = given_definition(tmp_path / "split.yaml", {"midtrain_data": pipeline_data,
                                                      "simulator_export": demo_vocab_export,
                                                      "agent_before": demo_vocab_export},
                            ["simulator_server", "agent_rl"],
                            {"agent_rl": {"args": [*FEW["agent_rl"], "--max-staleness", "1"],
                                          "rollout": "policy_server"}})
    data = yaml.safe_load(path.read_text())
    stages = {}
    for name, stage in data["stages"].items():
        if name == "agent_rl":
            stages["policy_server"] = {**data["stages"]["simulator_server"], "model": "agent_before", "name": "policy"}
        stages[name] = stage
    path.write_text(yaml.safe_dump({**data, "stages": stages}, sort_keys=False))
    run = PipelineRun(path, tmp_path / "run", python=VENV_PYTHON)
    try:
        assert run.start().wait(1500) == 0, run.output()
        assert not run.wait_gone(60), run.processes()  # both servers stopped with the pipeline
    finally:
        run.kill_leftovers()
    agent = json.loads((run.run_dir / "agent_rl" / "stage.json").read_text())
    served = json.loads((run.run_dir / "policy_server" / "stage.json").read_text())
    options = json.loads(agent["command"][agent["command"].index("--engine-options") + 1])
    assert agent["command"][agent["command"].index("--engine") + 1] == "served"
    assert options["base_url"] == served["outputs"]["endpoint"][0] and options["model"] == "policy"
    records = [json.loads(line) for line in (run.run_dir / "agent_rl" / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [1, 2, 3]
    assert all(r["staleness/0"] + r["staleness/1"] == r["rows"] > 0 for r in records)
    assert sorted(p.name for p in (run.run_dir / "agent_rl" / "rollout-weights").iterdir()) == ["v00000003"]
