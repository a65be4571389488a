"""A private SLURM cluster on this machine: N nodes of C CPUs, each a ``slurmd`` of its own, with a controller and a
``munged`` of their own key, on ports of their own, all under one directory. The tests submit the project's sbatch
files to it (``tests/slurm_cluster.py``), and a person can try the cluster path the same way before a real cluster:

    python tools/local_slurm.py start [--dir runs/local-slurm] [--nodes 4] [--cpus 2]   # then: export SLURM_CONF=...
    python tools/local_slurm.py stop [--dir runs/local-slurm]

It needs Debian's ``slurm-wlm`` (22.05, built with ``MULTIPLE_SLURMD``: one machine runs several nodes) and root (the
daemons run as root, ``SlurmUser=root``). Node names (``n1`` ...) resolve to nothing: every node's ``NodeAddr`` is
127.0.0.1, which is what the launchers use for the rendezvous (``launch/common.sh``: a node's address as SLURM
records it). ``stop`` ends every job, then every process the cluster started (its daemons by pid, then whatever
still carries its mark: slurmstepd, a job's tasks), whatever state a test left it in.
"""

import argparse
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

DAEMONS = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "squeue", "sinfo", "scancel")
MARK = "MIMESIS_LOCAL_SLURM"  # in the environment of every process the cluster starts (daemons, and through them jobs)
STATE = "cluster.json"  # the daemons' pids and the config, for stop


class SlurmUnavailable(RuntimeError):
    """What this machine lacks to run the cluster (a package, root); the message says what."""


def missing() -> str | None:
    """Why a cluster cannot start here, or None."""
    absent = [name for name in DAEMONS if shutil.which(name) is None]
    if absent:
        return f"{', '.join(absent)} not found (apt-get install slurm-wlm)"
    if os.geteuid() != 0:
        return "the private cluster's daemons run as root"
    return None


def _free_ports(count: int) -> list[int]:
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _config(directory: Path, nodes: int, cpus: int, ports: list[int], timeouts: dict, requeue_delay_s: int) -> str:
    host = socket.gethostname()
    names = ",".join(f"n{i}" for i in range(1, nodes + 1))
    # job ids start at random so that two clusters on one machine give their jobs different MASTER_PORTs
    # (the launchers derive it from the job id)
    lines = [
        f"ClusterName=mimesis{ports[0]}", f"SlurmctldHost={host}(127.0.0.1)", f"SlurmctldPort={ports[0]}",
        # cred_expire is also how long a requeued job waits before it may start again (120 s by default)
        "AuthType=auth/munge", f"AuthInfo=socket={directory}/munge/socket,cred_expire={requeue_delay_s}",
        "CredType=cred/munge",
        "SlurmUser=root", "SlurmdUser=root",
        f"StateSaveLocation={directory}/state", f"SlurmdSpoolDir={directory}/spool/%n",
        f"SlurmctldPidFile={directory}/slurmctld.pid", f"SlurmdPidFile={directory}/slurmd-%n.pid",
        f"SlurmctldLogFile={directory}/log/slurmctld.log", f"SlurmdLogFile={directory}/log/slurmd-%n.log",
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "MpiDefault=none",
        "SchedulerType=sched/backfill", "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core",
        # a node's CPUs are what the config says, not what the machine has (several nodes share its cores)
        "SlurmdParameters=config_overrides", "ReturnToService=2", "JobRequeue=1",
        "AccountingStorageType=accounting_storage/none", "JobAcctGatherType=jobacct_gather/none",
        "JobCompType=jobcomp/none", f"FirstJobId={random.randrange(1000, 30000)}",
        # pending jobs (a requeued one past its delay, a dependency met) are looked at every 2 s, not every minute
        "SchedulerParameters=sched_interval=2,bf_interval=2",
        # ended jobs stay known to scontrol (their state and exit code) for this long
        "MinJobAge=3600",
        *(f"{key}={value}" for key, value in timeouts.items()),
        *(f"NodeName=n{i} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} CPUs={cpus} Boards=1 "
          f"SocketsPerBoard=1 CoresPerSocket={cpus} ThreadsPerCore=1 State=UNKNOWN"
          for i, port in enumerate(ports[1:], start=1)),
        f"PartitionName=cpu Nodes={names} Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO",
    ]
    return "\n".join(lines) + "\n"


