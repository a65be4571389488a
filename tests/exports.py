"""Exports as a user makes them (``tools/convert_checkpoint.py export``), for the tests that serve or load one."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def export(load: Path, out: Path, tokenizer: Path) -> Path:
    """``load`` (a dist checkpoint) exported by the CLI to ``out`` with ``tokenizer``'s files."""
    proc = subprocess.run([sys.executable, "tools/convert_checkpoint.py", "export", "--load", str(load), "--out",
                           str(out), "--tokenizer", str(tokenizer)], cwd=REPO, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def tiny_simulator(tiny_hf_checkpoint: Path, tiny_dataset: Path, work: Path) -> Path:
    """The tiny model as a user would get it: imported to a dist checkpoint, then exported by the CLI."""
    from megatron_mimesis.checkpoint.conversion import import_from_hf

    import_from_hf(tiny_hf_checkpoint, work / "mcore")
    return export(work / "mcore", work / "export", tiny_dataset / "tokenizer")


def peaked(hf_dir: Path, out: Path) -> Path:
    """``hf_dir``'s model with its output layer scaled up 10x, saved to ``out``: random init gives ~uniform log-probs
    (-6.2 at the tiny vocab), so one set of weights (or one position) could not be told from another."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight.mul_(10.0)
    model.save_pretrained(out)
    return out


def transformers_logprobs(model_dir: Path, prompts: list[list[int]], responses: list[list[int]]) -> list[list[float]]:
    """transformers' log-prob (fp32) of each response token after its prompt: the reference a served model's
    prompt log-probs (``tests/vllm_server.VLLMServer.prompt_logprobs``) are compared with."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rows = []
    with torch.no_grad():
        for prompt, response in zip(prompts, responses, strict=True):
            logprobs = model(torch.tensor([prompt + response])).logits[0].log_softmax(-1)
            rows.append([logprobs[len(prompt) - 1 + i, token].item() for i, token in enumerate(response)])
    return rows
