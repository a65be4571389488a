"""The memory plan of a run: per GPU and pipeline stage, every term, its source, the total, and whether it fits.

A plan is a table whose columns are what one GPU goes through (each pipeline stage while it trains; with a
colocated rollout engine, also the rollout phase in which the engine is awake) and whose rows are terms in bytes:

* exact: parameters, fp32 main gradients and optimizer states of the rank's shard (``states.py``);
* measured: activations of the micro-batches the schedule holds in flight on that stage, per layer kind, the
  embedding and the loss head (``activations.py``), with full recompute keeping only each checkpointed layer's input;
* modelled: the backward temporaries, the larger of the fused loss's at its real chunk size
  (``kernels/linear_logprob.py``: fp32 grad_W and grad_h, one chunk of d logits, their casts), held while every
  activation still is, and one layer's gradients while its backward runs; the engine's share when awake and what it
  keeps asleep (given by the RL stage);
* allowance: the CUDA context, NCCL communicators and library workspaces, stated, outside the allocator's tensors.

A column fits when its total leaves ``MARGIN`` of the GPU free. A plan that does not fit names its biggest term and
the cheapest change that fits (:func:`cheapest_fit`). Other rows can join the same table (``Row(counts=False)``
for figures that are not GPU memory, e.g. a checkpoint's size): the table renders any row the plan holds.
"""

import dataclasses
import functools
import json
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

from megatron_mimesis.training.memory.activations import (
    Activations,
    MeasureSpec,
    lm_head,
    measure,
)
from megatron_mimesis.training.memory.checkpoint import (
    checkpoint_bytes,
    node_write_bytes,
    readable_bytes,
    write_seconds,
)
from megatron_mimesis.training.memory.gpus import GPU_MEMORY_GIB, MARGIN
from megatron_mimesis.training.memory.states import StageStates, stage_states

GIB = 2**30
# CUDA context and torch/cuBLAS handles (~0.6 GiB), NCCL communicators of megatron's groups (~1.5 GiB), TE and
# cuBLAS workspaces and megatron's sequence-parallel gather buffer: memory no term below counts.
CONTEXT_ALLOWANCE_GIB = 3.0
GRAD_ROW_ALIGN = 16  # kernels/linear_logprob.py pads each row of d logits to a multiple of 16


@dataclass(frozen=True)
class Engine:
    """A rollout engine colocated on the GPUs: its share while it samples, what it keeps while the trainer steps."""

    name: str
    awake_bytes: float
    asleep_bytes: float
    awake_source: str
    asleep_source: str


@dataclass(frozen=True)
class Workload:
    """What one step runs on a data-parallel rank, beyond the config's model and layout."""

    tokens: int  # per micro-batch, before context- and sequence-parallel splits
    microbatches: int  # per step and data-parallel rank (what the pipeline schedule can hold in flight)
    description: str
    head: Callable = lm_head  # the last stage's loss on the hidden states (activations.lm_head or the RL one)
    frozen_copies: tuple[str, ...] = ()  # frozen model copies the ranks hold next to the policy (a KL reference)
    engine: Engine | None = None


KIND_ORDER = ("parameters", "gradients", "optimizer", "frozen", "activations", "temporaries", "engine", "allowance")


@dataclass(frozen=True)
class Row:
    term: str
    values: dict  # column -> value in ``unit`` (bytes for "GiB" rows)
    source: str
    kind: str  # the plan's own rows: one of KIND_ORDER; a row added next to them names its own (with counts=False)
    unit: str = "GiB"
    counts: bool = True  # part of the GPU total


