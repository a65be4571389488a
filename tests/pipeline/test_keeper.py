"""No process of a stage outlives the pipeline, however it dies and whenever: a stand-in pipeline (the real
``processes.Child``, so the real keeper) starts a stage whose rank is blocked in a step (it ignores SIGTERM, as agent
RL's ranks retrying a user model that was stopped beside them do) and is killed with SIGKILL at many points, from
before the keeper's ``prctl`` to the stage's steady run. The keeper once waited for its command to exit before its
grace began, so such a stage outlived the pipeline forever (issue 42)."""

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid

from tests.multiproc import kill_all, processes_with_env
from tests.pipeline.runs import REPO

MARKER = "MIMESIS_TEST_KEEPER"
GRACE_S = 2
# seconds after the pipeline's start: its own start (~0.2 s), the keeper's start and prctl, the launcher's, the
# rank's, then the stage at work
KILL_POINTS = [0.0, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4, 0.5, 0.6, 0.8, 1.0, 1.5, 2.5, 4.0]

STAGE = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    from megatron_mimesis import lifetime
    if sys.argv[1] == "launcher":  # torchrun's part: forwards a stop to its rank and waits for it
        rank = subprocess.Popen([sys.executable, __file__, "rank", str(os.getpid())], start_new_session=True)
        signal.signal(signal.SIGTERM, lambda *_: rank.send_signal(signal.SIGTERM))
        rank.wait()
    else:  # a rank in a session of its own, tied to its launcher, blocked in its step
        lifetime.die_with_parent(int(sys.argv[2]))
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        open(__file__ + ".ready", "w").close()
        time.sleep(3600)
""")

PIPELINE = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from megatron_mimesis.pipeline.processes import Child
    Child([sys.executable, sys.argv[1], "launcher"], {}, Path(sys.argv[2]), float(sys.argv[3]))
    time.sleep(3600)
""")


def _survivors(markers: list[str], timeout: float) -> dict[int, dict]:
    deadline = time.monotonic() + timeout
    while True:
        alive = {pid: info for marker in markers for pid, info in processes_with_env(MARKER, marker).items()}
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


def test_a_pipeline_killed_at_any_point_of_a_stages_start_or_run_leaves_no_process(tmp_path):
    stage = tmp_path / "stage.py"
    stage.write_text(STAGE)
    started = []
    for i, at in enumerate(KILL_POINTS):
        marker = uuid.uuid4().hex
        env = {**os.environ, MARKER: marker, "PYTHONPATH": str(REPO)}
        pipeline = subprocess.Popen([sys.executable, "-c", PIPELINE, str(stage), str(tmp_path / f"stage-{i}.log"),
                                     str(GRACE_S)], env=env, cwd=REPO)
        started.append((at, time.monotonic(), pipeline, marker))
    for at, t0, pipeline, _ in sorted(started, key=lambda s: s[0]):
        time.sleep(max(0.0, t0 + at - time.monotonic()))
        pipeline.kill()
    for _, _, pipeline, _ in started:
        pipeline.wait()
    markers = [marker for *_, marker in started]
    try:
        # the rank that ignores SIGTERM is killed GRACE_S after the keeper's SIGTERM; the rest is process start-up
        alive = _survivors(markers, GRACE_S + 15)
        points = [at for at, *_, marker in started if processes_with_env(MARKER, marker)]
        assert not alive, f"kill points with survivors: {points} of {len(KILL_POINTS)}: {alive}"
    finally:
        kill_all(_survivors(markers, 0))


def test_a_stopped_stage_that_ignores_the_stop_is_killed_when_its_grace_ends(tmp_path):
    stage = tmp_path / "stage.py"
    stage.write_text(STAGE)
    marker = uuid.uuid4().hex
    keeper = subprocess.Popen([sys.executable, "-m", "megatron_mimesis.pipeline.keeper", str(GRACE_S), str(os.getpid()), "--",
                               sys.executable, str(stage), "launcher"],
                              env={**os.environ, MARKER: marker, "PYTHONPATH": str(REPO)}, cwd=REPO)
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "stage.py.ready").exists() and time.monotonic() < deadline:  # the rank ignores SIGTERM
            time.sleep(0.1)
        stopped = time.monotonic()
        keeper.send_signal(signal.SIGTERM)
        # the launcher never exits by itself; the keeper kills its group at the grace's end, the rank dies with it
        assert keeper.wait(GRACE_S + 10) == 128 + signal.SIGKILL
        assert GRACE_S <= time.monotonic() - stopped < GRACE_S + 5
        assert not _survivors([marker], 5)
    finally:
        kill_all(_survivors([marker], 0))
