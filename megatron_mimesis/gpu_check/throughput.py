"""Qwen3.5-9B layers at length 24576 on this GPU, the memory plan checked against them, and the extrapolation to the
paper's layout.

The step is the trainer's: the model chunk from its config (Transformer Engine spec, the fusions this GPU has), in
megatron's DDP with fp32 main gradients, on one packed row through the fused loss. The memory plan of the same config
(``mimesis-plan``, run in a child process while this one builds and times, since planning measures on the CPU) is
compared twice: each layer's saved-tensor bytes counted here on the real TE / fla modules against the plan's per-layer
figure, and the step's peak ``torch.cuda.max_memory_allocated`` against the plan's allocated terms (parameters,
gradients, activations, backward temporaries), within ``PLAN_TOLERANCE``. The same model then takes one micro-batch of
the agent-RL update as ``rl/update/policy_step.py`` computes it (a 32768-token row: the GRPO + CSD loss, each token
weighed by the rollout correction), against the update column of the agent-RL plan of the same model.

:func:`stage_agent` does the same for the agent's family, Qwen3-8B, on the workload its plan is tight for: 4 layers at
its width and its 151936-row head take the 32768-token agent-RL micro-batch, timed, each layer's saved tensors and the
step's peak against the agent-RL plan of the same model.
"""

import dataclasses
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from megatron_mimesis.gpu_check.record import StageRecorder
from megatron_mimesis.gpu_check.world import init_one_rank_megatron

THROUGHPUT_SEQ = 24576
THROUGHPUT_LAYERS = 4
PAPER_LAYERS, PAPER_TP = 32, 4
# the step as a trainer config: what both the step below and its memory plan build
THROUGHPUT_RUN = {"stage": "midtrain", "model": "9b",
                  "model_overrides": {"num_layers": THROUGHPUT_LAYERS, "mtp_num_layers": 0},
                  "seq_length": THROUGHPUT_SEQ, "micro_batch_size": 1, "global_batch_size": 1, "bf16": True}
# one micro-batch of the agent-RL update at the shipped configs' max_tokens_per_microbatch, with vLLM colocated
# (its share is not the trainer's allocation: only the update column's allocated kinds are compared)
RL_UPDATE_TOKENS = 32768
RL_UPDATE_RUN = {"stage": "rl_agent", "model": "9b",
                 "model_overrides": {"num_layers": THROUGHPUT_LAYERS, "mtp_num_layers": 0}, "bf16": True,
                 "engine": "vllm", "max_tokens_per_microbatch": RL_UPDATE_TOKENS, "csd_alpha": 0.01}
# the agent's family: Qwen3-8B's layers at the agent-RL update, the workload its plan is tightest for
AGENT_RL_UPDATE_RUN = {**RL_UPDATE_RUN, "model": "qwen3-8b", "model_overrides": {"num_layers": THROUGHPUT_LAYERS}}
PLAN_TOLERANCE = 0.10
# the plan's rows this step allocates (no optimizer step, and the context is outside the allocator)
ALLOCATED_KINDS = ("parameters", "gradients", "activations", "temporaries")


