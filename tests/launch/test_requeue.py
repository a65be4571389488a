"""A requeued job resumes, in every stage: each stage runs through its launcher under the fake SLURM (one node,
one process, a real torchrun and trainer) with the starting weights its 9B config uses, on the tiny preset; the
second launch on the same save directory (the job requeued after its checkpoint of step 1) must resume at the saved
iteration, say so once, and train the step the uninterrupted run trained, to the bit (issue 20: agent RL and SFT
from HF weights exited 2 on every requeue)."""

import json
import shutil
import socket

import pytest

from megatron_mimesis.checkpoint.conversion import import_from_hf
from tests.launch.slurm import JOB_ID, run
from tests.rl.test_simulator_rl import TOY_PROMPTS
from tests.training.conftest import SEQ_LENGTH, VOCAB, read_metrics

pytestmark = pytest.mark.slow

COMPARED = {"midtrain": ("loss", "grad_norm", "loss_tokens"), "sft": ("loss", "grad_norm", "loss_tokens"),
            "rl_simulator": ("reward_mean", "pg_loss", "rows", "grad_norm"),
            "rl_agent": ("reward_mean", "pg_loss", "rows", "grad_norm", "csd_gate_mean")}


@pytest.fixture(scope="module")
def imported(tiny_hf_checkpoint, tmp_path_factory):
    """The tiny HF model as a dist checkpoint (weights only): what sft_9b.yaml and rl_simulator_9b.yaml load."""
    out = tmp_path_factory.mktemp("imported") / "ckpt"
    import_from_hf(tiny_hf_checkpoint, out, dtype="fp32", progress=False)
    return out


def _stage_config(stage, tmp_path, tiny_dataset, tiny_hf_checkpoint, imported) -> tuple[dict, dict]:
    """(config, environment) of ``stage`` as its 9B config starts: midtrain from PRETRAINED_HF, SFT and simulator RL
    from `load` + `finetune`, agent RL from `pretrained_hf`."""
    common = {"model": "tiny", "model_overrides": {"vocab_size": VOCAB}, "train_iters": 2, "save_interval": 1,
              "save": str(tmp_path / "ckpt"), "log_dir": str(tmp_path / "log"), "progress": False, "lr": 1e-2,
              "min_lr": 1e-3, "lr_warmup_iters": 1}
    if stage in ("midtrain", "sft"):
        config = {**common, "data_path": str(tiny_dataset), "seq_length": SEQ_LENGTH, "global_batch_size": 4,
                  "micro_batch_size": 1}
        return ({**config, "load": str(imported), "finetune": True} if stage == "sft" else config,
                {"PRETRAINED_HF": str(tiny_hf_checkpoint)} if stage == "midtrain" else {})
    rl = {**common, "lr": 1e-2, "min_lr": 1e-2, "lr_warmup_iters": 0, "tokenizer": str(tiny_dataset / "tokenizer"),
          "thinking": False, "rollouts_per_prompt": 2, "max_new_tokens": 6}
    if stage == "rl_simulator":
        prompts = tmp_path / "prompts.jsonl"
        prompts.write_text("".join(json.dumps(p) + "\n" for p in TOY_PROMPTS[:2]))
        return {**rl, "load": str(imported), "finetune": True, "prompts": [str(prompts)],
                "domain_rewards": {"brief": "length_target"}, "counterpart": "scripted",
                "counterpart_options": {"reply": "Tell me more."}, "prompts_per_step": 2, "max_turns": 2}, {}
    return {**rl, "pretrained_hf": str(tiny_hf_checkpoint), "env": "toy", "user_model": "scripted",
            "coach": "scripted", "coach_options": {"note": "Answer in two words."}, "tasks_per_step": 1,
            "max_agent_turns": 2}, {}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("stage", list(COMPARED))
def test_a_requeued_job_resumes_and_trains_the_next_step_as_the_uninterrupted_one(
        fake, stage, tiny_dataset, tiny_hf_checkpoint, imported):
    tmp_path, env = fake
    config, start_env = _stage_config(stage, tmp_path, tiny_dataset, tiny_hf_checkpoint, imported)
    (tmp_path / "run.yaml").write_text(json.dumps(config))  # JSON is YAML
    job = {**env, **start_env, "CONFIG": str(tmp_path / "run.yaml"), "SLURM_JOB_ID": str(JOB_ID),
           "SLURM_JOB_NODELIST": "node001", "SLURM_NNODES": "1", "GPUS_PER_NODE": "1", "FAKE_NODEID": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "OMP_NUM_THREADS": "1"}
    script = f"{stage}.sh"
    first = run(script, [], job, timeout=600)
    assert first.returncode == 0, first.stderr[-4000:]
    uninterrupted = {r["iteration"]: r for r in read_metrics(tmp_path / "log")}
    assert sorted(uninterrupted) == [1, 2] and "resuming from" not in first.stderr
    # the job preempted after its checkpoint of step 1, requeued: the same command on the same save directory
    shutil.rmtree(tmp_path / "ckpt" / "iter_0000002")
    (tmp_path / "ckpt" / "latest").write_text("1\n")
    second = run(script, [], {**job, "MASTER_PORT": str(_free_port())}, timeout=600)
    assert second.returncode == 0, second.stderr[-4000:]
    resumed = [line for line in second.stderr.splitlines() if line.startswith("resuming from")]
    assert len(resumed) == 1 and resumed[0].startswith(f"resuming from {tmp_path / 'ckpt'} (iteration 1), not from "
                                                       f"{'the weights of ' * ('load' in config)}"), resumed
    records = read_metrics(tmp_path / "log")
    assert [r["iteration"] for r in records] == [1, 2]
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "2"
    step = records[1]
    assert {k: step.get(k) for k in COMPARED[stage]} == {k: uninterrupted[2].get(k) for k in COMPARED[stage]}
    assert all(uninterrupted[2].get(k) is not None for k in COMPARED[stage])