@dataclass
class MemoryPlan:
    title: str
    gpu: str
    capacity_bytes: float
    columns: list[str]
    rows: list[Row] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    details: dict = field(default_factory=dict)  # machine-readable extras (one layer's activations, for gpu_check)

    def total(self, column: str) -> float:
        return sum(r.values.get(column, 0.0) for r in self.rows if r.counts)

    @property
    def usable_bytes(self) -> float:
        return self.capacity_bytes * (1 - MARGIN)

    @property
    def worst_column(self) -> str:
        return max(self.columns, key=self.total)

    @property
    def fits(self) -> bool:
        return self.total(self.worst_column) <= self.usable_bytes

    def biggest_term(self, column: str) -> Row:
        return max((r for r in self.rows if r.counts), key=lambda r: r.values.get(column, 0.0))

    def to_dict(self) -> dict:
        return {
            "gpu": self.gpu, "capacity_gib": self.capacity_bytes / GIB, "margin": MARGIN, "columns": self.columns,
            "rows": [{"term": r.term, "kind": r.kind, "source": r.source, "unit": r.unit, "counts": r.counts,
                      "values": {c: (v / GIB if r.unit == "GiB" else v) for c, v in r.values.items()}}
                     for r in self.rows],
            "total_gib": {c: self.total(c) / GIB for c in self.columns}, "fits": self.fits,
            "worst_column": self.worst_column, "notes": self.notes, "details": self.details,
        }

    def render(self) -> str:
        """The table people read: one row per term, one column per stage or phase, then the verdict."""
        def cell(row, column):
            value = row.values.get(column)
            if value is None:
                return ""
            return f"{value / GIB:.2f}" if row.unit == "GiB" else f"{value:g} {row.unit}"

        term_width = max(len(r.term) for r in self.rows)
        widths = [max(len(c), 7) for c in self.columns]

        def line(first: str, cells: list[str], last: str = "") -> str:
            row = first.ljust(term_width) + "  " + "  ".join(c.rjust(w) for c, w in zip(cells, widths, strict=True))
            return row + (f"  {last}" if last else "")

        lines = [self.title, line("", self.columns, "source")]
        lines += [line(row.term, [cell(row, c) for c in self.columns], row.source) for row in self.rows if row.counts]
        lines.append(line("total (GiB)", [f"{self.total(c) / GIB:.2f}" for c in self.columns]))
        lines += [line(row.term, [cell(row, c) for c in self.columns], row.source)
                  for row in self.rows if not row.counts]
        worst = self.total(self.worst_column)
        verdict = (f"fits, {(self.usable_bytes - worst) / GIB:.1f} GiB to spare" if self.fits
                   else f"does not fit: {(worst - self.usable_bytes) / GIB:.1f} GiB over")
        lines.append(f"{self.gpu}: {self.capacity_bytes / GIB:.1f} GiB, {MARGIN:.0%} kept free: {verdict} "
                     f"({self.worst_column})")
        lines += [f"  {note}" for note in self.notes]
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------- building


def gpu_capacity_bytes(config) -> float:
    gib = config.gpu_memory_gib if config.gpu_memory_gib is not None else GPU_MEMORY_GIB[config.gpu]
    return gib * GIB


def gpu_run_fusions() -> dict[str, bool]:
    """The fusions of a GPU run with the [gpu] extra (``models.config.fusion_flags``), as the activation measurement
    applies them: the wgrad-accumulation and masked-softmax fusions change no activation and cannot be built here."""
    from megatron_mimesis.models.config import apex_fused_kernels_importable, fusion_flags

    flags = fusion_flags(cuda=True, te=True, apex=apex_fused_kernels_importable())
    return {**flags, "gradient_accumulation_fusion": False, "masked_softmax_fusion": False}


def measure_spec(config, workload: Workload) -> MeasureSpec:
    return MeasureSpec(
        preset=config.preset, tensor_parallel=config.tensor_model_parallel_size,
        context_parallel=config.context_parallel_size, sequence_parallel=config.sequence_parallel, bf16=config.bf16,
        selective_recompute=config.recompute_granularity == "selective",
        fusions=tuple(sorted(gpu_run_fusions().items())), head=workload.head,
        trained_mtp=bool(config.mtp_loss_scaling_factor))


_stage_cache: dict = {}


def cached_stage_states(config, world_size: int, pipeline_rank: int, microbatches: int) -> StageStates:
    """:func:`stage_states`, once per distinct model, layout and optimizer (a plan's candidates share them); a trained
    MTP head is another model (its optimizer state, the last stage's embedding copy)."""
    key = (config.preset, config.tensor_model_parallel_size, config.pipeline_model_parallel_size,
           config.virtual_pipeline_model_parallel_size, config.context_parallel_size, config.sequence_parallel,
           config.bf16, config.use_distributed_optimizer, config.overlap_grad_reduce, config.overlap_param_gather,
           bool(config.mtp_loss_scaling_factor), world_size, pipeline_rank, microbatches)
    if key not in _stage_cache:
        _stage_cache[key] = stage_states(config, world_size, pipeline_rank, microbatches)
    return _stage_cache[key]


