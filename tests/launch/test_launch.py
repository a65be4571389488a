"""launch/*.sh against a fake SLURM (scontrol, srun on PATH) and a machine without GPUs; nothing is trained."""

import json
import re
import subprocess
import sys

import pytest

from megatron_mimesis.pipeline.processes import free_port
from tests.checkpoints import small_checkpoint
from tests.launch.slurm import (
    JOB_ID,
    REPO,
    after_config_line,
    midtrain_job,
    released_hf_config,
    run,
    slurm_env,
    trainer_json,
    write_exe,
)
from tests.rl.fakes import FakeOpenAIServer

MIDTRAIN_9B = "launch/configs/midtrain_9b.yaml"
PAPER_RUN = "the paper's run; CONFIG=<config.yaml> runs another"
CPU_DEMO = "the CPU demo; CONFIG=<config.yaml> runs another"

# Stands in for the per-node torchrun: prints its arguments; anything else goes to the real interpreter.
FAKE_PYTHON = f"""#!/bin/bash
if [[ "$1 $2" == "-m megatron_mimesis.torchrun" ]]; then echo "TORCHRUN $*"; exit 0; fi
exec {sys.executable} "$@"
"""


def test_slurm_dry_run_has_paper_layout(fake):
    tmp_path, env = fake
    result = run("midtrain.sh", ["--dry-run"], midtrain_job(env, tmp_path))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "srun --nodes=4 --ntasks=4 --ntasks-per-node=1 --cpus-per-task=64" in out
    assert (f"--nnodes 4 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint node001:PORT "
            f"--rdzv-id {JOB_ID} --rdzv-conf is_host=false") in out
    assert "rendezvous: a store the batch shell holds on node001:PORT for the job step (PORT: one free" in out
    assert "--config launch/configs/midtrain_9b.yaml" in out
    assert "MASTER_ADDR=node001" in out and "CUDA_DEVICE_MAX_CONNECTIONS=1" in out
    resolved = trainer_json(out)
    assert resolved["world_size"] == 32 and resolved["data_parallel_size"] == 8
    assert resolved["num_microbatches"] == 10 and resolved["tokens_per_step"] == 80 * 24576
    config = resolved["config"]
    assert (config["tensor_model_parallel_size"], config["pipeline_model_parallel_size"]) == (4, 1)
    assert "memory plan per GPU: 9b, TP=4 (SP) PP=1 DP=8 on 32 GPUs;" in out
    # after the GPU total, in the same table: the checkpoint, the busiest node's share of it (a quarter: every rank
    # writes its own), its write time and the sbatch lead times from them
    assert re.search(r"^total \(GiB\) .*\ncheckpoint \(weights, fp32 main copy, Adam m, v\) +117\.\d\d  exact", out, re.M)
    assert re.search(r"^checkpoint share of the busiest of 4 nodes +29\.\d\d  planned", out, re.M)
    assert re.search(r"^checkpoint write at 1 GB/s per node +31\.\d s  planned", out, re.M)
    assert re.search(r"^SLURM lead: sbatch --signal=B:USR1@ +360 s .*\nSLURM lead: SHUTDOWN_TIMEOUT +240 s ", out, re.M)
    plan = resolved["memory_plan"]
    assert plan["fits"] and plan["gpu"] == "A100-80GB" and plan["columns"] == ["per GPU"]
    assert not (tmp_path / "log" / "srun").exists()


def test_slurm_launch_refuses_a_save_directory_without_room_before_srun(fake):
    """The paper's mid-training keeps 7 checkpoints of 117.2 GiB at once: the launcher's pre-check, whose memory plan
    sizes them, refuses a disk without room for them in one line, and the job never reaches srun."""
    tmp_path, env = fake
    job = {k: v for k, v in midtrain_job(env, tmp_path).items() if k != "MIMESIS_SAVE_DIR_CHECKED"}
    result = run("midtrain.sh", ["--save", str(tmp_path / "ckpt")], {**job, "SLURM_NNODES": "4"})
    assert result.returncode == 2 and after_config_line(result, "midtrain", MIDTRAIN_9B, PAPER_RUN) == ""
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"error: save: no space left for the checkpoints of this run in {tmp_path}: ")
    assert line.endswith(" needed (7 checkpoints of about 117.2 GiB on disk at once)"), line
    assert not (tmp_path / "log" / "srun").exists()


