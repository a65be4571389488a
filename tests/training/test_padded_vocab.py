"""A model whose vocabulary megatron pads (1000 -> 1024 output rows, at TP=1, TP=2 with and without sequence
parallelism, and PP=2) trains on the trainer's fused loss exactly like its transformers twin, which has no padding
rows: same loss, same gradient for every parameter, and the padding rows of the output layer get exactly zero
gradient. The tests' usual vocab 512 never pads, so the kernels' vocab_size was never exercised by the model."""

import pytest
import torch

from megatron_mimesis.models.config import ParallelConfig
from tests.models.harness import (
    PRESET,
    QWEN3_PRESET,
    assert_grads_close,
    build_megatron_from_hf,
    hf_loss_and_grads,
    hf_reference,
    make_batch,
    megatron_train_step,
)
from tests.multiproc import run_distributed

VOCAB = 1000
PADDED_PRESET = PRESET.replace(vocab_size=VOCAB)
LOSS_TOL = 1e-5


def _twin(preset):
    model = hf_reference(seed=2, preset=preset)
    batch = make_batch(seed=3, vocab=VOCAB)
    batch["labels"][0, :4] = torch.tensor([VOCAB - 1, VOCAB - 2, 0, VOCAB - 3])  # ids next to the padding
    loss, grads = hf_loss_and_grads(model, batch)
    return model.state_dict(), batch, loss, grads, preset


@pytest.fixture(scope="module")
def hf_twin():
    return _twin(PADDED_PRESET)


def _train(hf_twin, tp, pp=1, sequence_parallel=False):
    state, batch, ref_loss, ref_grads, preset = hf_twin
    outs = run_distributed(megatron_train_step, tp * pp, tp, pp, sequence_parallel, state, batch, preset, True)
    last_stage = outs[-tp:]
    grads = {}
    for out in outs[::tp]:  # the first TP rank of each stage: its own parameters
        grads.update(out["grads"])
    assert_grads_close(grads, ref_grads, f"TP={tp} PP={pp}")
    rows = 1024 // tp
    for out in last_stage:
        assert out["padded_vocab_size"] == 1024
        assert abs(out["loss"] - ref_loss) <= LOSS_TOL, (out["loss"], ref_loss)
        padding = torch.arange(rows) + rows * out["tp_rank"] >= VOCAB
        assert padding.any() == (out["tp_rank"] == tp - 1)
        assert (out["output_grad"][padding] == 0).all()
        assert out["output_grad"][~padding].abs().max() > 0


def test_padded_model_equals_its_transformers_twin(hf_twin):
    _train(hf_twin, tp=1)


@pytest.mark.slow
@pytest.mark.parametrize(("tp", "pp", "sequence_parallel"), [(2, 1, False), (2, 1, True), (1, 2, False)],
                         ids=["tp2", "tp2-sp", "pp2"])
def test_padded_model_in_parallel_layouts_equals_its_transformers_twin(hf_twin, tp, pp, sequence_parallel):
    _train(hf_twin, tp, pp, sequence_parallel)


@pytest.mark.slow
def test_padded_qwen3_at_tp2_with_sequence_parallel_equals_its_transformers_twin():
    """The dense family on the same padded vocabulary (1000 -> 1024 rows), split over TP=2 with sequence parallel."""
    _train(_twin(QWEN3_PRESET.replace(vocab_size=VOCAB)), tp=2, sequence_parallel=True)


def test_rl_scoring_and_local_engine_see_the_real_vocabulary_only(hf_twin):
    """Teacher scoring (fused kernel) and the local engine's sampling log-probs equal transformers' log_softmax
    over the 1000 real tokens (the 24 padding logits would shift every log-prob by about 2e-2)."""
    from megatron_mimesis.rl.engines.local import LocalEngine
    from megatron_mimesis.rl.types import SamplingParams
    from megatron_mimesis.rl.update.scoring import score_rows
    from tests.models.harness import init_single_process_megatron

    state = hf_twin[0]
    hf = hf_reference(seed=2, preset=PADDED_PRESET)
    init_single_process_megatron()
    model, _, _ = build_megatron_from_hf(state, ParallelConfig(), preset=PADDED_PRESET)
    rows = [([5, 17, 999, 3], [998, 8, 120]), ([42], [7, 300, 2, 997])]
    scores = score_rows([model], rows, 64, torch.device("cpu"))
    for (context, response), got in zip(rows, scores, strict=True):
        with torch.no_grad():
            logp = torch.log_softmax(hf(torch.tensor([context + response])).logits[0].float(), dim=-1)
        want = [logp[len(context) - 1 + k, token].item() for k, token in enumerate(response)]
        assert max(abs(a - b) for a, b in zip(got, want, strict=True)) <= 1e-4

    class Decoder:
        def decode(self, ids, skip_special_tokens=False):
            return " ".join(map(str, ids))

    prompt = [5, 17, 999, 3]
    (gen,) = LocalEngine(model, Decoder(), torch.device("cpu")).generate([prompt], SamplingParams(max_new_tokens=4,
                                                                                                  temperature=0.0))
    with torch.no_grad():
        logp = torch.log_softmax(hf(torch.tensor([prompt + gen.token_ids])).logits[0].float(), dim=-1)
    steps = range(len(prompt) - 1, len(prompt) + 3)
    assert gen.token_ids == [int(logp[t].argmax()) for t in steps]
    want = [logp[t, token].item() for t, token in zip(steps, gen.token_ids, strict=True)]
    assert max(abs(a - b) for a, b in zip(gen.logprobs, want, strict=True)) <= 1e-4