def _checkpoint_stages(config, world_size: int) -> list[StageStates]:
    """Every pipeline stage of ``config`` on ``world_size`` ranks, in a process without a process group yet (a rank
    before its trainer starts: the CPU adaptation it would enable anyway comes first)."""
    from megatron_mimesis.compat import enable_cpu_compat

    enable_cpu_compat()
    return [cached_stage_states(config, world_size, r, 1) for r in range(config.pipeline_model_parallel_size)]


def planned_checkpoint_bytes(config, world_size: int) -> int:
    """One checkpoint of ``config`` on ``world_size`` ranks (``checkpoint.checkpoint_bytes``)."""
    return checkpoint_bytes(config, _checkpoint_stages(config, world_size))


def planned_node_write_bytes(config, world_size: int) -> list[int]:
    """What each node writes of one checkpoint of ``config`` on ``world_size`` ranks (``checkpoint.node_write_bytes``)."""
    return node_write_bytes(config, _checkpoint_stages(config, world_size), world_size)


def memory_plan(config, world_size: int, workload: Workload) -> MemoryPlan:
    """The plan of ``config`` (a TrainConfig or RL config, validated) on ``world_size`` GPUs running ``workload``."""
    pp = config.pipeline_model_parallel_size
    stages = [cached_stage_states(config, world_size, r, workload.microbatches) for r in range(pp)]
    acts = measure(measure_spec(config, workload))
    columns = [f"stage {r}" for r in range(pp)] if pp > 1 else ["per GPU"]
    if workload.engine is not None:
        columns = [f"{name}, update" if pp > 1 else "update" for name in columns] + ["rollout"]
    model_total = sum(s.model_parameters for s in stages)
    table = _Table()
    temporaries = {}
    for stage, column in zip(stages, columns, strict=False):
        _states(table, config, world_size, workload, stage, column, model_total)
        temporaries[column] = _activations(table, config, workload, acts, stage, column)
        table.add("CUDA context, NCCL, workspaces", column, CONTEXT_ALLOWANCE_GIB * GIB, _ALLOWANCE, "allowance")
    if workload.engine is not None:
        _states(table, config, world_size, workload, stages[0], "rollout", model_total)
        table.add(f"{workload.engine.name} engine, awake", "rollout", workload.engine.awake_bytes,
                  workload.engine.awake_source, "engine")
        table.add("CUDA context, NCCL, workspaces", "rollout", CONTEXT_ALLOWANCE_GIB * GIB, _ALLOWANCE, "allowance")
    checkpoint_rows, leads = _checkpoint_rows(config, world_size, stages, columns[0])
    rows = table.rows() + checkpoint_rows
    gpu = config.gpu if config.gpu_memory_gib is None else f"{config.gpu} at {config.gpu_memory_gib:g} GiB"
    tokens = workload.tokens // config.context_parallel_size
    details = {"tokens_per_microbatch": tokens, "checkpoint_bytes": checkpoint_bytes(config, stages),
               "layer_gib": {kind: fit.at(tokens) / GIB for kind, fit in acts.layers.items()},
               "signal_lead_s": leads[0], "shutdown_timeout_s": leads[1]}
    return MemoryPlan(title=_title(config, world_size, workload), gpu=gpu, capacity_bytes=gpu_capacity_bytes(config),
                      columns=columns, rows=rows, notes=_notes(config, workload, stages, columns, temporaries),
                      details=details)


