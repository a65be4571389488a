"""A fake SLURM for the launcher tests: ``scontrol`` and ``srun`` that stand in for the cluster's (the ``fake``
fixture in conftest.py puts them on PATH), and the environment a batch job on four 8-GPU nodes sees."""

import json
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
JOB_ID = 4242

FAKE_SCONTROL = """#!/bin/bash
if [[ "$1 $2" == "show hostnames" ]]; then printf 'node001\\nnode002\\nnode003\\nnode004\\n'; exit 0; fi
echo "$*" >> "$FAKE_LOG/scontrol"
"""
# Records its arguments, then runs the per-node command as node 3 would (SLURM_NODEID=3; FAKE_NODEID overrides).
FAKE_SRUN = """#!/bin/bash
printf '%s\\n' "$@" > "$FAKE_LOG/srun"
SLURM_NODEID="${FAKE_NODEID:-3}" bash -c "${@: -1}"
"""
# Waits for SIGUSR1 the way a running job step would, and records that it got it.
FAKE_SRUN_WAITING = """#!/bin/bash
trap 'echo USR1 >> "$FAKE_LOG/srun_signals"; exit 0' USR1
touch "$FAKE_LOG/srun_started"
while true; do sleep 0.05; done
"""


def released_hf_config(path: Path, preset_name: str) -> Path:
    """A model's released HF config and a tokenizer stand-in, no weights: what a launcher's config check reads."""
    from megatron_mimesis.models.presets import get_preset

    preset = get_preset(preset_name)
    preset.family.hf_config(preset).save_pretrained(path)
    (path / "tokenizer.json").write_text("{}")
    return path


def write_exe(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o755)
    return path


def slurm_env(env, tmp_path):
    return {
        **env,
        "SLURM_JOB_ID": str(JOB_ID),
        "SLURM_JOB_NODELIST": "node[001-004]",
        "SLURM_NNODES": "4",
        "SLURM_NODEID": "0",
        "SLURM_GPUS_ON_NODE": "8",
        "SLURM_CPUS_ON_NODE": "64",
        "DATA_PATH": str(tmp_path / "data9b"),
        # the paper's checkpoints need ~0.8 TiB free and these jobs' ranks are fakes that save nothing: the launcher's
        # save-directory check is tested on its own (test_launch.py)
        "MIMESIS_SAVE_DIR_CHECKED": "1",
    }


def midtrain_job(env, tmp_path) -> dict:
    """A mid-training job's environment (midtrain_9b.yaml): the batch job's, with the model to start from."""
    return {**slurm_env(env, tmp_path), "PRETRAINED_HF": str(released_hf_config(tmp_path / "qwen3.5-9b", "9b"))}


def run(script, args, env, timeout: float = 300, **kwargs):
    return subprocess.run(["bash", f"launch/{script}", *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout, **kwargs)


def trainer_json(stdout: str) -> dict:
    return json.loads(stdout[stdout.index("{\n"):])


def after_config_line(result, stage: str, config: str, chosen: str = "from CONFIG") -> str:
    """The launcher's stdout past its first line, which must say which config it runs and why."""
    first, _, rest = result.stdout.partition("\n")
    assert first == f"== {stage}: {config} ({chosen})", result.stdout + result.stderr
    return rest
