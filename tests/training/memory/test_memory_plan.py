"""The memory plan against independent counts: transformers' parameter count of the same model at every layout, a
real tiny run's sharded states, the saved tensors measured at a length the fit never saw, and a hand count of the
SwiGLU MLP's activations."""

import pytest
import torch

from tests.multiproc import run_distributed
from tests.training.memory import planning

NINE_B_TEXT_PARAMETERS = 8_953_803_264  # Qwen3.5-9B without the MTP layer (DESIGN.md: 8.95B)
QWEN3_8B_PARAMETERS = 8_190_735_360  # Qwen3-8B as released (DESIGN.md: 8.19B, norms included)
PLANNED = ["tiny", "4b", "9b", "qwen3-tiny", "qwen3-4b", "qwen3-8b"]


def test_the_plan_counts_every_preset_whole_at_every_tp_and_pp(planner):
    """Each stage's shard, built by megatron for one rank, adds up (TP shards times TP, replicated tensors once, no
    vocabulary padding, a tied output layer once) to transformers' model, at TP 1/2/4/8 x PP 1/2/4, for both
    families."""
    result = planner.submit(planning.whole_model_counts, PLANNED, [1, 2, 4, 8], [1, 2, 4]).result()
    assert result["hf"]["9b"] == NINE_B_TEXT_PARAMETERS
    assert result["hf"]["qwen3-8b"] == QWEN3_8B_PARAMETERS
    assert {key[0] for key in result["plan"]} == set(PLANNED)
    assert len([key for key in result["plan"] if key[0] == "9b"]) == 12  # every layout is valid for 9B
    assert len([key for key in result["plan"] if key[0] == "qwen3-8b"]) == 12  # and for Qwen3-8B
    wrong = {key: count for key, count in result["plan"].items() if count != result["hf"][key[0]]}
    assert not wrong


def test_a_specs_fits_are_kept_on_disk_and_an_unreadable_entry_is_measured_again(planner, tmp_path):
    """The launcher plans before every submission: a spec measured once is read back by the next process."""
    result = planner.submit(planning.fits_kept_on_disk, str(tmp_path)).result()
    assert len(result["files"]) == 1 and result["files"][0].startswith("megatron-mimesis/activation-fits/")
    assert result["read_back"] == result["first"] == result["remeasured"]
    assert set(result["first"]) == {"embedding", "attention", "deltanet"}, result
    assert result["rewritten"] == {name: {"per_token": fit.per_token, "fixed": fit.fixed}
                                   for name, fit in result["first"].items()}
    assert result["other_specs_elsewhere"]


def _real_run_states(rank, world_size, fields):
    """A real tiny trainer on this gloo rank after one optimizer step (Adam creates its moments there): the bytes of
    its DDP parameter and gradient buffers and of its optimizer states."""
    from megatron.core import parallel_state

    from megatron_mimesis.training.config import TrainConfig
    from megatron_mimesis.training.train import Trainer

    trainer = Trainer(TrainConfig(**fields), tokenizer_dir="unused")
    trainer.optimizer.step()
    buffers = [b for model in trainer.model for b in model.buffers]
    optimizer = 0
    for opt in getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer]):
        for state in opt.optimizer.state.values():
            optimizer += sum(t.numel() * t.element_size() for name, t in state.items() if name != "step")
        optimizer += sum(t.numel() * t.element_size() for group in opt.shard_fp32_from_float16_groups for t in group)
    return {"pp": parallel_state.get_pipeline_model_parallel_rank(), "dp": parallel_state.get_data_parallel_rank(),
            "parameters": sum(b.param_data.numel() * b.param_data.element_size() for b in buffers),
            "gradients": sum(b.grad_data.numel() * b.grad_data.element_size() for b in buffers),
            "optimizer": optimizer}


@pytest.mark.slow
def test_state_bytes_equal_a_real_tiny_runs_sharded_states(planner):
    """bf16 tiny with tied embeddings at PP=2 x DP=2: the distributed optimizer shards over 2 ranks and the last
    stage holds its own copy of the embedding; the plan's bytes per stage equal the real ranks' to the byte."""
    fields = dict(model="tiny", pipeline_model_parallel_size=2, bf16=True, global_batch_size=4,
                  model_overrides={"tie_word_embeddings": True})
    planned = planner.submit(planning.stage_state_bytes, fields, 4).result()
    real = run_distributed(_real_run_states, 4, fields)
    for rank in real:
        if rank["dp"] == 0:
            assert {k: rank[k] for k in ("parameters", "gradients", "optimizer")} == planned[rank["pp"]], rank
    assert all(stage["optimizer"] > 0 for stage in planned)