def _checkpoint_rows(config, world_size: int, stages: list[StageStates], column: str) -> tuple[list[Row], tuple]:
    """Not GPU memory, in the same table: one checkpoint's size, the share of the node that writes the most of it and
    its planned write time, which the SLURM lead times are derived from (``training/lead_times.py``), and what the
    save directory holds at most under the run's retention (``checkpoint/retention.py``); and the lead times."""
    from megatron_mimesis.checkpoint.retention import most_on_disk
    from megatron_mimesis.training.lead_times import lead_times

    size = checkpoint_bytes(config, stages)
    nodes = node_write_bytes(config, stages, world_size)
    seconds = write_seconds(max(nodes), config)
    signal_lead, shutdown = lead_times(config.stage, seconds)
    saves = config.planned_saves()
    most = most_on_disk(saves, config.keep_last_n, config.keep_every)
    retention = (f"keep_last_n {config.keep_last_n}" + (f", keep_every {config.keep_every}" if config.keep_every else "")
                 if config.keep_last_n else "every checkpoint kept (no keep_last_n)")
    return [
        _bytes_row("checkpoint (weights, fp32 main copy, Adam m, v)", column, size,
                   "exact: every stage's parameters, as saved"),
        _bytes_row(f"checkpoint share of the busiest of {len(nodes)} node{'s' * (len(nodes) > 1)}", column, max(nodes),
                   "planned: its ranks' optimizer shards and megatron's fully parallel split of the weights"),
        Row(f"checkpoint write at {config.ckpt_write_gb_per_s:g} GB/s per node", {column: round(seconds, 1)},
            "planned: the busiest node's share at ckpt_write_gb_per_s; nothing gathered first", "checkpoint", unit="s",
            counts=False),
        _bytes_row(f"checkpoints on disk at once ({most} of {len(saves)} saves)", column, most * size,
                   f"planned: {retention} (checkpoint/retention.py)"),
        Row("SLURM lead: sbatch --signal=B:USR1@", {column: signal_lead}, "derived: training/lead_times.py",
            "checkpoint", unit="s", counts=False),
        Row("SLURM lead: SHUTDOWN_TIMEOUT", {column: shutdown}, "derived: training/lead_times.py", "checkpoint",
            unit="s", counts=False),
    ], (signal_lead, shutdown)


def _bytes_row(term: str, column: str, size: float, source: str) -> Row:
    """A row of ``size`` bytes, not GPU memory, in a readable unit below a GiB (a "GiB" row's values are bytes)."""
    value, unit = readable_bytes(size).split()
    value = size if unit in ("GiB", "TiB") else float(value)
    return Row(term, {column: value}, source, "checkpoint", unit="GiB" if unit == "TiB" else unit, counts=False)


_EXACT = "exact: the rank's shard, built by megatron on fake tensors"
_MEASURED = "measured: saved tensors of the real modules (GPU kernels' saved sets)"
_ALLOWANCE = "allowance, outside the tensors counted above"


class _Table:
    """Rows in the order terms first appear, each with a value per column."""

    def __init__(self):
        self._values: dict[str, dict] = {}
        self._about: dict[str, tuple[str, str]] = {}

    def add(self, term: str, column: str, value: float, source: str, kind: str) -> None:
        self._values.setdefault(term, {})[column] = value
        self._about[term] = (source, kind)

    def rows(self) -> list[Row]:
        rows = [Row(term, values, *self._about[term]) for term, values in self._values.items()]
        return sorted(rows, key=lambda row: KIND_ORDER.index(row.kind))


def _states(table: _Table, config, world_size: int, workload: Workload, stage: StageStates, column: str,
            model_total: int) -> None:
    dtype = "bf16" if config.bf16 else "fp32"
    table.add(f"parameters ({dtype}; {stage.parameters / 1e9:.2f}B here, {model_total / 1e9:.2f}B in the model)",
              column, stage.parameter_bytes, _EXACT, "parameters")
    table.add("main gradients (fp32)", column, stage.gradient_bytes, _EXACT, "gradients")
    dp = config.data_parallel_size(world_size) * config.context_parallel_size
    share = f", 1/{dp} each" if config.use_distributed_optimizer and dp > 1 else ""
    masters = "fp32 master + " if config.bf16 else ""
    table.add(f"optimizer ({masters}Adam m, v{share})", column, stage.optimizer_bytes, _EXACT, "optimizer")
    for name in workload.frozen_copies:
        table.add(f"{name} (frozen copy of the weights)", column, stage.parameters * (2 if config.bf16 else 4),
                  "exact: the rank's parameters, without gradients or optimizer", "frozen")


