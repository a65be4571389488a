"""An ``openai:`` simulator's likelihood comes from the server's prompt log-probs (``echo``): against a real
``vllm serve`` of the tiny model it equals the in-process transformers model's up to bf16; a server that refuses
prompt log-probs leaves the likelihood empty with the reason, and the simulator is still evaluated."""

import json

import pytest
from transformers import AutoTokenizer

from tests.eval.test_cli import eval_simulator
from tests.rl.fakes import FakeOpenAIServer

# vLLM computes in bf16, the in-process model in fp32 on the same weights: measured relative difference of the
# mean NLL 2e-4 (10.9415 vs 10.9395); scoring the wrong positions (one token off) moves it by far more than this
VLLM_REL_TOL = 2e-2


@pytest.fixture
def echoing_checkpoint(tiny_hf_checkpoint, tmp_path):
    """The tiny model with its output layer set to 10 x its embeddings: it predicts the token it has just read,
    peakedly. Real text rarely repeats a token, so its NLL is high; a scorer one position off would read each
    token's log-prob where that token is the input, and get an NLL near 0."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_hf_checkpoint, dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight.copy_(10.0 * model.model.embed_tokens.weight)
    model.save_pretrained(tmp_path / "echoing")
    return tmp_path / "echoing"


def _evaluate(tmp_path, tokenizer, heldout_file, *simulators):
    code = eval_simulator.main([
        *[arg for spec in simulators for arg in ("--simulator", spec)], "--tokenizer", str(tokenizer),
        "--input", str(heldout_file), "--seq-length", "128", "--max-new-tokens", "2", "--bootstrap", "0",
        "--output", str(tmp_path / "out"), "--no-progress"])
    assert code == 0
    return json.loads((tmp_path / "out" / "results.json").read_text())


def test_a_server_that_refuses_prompt_logprobs_leaves_the_likelihood_empty(tiny_dataset, heldout_file, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_dataset / "tokenizer")
    with FakeOpenAIServer(complete=lambda prompt: "hi", encode=tokenizer.encode, refuse_echo=True) as server:
        results = _evaluate(tmp_path, tiny_dataset / "tokenizer", heldout_file,
                            f"no-echo=openai:{server.base_url}@tiny")
    assert any(request.get("echo") for request in server.requests)
    assert results["cells"]["no-echo"]["nll_per_token"]["value"] is None
    assert "refuses prompt log-probs" in results["counts"]["no-echo"]["likelihood_note"]
    assert results["counts"]["no-echo"]["observations"] == 7  # its replies were still generated and scored


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_prompt_logprobs_give_the_in_process_nll(echoing_checkpoint, tiny_dataset, heldout_file, tmp_path):
    from tests.vllm_server import VLLMServer

    with VLLMServer(echoing_checkpoint, tmp_path / "server.log", tokenizer=tiny_dataset / "tokenizer") as server:
        results = _evaluate(tmp_path, tiny_dataset / "tokenizer", heldout_file, f"local=hf:{echoing_checkpoint}",
                            f"served=openai:{server.base_url}@tiny")
    local, remote = results["cells"]["local"], results["cells"]["served"]
    print(f"MEASURED vllm serve vs transformers NLL/token: {remote['nll_per_token']['value']:.5f} vs "
          f"{local['nll_per_token']['value']:.5f}")
    assert remote["nll_per_token"]["value"] == pytest.approx(local["nll_per_token"]["value"], rel=VLLM_REL_TOL)
    assert remote["bits_per_byte"]["value"] == pytest.approx(local["bits_per_byte"]["value"], rel=VLLM_REL_TOL)
    assert results["counts"]["served"]["likelihood_tokens"] == results["counts"]["local"]["likelihood_tokens"] > 0
    served = results["counts"]["served"]  # the echoing model mostly says nothing: counted, not dropped
    assert served["observations"] + sum(served["generation_errors"].values()) == 7
