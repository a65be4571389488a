"""A model whose vocabulary megatron pads (1000 -> 1024 output rows, at TP=1 and TP=2) trains on the trainer's
fused loss exactly like its transformers twin, which has no padding rows: same loss, same gradient for every
parameter, and the padding rows of the output layer get exactly zero gradient. The tests' usual vocab 512 never
pads, so the kernels' vocab_size was never exercised by the model."""

import pytest
import torch

from megatron_mimesis.models.config import ParallelConfig
from megatron_mimesis.models.hf_weights import gather_hf_tensors
from tests.models.harness import PRESET, build_megatron_from_hf, hf_loss_and_grads, hf_reference, make_batch
from tests.multiproc import run_distributed

VOCAB = 1000
PADDED_PRESET = PRESET.replace(vocab_size=VOCAB)
LOSS_TOL = 1e-5
GRAD_TOL = 1e-5  # relative to each tensor's largest HF gradient entry (as the HF-parity tests)


def _forward_step(data_iterator, model):
    from megatron_mimesis.training.loss import lm_loss_output_processor

    batch = next(data_iterator)
    positions = torch.arange(batch["tokens"].shape[1]).expand_as(batch["tokens"])
    loss_sum = model(batch["tokens"], positions, None, labels=batch["labels"], loss_mask=batch["loss_mask"],
                     output_processor=lm_loss_output_processor)

    def mean_loss(output):
        loss = output / batch["loss_mask"].sum()
        return loss, {"loss": loss.detach().clone()}

    return loss_sum, mean_loss


def _train_step(rank, world_size, tp, hf_state, batch):
    """One forward/backward of the trainer's loss through megatron's schedule; HF-named grads and the output
    layer's full local gradient (padding rows included)."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_mimesis.compat import enable_cpu_compat
    from megatron_mimesis.training.grads import finalize_grads

    enable_cpu_compat()
    parallel_state.initialize_model_parallel(tp, 1)
    model_parallel_cuda_manual_seed(0)
    module, config, provider = build_megatron_from_hf(hf_state, ParallelConfig(tensor_model_parallel_size=tp),
                                                      preset=PADDED_PRESET)
    assert provider.padded_vocab_size == 1024
    model = DistributedDataParallel(config=config, ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True),
                                    module=module)
    config.finalize_model_grads_func = finalize_grads
    model.zero_grad_buffer()
    losses = get_forward_backward_func()(
        forward_step_func=_forward_step, data_iterator=iter([batch]), model=[model], num_microbatches=1,
        seq_length=batch["tokens"].shape[1], micro_batch_size=batch["tokens"].shape[0], forward_only=False,
    )
    result = {
        "loss": losses[0]["loss"].item(),
        "grads": gather_hf_tensors(module, PADDED_PRESET, provider.padded_vocab_size, grads=True),
        "output_grad": module.output_layer.weight.main_grad.detach().clone(),
        "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
    }
    parallel_state.destroy_model_parallel()
    return result


@pytest.fixture(scope="module")
def hf_twin():
    model = hf_reference(seed=2, preset=PADDED_PRESET)
    batch = make_batch(seed=3, vocab=VOCAB)
    batch["labels"][0, :4] = torch.tensor([VOCAB - 1, VOCAB - 2, 0, VOCAB - 3])  # ids next to the padding
    loss, grads = hf_loss_and_grads(model, batch)
    return model.state_dict(), batch, loss, grads


def _check(out, hf_twin, tp):
    _, _, ref_loss, ref_grads = hf_twin
    assert abs(out["loss"] - ref_loss) <= LOSS_TOL, (out["loss"], ref_loss)
    assert set(out["grads"]) == set(ref_grads)
    for name, grad in ref_grads.items():
        err = (out["grads"][name] - grad).abs().max().item()
        assert err <= GRAD_TOL * max(1.0, grad.abs().max().item()), f"TP={tp}: {name} grad differs by {err}"
    rows = 1024 // tp
    padding = torch.arange(rows) + rows * out["tp_rank"] >= VOCAB
    assert padding.any() == (out["tp_rank"] == tp - 1)
    assert (out["output_grad"][padding] == 0).all()
    assert out["output_grad"][~padding].abs().max() > 0


def test_padded_model_equals_its_transformers_twin(hf_twin):
    state, batch = hf_twin[:2]
    (out,) = run_distributed(_train_step, 1, 1, state, batch)
    _check(out, hf_twin, 1)


@pytest.mark.slow
def test_padded_model_at_tp2_equals_its_transformers_twin(hf_twin):
    state, batch = hf_twin[:2]
    for out in run_distributed(_train_step, 2, 2, state, batch):
        _check(out, hf_twin, 2)


def test_rl_scoring_and_local_engine_see_the_real_vocabulary_only(hf_twin):
    """Teacher scoring (fused kernel) and the local engine's sampling log-probs equal transformers' log_softmax
    over the 1000 real tokens (the 24 padding logits would shift every log-prob by about 2e-2)."""
    from megatron_mimesis.rl.local_engine import LocalEngine
    from megatron_mimesis.rl.scoring import score_rows
    from megatron_mimesis.rl.types import SamplingParams
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