def _activations(table: _Table, config, workload: Workload, acts: Activations, stage: StageStates,
                 column: str) -> tuple[float, float]:
    """The activation rows of one stage's column, and the two backward temporaries it takes the larger of: the fused
    loss's (fp32 grad_W and grad_h, one chunk of d logits) while every activation is still held, and one layer's
    gradients (or the embedding's weight gradient) while its backward runs, after the loss's are freed."""
    tokens = workload.tokens // config.context_parallel_size
    held, working = layer_activation_bytes(config, acts, stage, tokens)
    for kind, name in config.preset.family.layer_kinds.items():
        if held.get(kind):
            table.add(f"activations: {name}s", column, held[kind], _MEASURED, "activations")
    edges = sum(acts.embedding.at(tokens) for c in stage.in_flight if stage.chunks[c].embeds)
    edges += sum(acts.head.at(tokens) for c in stage.in_flight if stage.chunks[c].computes_loss)
    if edges:
        table.add("activations: embedding, final norm, loss", column, edges, _MEASURED, "activations")
    mtp = sum(stage.chunks[c].trained_mtp_layers for c in stage.in_flight)
    if mtp:
        table.add("activations: MTP head (trained)", column, mtp * acts.mtp.at(tokens), _MEASURED, "activations")
    loss_chunk = next((c for c in stage.chunks if c.computes_loss), None)
    loss = loss_backward_bytes(config, tokens, loss_chunk.vocab_rows) if loss_chunk is not None else 0.0
    if any(c.embeds for c in stage.chunks):
        embedding_grad = config.preset.hidden_size * _local_vocab_rows(config) * (2 if config.bf16 else 4)
        working = max(working, embedding_grad)
    table.add("backward temporaries", column, max(loss, working),
              "modelled: the larger of the fused loss's backward (kernels/linear_logprob.py) and one layer's",
              "temporaries")
    if workload.engine is not None:
        table.add(f"{workload.engine.name} engine, asleep", column, workload.engine.asleep_bytes,
                  workload.engine.asleep_source, "engine")
    return loss, working


def _local_vocab_rows(config) -> int:
    from megatron_mimesis.models.config import padded_vocab_size

    tp = config.tensor_model_parallel_size
    return padded_vocab_size(config.preset.vocab_size, tp) // tp


def layer_activation_bytes(config, acts: Activations, stage: StageStates, tokens: int) -> tuple[dict, float]:
    """Bytes the stage's in-flight forwards keep per layer kind, and the working set of one backward step. Under
    full recompute a checkpointed group keeps only its input (megatron's ``CheckpointFunction`` saves its
    arguments): "uniform" checkpoints every group of recompute_num_layers layers, "block" the first
    recompute_num_layers layers of each chunk one by one; a group's activations come back during its backward."""
    held = dict.fromkeys(acts.layers, 0.0)
    full = {kind: fit.at(tokens) for kind, fit in acts.layers.items()}
    checkpointed_input = acts.layer_input_per_token * tokens
    groups = [group for chunk in stage.chunks for group in _checkpoint_groups(config, chunk.layers)[0]]
    working = max([full[k] for c in stage.chunks for k in c.layers]
                  + [sum(full[k] for k in group) for group in groups])
    for chunk_id in stage.in_flight:
        layers = stage.chunks[chunk_id].layers
        checkpointed, plain = _checkpoint_groups(config, layers)
        for group in checkpointed:
            held[group[0]] += checkpointed_input
        for kind in plain:
            held[kind] += full[kind]
    return held, working


def _checkpoint_groups(config, layers: tuple[str, ...]) -> tuple[list[tuple[str, ...]], list[str]]:
    """A chunk's layers as (checkpointed groups, layers that keep their activations) under the config's recompute."""
    if config.recompute_granularity != "full":
        return [], list(layers)
    n = config.recompute_num_layers or 1
    if config.recompute_method == "uniform":
        return [layers[i:i + n] for i in range(0, len(layers), n)], []
    return [(kind,) for kind in layers[:n]], list(layers[n:])