def test_slurm_launch_refuses_a_layout_that_does_not_fit_before_srun(fake):
    """9B at TP=1 on one node: the config check's memory plan refuses it in one line that names the biggest term and
    the cheapest change that fits, and the job never reaches srun."""
    tmp_path, env = fake
    result = run("midtrain.sh", ["--tensor-model-parallel-size", "1", "--no-sequence-parallel"],
                 {**midtrain_job(env, tmp_path), "SLURM_NNODES": "1"})
    assert result.returncode == 2 and after_config_line(result, "midtrain", MIDTRAIN_9B, PAPER_RUN) == ""
    (line,) = result.stderr.splitlines()
    assert line.startswith("error: memory plan: per GPU needs ") and " GiB per GPU; the A100-80GB has 79.1, 75.1 " in line
    assert line.endswith("cheapest change that fits: --tensor-model-parallel-size 4 --sequence-parallel"), line
    assert "biggest term: activations: Gated DeltaNet layers" in line
    assert not (tmp_path / "log" / "srun").exists() and not (tmp_path / "log" / "scontrol").exists()


def test_slurm_launch_refuses_a_config_whose_stop_save_outlasts_the_jobs_shutdown_timeout(fake):
    """rl_agent.sbatch gives the ranks the 780 s its default config (Qwen3-8B) needs to save on SLURM's pre-timeout
    signal; the Qwen3.5-9B agent it also serves (CONFIG=launch/configs/rl_agent_9b.yaml) writes larger checkpoints
    and needs 840: refused in one line with the values to submit with, before srun."""
    tmp_path, env = fake
    hf = released_hf_config(tmp_path / "qwen3.5-9b", "9b")
    job = {**slurm_env(env, tmp_path), "SLURM_NNODES": "2", "SHUTDOWN_TIMEOUT": "780"}
    result = run("rl_agent.sh", ["--pretrained-hf", str(hf), "--tokenizer", str(hf)],
                 {**job, "CONFIG": "launch/configs/rl_agent_9b.yaml"})
    assert result.returncode == 2 and after_config_line(result, "rl_agent", "launch/configs/rl_agent_9b.yaml") == ""
    (line,) = result.stderr.splitlines()
    assert line == ("error: SHUTDOWN_TIMEOUT 780 s is less than the 840 s this run needs to stop and save on SLURM's "
                    "pre-timeout signal (its longest phase and two checkpoint writes: training/lead_times.py): submit "
                    "with SHUTDOWN_TIMEOUT=840 sbatch --signal=B:USR1@960 ..."), line
    # the file's header and docs/cluster.md say to submit it so: then the lead is accepted (the next check is the
    # endpoints')
    submit = "CONFIG=launch/configs/rl_agent_9b.yaml SHUTDOWN_TIMEOUT=840 sbatch --signal=B:USR1@960"
    assert submit in (REPO / "launch" / "slurm" / "rl_agent.sbatch").read_text()
    assert submit in " ".join((REPO / "docs" / "cluster.md").read_text().split())
    result = run("rl_agent.sh", ["--pretrained-hf", str(hf), "--tokenizer", str(hf)],
                 {**job, "SHUTDOWN_TIMEOUT": "840", "CONFIG": "launch/configs/rl_agent_9b.yaml"})
    assert result.returncode == 2 and result.stderr.startswith("error: user_model_options: "), result.stderr
    assert not (tmp_path / "log" / "srun").exists()


