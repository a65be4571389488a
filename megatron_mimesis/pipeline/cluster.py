"""What the pipeline and the launchers ask SLURM (``scontrol``, ``sacct`` where the cluster keeps accounting, ``sinfo``):
the state of the chain's jobs, SLURM's time strings, and the address at which other nodes reach a node, in one place
for the chain's submission, its stage jobs, ``pipeline.sh status`` and ``launch/common.sh``.

    python -m megatron_mimesis.pipeline.cluster address [NODE]   # the launchers' rendezvous address
"""

import os
import re
import socket
import subprocess
import sys

# states in which a job may still run (or is running); any other state is an end
ACTIVE = {"PENDING", "CONFIGURING", "RUNNING", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD", "RESIZING", "SUSPENDED",
          "COMPLETING", "SIGNALING", "STAGE_OUT", "RESV_DEL_HOLD", "SPECIAL_EXIT"}
UNLIMITED = ("UNLIMITED", "INFINITE", "NOT_SET", "INVALID", "Partition_Limit")


def _run(argv: list[str]) -> subprocess.CompletedProcess | None:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None


def job_info(job_id: str) -> dict[str, str] | None:
    """The controller's fields of a job (``JobState``, ``ExitCode``, ``TimeLimit``, ``RunTime``, ``Restarts``,
    ``Reason``, ...); from accounting (``JobState``, ``ExitCode`` only) once the controller has forgotten it; None when
    neither knows it."""
    shown = _run(["scontrol", "--oneliner", "show", "job", str(job_id)])
    if shown is not None and shown.returncode == 0 and "JobState=" in shown.stdout:
        return dict(word.split("=", 1) for word in shown.stdout.split() if "=" in word)
    accounted = _run(["sacct", "--noheader", "--parsable2", "--allocations", f"--jobs={job_id}",
                      "--format=State,ExitCode"])
    if accounted is not None and accounted.returncode == 0 and accounted.stdout.strip():
        state, exit_code = accounted.stdout.strip().splitlines()[0].split("|")
        return {"JobState": state.split()[0], "ExitCode": exit_code}
    return None


def state(info: dict | None) -> str:
    return (info or {}).get("JobState", "UNKNOWN")


def seconds(text: str | None) -> float | None:
    """SLURM's ``[D-]HH:MM:SS`` / ``MM:SS`` / ``MM`` / ``D-HH[:MM]`` in seconds; None for no limit."""
    if text is None or text in UNLIMITED:
        return None
    match = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", text.strip())
    if not match:
        raise ValueError(f"not a SLURM time: {text!r}")
    days, first, second, third = match.groups()
    if days is not None:  # D-HH[:MM[:SS]]
        parts = [int(first), int(second or 0), int(third or 0)]
        return int(days) * 86400 + parts[0] * 3600 + parts[1] * 60 + parts[2]
    if third is not None:  # HH:MM:SS
        return int(first) * 3600 + int(second) * 60 + int(third)
    if second is not None:  # MM:SS
        return int(first) * 60 + int(second)
    return int(first) * 60  # MM


def time_text(total_s: float) -> str:
    """Seconds as SLURM's ``D-HH:MM:SS``."""
    total_s = int(total_s)
    days, rest = divmod(total_s, 86400)
    return f"{days}-{rest // 3600:02d}:{rest % 3600 // 60:02d}:{rest % 60:02d}"


def remaining_s(info: dict | None) -> float | None:
    """Seconds a running job has left before its time limit; None without a limit (or unknown)."""
    if not info:
        return None
    limit = seconds(info.get("TimeLimit"))
    if limit is None:
        return None
    return limit - (seconds(info.get("RunTime")) or 0)


def requeue(job_id: str) -> str | None:
    """``scontrol requeue``; the error, if it was refused."""
    result = _run(["scontrol", "requeue", str(job_id)])
    if result is None:
        return "scontrol: not found"
    return None if result.returncode == 0 else (result.stderr.strip() or f"exit {result.returncode}")


def cancel(job_ids: list[str]) -> None:
    if job_ids:
        _run(["scancel", *map(str, job_ids)])


def node_address(name: str | None = None) -> str:
    """How the other nodes of a job reach node ``name`` (default: this one): its name where that resolves, else the
    address SLURM itself reaches it at (``NodeAddr``), so that clusters whose node names are not in DNS work too."""
    name = name or os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    try:
        socket.getaddrinfo(name, None)
        return name
    except OSError:
        pass
    found = _run(["sinfo", "--noheader", "--Node", f"--nodes={name}", "--format=%o"])
    address = found.stdout.split()[0] if found is not None and found.returncode == 0 and found.stdout.split() else ""
    return address or name


if __name__ == "__main__":
    if sys.argv[1:2] != ["address"] or len(sys.argv) > 3:
        sys.exit("usage: python -m megatron_mimesis.pipeline.cluster address [NODE]")
    print(node_address(sys.argv[2] if len(sys.argv) == 3 else None))