def loss_backward_bytes(config, tokens: int, vocab_rows: int) -> float:
    """Peak of ``LinearLogprob.backward`` on this rank: grad_h (fp32 under TP, summed across the group), grad_W in
    fp32 over the shard's rows, one chunk of d logits and the chunk's ``d_logits @ W`` (in the model's dtype, before
    it is written into grad_h); at its return both gradients are cast to the model's dtype while the fp32 ones are
    still held."""
    from megatron_mimesis.kernels.linear_logprob import backward_chunk_tokens

    element = 2 if config.bf16 else 4
    hidden = config.preset.hidden_size
    tp = config.tensor_model_parallel_size
    real_rows = min(vocab_rows, config.preset.vocab_size)
    width = math.ceil(real_rows / GRAD_ROW_ALIGN) * GRAD_ROW_ALIGN
    chunk = min(tokens, backward_chunk_tokens(width, element))
    grad_h = tokens * hidden * (4 if tp > 1 else element)
    grad_w = vocab_rows * hidden * 4
    in_loop = grad_h + grad_w + chunk * width * element + chunk * hidden * element
    at_return = grad_h + grad_w + vocab_rows * hidden * element + (tokens * hidden * element if tp > 1 else 0)
    return max(in_loop, at_return)


def _title(config, world_size: int, workload: Workload) -> str:
    tp, pp, cp = (config.tensor_model_parallel_size, config.pipeline_model_parallel_size,
                  config.context_parallel_size)
    layout = f"TP={tp}{' (SP)' if config.sequence_parallel else ''} PP={pp}"
    if config.virtual_pipeline_model_parallel_size:
        layout += f" VPP={config.virtual_pipeline_model_parallel_size}"
    if cp > 1:
        layout += f" CP={cp}"
    recompute = config.recompute_granularity or "none"
    if recompute == "full":
        recompute += f" ({config.recompute_method}, {config.recompute_num_layers or 'all'} layers)"
    return (f"memory plan per GPU: {config.model}, {layout} DP={config.data_parallel_size(world_size)} on {world_size} "
            f"GPUs; {workload.description}; {'bf16' if config.bf16 else 'fp32'}, "
            f"{'distributed' if config.use_distributed_optimizer else 'replicated'} optimizer, recompute {recompute}")


def _notes(config, workload: Workload, stages: list[StageStates], columns: list[str], temporaries: dict) -> list[str]:
    notes = []
    for stage, column in zip(stages, columns, strict=False):
        loss, layer = temporaries[column]
        notes.append(f"{column}: backward temporaries: the loss's {loss / GIB:.2f}, one layer's {layer / GIB:.2f} GiB")
        counts = {name: sum(stage.chunks[c].layers.count(kind) for c in stage.in_flight)
                  for kind, name in config.preset.family.layer_kinds.items()}
        passes = " + ".join(f"{n} {name}{'s' * (n != 1)}" for name, n in counts.items())
        flight = len(stage.in_flight)
        chunk = " (one model chunk each)" if len(stage.chunks) > 1 else ""
        notes.append(f"{column}: {flight} forward pass{'es' if flight > 1 else ''}{chunk} held at the first backward "
                     f"(megatron's schedule): {passes} of {workload.tokens // config.context_parallel_size} tokens")
    enabled = [name for name, on in gpu_run_fusions().items() if on]
    family = config.preset.family
    eager = f"; {family.measured_eagerly} measured eagerly (an upper bound)" if family.measured_eagerly else ""
    notes.append(f"activations as on a GPU with {family.gpu_kernels}, fusions {', '.join(enabled)}{eager}")
    return notes


# ---------------------------------------------------------------------------------------------------- deciding


def training_workload(config, world_size: int) -> Workload:
    """Mid-training / SFT: rows of seq_length tokens, micro_batch_size of them packed into each micro-batch."""
    micro = config.num_microbatches(world_size)
    return Workload(tokens=config.seq_length * config.micro_batch_size, microbatches=micro,
                    description=f"{config.micro_batch_size} x {config.seq_length} tokens per micro-batch, "
                                f"{micro} micro-batches per step")


def smaller_micro_batches(config) -> list[dict]:
    """Training's micro-batch candidates, largest first (fewer rows per micro-batch, more micro-batches)."""
    sizes = []
    size = config.micro_batch_size // 2
    while size >= 1:
        sizes.append({"micro_batch_size": size})
        size //= 2
    return sizes