class LocalSlurm:
    """The cluster under ``directory``. ``timeouts`` are slurm.conf settings (``SlurmdTimeout``, ``KillWait``...):
    how fast the controller notices a lost node, how long a signalled job has before SIGKILL. A requeued job may start
    again ``requeue_delay_s`` after its requeue (real clusters: 120 s unless their AuthInfo says otherwise)."""

    def __init__(self, directory: str | Path, nodes: int = 4, cpus: int = 2, timeouts: dict | None = None,
                 requeue_delay_s: int = 10):
        self.dir = Path(directory).resolve()
        self.nodes, self.cpus = nodes, cpus
        self.timeouts = {"SlurmdTimeout": 60, "KillWait": 30, **(timeouts or {})}
        self.requeue_delay_s = requeue_delay_s
        self._lost: dict[str, list[int]] = {}  # a lost node -> its stopped processes
        self.conf = self.dir / "slurm.conf"
        state = self.dir / STATE  # a cluster started by another process (the CLI's start, then its stop)
        self.pids: dict[str, int] = json.loads(state.read_text())["pids"] if state.is_file() else {}

    @property
    def env(self) -> dict[str, str]:
        """The environment the SLURM commands (and everything a job runs) need to reach this cluster."""
        return {**os.environ, "SLURM_CONF": str(self.conf), MARK: str(self.dir)}

    @property
    def node_names(self) -> list[str]:
        return [f"n{i}" for i in range(1, self.nodes + 1)]

    # ------------------------------------------------------------------ start, stop
    def start(self, timeout_s: float = 60) -> "LocalSlurm":
        reason = missing()
        if reason:
            raise SlurmUnavailable(reason)
        for sub in ("munge", "state", "spool", "log"):  # a fresh cluster: nothing of an earlier one's state
            shutil.rmtree(self.dir / sub, ignore_errors=True)
            (self.dir / sub).mkdir(parents=True)
        (self.dir / "munge").chmod(0o700)
        key = self.dir / "munge" / "key"
        subprocess.run(["mungekey", "--create", "--force", f"--keyfile={key}"], check=True, capture_output=True)
        self.conf.write_text(_config(self.dir, self.nodes, self.cpus, _free_ports(self.nodes + 1), self.timeouts,
                                     self.requeue_delay_s))
        try:
            self._daemon("munged", ["munged", "--foreground", "--force", f"--key-file={key}",
                                    f"--socket={self.dir}/munge/socket", f"--pid-file={self.dir}/munge/pid",
                                    f"--log-file={self.dir}/log/munged.log", f"--seed-file={self.dir}/munge/seed"])
            self._wait_for(lambda: (self.dir / "munge" / "socket").exists(), timeout_s, "munged's socket")
            self._daemon("slurmctld", ["slurmctld", "-D", "-c", "-f", str(self.conf)])
            for name in self.node_names:
                self._daemon(f"slurmd-{name}", ["slurmd", "-D", "-N", name, "-f", str(self.conf)])
            self._wait_for(lambda: self.node_states() == dict.fromkeys(self.node_names, "idle"), timeout_s,
                           f"{self.nodes} idle nodes")
        except BaseException:
            self.stop()
            raise
        return self

    def _daemon(self, name: str, argv: list[str]) -> None:
        log = open(self.dir / "log" / f"{name}.out", "ab")
        proc = subprocess.Popen(argv, env=self.env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        log.close()
        self.pids[name] = proc.pid
        (self.dir / STATE).write_text(json.dumps({"pids": self.pids, "conf": str(self.conf)}))

    def _wait_for(self, ready, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            dead = [name for name, pid in self.pids.items() if not _alive(pid)]
            if dead:
                raise RuntimeError(f"local SLURM: {', '.join(dead)} exited before {what}; logs in {self.dir / 'log'}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"local SLURM: no {what} after {timeout_s:.0f} s; logs in {self.dir / 'log'}")
            time.sleep(0.2)

    def stop(self) -> None:
        """End every job, then every process this cluster started (daemons by pid, then what carries its mark)."""
        if self.pids.get("slurmctld") and _alive(self.pids["slurmctld"]):
            subprocess.run(["scancel", "--full", "--user=root"], env=self.env, capture_output=True, timeout=30)
        for pid in reversed(list(self.pids.values())):
            _signal(pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while any(_alive(pid) for pid in self.pids.values()) and time.monotonic() < deadline:
            time.sleep(0.1)
        for pid in self.pids.values():
            _signal(pid, signal.SIGKILL)
        for pid in marked_processes(self.dir):
            _signal(pid, signal.SIGKILL)
        for pid in self.pids.values():  # reap the daemons this process started
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
        self.pids = {}
        (self.dir / STATE).unlink(missing_ok=True)

    # ------------------------------------------------------------------ queries and actions
    def command(self, *argv: str, check: bool = True, timeout: float = 60) -> str:
        result = subprocess.run(list(argv), env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and result.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)}: exit {result.returncode}: {result.stderr.strip()}")
        return result.stdout

    def node_states(self) -> dict[str, str]:
        try:
            out = self.command("sinfo", "--noheader", "--Node", "--format=%N %T", check=False, timeout=10)
        except subprocess.TimeoutExpired:
            return {}
        return dict(line.split() for line in out.splitlines() if len(line.split()) == 2)

    def job(self, job_id: str | int) -> dict[str, str]:
        """``scontrol show job``'s fields of one job ({} once the controller forgot it)."""
        out = self.command("scontrol", "--oneliner", "show", "job", str(job_id), check=False)
        return dict(word.split("=", 1) for word in out.split() if "=" in word)

    def lose_node(self, name: str) -> list[int]:
        """Node ``name`` lost as a machine that loses its power: its slurmd, its step daemons and every task on it
        stop at once (SIGSTOP: none of them runs again, answers or closes a socket, so that their peers see silence,
        not a reset connection). Returns their pids; :meth:`revive_node` kills them and starts the node again."""
        lost = [self.pids[f"slurmd-{name}"]]
        tasks = [pid for pid, env in _environments(self.dir).items() if env.get("SLURMD_NODENAME") == name]
        for pid in tasks:  # the step daemons above the node's tasks
            parent = _ppid(pid)
            while parent > 1 and _comm(parent).startswith("slurmstepd"):
                lost.append(parent)
                parent = _ppid(parent)
        lost += tasks
        for pid in lost:
            _signal(pid, signal.SIGSTOP)
        self._lost[name] = lost
        return lost


    def revive_node(self, name: str, timeout_s: float = 60) -> None:
        """Node ``name`` restarted after :meth:`lose_node`: what it ran is gone, its slurmd starts again, and the
        controller takes it back into service."""
        for pid in self._lost.pop(name, []):
            _signal(pid, signal.SIGKILL)
        self._daemon(f"slurmd-{name}", ["slurmd", "-D", "-N", name, "-f", str(self.conf)])
        self.command("scontrol", "update", f"NodeName={name}", "State=RESUME", check=False)
        self._wait_for(lambda: self.node_states().get(name) in ("idle", "mixed", "allocated"), timeout_s,
                       f"node {name} back in service")


def _environments(directory: Path) -> dict[int, dict[str, str]]:
    """The environment of every live process carrying the cluster's mark or its config."""
    marks = {f"{MARK}={directory}".encode(), f"SLURM_CONF={directory}/slurm.conf".encode()}
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                words = f.read().split(b"\0")
        except OSError:
            continue
        if marks.intersection(words):
            found[int(entry)] = dict(w.decode(errors="replace").split("=", 1) for w in words if b"=" in w)
    return found


def marked_processes(directory: Path) -> list[int]:
    return [pid for pid in _environments(Path(directory).resolve()) if not _is_ancestor(pid)]


def _is_ancestor(pid: int) -> bool:
    """Whether ``pid`` is this process or one of its parents (a shell that started the cluster carries its mark)."""
    current = os.getpid()
    while current > 1:
        if current == pid:
            return True
        current = _ppid(current)
    return False


def _ppid(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie child of this process has exited
        done, _ = os.waitpid(pid, os.WNOHANG)
        return done == 0
    except ChildProcessError:
        return _state(pid) != "Z"


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python tools/local_slurm.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=("start", "stop"))
    parser.add_argument("--dir", default="runs/local-slurm", help="where its config, state and logs live")
    parser.add_argument("--nodes", type=int, default=4, help="nodes (default: 4)")
    parser.add_argument("--cpus", type=int, default=2, help="CPUs per node (default: 2)")
    args = parser.parse_args(argv)
    cluster = LocalSlurm(args.dir, args.nodes, args.cpus)
    if args.action == "stop":
        cluster.stop()
        print(f"local SLURM in {cluster.dir}: stopped")
        return 0
    if (cluster.dir / STATE).is_file():
        print(f"error: {cluster.dir} holds a running cluster (python tools/local_slurm.py stop --dir {args.dir})",
              file=sys.stderr)
        return 2
    try:
        cluster.start()
    except (SlurmUnavailable, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"local SLURM: {args.nodes} nodes x {args.cpus} CPUs ({', '.join(cluster.node_names)}), partition cpu\n"
          f"export SLURM_CONF={cluster.conf}\n"
          f"stop it with: python tools/local_slurm.py stop --dir {args.dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