@pytest.mark.parametrize("gpus", [0, 8])
def test_local_dry_run_without_config_is_the_cpu_demo_with_gpus_or_without(fake, gpus):
    """Outside SLURM and without CONFIG the launcher runs the CPU demo, on a machine with GPUs too (it ran the 9B paper
    config there and failed on its missing dataset), and says so in its first line."""
    tmp_path, env = fake
    listing = "".join(f"echo 'GPU {i}: NVIDIA H100 80GB HBM3 (UUID: GPU-{i})'\n" for i in range(gpus))
    write_exe(tmp_path / "bin" / "nvidia-smi", f"#!/bin/sh\n{listing}exit {0 if gpus else 9}\n")
    # SAVE away from the repository's runs/: a demo run there would make this a resume (of another train_iters)
    result = run("midtrain.sh", ["--dry-run", "--train-iters", "20"],
                 {**env, "DATA_PATH": str(tmp_path / "demo"), "SAVE": str(tmp_path / "save")})
    assert result.returncode == 0, result.stderr
    command = after_config_line(result, "midtrain", "launch/configs/demo_midtrain.yaml", CPU_DEMO).splitlines()[1]
    assert command.startswith(f"{sys.executable} -m megatron_mimesis.torchrun --standalone --nnodes 1 --nproc-per-node 2")
    assert "--config launch/configs/demo_midtrain.yaml --train-iters 20" in command
    environment = result.stdout.split("== environment\n")[1].split("== trainer config")[0]
    assert environment.splitlines() == ["OMP_NUM_THREADS=1", "NNODES=1", "CUDA_VISIBLE_DEVICES="]
    resolved = trainer_json(result.stdout)
    assert resolved["world_size"] == 2 and resolved["config"]["train_iters"] == 20


def test_slurm_launch_runs_one_torchrun_per_node(fake):
    tmp_path, env = fake
    fake_python = write_exe(tmp_path / "bin" / "python-fake", FAKE_PYTHON)
    # midtrain: sft_9b.yaml loads the mid-training checkpoint, which the launcher's config check finds missing here
    port = free_port()  # the batch shell's rendezvous store listens there while srun runs
    job = midtrain_job(env, tmp_path)
    result = run("midtrain.sh", ["--lr", "2e-5"], {**job, "SLURM_NNODES": "1", "PYTHON": str(fake_python),
                                                    "MASTER_PORT": str(port)})
    assert result.returncode == 0, result.stderr
    srun_args = (tmp_path / "log" / "srun").read_text().splitlines()
    assert srun_args[:5] == ["--nodes=1", "--ntasks=1", "--ntasks-per-node=1", "--cpus-per-task=64",
                             "--kill-on-bad-exit=1"]
    torchrun = after_config_line(result, "midtrain", MIDTRAIN_9B, PAPER_RUN).strip()
    assert torchrun.startswith("TORCHRUN -m megatron_mimesis.torchrun --nnodes 1 --nproc-per-node 8 --rdzv-backend c10d "
                               f"--rdzv-endpoint node001:{port} --rdzv-id {JOB_ID} --rdzv-conf is_host=false ")
    assert torchrun.endswith(f"--config launch/configs/midtrain_9b.yaml --lr 2e-5 --data-path {tmp_path / 'data9b'} "
                             f"--pretrained-hf {job['PRETRAINED_HF']}")


def test_slurm_launch_refuses_a_bad_config_before_srun(fake):
    tmp_path, env = fake
    result = run("midtrain.sh", ["--lr=-1"], slurm_env(env, tmp_path))
    assert result.returncode == 2
    assert result.stderr == "error: lr must be greater than 0, got -1\n"
    assert after_config_line(result, "midtrain", MIDTRAIN_9B, PAPER_RUN) == ""
    # the paper's mid-training without PRETRAINED_HF would train Qwen3.5-9B from random weights on 32 GPUs
    result = run("midtrain.sh", [], slurm_env(env, tmp_path))
    assert result.returncode == 2 and after_config_line(result, "midtrain", MIDTRAIN_9B, PAPER_RUN) == ""
    assert result.stderr == ("error: pretrained_hf: the 9b model would train from random weights; give pretrained_hf "
                             "(or load), or set from_scratch: true if that is the intent\n")
    assert not (tmp_path / "log" / "srun").exists() and not (tmp_path / "log" / "scontrol").exists()


