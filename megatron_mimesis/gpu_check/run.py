"""The orchestration: each stage in its own process with its own time cap, the report rewritten after every stage."""

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from megatron_mimesis.gpu_check import __doc__ as gpu_check_doc
from megatron_mimesis.gpu_check.kernels import stage_kernels
from megatron_mimesis.gpu_check.parity import stage_parity
from megatron_mimesis.gpu_check.record import StageRecorder, stage_file, write_json
from megatron_mimesis.gpu_check.throughput import stage_agent, stage_throughput
from megatron_mimesis.gpu_check.vllm import stage_vllm

TOTAL_BUDGET_S = 570
# stage -> time cap (s); their sum stays under the budget, which also pays for the processes' start-up. On a bare
# H200 (empty Triton cache, 2026-12-04) kernels took 119 s and parity 180 s, most of it compiling fla's kernels. vllm
# starts an engine per family and agent (Qwen3-8B's layers) is new since 2026-12-05 (vllm's cap was 80 s with one
# engine); neither is timed on a GPU yet. Their rows are written as they come, so a cut stage still reports what it
# reached, and a stage the budget no longer covers is reported as skipped
STAGE_CAPS = {"kernels": 150, "parity": 210, "throughput": 115, "agent": 60, "vllm": 120}


def detect_gpu() -> str | None:
    """The GPU's name, or None when this process sees no CUDA device."""
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def stage_command(name: str, out_dir: Path) -> list[str]:
    return [sys.executable, "-m", "megatron_mimesis.gpu_check", "--stage", name, "--out", str(out_dir)]


def run_stage(name: str, out_dir: Path, cap_s: float) -> dict:
    """Run one stage in a child process (its own session, so a timeout kills everything it started)."""
    log = out_dir / f"stage_{name}.log"
    started = time.monotonic()
    with log.open("w") as sink:
        child = subprocess.Popen(stage_command(name, out_dir), stdout=sink, stderr=subprocess.STDOUT,
                                 start_new_session=True)
        try:
            rc = child.wait(timeout=cap_s)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            rc = None
    results = json.loads(stage_file(out_dir, name).read_text()) if stage_file(out_dir, name).exists() else {}
    if rc == 0:
        status = "ok"
    elif rc is None:
        status = f"timeout after {cap_s:.0f} s (partial results kept)"
    else:  # the stage's own exception when it recorded one: the log's last line is often a warning printed at exit
        status = f"failed (rc {rc}): {results.pop('error', None) or _last_line(log)}"
    return {"status": status, "seconds": round(time.monotonic() - started, 1), "log": log.name, **results}


def _last_line(path: Path) -> str:
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1][:200] if lines else "no output"


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    return "-" if value is None else str(value)


def markdown(report: dict) -> str:
    lines = [f"# GPU check: {report['device']}", "", f"{report['started']}; " +
             ", ".join(f"{k} {v}" for k, v in report["versions"].items()), ""]
    for name, stage in report["stages"].items():
        lines += [f"## {name}: {stage['status']} ({stage.get('seconds', 0):.0f} s)", ""]
        rows = stage.get("rows", [])
        if rows:
            columns = list(dict.fromkeys(key for row in rows for key in row))
            lines += ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
            lines += ["| " + " | ".join(_cell(row.get(c)) for c in columns) + " |" for row in rows]
            lines.append("")
        lines += [f"- {note}" for note in stage.get("notes", [])]
        lines.append("")
    return "\n".join(lines)


def _versions() -> dict:
    import importlib.metadata

    out = {}
    for package in ("torch", "triton", "transformer-engine", "flash-linear-attention", "liger-kernel", "vllm"):
        try:
            out[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            out[package] = "missing"
    return out


def orchestrate(out_dir: Path, stages: list[str], device: str) -> int:
    out_dir.mkdir(parents=True, exist_ok=True)
    report = {"device": device, "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
              "versions": _versions(), "stages": {}}
    deadline = time.monotonic() + TOTAL_BUDGET_S
    for name in stages:
        stage_file(out_dir, name).unlink(missing_ok=True)
        left = deadline - time.monotonic()
        if left < 15:
            report["stages"][name] = {"status": "skipped: total time budget spent"}
        else:
            report["stages"][name] = run_stage(name, out_dir, min(STAGE_CAPS[name], left))
        write_json(out_dir / "gpu_check.json", report)
        (out_dir / "gpu_check.md").write_text(markdown(report))
        print(f"gpu_check: {name}: {report['stages'][name]['status']}", flush=True)
    print(f"gpu_check: wrote {out_dir / 'gpu_check.json'} and {out_dir / 'gpu_check.md'}")
    return 0 if all(s["status"] == "ok" for s in report["stages"].values()) else 1


# ------------------------------------------------------------------------------------------------ the stages


STAGES = {"kernels": stage_kernels, "parity": stage_parity, "throughput": stage_throughput, "agent": stage_agent,
          "vllm": stage_vllm}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=gpu_check_doc.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("gpu_check"), help="report directory (default: gpu_check)")
    parser.add_argument("--stages", nargs="+", choices=list(STAGES), default=list(STAGES), help="stages to run")
    parser.add_argument("--stage", choices=list(STAGES), help=argparse.SUPPRESS)  # one stage, in this process
    args = parser.parse_args(argv)
    if args.stage:
        recorder = StageRecorder(args.out, args.stage)
        try:
            STAGES[args.stage](recorder)
        except Exception as error:
            recorder.fail(error)
            raise
        return 0
    device = detect_gpu()
    if device is None:
        print("gpu_check: no CUDA GPU visible to this process (torch.cuda.is_available() is False); nothing run")
        return 2
    return orchestrate(args.out, args.stages, device)
