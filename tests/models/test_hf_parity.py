"""Our megatron-core models against transformers' (fp32, random tiny weights), for every family: the tiny Qwen3.5
against ``Qwen3_5ForCausalLM``, the tiny Qwen3 against ``Qwen3ForCausalLM``."""

import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams

from megatron_mimesis.models.config import ParallelConfig
from tests.models.harness import (
    TINY_PRESETS,
    assert_grads_close,
    build_megatron_from_hf,
    hf_loss_and_grads,
    hf_reference,
    init_single_process_megatron,
    make_batch,
    megatron_train_step,
)
from tests.multiproc import run_distributed

LOGIT_TOL = 1e-4  # measured: ~2e-7


@pytest.fixture(scope="module", params=TINY_PRESETS, ids=lambda p: p.name)
def preset(request):
    return request.param


@pytest.fixture(scope="module")
def hf_model(preset):
    return hf_reference(preset=preset)


@pytest.fixture(scope="module")
def megatron_model(hf_model, preset):
    init_single_process_megatron()
    model, _, _ = build_megatron_from_hf(hf_model.state_dict(), ParallelConfig(), preset=preset)
    return model


def test_logits_match_transformers(hf_model, megatron_model):
    batch = make_batch(seq=80)  # longer than one 64-token delta-rule chunk (Qwen3.5)
    positions = torch.arange(80).expand(2, 80)
    with torch.no_grad():
        ours = megatron_model(batch["tokens"], positions, None)
        ref = hf_model(batch["tokens"]).logits
    diff = (ours - ref).abs().max().item()
    assert diff <= LOGIT_TOL, diff
    assert ref.abs().max() > 0.1  # not a vacuous comparison


def test_packed_row_equals_each_document_alone(megatron_model):
    lengths = [7, 19, 12]
    g = torch.Generator().manual_seed(3)
    docs = [torch.randint(0, 512, (1, n), generator=g) for n in lengths]
    cu = torch.tensor([0, 7, 26, 38], dtype=torch.int32)
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=19, max_seqlen_kv=19)
    positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    with torch.no_grad():
        packed_logits = megatron_model(torch.cat(docs, dim=1), positions, None, packed_seq_params=packed)
        alone = [megatron_model(d, torch.arange(d.shape[1]).unsqueeze(0), None) for d in docs]
    diff = (packed_logits - torch.cat(alone, dim=1)).abs().max().item()
    assert diff <= 1e-5, diff
    # and a document does see its own context: packing without boundaries would differ
    unpacked = megatron_model(torch.cat(docs, dim=1), positions, None)
    assert (unpacked - packed_logits).abs().max() > 1e-3


def test_loss_and_every_gradient_match_transformers_single_process(hf_model, preset):
    batch = make_batch()
    ref_loss, ref_grads = hf_loss_and_grads(hf_model, batch)
    (out,) = run_distributed(megatron_train_step, 1, 1, 1, False, hf_model.state_dict(), batch, preset)
    assert abs(out["loss"] - ref_loss) <= 1e-5, (out["loss"], ref_loss)
    assert_grads_close(out["grads"], ref_grads, "TP=1")


@pytest.mark.slow
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["sp-off", "sp-on"])
def test_tensor_parallel_2_matches_transformers(hf_model, preset, sequence_parallel):
    batch = make_batch()
    ref_loss, ref_grads = hf_loss_and_grads(hf_model, batch)
    outs = run_distributed(megatron_train_step, 2, 2, 1, sequence_parallel, hf_model.state_dict(), batch, preset)
    for rank, out in enumerate(outs):
        assert abs(out["loss"] - ref_loss) <= 1e-5, (rank, out["loss"], ref_loss)
        assert_grads_close(out["grads"], ref_grads, f"TP=2 rank {rank}")


@pytest.mark.slow
def test_pipeline_parallel_2_matches_transformers(hf_model, preset):
    batch = make_batch()
    ref_loss, ref_grads = hf_loss_and_grads(hf_model, batch)
    first, last = run_distributed(megatron_train_step, 2, 1, 2, False, hf_model.state_dict(), batch, preset)
    assert abs(last["loss"] - ref_loss) <= 1e-5, (last["loss"], ref_loss)
    assert set(first["grads"]).isdisjoint(last["grads"])
    assert_grads_close({**first["grads"], **last["grads"]}, ref_grads, "PP=2")


def test_a_model_with_the_mtp_head_trains_as_transformers_without_it_and_holds_the_head_frozen():
    """Qwen3.5 with its MTP head (``models/provider.py``: frozen, not run): at TP=2 the trainer's fused loss and
    every gradient are transformers' (which has no MTP head), and the head takes none."""
    from tests.models.harness import PRESET
    from tests.models.hf_mtp import hf_mtp_tensors

    preset = PRESET.replace(mtp_num_layers=1)
    hf_model = hf_reference(preset=PRESET)
    head = hf_mtp_tensors(preset)
    batch = make_batch()
    ref_loss, ref_grads = hf_loss_and_grads(hf_model, batch)
    outs = run_distributed(megatron_train_step, 2, 2, 1, False, hf_model.state_dict() | head, batch, preset, True)
    for rank, out in enumerate(outs):
        assert abs(out["loss"] - ref_loss) <= 1e-5, (rank, out["loss"], ref_loss)
        assert_grads_close(out["grads"], ref_grads, f"TP=2 rank {rank}")  # the same names: none of the head's
        assert set(head) <= set(out["weights"]), rank  # while the model holds it


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)], ids=["tp2-sp", "pp2"])
def test_a_trained_mtp_head_learns_what_vllms_drafter_runs(tp, pp):
    """A run that trains the head (megatron's MTP block and loss, the loss fused in ``training/mtp_loss.py``): the
    objective and every gradient, the head's and the word embedding's (which the head reads too) included, are those
    of transformers' model with the head wired as vLLM's drafter runs it, at TP=2 with sequence parallelism and at
    PP=2 (the head and its copy of the embedding on the last stage, its gradient summed into the first's)."""
    from tests.models.harness import PRESET
    from tests.models.hf_mtp import hf_mtp_loss_and_grads, hf_mtp_tensors

    preset, scale = PRESET.replace(mtp_num_layers=1), 0.3
    hf_model = hf_reference(preset=PRESET)
    head = {name: t * 0.1 if name.endswith(("fc.weight", "proj.weight")) else t
            for name, t in hf_mtp_tensors(preset).items()}
    batch = make_batch()
    ref_loss, ref_grads = hf_mtp_loss_and_grads(hf_model, head, batch, scale)
    outs = run_distributed(megatron_train_step, tp * pp, tp, pp, tp > 1, hf_model.state_dict() | head, batch,
                           preset, True, {"mtp_num_layers": 1, "mtp_loss_scaling_factor": scale})
    last = outs[-1]
    assert abs(last["loss"] - ref_loss) > 1e-3  # the head's loss is not in the logged value, but is in the gradients
    grads = {**outs[0]["grads"], **last["grads"]}
    assert set(head) <= set(grads)
    assert_grads_close(grads, ref_grads, f"TP={tp} PP={pp}")
    if pp > 1:  # both stages' copies of the word embedding took the whole gradient
        name = "model.embed_tokens.weight"
        assert torch.equal(outs[0]["grads"][name], last["grads"][name])
