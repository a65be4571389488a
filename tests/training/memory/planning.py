"""Work the memory-plan tests hand to the planning process (the ``planner`` fixture): a spawned process with no
process group, which the plan's fake worlds need, and whose measurement cache the tests share. Module-level, so
that they can be pickled into it."""

import dataclasses
import io
import json
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

from megatron_mimesis.compat import prepare_cpu_process

prepare_cpu_process()  # before torch and megatron-core are imported here


def _cpu():
    from megatron_mimesis.compat import enable_cpu_compat

    enable_cpu_compat(force=True)


def whole_model_counts(presets: list[str], tps: list[int], pps: list[int]) -> dict:
    """(preset, TP, PP) -> the parameters the plan counts in the whole model, summed over the pipeline stages of
    one rank each, for every valid layout; and preset -> transformers' count of the same text model."""
    import torch

    from megatron_mimesis.models.config import ParallelConfig, validate_layout
    from megatron_mimesis.models.presets import get_preset
    from megatron_mimesis.training.config import TrainConfig
    from megatron_mimesis.training.memory.states import model_parameters

    _cpu()
    counts, hf = {}, {}
    for name in presets:
        preset = get_preset(name)
        with torch.device("meta"):
            hf[name] = sum(p.numel() for p in preset.family.hf_model(preset).parameters())
        for tp in tps:
            for pp in pps:
                try:
                    validate_layout(preset, ParallelConfig(tensor_model_parallel_size=tp,
                                                           pipeline_model_parallel_size=pp))
                except ValueError:
                    continue
                config = TrainConfig(model=name, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                     bf16=True)
                counts[name, tp, pp] = sum(model_parameters(config, tp * pp, r) for r in range(pp))
    return {"plan": counts, "hf": hf}


def stage_state_bytes(config_fields: dict, world_size: int) -> list[dict]:
    """The plan's parameter, gradient and optimizer bytes of each pipeline stage's first data-parallel rank."""
    from megatron_mimesis.training.config import TrainConfig
    from megatron_mimesis.training.memory.states import stage_states

    _cpu()
    config = TrainConfig(**config_fields)
    out = []
    for r in range(config.pipeline_model_parallel_size):
        s = stage_states(config, world_size, r, config.num_microbatches(world_size))
        out.append({"parameters": s.parameter_bytes, "gradients": s.gradient_bytes, "optimizer": s.optimizer_bytes})
    return out


def activations_at_another_length(preset_name: str, tp: int, head: str, third_length: int) -> dict:
    """module -> (the fit's bytes at ``third_length``, the bytes measured there), for the run's GPU fusions."""
    from megatron_mimesis.models.presets import get_preset
    from megatron_mimesis.rl.memory import PolicyHead
    from megatron_mimesis.training.memory.activations import MeasureSpec, lm_head, measure, saved_bytes_at
    from megatron_mimesis.training.memory.plan import gpu_run_fusions

    _cpu()
    heads = {"lm": lm_head, "policy": PolicyHead(csd=True, kl=True, weighted=True)}
    spec = MeasureSpec(preset=get_preset(preset_name), tensor_parallel=tp, context_parallel=1,
                       sequence_parallel=tp > 1, bf16=True, selective_recompute=False,
                       fusions=tuple(sorted(gpu_run_fusions().items())), head=heads[head], trained_mtp=head == "lm")
    fits = measure(spec)
    planned = {**fits.layers, "embedding": fits.embedding, "head": fits.head, **({"mtp": fits.mtp} if fits.mtp else {})}
    measured = {**saved_bytes_at(spec.__class__(**{**spec.__dict__, "head": None, "trained_mtp": False}),
                                 [third_length]),
                **saved_bytes_at(spec, [third_length])}
    return {name: (planned[name].at(third_length), measured[name][0][1]) for name in planned}


def run_mimesis_plan(argv: list[str]) -> tuple[int, str, str]:
    """``mimesis-plan argv`` in the planning process: (exit status, stdout, stderr)."""
    from megatron_mimesis.tools.plan import main

    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        status = main(argv)
    return status, out.getvalue(), err.getvalue()


def trainer_dry_run(argv: list[str], world_size: int) -> tuple[int, str, str]:
    """The trainer's ``main(argv + ["--dry-run"])`` under ``WORLD_SIZE``: (exit status, stdout, stderr)."""
    import os

    from megatron_mimesis.training.train import main

    os.environ["WORLD_SIZE"] = str(world_size)
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        status = main([*argv, "--dry-run"])
    return status, out.getvalue(), err.getvalue()


