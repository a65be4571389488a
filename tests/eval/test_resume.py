"""A real eval_simulator process killed mid-scoring resumes where it stopped and ends as an uninterrupted run."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.eval.conftest import write_conversations
from tests.eval.test_cli import eval_simulator
from tests.eval.test_judge import candidates
from tests.rl.fakes import FakeOpenAIServer

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
POSITIONS = 7  # user turns of conftest.CONVERSATIONS


def slow_reply(messages):
    time.sleep(0.15)
    prompt = messages[-1]["content"]
    if "Candidate A:" in prompt:
        a, _ = candidates(prompt)
        return "2" if "yeah" in a else "6"
    return "yeah " + prompt.split()[-1]


def command(server, heldout, out, *extra):
    return [sys.executable, str(REPO / "tools" / "eval_simulator.py"), "--simulator",
            f"chat=openai:{server.base_url}@sim", "--judge", f"{server.base_url}@judge", "--no-labels",
            "--input", str(heldout), "--output", str(out), "--concurrency", "1", "--bootstrap", "0",
            "--no-progress", *extra]


def cache_lines(out: Path) -> int:
    path = out / "cache.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def test_a_killed_run_resumes_and_matches_an_uninterrupted_one(tmp_path):
    heldout = write_conversations(tmp_path / "h.jsonl")
    out = tmp_path / "killed"
    with FakeOpenAIServer(reply=slow_reply) as server:
        proc = subprocess.Popen(command(server, heldout, out), cwd=REPO, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, env={**os.environ, "OMP_NUM_THREADS": "1"})
        deadline = time.monotonic() + 300
        while cache_lines(out) < POSITIONS + 2 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)  # mid-scoring: the replies are in, the judge is part-way through
        proc.wait(timeout=30)
        cached = cache_lines(out)
        assert POSITIONS + 2 <= cached < 2 * POSITIONS, (cached, proc.stderr.read().decode()[-2000:])
        assert not (out / "results.json").exists()

        before = len(server.requests)
        assert eval_simulator.main(command(server, heldout, out, "--resume")[2:]) == 0
        assert len(server.requests) - before == 2 * POSITIONS - cached  # only what the cache did not hold
        assert eval_simulator.main(command(server, heldout, tmp_path / "fresh")[2:]) == 0
    killed_then_resumed = json.loads((out / "results.json").read_text())
    uninterrupted = json.loads((tmp_path / "fresh" / "results.json").read_text())
    assert killed_then_resumed["cells"] == uninterrupted["cells"]
    assert killed_then_resumed["cells"]["chat"]["turing_distance"]["value"] is not None
    assert cache_lines(out) == 2 * POSITIONS