def test_rl_simulator_dry_run_runs_the_rl_entry_point(fake):
    tmp_path, env = fake
    tokenizer = tmp_path / "tok"
    tokenizer.mkdir()
    (tokenizer / "tokenizer.json").write_text("{}")
    config = tmp_path / "rl.yaml"
    config.write_text(f"model: tiny\ntensor_model_parallel_size: 2\ntokenizer: {tokenizer}\n"
                      "prompts: [launch/configs/toy_rl_prompts.jsonl]\ndomain_rewards: {brief: length_target}\n"
                      "counterpart: scripted\ncounterpart_options: {reply: ok}\nprompts_per_step: 4\n")
    result = run("rl_simulator.sh", ["--dry-run", "--rollouts-per-prompt", "8"], {**env, "CONFIG": str(config)})
    assert result.returncode == 0, result.stderr
    assert f"-m megatron_mimesis.rl.simulator_rl --config {config} --rollouts-per-prompt 8" in result.stdout
    resolved = trainer_json(result.stdout)
    assert resolved["rollouts_per_step"] == 32 and resolved["config"]["tensor_model_parallel_size"] == 2


def test_rl_simulator_slurm_dry_run_has_the_paper_layout(fake):
    tmp_path, env = fake
    checkpoint = tmp_path / "sft-ckpt"
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"id": "p0", "domain": "abcd", "prompt": "Book a flight."}\n')
    args = ["--dry-run", "--load", str(checkpoint), "--prompts", json.dumps([str(prompts)])]
    job = {**slurm_env(env, tmp_path), "SLURM_NNODES": "2"}
    tokenizer = small_checkpoint(checkpoint, 203) / "tokenizer"  # the config names no iteration: the latest's
    result = run("rl_simulator.sh", args, job)
    assert result.returncode == 2 and result.stderr == (
        f"error: tokenizer: not given, and {tokenizer} (the one saved with the checkpoint load names) is not an HF "
        f"tokenizer directory\n"), result.stderr
    tokenizer.mkdir()
    (tokenizer / "tokenizer.json").write_text("{}")
    result = run("rl_simulator.sh", args, job)
    assert result.returncode == 0, result.stderr
    assert "srun --nodes=2 --ntasks=2 --ntasks-per-node=1 --cpus-per-task=64" in result.stdout
    assert "--nnodes 2 --nproc-per-node 8" in result.stdout
    assert "-m megatron_mimesis.rl.simulator_rl --config launch/configs/rl_simulator_9b.yaml" in result.stdout
    resolved = trainer_json(result.stdout)
    assert resolved["world_size"] == 16 and resolved["data_parallel_size"] == 4
    assert resolved["rollouts_per_step"] == 64 * 8
    config = resolved["config"]
    assert (config["tensor_model_parallel_size"], config["pipeline_model_parallel_size"]) == (4, 1)
    assert (config["engine"], config["train_iters"], config["lr"], config["lr_decay_style"]) == ("vllm", 500, 1e-6,
                                                                                                "constant")
    assert config["load"] == str(checkpoint) and config["finetune"] and config["tokenizer"] == str(tokenizer)
    from megatron_mimesis.rl.engines.vllm import check_vllm_config
    from megatron_mimesis.rl.simulator.config import SimulatorRLConfig

    check_vllm_config(SimulatorRLConfig(**config))  # the layout the vLLM engine accepts


USERRL_CONFIG = "launch/configs/rl_agent_userrl_qwen3_8b.yaml"
TAU2_CONFIG = "launch/configs/rl_agent_qwen3_8b.yaml"


