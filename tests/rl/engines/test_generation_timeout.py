"""generation_timeout_s: a generate call past the limit kills the process with a clear error and the thread stacks;
a call within it changes nothing. The watchdog ends its process, so each case runs in a subprocess."""

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

from megatron_mimesis.rl.engines.factory import build_rollout_engine
from megatron_mimesis.rl.engines.generation_timeout import EXIT_CODE, add_generation_timeout
from megatron_mimesis.rl.engines.local import LocalEngine

REPO = Path(__file__).resolve().parents[3]

# argv: generate's duration, the timeout, how long to live after the call (a finished call's watchdog must not fire)
SCRIPT = """
import sys, time
from megatron_mimesis.rl.engines.generation_timeout import add_generation_timeout

class SlowEngine:
    def generate(self, prompts, sampling):
        time.sleep(float(sys.argv[1]))
        return [p[::-1] for p in prompts]

engine = add_generation_timeout(SlowEngine(), float(sys.argv[2]))
print("generated", engine.generate([[1, 2], [3]], None), flush=True)
time.sleep(float(sys.argv[3]))
print("still alive", flush=True)
"""


def run_script(duration, timeout, linger):
    return subprocess.run([sys.executable, "-c", SCRIPT, str(duration), str(timeout), str(linger)], cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO), "RANK": "3"}, capture_output=True, text=True,
                          timeout=60)


def test_a_hung_generate_kills_the_process_with_the_reason_and_the_stacks():
    result = run_script(duration=30, timeout=0.5, linger=0)
    assert result.returncode == EXIT_CODE != 0
    assert "generated" not in result.stdout
    assert ("error: SlowEngine.generate ran longer than generation_timeout_s=0.5s on rank 3; all thread stacks "
            "follow") in result.stderr
    assert "in generate" in result.stderr  # faulthandler's stack of the main thread, stuck in the engine


def test_a_generate_within_the_limit_is_unaffected():
    result = run_script(duration=0, timeout=0.5, linger=1.5)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["generated [[2, 1], [3]]", "still alive"]
    assert result.stderr == ""


class Engine:
    def generate(self, prompts, sampling):
        return prompts


def test_the_engine_object_is_kept():
    engine = Engine()
    assert add_generation_timeout(engine, None) is engine and "generate" not in vars(engine)
    assert add_generation_timeout(engine, 60) is engine and "generate" in vars(engine)  # patched, not wrapped
    assert engine.generate([[7]], None) == [[7]]


def test_the_factory_puts_every_engine_under_the_configured_timeout():
    trainer = SimpleNamespace(model=["chunk"], device="cpu")
    for timeout_s, patched in ((None, False), (30.0, True)):
        config = SimpleNamespace(engine="local", generation_timeout_s=timeout_s, max_staleness=None)
        engine = build_rollout_engine(config, trainer, "tok", None)
        assert isinstance(engine, LocalEngine) and ("generate" in vars(engine)) == patched
