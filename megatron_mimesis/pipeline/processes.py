"""The pipeline's child processes: each stage's command and the simulator's server, each under a keeper
(``keeper.py``) so that a signal, a kill -9 of the pipeline or a failing stage leaves no process behind."""

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from megatron_mimesis.pipeline.definition import PipelineError

# a stopped stage's ranks finish their phase and save before they exit (torchrun's --shutdown-timeout, 300 s by
# default in the launchers); the keeper kills what is left after that
STOP_GRACE_S = int(os.environ.get("SHUTDOWN_TIMEOUT", 300)) + 30
SERVER_GRACE_S = 30


class Child:
    """A command under its keeper, in a session of its own (a Ctrl-C of the pipeline's terminal reaches the pipeline,
    which decides what its stages get), its output appended to ``log``."""

    def __init__(self, argv: list[str], env: dict, log: Path, grace_s: float):
        log.parent.mkdir(parents=True, exist_ok=True)
        self.log = log
        with open(log, "a") as out:
            keeper = [sys.executable, "-m", "megatron_mimesis.pipeline.keeper", str(grace_s), str(os.getpid()), "--"]
            self.proc = subprocess.Popen([*keeper, *argv], env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)

    def signal(self, signum: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signum)

    def wait(self) -> int:
        return self.proc.wait()

    def stop(self) -> int:
        self.signal(signal.SIGTERM)
        return self.wait()

    def tail(self, lines: int = 20) -> str:
        return log_tail(self.log, lines)


def log_tail(log: Path, lines: int = 20) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 5) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.read().decode() if response.status == 200 else None
    except (OSError, urllib.error.URLError):
        return None


def served_requests(base_url: str) -> float | None:
    """Requests the server has answered, from vLLM's Prometheus counters (``vllm:request_success_total``)."""
    text = _get(base_url.removesuffix("/v1") + "/metrics")
    if text is None:
        return None
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:request_success_total"))


def wait_ready(base_url: str, model: str, timeout_s: float, child: Child | None = None, what: str = "server",
               stopped=lambda: False) -> None:
    """Until ``base_url`` serves ``model`` (``/v1/models``); a server that exits or stays silent is one line, and so
    is a wait that ``stopped()`` ends (the pipeline got a signal meanwhile)."""
    import json

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if stopped():
            raise PipelineError(f"stopped by a signal while waiting for {what}")
        if child is not None and child.proc.poll() is not None:
            raise PipelineError(f"{what} exited with {child.proc.returncode} before it served {model}; "
                                f"log {child.log}:\n{child.tail()}")
        body = _get(f"{base_url}/models")
        if body is not None:
            served = [m.get("id") for m in json.loads(body).get("data", [])]
            if model in served:
                return
            raise PipelineError(f"{base_url} serves {served}, not {model}")
        time.sleep(2)
    raise PipelineError(f"{what} at {base_url} did not serve {model} within {timeout_s:.0f} s"
                        + (f"; log {child.log}:\n{child.tail()}" if child else ""))