def test_rl_agent_slurm_default_is_the_papers_stage_two_on_userrl_gyms(fake):
    """What the paper ran (docs/stage2.md): Qwen3-8B on UserRL's gyms with its update protocol. Two of its five
    training gyms have no data in this copy of UserRL: the default is refused naming that, and runs on the three
    others."""
    import yaml

    tmp_path, env = fake
    hf = released_hf_config(tmp_path / "qwen3-8b", "qwen3-8b")  # the paper's agent
    args = ["--dry-run", "--pretrained-hf", str(hf), "--tokenizer", str(hf)]
    job = {**slurm_env(env, tmp_path), "SLURM_NNODES": "2"}
    refused = run("rl_agent.sh", args, job)
    assert refused.returncode == 2 and after_config_line(refused, "rl_agent", USERRL_CONFIG, PAPER_RUN)
    assert refused.stderr.startswith("error: env_options: TravelGym: its tasks do not load"), refused.stderr
    options = yaml.safe_load((REPO / USERRL_CONFIG).read_text())["env_options"]
    options["gyms"] = {name: gym for name, gym in options["gyms"].items() if name not in ("TravelGym", "PersuadeGym")}
    result = run("rl_agent.sh", [*args, "--env-options", json.dumps(options)], job)
    assert result.returncode == 0, result.stderr
    assert "--nnodes 2 --nproc-per-node 8" in result.stdout
    resolved = trainer_json(after_config_line(result, "rl_agent", USERRL_CONFIG, PAPER_RUN))
    assert resolved["world_size"] == 16 and resolved["data_parallel_size"] == 4
    config = resolved["config"]
    assert (config["model"], config["env"], config["rollouts_per_prompt"], resolved["rollouts_per_step"]) == (
        "qwen3-8b", "userrl", 8, 64 * 8)
    assert (config["optimizer_steps_per_batch"], config["advantage"], config["gamma"], config["max_agent_turns"]) == (
        8, "turn_credit", 0.8, 16)
    assert (config["csd_alpha"], config["csd_beta"], config["lr"], config["engine"]) == (0.01, 5.0, 1e-6, "vllm")


def test_rl_agent_slurm_dry_run_on_tau2_has_the_paper_settings(fake):
    tmp_path, env = fake
    hf = released_hf_config(tmp_path / "qwen3-8b", "qwen3-8b")  # the paper's agent
    args = ["--dry-run", "--pretrained-hf", str(hf), "--tokenizer", str(hf)]
    result = run("rl_agent.sh", args, {**slurm_env(env, tmp_path), "SLURM_NNODES": "2", "CONFIG": TAU2_CONFIG})
    assert result.returncode == 0, result.stderr
    assert "--nnodes 2 --nproc-per-node 8" in result.stdout
    assert f"-m megatron_mimesis.rl.agent_rl --config {TAU2_CONFIG}" in result.stdout
    resolved = trainer_json(result.stdout)
    assert resolved["world_size"] == 16 and resolved["data_parallel_size"] == 4
    config = resolved["config"]
    assert (config["model"], config["rollouts_per_prompt"], config["gamma"], config["train_iters"]) == (
        "qwen3-8b", 8, 0.8, 100)
    assert (config["csd_alpha"], config["csd_beta"], config["env"], config["engine"]) == (0.01, 5.0, "tau2", "vllm")
    assert (config["lr"], config["max_agent_turns"], resolved["rollouts_per_step"]) == (1e-6, 16, 64 * 8)


def test_rl_agent_local_dry_run_without_gpu_is_the_toy_demo(fake):
    tmp_path, env = fake
    tokenizer, checkpoint = tmp_path / "demo-tok", tmp_path / "demo-ckpt"  # what the mid-training demo leaves
    tokenizer.mkdir()
    (tokenizer / "tokenizer.json").write_text("{}")
    small_checkpoint(checkpoint, 200)
    result = run("rl_agent.sh", ["--dry-run", "--tokenizer", str(tokenizer), "--load", str(checkpoint)], env)
    assert result.returncode == 0, result.stderr
    assert "--standalone --nnodes 1 --nproc-per-node 2" in result.stdout
    config = trainer_json(result.stdout)["config"]
    assert (config["env"], config["user_model"], config["coach"]) == ("toy", "scripted", "scripted")


