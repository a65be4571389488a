"""Task-difficulty calibration end to end on the toy env: one agent against two simulators, gap, both ECEs and
τ-USI by hand."""

import json
import re
from contextlib import ExitStack

import pytest
from transformers import AutoTokenizer

from tests.eval.test_cli import eval_simulator
from tests.rl.fakes import FakeOpenAIServer
from tests.tools.test_eval_agent import oracle_server

REAL = {"toy-4": 0.8, "toy-5": 0.3}  # share of real users who got their code


def simulator(asks_properly: bool):
    """A chat model playing the toy user: asks for its item's code, or for the code of something else."""

    def reply(messages):
        scenario = re.search(r"access code for (\w+)", messages[0]["content"])
        if scenario is None:  # a held-out chit-chat position
            return "haha yeah"
        return f"what is the code for {scenario.group(1) if asks_properly else 'nothing'}?"

    return reply


def test_success_gap_and_ece_against_real_outcomes(tiny_dataset, heldout_file, tmp_path):
    tokenizer = tiny_dataset / "tokenizer"
    outcomes = tmp_path / "outcomes.jsonl"
    outcomes.write_text("".join(json.dumps({"task_id": t, "success": s}) + "\n" for t, s in REAL.items()))
    with ExitStack() as stack:
        agent = stack.enter_context(oracle_server(AutoTokenizer.from_pretrained(tokenizer)))
        asker = stack.enter_context(FakeOpenAIServer(reply=simulator(True)))
        vague = stack.enter_context(FakeOpenAIServer(reply=simulator(False)))
        code = eval_simulator.main([
            "--simulator", f"asker=openai:{asker.base_url}@u", "--simulator", f"vague=openai:{vague.base_url}@u",
            "--input", str(heldout_file), "--outcomes", str(outcomes), "--agent", f"openai:{agent.base_url}@oracle",
            "--agent-tokenizer", str(tokenizer), "--env", "toy", "--max-agent-turns", "1",
            "--agent-max-new-tokens", "8", "--success-reward", "2", "--trials", "5", "--bootstrap", "0",
            "--output", str(tmp_path / "out"), "--no-progress"])
    assert code == 0
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    cells = results["cells"]
    # the oracle gives the asked-for code briefly: 2 points with the asker, 1 (brief, wrong code) with the vague one
    assert results["calibration"]["asker"]["per_task"] == {"toy-4": 1.0, "toy-5": 1.0}
    assert results["calibration"]["vague"]["per_task"] == {"toy-4": 0.0, "toy-5": 0.0}
    assert cells["human"]["success_rate"]["value"] == pytest.approx(0.55)
    assert cells["asker"]["gap"]["value"] == pytest.approx(45.0) and cells["vague"]["gap"]["value"] == pytest.approx(-55.0)
    assert cells["asker"]["ece"]["value"] == pytest.approx(0.45)  # one bin: |1.0 - 0.55|
    assert cells["vague"]["ece"]["value"] == pytest.approx(0.55)
    # τ-USI's ECE: each task's difficulty pools both simulators' 10 episodes (5 solved), so both tasks share bin 2
    # and every trial gives |1 - 0.55| and |0 - 0.55|
    assert cells["asker"]["ece_difficulty"]["value"] == pytest.approx(0.45)
    assert cells["vague"]["ece_difficulty"]["value"] == pytest.approx(0.55)
    for row, ece in (("asker", 0.45), ("vague", 0.55)):
        dimensions = [cells[row][f"usi_{d}"]["value"] for d in ("D1_conv", "D2_info", "D3_clarif", "D4_react")]
        assert all(0.0 <= d <= 100.0 for d in dimensions)
        assert cells[row]["tau_usi"]["value"] == pytest.approx((sum(dimensions) + (1 - ece) * 100) / 5)
    assert cells["human"]["tau_usi"]["value"] is None
    episodes = [json.loads(line) for line in (tmp_path / "out" / "items.jsonl").read_text().splitlines()
                if "episode" in json.loads(line)]
    assert sorted((e["row"], e["episode"]["task_id"]) for e in episodes) == sorted(
        [(row, task) for row in ("asker", "vague") for task in ("toy-4", "toy-5")] * 5)
    table = (tmp_path / "out" / "table.md").read_text()
    assert "| asker | 1.000 | 45.000 | 0.450 | 0.450 |" in table
    assert f"| {cells['asker']['tau_usi']['value']:.3f} |" in table.split("### τ-USI")[1].split("###")[0]
