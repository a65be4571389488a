"""Reading Hugging Face Qwen3.5 checkpoint directories (safetensors, sharded or not).

The released checkpoints are ``Qwen3_5ForConditionalGeneration``: text weights under
``model.language_model.*`` beside a vision tower (``model.visual.*``) and MTP weights (``mtp.*``). Training
is text-only, so this returns the text model under ``Qwen3_5ForCausalLM`` names (``model.*``, ``lm_head``),
the names the parameter mapping uses.
"""

import json
from pathlib import Path

import torch
from safetensors import safe_open

CONDITIONAL_TEXT_PREFIX = "model.language_model."
TEXT_PREFIX = "model."


def safetensors_files(directory: str | Path) -> list[Path]:
    directory = Path(directory)
    index = directory / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [directory / n for n in names]
    else:
        files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{directory}: no safetensors weights (model.safetensors or an index)")
    missing = [str(f) for f in files if not f.exists()]
    if missing:
        raise FileNotFoundError(f"{directory}: shard(s) listed in the index are missing: {missing}")
    return files


def text_model_name(name: str) -> str | None:
    """Checkpoint tensor name -> Qwen3_5ForCausalLM name, or None for non-text tensors (vision, MTP)."""
    if name.startswith(CONDITIONAL_TEXT_PREFIX):
        return TEXT_PREFIX + name[len(CONDITIONAL_TEXT_PREFIX):]
    if name == "lm_head.weight" or (name.startswith(TEXT_PREFIX) and not name.startswith("model.visual.")):
        return name
    return None


def read_hf_state(directory: str | Path) -> dict[str, torch.Tensor]:
    """All text-model tensors of an HF checkpoint directory, under Qwen3_5ForCausalLM names."""
    state = {}
    for path in safetensors_files(directory):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                text_name = text_model_name(name)
                if text_name is not None:
                    state[text_name] = f.get_tensor(name)
    return state
