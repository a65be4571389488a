"""The tests' gloo launcher (test bodies run on N gloo ranks, forked from one server per test process that has
imported what every rank imports), and the processes of one run, found by an environment marker the test set
(never by a process name other runs share)."""

import os

from megatron_mimesis.gloo import GlooForkServer

__all__ = ["processes_with_env", "run_distributed"]

RANK_IMPORTS = ("torch.distributed", "megatron.core.models.gpt", "megatron_mimesis.training.train", "transformers")
_server: GlooForkServer | None = None


def run_distributed(fn, world_size: int, *args) -> list:
    """``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks: their return values, in rank order."""
    global _server
    if _server is None:
        _server = GlooForkServer(RANK_IMPORTS)
    return _server.run(fn, world_size, *args)


def processes_with_env(name: str, value: str) -> dict[int, dict]:
    """Live processes whose environment has ``name=value``: pid -> {ppid, cmdline, rss_mb}."""
    wanted = f"{name}={value}".encode()
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if wanted not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{entry}/status") as f:
                status = dict(line.split(":", 1) for line in f if ":" in line)
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue  # exited while being looked at
        if status.get("State", "").split()[:1] == ["Z"]:
            continue  # a zombie has exited; only its parent's wait is missing
        rss_kb = int(status.get("VmRSS", "0 kB").split()[0])
        found[int(entry)] = {"ppid": int(status["PPid"]), "cmdline": cmdline, "rss_mb": rss_kb / 1024}
    return found
