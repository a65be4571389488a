"""Each training stage's config as its 9B config starts (midtrain from PRETRAINED_HF, SFT and simulator RL from `load`
+ `finetune`, agent RL from `pretrained_hf`), on the tiny preset and the tiny dataset: what the launcher tests run
through the fake SLURM (test_requeue.py) and the real one (test_slurm_jobs.py)."""

import json

from tests.rl.test_simulator_rl import TOY_PROMPTS
from tests.training.conftest import SEQ_LENGTH, VOCAB

STAGES = ("midtrain", "sft", "rl_simulator", "rl_agent")
# what a resumed step must reproduce, per stage
COMPARED = {"midtrain": ("loss", "grad_norm", "loss_tokens"), "sft": ("loss", "grad_norm", "loss_tokens"),
            "rl_simulator": ("reward_mean", "pg_loss", "rows", "grad_norm"),
            "rl_agent": ("reward_mean", "pg_loss", "rows", "grad_norm", "csd_gate_mean")}


def stage_config(stage, tmp_path, tiny_dataset, tiny_hf_checkpoint, imported, **changes) -> tuple[dict, dict]:
    """(config, environment) of ``stage`` as its 9B config starts, with ``changes`` over the config."""
    common = {"model": "tiny", "model_overrides": {"vocab_size": VOCAB}, "train_iters": 2, "save_interval": 1,
              "save": str(tmp_path / "ckpt"), "log_dir": str(tmp_path / "log"), "progress": False, "lr": 1e-2,
              "min_lr": 1e-3, "lr_warmup_iters": 1}
    if stage in ("midtrain", "sft"):
        config = {**common, "data_path": str(tiny_dataset), "seq_length": SEQ_LENGTH, "global_batch_size": 4,
                  "micro_batch_size": 1}
        config, env = ({**config, "load": str(imported), "finetune": True} if stage == "sft" else config,
                       {"PRETRAINED_HF": str(tiny_hf_checkpoint)} if stage == "midtrain" else {})
        return {**config, **changes}, env
    rl = {**common, "lr": 1e-2, "min_lr": 1e-2, "lr_warmup_iters": 0, "tokenizer": str(tiny_dataset / "tokenizer"),
          "thinking": False, "rollouts_per_prompt": 2, "max_new_tokens": 6}
    if stage == "rl_simulator":
        prompts = tmp_path / "prompts.jsonl"
        prompts.write_text("".join(json.dumps(p) + "\n" for p in TOY_PROMPTS[:2]))
        return {**rl, "load": str(imported), "finetune": True, "prompts": [str(prompts)],
                "domain_rewards": {"brief": "length_target"}, "counterpart": "scripted",
                "counterpart_options": {"reply": "Tell me more."}, "prompts_per_step": 2, "max_turns": 2,
                **changes}, {}
    return {**rl, "pretrained_hf": str(tiny_hf_checkpoint), "env": "toy", "user_model": "scripted",
            "coach": "scripted", "coach_options": {"note": "Answer in two words."}, "tasks_per_step": 1,
            "max_agent_turns": 2, **changes}, {}