# The demo's torchrun writes the metrics of a run into the --log-dir it was given; the data build is skipped.
FAKE_DEMO_PYTHON = f"""#!/bin/bash
if [[ "$1 $2" == "-m megatron_mimesis.torchrun" ]]; then
  for ((i = 1; i < $#; i++)); do if [[ "${{!i}}" == --log-dir ]]; then j=$((i + 1)); log="${{!j}}"; fi; done
  mkdir -p "$log" && cp "$FAKE_METRICS" "$log/metrics.jsonl"; exit 0
fi
if [[ "$1 $2" == "-m data_prep.midtrain" ]]; then exit 0; fi
exec {sys.executable} "$@"
"""


def test_the_demo_plots_and_summarises_the_log_dir_it_was_given(fake):
    tmp_path, env = fake
    losses = [10.0 - 0.1 * i for i in range(1, 26)]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"iteration": i, "loss": loss, "tokens_per_sec": 100.0}) + "\n"
                               for i, loss in enumerate(losses, start=1))
                       + json.dumps({"iteration": 25, "split": "valid", "loss": 7.25}) + "\n")
    python = write_exe(tmp_path / "bin" / "fake-python", FAKE_DEMO_PYTHON)
    log_dir = tmp_path / "elsewhere"
    result = run("midtrain.sh", ["--train-iters", "25", "--log-dir", str(log_dir), "--save", str(tmp_path / "ckpt")],
                 {**env, "PYTHON": str(python), "FAKE_METRICS": str(metrics), "DATA_PATH": str(tmp_path / "demo")})
    assert result.returncode == 0, result.stderr
    assert f"plot:        {log_dir / 'loss.png'}" in result.stdout
    assert (log_dir / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10  # 9.45 and 7.95
    summary = result.stdout.strip().splitlines()[-1]
    assert re.fullmatch(f"summary:     loss {first:.3f} over the first 10 steps, {last:.3f} over the last 10 "
                        r"\(25 steps\), valid 7.250 at step 25; wall \d+ min \d+ s", summary), summary


# torchrun after a preemption: the rank may have written its record of the stop (FAKE_RECORD), then torchrun fails
FAKE_PREEMPTED_PYTHON = f"""#!/bin/bash
if [[ "$1 $2" == "-m megatron_mimesis.torchrun" ]]; then
  if [[ -n "$FAKE_RECORD" ]]; then printf '%s' "$FAKE_RECORD" > "$LOG_DIR/exit.json"; fi
  echo "torch.distributed.elastic.multiprocessing.api.SignalException: Process 1 got signal: 15" >&2
  exit 1
fi
exec {sys.executable} "$@"
"""


def test_a_preemption_that_saved_exits_0_in_one_line_and_anything_else_keeps_torchruns_status(fake):
    """A rank's recorded error is repeated as the last line, torchrun's status kept."""
    tmp_path, env = fake
    python = write_exe(tmp_path / "bin" / "fake-python", FAKE_PREEMPTED_PYTHON)
    log_dir = tmp_path / "log-dir"
    log_dir.mkdir()
    config = tmp_path / "run.yaml"
    config.write_text(json.dumps({"model": "tiny", "model_overrides": {"vocab_size": 8192}, "seq_length": 256,
                                  "data_path": str(tmp_path / "demo"), "log_dir": str(log_dir)}))
    job = {**env, "PYTHON": str(python), "CONFIG": str(config), "LOG_DIR": str(log_dir)}
    saved = json.dumps({"stopped": "signal", "signal": "SIGTERM", "iteration": 7, "saved": True})
    result = run("midtrain.sh", [], {**job, "FAKE_RECORD": saved})
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines()[-1] == ("preempted (SIGTERM): stopped at iteration 7 with its checkpoint saved; "
                                              "exit 0 for the requeue")
    unsaved = json.dumps({"stopped": "signal", "signal": "SIGTERM", "iteration": 7, "saved": False})
    assert run("midtrain.sh", [], {**job, "FAKE_RECORD": unsaved}).returncode == 1  # nothing to resume from
    failed = json.dumps({"stopped": "error", "error": "save of iteration 3 to /ckpt failed: [Errno 28] No space"})
    result = run("midtrain.sh", [], {**job, "FAKE_RECORD": failed})  # repeated below torchrun's report
    assert result.returncode == 1
    assert result.stderr.splitlines()[-1] == "failed (exit 1): save of iteration 3 to /ckpt failed: [Errno 28] No space"
    (log_dir / "exit.json").write_text(saved)  # a record of the previous launch is not this one's
    result = run("midtrain.sh", [], job)
    assert result.returncode == 1 and "preempted" not in result.stderr and not (log_dir / "exit.json").exists()


def test_gloo_takes_nccls_interfaces_or_the_default_routes_unless_set(fake):
    """The dry run shows the default route's interface (NCCL's default ``^lo,docker`` is an exclusion, which gloo
    cannot take); the launcher's own set_gpu_env gives named NCCL interfaces to gloo and keeps an exported one."""
    tmp_path, env = fake
    env = {k: v for k, v in env.items() if k not in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")}
    write_exe(tmp_path / "bin" / "ip", "#!/bin/sh\necho 'default via 10.1.2.3 dev eth7 proto static'\n")
    result = run("midtrain.sh", ["--dry-run"], midtrain_job(env, tmp_path))
    assert result.returncode == 0, result.stderr
    assert [line for line in result.stdout.splitlines() if line.startswith("GLOO_SOCKET_IFNAME=")] == [
        "GLOO_SOCKET_IFNAME=eth7"]

    def gloo_ifname(**extra):
        shell = 'source launch/common.sh && gpus_per_node=8 && set_gpu_env && echo "$GLOO_SOCKET_IFNAME"'
        return subprocess.run(["bash", "-c", shell], cwd=REPO, env={**env, **extra}, capture_output=True, text=True,
                              check=True).stdout.strip()

    assert gloo_ifname() == "eth7"
    assert gloo_ifname(NCCL_SOCKET_IFNAME="lo") == "lo"  # interfaces of this node by name: gloo takes them too
    for nccl_only in ("=lo", "ib", "lo,ib"):  # NCCL's exact form, a prefix: not for gloo
        assert gloo_ifname(NCCL_SOCKET_IFNAME=nccl_only) == "eth7", nccl_only
    assert gloo_ifname(GLOO_SOCKET_IFNAME="bond0") == "bond0"


def test_slurm_launch_asks_every_endpoint_before_srun_and_refuses_a_placeholder(fake):
    """The shipped agent config names its simulator and coach by placeholders (EDIT): the job is refused before srun,
    in one line naming the field and the URL, until each answers with its model; it used to train plain GRPO with
    every coach request failing."""
    tmp_path, env = fake
    hf = released_hf_config(tmp_path / "qwen3-8b", "qwen3-8b")
    job = {**slurm_env(env, tmp_path), "SLURM_NNODES": "2", "CONFIG": TAU2_CONFIG}
    args = ["--pretrained-hf", str(hf), "--tokenizer", str(hf)]
    with FakeOpenAIServer(models=["mimesis-sim"]) as simulator:
        refusals = []
        for user in ({}, {"base_url": simulator.base_url, "model": "mimesis-sim"}):
            result = run("rl_agent.sh", [*args, "--user-model-options", json.dumps(user)] if user else args, job)
            assert result.returncode == 2, result.stderr
            assert after_config_line(result, "rl_agent", TAU2_CONFIG) == ""
            refusals += result.stderr.splitlines()
    assert len(refusals) == 2, refusals
    assert re.fullmatch(r"error: user_model_options: http://SIMULATOR_HOST:8000/v1/models did not answer \(.+\); "
                        r"the run would call it at every step", refusals[0]), refusals
    assert re.fullmatch(r"error: coach_options: http://COACH_HOST:8000/v1/models did not answer \(.+\); "
                        r"the run would call it at every step", refusals[1]), refusals
    assert simulator.requests == []  # asked for its model list only
    assert not (tmp_path / "log" / "srun").exists()