def start_plan(out_dir: Path, run: dict = THROUGHPUT_RUN) -> subprocess.Popen:
    """``mimesis-plan --json`` of ``run`` on one GPU, in a child process."""
    config = Path(tempfile.mkdtemp(prefix="plan-", dir=out_dir)) / f"{run['stage']}.yaml"
    config.write_text(yaml.safe_dump(run))
    return subprocess.Popen([sys.executable, "-m", "megatron_mimesis.tools.plan", "--config", str(config), "--nodes",
                             "1", "--gpus-per-node", "1", "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def planned_step(child: subprocess.Popen) -> dict:
    """The planned bytes the step is compared with: ``allocated`` (the allocated kinds of the first column: the only
    one, or an RL plan's update) and ``layers`` (per layer kind, at the step's tokens). A plan that does not fit this
    GPU still prints its rows."""
    stdout, stderr = child.communicate(timeout=600)
    if not stdout.strip():
        raise RuntimeError(f"mimesis-plan printed no plan: {stderr.strip()[-300:]}")
    plan = json.loads(stdout)["memory_plan"]
    column = plan["columns"][0]
    allocated = sum(row["values"].get(column, 0.0) for row in plan["rows"] if row["kind"] in ALLOCATED_KINDS)
    return {"allocated_gib": allocated, "layer_gib": plan["details"]["layer_gib"]}


def stage_throughput(rec: StageRecorder) -> None:
    import torch

    from megatron_mimesis.data.collate import packed_seq_params
    from megatron_mimesis.training.flops import device_peak_flops, train_flops_per_token
    from megatron_mimesis.training.loss import lm_loss_output_processor
    from megatron_mimesis.training.memory.saved import SavedTensors

    plan_child = start_plan(rec.path.parent)
    rl_plan_child = start_plan(rec.path.parent, RL_UPDATE_RUN)
    init_one_rank_megatron()
    model, preset = _trainer_model(THROUGHPUT_RUN)
    tokens = torch.randint(0, preset.vocab_size, (1, THROUGHPUT_SEQ), device="cuda")
    positions = torch.arange(THROUGHPUT_SEQ, device="cuda")[None]
    mask = torch.ones(1, THROUGHPUT_SEQ, device="cuda")
    packed = packed_seq_params({"cu_seqlens": torch.tensor([0, THROUGHPUT_SEQ], dtype=torch.int32, device="cuda"),
                                "max_seqlen": THROUGHPUT_SEQ})

    def forward():
        return model(tokens, positions, None, labels=tokens, loss_mask=mask, packed_seq_params=packed,
                     output_processor=lm_loss_output_processor)

    def step():
        model.zero_grad_buffer()
        forward().backward()

    for _ in range(2):  # warm-up: Triton autotuning and compilation, TE workspace
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    reps = 5
    started = time.perf_counter()
    for _ in range(reps):
        step()
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - started) / reps
    peak_bytes = torch.cuda.max_memory_allocated()
    peak_flops = device_peak_flops(torch.cuda.get_device_name(0))
    tokens_per_s = THROUGHPUT_SEQ / seconds
    flops = train_flops_per_token(preset, THROUGHPUT_SEQ) * tokens_per_s
    kinds = preset.family.layer_kind_of(preset)
    layers = " + ".join(f"{kinds.count(kind)} {name}" for kind, name in preset.family.layer_kinds.items())
    rec.row(layers=f"{THROUGHPUT_LAYERS} ({layers}) + lm head", seq=THROUGHPUT_SEQ,
            step_s=seconds, tokens_per_s=tokens_per_s, tflops=flops / 1e12,
            mfu=flops / peak_flops if peak_flops else None, peak_gib=peak_bytes / 2**30,
            gpu_gib=torch.cuda.get_device_properties(0).total_memory / 2**30)
    layer_bytes = _saved_bytes_per_layer(model.module, forward, SavedTensors)
    _check_plan(rec, planned_step(plan_child), peak_bytes, layer_bytes, preset)
    _extrapolate(rec, model.module, tokens, mask, seconds, peak_flops, preset)
    _check_rl_update(rec, model, preset, planned_step(rl_plan_child), RL_UPDATE_RUN)


def stage_agent(rec: StageRecorder) -> None:
    """The agent's family (Qwen3-8B): its layers take one micro-batch of the agent-RL update as ``stage_throughput``'s
    do, and each layer's saved tensors and the step's peak are checked against the agent-RL plan of the same model."""
    plan_child = start_plan(rec.path.parent, AGENT_RL_UPDATE_RUN)
    init_one_rank_megatron()
    model, preset = _trainer_model(AGENT_RL_UPDATE_RUN)
    _check_rl_update(rec, model, preset, planned_step(plan_child), AGENT_RL_UPDATE_RUN, check_layers=True)


def _trainer_model(run: dict):
    """The one-rank model chunk ``run`` (a stage config's fields) trains, as the trainer builds it: Transformer
    Engine spec, this GPU's fusions, megatron's DDP with fp32 main gradients; and its preset."""
    from megatron_mimesis.models.provider import ModelProvider
    from megatron_mimesis.training.config import TrainConfig
    from megatron_mimesis.training.model import model_config, wrap_in_ddp

    fields = {k: v for k, v in run.items() if k in {f.name for f in dataclasses.fields(TrainConfig)} - {"stage"}}
    config = TrainConfig(**fields)
    preset, tf_config = config.preset, model_config(config)
    (model,) = wrap_in_ddp(config, tf_config, [ModelProvider(preset, tf_config, backend="te")().cuda()])
    return model, preset


def _saved_bytes_per_layer(module, forward, meter_cls) -> list[int]:
    """One more forward with a saved-tensor meter around each decoder layer (its parameters excluded)."""
    meters, hooks = [], []
    for layer in module.decoder.layers:
        def enter(mod, args, meters=meters):
            meters.append(meter_cls(exclude=list(mod.parameters())).__enter__())

        def leave(mod, args, output, meters=meters):
            meters[-1].__exit__(None, None, None)

        hooks += [layer.register_forward_pre_hook(enter), layer.register_forward_hook(leave)]
    loss = forward()
    for hook in hooks:
        hook.remove()
    del loss
    return [meter.bytes for meter in meters]


def _check_layers(rec: StageRecorder, planned: dict, layer_bytes: list[int], preset) -> None:
    kinds = preset.family.layer_kind_of(preset)
    for index, measured in enumerate(layer_bytes):
        kind = kinds[index]
        rec.row(check=f"{preset.name} layer {index} ({kind}) saved tensors vs plan", measured_gib=measured / 2**30,
                planned_gib=planned["layer_gib"][kind], ratio=measured / 2**30 / planned["layer_gib"][kind])


def _check_plan(rec: StageRecorder, planned: dict, peak_bytes: int, layer_bytes: list[int], preset) -> None:
    _check_layers(rec, planned, layer_bytes, preset)
    rec.note("plan: megatron's torch.compile'd GDN and output-gate helpers are counted eagerly there, an upper bound; "
             "a layer ratio below 1 is what compiling them saves")
    ratio = peak_bytes / 2**30 / planned["allocated_gib"]
    within = abs(ratio - 1) <= PLAN_TOLERANCE
    rec.row(check="step peak (max_memory_allocated) vs plan (parameters, gradients, activations, temporaries)",
            measured_gib=peak_bytes / 2**30, planned_gib=planned["allocated_gib"], ratio=ratio,
            status="ok" if within else "failed")
    if not within:
        raise RuntimeError(f"peak allocated {peak_bytes / 2**30:.2f} GiB is {ratio:.2f}x the plan's "
                           f"{planned['allocated_gib']:.2f} GiB (tolerance {PLAN_TOLERANCE:.0%})")


def _check_rl_update(rec: StageRecorder, model, preset, planned: dict, run: dict, check_layers: bool = False) -> None:
    """One micro-batch of the agent-RL update, built and lost as ``rl/update/policy_step.py`` does (one row: half
    context, half response; old, teacher and rollout-correction fields): its time, its peak against the plan's update
    and, with ``check_layers``, each layer's saved tensors against the plan's."""
    from functools import partial

    import torch

    from megatron_mimesis.data.collate import packed_seq_params
    from megatron_mimesis.rl.update.policy_step import PolicyLossConfig, _policy_output_processor
    from megatron_mimesis.rl.update.rows import StepRows
    from megatron_mimesis.training.memory.saved import SavedTensors

    tokens = run["max_tokens_per_microbatch"]
    half = tokens // 2
    ids = torch.randint(0, preset.vocab_size, (tokens,)).tolist()
    rows = StepRows.of([(ids[:half], ids[half:])], {name: [[value] * half] for name, value in (
        ("old_logprobs", -2.0), ("teacher_logprobs", -1.5), ("rollout_weights", 1.0))})
    batch = rows.microbatch([0], torch.tensor([0.5]), 1, torch.device("cuda"))
    loss_config = PolicyLossConfig(csd_alpha=run["csd_alpha"])

    def forward():
        return model(batch["tokens"], batch["position_ids"], None, packed_seq_params=packed_seq_params(batch),
                     output_processor=partial(_policy_output_processor, loss_config, True, batch))[0]

    def step():
        model.zero_grad_buffer()
        forward().backward()

    step()  # warm-up: the policy loss kernel's compilation
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    step()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    peak = torch.cuda.max_memory_allocated() / 2**30
    ratio = peak / planned["allocated_gib"]
    within = abs(ratio - 1) <= PLAN_TOLERANCE
    rec.row(check=f"{preset.name} agent-RL update, {THROUGHPUT_LAYERS} layers, one {tokens}-token micro-batch, peak "
            "vs plan (update column)", measured_gib=peak, planned_gib=planned["allocated_gib"], ratio=ratio,
            step_s=seconds, tokens_per_s=tokens / seconds, status="ok" if within else "failed")
    if check_layers:
        _check_layers(rec, planned, _saved_bytes_per_layer(model.module, forward, SavedTensors), preset)
    if not within:
        raise RuntimeError(f"the agent-RL update's peak allocated {peak:.2f} GiB is {ratio:.2f}x the plan's "
                           f"{planned['allocated_gib']:.2f} GiB (tolerance {PLAN_TOLERANCE:.0%})")


def _extrapolate(rec: StageRecorder, module, tokens, mask, seconds: float, peak_flops, preset) -> None:
    """The lm head + fused loss alone, to separate it from the per-layer cost, and the 32-layer TP=4 upper bound."""
    import torch

    from megatron_mimesis.kernels import fused_linear_cross_entropy
    from megatron_mimesis.models.presets import get_preset
    from megatron_mimesis.training.flops import train_flops_per_token

    hidden = torch.randn(THROUGHPUT_SEQ, preset.hidden_size, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = module.output_layer.weight

    def head():
        fused_linear_cross_entropy(hidden, weight, tokens[0], mask[0], vocab_size=preset.vocab_size)[0].backward()

    head()
    torch.cuda.synchronize()
    reps = 5
    started = time.perf_counter()
    for _ in range(reps):
        head()
    torch.cuda.synchronize()
    head_s = (time.perf_counter() - started) / reps
    per_layer_s = (seconds - head_s) / THROUGHPUT_LAYERS
    full = get_preset("9b")
    full_step_s = (PAPER_LAYERS * per_layer_s + head_s) / PAPER_TP
    full_tokens_per_gpu = THROUGHPUT_SEQ / full_step_s / PAPER_TP
    full_mfu = full_tokens_per_gpu * train_flops_per_token(full, THROUGHPUT_SEQ) / peak_flops if peak_flops else None
    rec.row(layers=f"extrapolated: {PAPER_LAYERS} layers at TP={PAPER_TP}", seq=THROUGHPUT_SEQ, step_s=full_step_s,
            tokens_per_s=full_tokens_per_gpu, mfu=full_mfu)
    rec.note(f"measured lm head + fused loss alone: {head_s * 1e3:.1f} ms; per layer (averaged over the 3:1 mix): "
             f"{per_layer_s * 1e3:.1f} ms")
    rec.note(f"extrapolation assumes: layers cost the same as the measured 3:1 mix, TP={PAPER_TP} splits every "
             "layer's and the head's work perfectly with no communication cost, no pipeline bubble, embedding and "
             "optimizer step not counted: an upper bound; tokens_per_s of that row is per GPU")