def checkpointed_block(method: str, layers: int, tokens: int) -> tuple[int, float]:
    """The tiny preset's decoder block (3 DeltaNet + 1 attention layer) under full recompute with ``method`` and
    ``layers``: (saved bytes measured on the real block, the plan's activation bytes for it)."""
    import torch
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.transformer.transformer_block import TransformerBlock

    from megatron_mimesis.data.collate import packed_seq_params
    from megatron_mimesis.models.config import ParallelConfig, transformer_config
    from megatron_mimesis.training.config import TrainConfig
    from megatron_mimesis.training.memory.activations import measure
    from megatron_mimesis.training.memory.gpu_kernels import gpu_saved_sets
    from megatron_mimesis.training.memory.plan import (
        gpu_run_fusions,
        layer_activation_bytes,
        measure_spec,
        training_workload,
    )
    from megatron_mimesis.training.memory.saved import SavedTensors
    from megatron_mimesis.training.memory.states import stage_states
    from megatron_mimesis.training.memory.world import rank_of_world

    _cpu()
    run = TrainConfig(model="tiny", bf16=True, seq_length=tokens, global_batch_size=1, recompute_granularity="full",
                      recompute_method=method, recompute_num_layers=layers)
    held, _ = layer_activation_bytes(run, measure(measure_spec(run, training_workload(run, 1))),
                                     stage_states(run, 1, 0, 1), tokens)
    with rank_of_world(run, 1), gpu_saved_sets():
        config = transformer_config(run.preset, ParallelConfig(), params_dtype=torch.bfloat16,
                                    perform_initialization=False, recompute_granularity="full",
                                    recompute_method=method, recompute_num_layers=layers, **gpu_run_fusions())
        block = TransformerBlock(config, run.preset.family.block_spec(config, "local"), post_layer_norm=False)
        rotary = RotaryEmbedding(kv_channels=config.kv_channels, rotary_percent=run.preset.rotary_percent,
                                 rotary_base=int(run.preset.rotary_base), use_cpu_initialization=True)
        freqs = rotary(tokens, packed_seq=True)
        hidden = torch.zeros(tokens, 1, run.preset.hidden_size, dtype=torch.bfloat16, requires_grad=True)
        packed = packed_seq_params({"cu_seqlens": torch.tensor([0, tokens], dtype=torch.int32), "max_seqlen": tokens})
        with SavedTensors(exclude=[*block.parameters(), freqs]) as saved:
            out = block(hidden, attention_mask=None, rotary_pos_emb=freqs, packed_seq_params=packed)
        del out
    return saved.bytes, sum(held.values())


def save_dir_refusal(config, world_size: int, free_bytes: int) -> str | None:
    """``check_save_dir``'s refusal on a disk with ``free_bytes`` free (None when it has room)."""
    import shutil
    from types import SimpleNamespace
    from unittest import mock

    from megatron_mimesis.training.config import ConfigError
    from megatron_mimesis.training.save_dir import check_save_dir

    with mock.patch.object(shutil, "disk_usage", lambda path: SimpleNamespace(free=free_bytes)):
        try:
            check_save_dir(config, world_size)
        except ConfigError as exc:
            return str(exc)
    return None


def fits_kept_on_disk(cache_home: str) -> dict:
    """A spec's fits measured once into ``cache_home``, read back by a fresh process (the in-memory cache cleared and
    measuring made impossible), and measured again over an unreadable entry."""
    import os

    from megatron_mimesis.models.presets import get_preset
    from megatron_mimesis.training.memory import activations

    _cpu()
    previous = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = cache_home
    spec = activations.MeasureSpec(preset=get_preset("tiny"), tensor_parallel=1, context_parallel=1,
                                   sequence_parallel=False, bf16=True, selective_recompute=False, fusions=(),
                                   head=None)
    measuring = activations.saved_bytes_at
    try:
        activations._fits.cache_clear()
        first = activations._fits(spec)
        files = sorted(Path(cache_home).rglob("*.json"))

        def refuse(*args):
            raise AssertionError("measured again")

        activations._fits.cache_clear()
        activations.saved_bytes_at = refuse
        read_back = activations._fits(spec)
        activations.saved_bytes_at = measuring
        files[0].write_text("{not json")
        activations._fits.cache_clear()
        remeasured = activations._fits(spec)
        others = [activations._cached_fits(dataclasses.replace(spec, **change))
                  for change in ({"tensor_parallel": 2}, {"head": activations.lm_head})]
        return {"files": [str(f.relative_to(cache_home)) for f in files], "first": first, "read_back": read_back,
                "remeasured": remeasured, "rewritten": json.loads(files[0].read_text()),
                "other_specs_elsewhere": len({*others, files[0]}) == 3}
    finally:
        activations.saved_bytes_at = measuring
        activations._fits.cache_clear()
        if previous is None:
            os.environ.pop("XDG_CACHE_HOME")
        else:
            os.environ["XDG_CACHE_HOME"] = previous