def plan_and_refusal(config, world_size: int, workload_for: Callable,
                     smaller: Callable) -> tuple[MemoryPlan, str | None]:
    """The plan of a validated config and, when it does not fit, the one-line refusal naming its biggest term and the
    cheapest change that fits. It measures on the CPU whatever the machine (the CPU adaptation is forced for the rest
    of the process), so only processes that plan and exit call it: the dry runs and ``mimesis-plan``."""
    from megatron_mimesis.compat import enable_cpu_compat

    enable_cpu_compat(force=True, announce=False)
    plan = memory_plan(config, world_size, workload_for(config))
    if plan.fits:
        return plan, None
    column = plan.worst_column
    term = plan.biggest_term(column)
    return plan, (
        f"memory plan: {column} needs {plan.total(column) / GIB:.1f} GiB per GPU; the {plan.gpu} has "
        f"{plan.capacity_bytes / GIB:.1f}, {plan.usable_bytes / GIB:.1f} with {MARGIN:.0%} kept free; biggest term: "
        f"{term.term} {term.values[column] / GIB:.1f} GiB; cheapest change that fits: "
        f"{cheapest_fit(config, world_size, workload_for, smaller)}")


def plan_training(config, world_size: int) -> tuple[MemoryPlan, str | None]:
    """:func:`plan_and_refusal` of a mid-training or SFT config."""
    return plan_and_refusal(config, world_size, functools.partial(training_workload, world_size=world_size),
                            smaller_micro_batches)


def print_plan(plan: MemoryPlan, refusal: str | None, resolved: dict | None = None, table: bool = True) -> int:
    """What the dry runs and ``mimesis-plan`` print: the table, then ``resolved`` (the run's resolved config) as
    JSON with the plan in it; a refusal goes to stderr in one line and makes the exit status 2."""
    if table:
        print(plan.render())
    if resolved is not None:
        print(json.dumps({**resolved, "memory_plan": plan.to_dict()}, indent=2))
    if refusal:
        print(f"error: {refusal}", file=sys.stderr)
        return 2
    return 0


def cheapest_fit(config, world_size: int, workload_for: Callable, smaller: Callable) -> str:
    """The first change that fits, cheapest first: smaller micro-batches (more of them, the same work), recomputing the
    fewest layers, a wider tensor- then pipeline-parallel split of the same GPUs, then such a split with recompute."""
    from megatron_mimesis.training.config import ConfigError

    def recompute(candidate) -> list[dict]:
        """Recomputing more layers than the candidate does: block recompute of the first n, then every layer."""
        if candidate.recompute_granularity == "full" and candidate.recompute_method == "uniform":
            return []
        layers = candidate.preset.num_layers // candidate.pipeline_model_parallel_size
        already = candidate.recompute_num_layers or 0 if candidate.recompute_granularity == "full" else 0
        full = {"recompute_granularity": "full"}
        return ([{**full, "recompute_method": "block", "recompute_num_layers": n}
                 for n in range(already + 1, layers + 1)]
                + [{**full, "recompute_method": "uniform", "recompute_num_layers": 1}])

    tp, pp = config.tensor_model_parallel_size, config.pipeline_model_parallel_size
    layouts = [{"tensor_model_parallel_size": t, "sequence_parallel": True} for t in (2 * tp, 4 * tp, 8 * tp) if t <= 8]
    layouts += [{"pipeline_model_parallel_size": p} for p in (2 * pp, 4 * pp)]
    candidates = list(smaller(config)) + recompute(config) + layouts
    candidates += [{**layout, **r} for layout in layouts for r in recompute(config)]
    for changes in candidates:
        candidate = dataclasses.replace(config, **changes)
        try:
            candidate.validate_without_files(world_size)
        except ConfigError:
            continue
        if memory_plan(candidate, world_size, workload_for(candidate)).fits:
            return _describe(changes, config)
    return "none of smaller micro-batches, recompute, or a wider TP or PP split; use more GPUs or a larger GPU"


def _describe(changes: dict, config) -> str:
    flags = " ".join(f"--{'' if value else 'no-'}{name.replace('_', '-')}" if isinstance(value, bool)
                     else f"--{name.replace('_', '-')} {value}" for name, value in changes.items())
    if changes.get("recompute_method") == "block":
        pp = changes.get("pipeline_model_parallel_size", config.pipeline_model_parallel_size)
        n, layers = changes["recompute_num_layers"], config.preset.num_layers // pp
        return f"{flags} (recomputes {n} of {layers} layers per stage: about +{100 * n / layers / 3:.0f}% compute)"
    if changes.get("recompute_method") == "uniform":
        return f"{flags} (recomputes every layer: about +33% compute)"
    return flags