@pytest.mark.parametrize("preset, tp, head", [("9b", 4, "lm"), ("tiny", 2, "policy"), ("qwen3-8b", 4, "policy")])
def test_activation_fits_predict_the_bytes_measured_at_another_length(planner, preset, tp, head):
    """The plan scales what it measured at two short rows to any length; here it is checked against the saved tensors
    of the same real modules measured at a third length (9B at the paper's TP=4 with the LM loss and a trained MTP
    head, tiny at TP=2 and Qwen3-8B at TP=4 with the GRPO + CSD + KL loss): every layer kind, the embedding, the head
    and the MTP layer with its loss agree to the byte."""
    from megatron_mimesis.models.presets import get_preset

    third = 5 * 32 * tp  # measurement_lengths: 64 and 128 tokens per TP rank
    result = planner.submit(planning.activations_at_another_length, preset, tp, head, third).result()
    mtp = {"mtp"} if head == "lm" else set()
    assert set(result) == {*get_preset(preset).family.layer_kinds, "embedding", "head", *mtp}
    for name, (planned, measured) in result.items():
        assert measured > 0 and planned == pytest.approx(measured, abs=0.5), name


@pytest.mark.parametrize("fused, values_per_token", [(True, 3), (False, 5)])
def test_fused_swiglu_keeps_3f_and_unfused_5f_per_token(fused, values_per_token):
    """The 9B MLP at its real width (F = 12288): megatron's fused SwiGLU keeps its input, the fc1 output (2F), and fc2
    keeps the SwiGLU output (F); unfused glu() also keeps silu(x) and the new x_linear + 0.0 (F each)."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLP, MLPSubmodules

    from megatron_mimesis.models.config import transformer_config
    from megatron_mimesis.models.presets import get_preset
    from megatron_mimesis.training.memory.saved import SavedTensors
    from tests.models.harness import init_single_process_megatron

    init_single_process_megatron()
    preset = get_preset("9b").replace(num_layers=4)
    config = transformer_config(preset, params_dtype=torch.bfloat16, perform_initialization=False,
                                bias_activation_fusion=fused)
    mlp = MLP(config, MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear))
    tokens = 16
    x = torch.zeros(tokens, 1, preset.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    with SavedTensors(exclude=[x, *mlp.parameters()]) as saved:
        out, _ = mlp(x)
    assert saved.bytes == values_per_token * preset.ffn_hidden_size * tokens * 2
    assert out.shape == x.shape


@pytest.mark.parametrize("method, layers", [("uniform", 1), ("uniform", 2), ("block", 1), ("block", 3)])
def test_full_recompute_keeps_what_the_plan_counts(planner, method, layers):
    """megatron's block with full recompute, measured on the real modules: checkpointed groups keep their input
    only, the others everything; the plan's model of it gives the same bytes."""
    measured, planned = planner.submit(planning.checkpointed_block, method, layers, 256).result()
    assert measured == pytest.approx(planned, abs=0.5)


def test_saved_tensors_count_what_the_graph_still_holds_at_the_end_of_the_forward():
    """A branch saved and freed mid-forward costs nothing at the backward pass, even when malloc hands its address
    to the next saved tensor; a view counts its whole storage once."""
    from megatron_mimesis.training.memory.saved import SavedTensors

    x = torch.ones(1024, requires_grad=True)
    with SavedTensors(exclude=[x]) as saved:
        for _ in range(3):
            branch = (x * 2).sin()  # sin saves its 4 KiB input; dropping the branch frees it
            del branch
        y = x * 3
        kept = y.sin()  # holds y: 4 KiB
        view = y[:10].cos()  # saves a view of y's storage: no new bytes
        del y
    assert saved.bytes == 1024 * 4
    (kept.sum() + view.sum()).backward()
    assert torch.allclose(x.grad, 3 * torch.cos(torch.full((1024,), 3.0)) - 3 * torch.sin(torch.full((1024,), 3.0))
                          * (torch.arange(1024) < 10))
