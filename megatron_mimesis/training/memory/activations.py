"""Activation bytes per token of each layer type, measured on the real megatron modules at the run's widths.

One decoder layer of each kind the model's family has (Qwen3.5: Gated DeltaNet + MLP and gated attention + MLP;
Qwen3: attention + MLP; ``ModelFamily.layer_kinds``) is built from the model's own layer spec at the full hidden size and the rank's tensor-parallel split (in a one-rank world, ``world.py``), in the run's
dtype and with the fusion and recompute settings of a GPU run, and runs forward on a short packed row while
:class:`~megatron_mimesis.training.memory.saved.SavedTensors` counts what autograd keeps, with the GPU kernels'
saved sets declared by ``gpu_kernels.py``. The same is done for the embedding and for the head (final norm, the
gather under sequence parallelism, the loss), and for a run that trains the MTP head, megatron's MTP layer with the
same loss on its output. Each is measured at two row lengths and fitted as
``per_token * tokens + fixed``; on the GPU path nothing grows faster than the tokens (TE's attention keeps no S x S
scores), which the tests check at a third length. Measurements are cached per distinct layout and width, so a plan
of several candidate layouts measures each once; and on disk (``~/.cache/megatron-mimesis/activation-fits``, under
``XDG_CACHE_HOME``), keyed by the spec, torch, megatron-core and this package's source, because the launcher plans
before every submission and a plan's measuring takes tens of seconds on a busy CPU.
"""

import dataclasses
import functools
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_mimesis.training.memory.gpu_kernels import gpu_saved_sets
from megatron_mimesis.training.memory.saved import SavedTensors
from megatron_mimesis.training.memory.world import rank_of_world


def layer_kinds(preset) -> list[str]:
    """The layer kinds the model has, in its family's order."""
    present = set(preset.family.layer_kind_of(preset))
    return [kind for kind in preset.family.layer_kinds if kind in present]


@dataclass(frozen=True)
class Linear:
    """Bytes as a function of the tokens of one micro-batch on this rank (before sequence-parallel splitting)."""

    per_token: float
    fixed: float

    def at(self, tokens: int) -> float:
        return self.per_token * tokens + self.fixed

    @classmethod
    def fit(cls, points: list[tuple[int, int]]) -> "Linear":
        (t1, b1), (t2, b2) = points
        per_token = (b2 - b1) / (t2 - t1)
        return cls(per_token, b1 - per_token * t1)


@dataclass(frozen=True)
class Activations:
    """What one micro-batch keeps: per layer kind, for the first stage's embedding, for the last stage's head; and
    the bytes of one layer's input, which is all that a layer under full recompute keeps."""

    layers: dict[str, Linear]
    embedding: Linear
    head: Linear
    layer_input_per_token: float
    mtp: Linear | None = None  # one trained MTP layer and its loss (None: the spec trains no MTP head)


@dataclass(frozen=True)
class MeasureSpec:
    """Everything the activations depend on (the cache key)."""

    preset: object
    tensor_parallel: int
    context_parallel: int
    sequence_parallel: bool
    bf16: bool
    selective_recompute: bool
    fusions: tuple[tuple[str, bool], ...]
    head: object  # callable(hidden_states, output_layer, config, tokens) -> loss: the stage's loss on the last stage
    trained_mtp: bool = False  # the run trains the MTP head: its layer and loss are measured with the head


def measurement_lengths(spec: MeasureSpec) -> tuple[int, int]:
    """Two short row lengths every split accepts: whole sequence-parallel slices, whole context-parallel halves."""
    unit = 32 * spec.tensor_parallel * spec.context_parallel
    return unit, 2 * unit


def lm_head(hidden_states, output_layer, config, tokens: int):
    """The mid-training / SFT loss on the last stage's hidden states (``training/loss.py``), on a row of ``tokens``."""
    from megatron_mimesis.training.loss import lm_loss_output_processor

    labels = torch.zeros(1, tokens, dtype=torch.long)
    mask = torch.ones(1, tokens)
    return lm_loss_output_processor(hidden_states=hidden_states, output_layer=output_layer, output_weight=None,
                                    labels=labels, loss_mask=mask, config=config)


def measure(spec: MeasureSpec) -> Activations:
    """The fits of every module of the spec: the layers and the embedding once per layout and width, the head once
    more per loss."""
    body = _fits(dataclasses.replace(spec, head=None, trained_mtp=False))
    element = 2 if spec.bf16 else 4
    local_share = spec.context_parallel * (spec.tensor_parallel if spec.sequence_parallel else 1)
    head = _fits(spec)
    return Activations(layers={kind: body[kind] for kind in layer_kinds(spec.preset)}, embedding=body["embedding"],
                       head=head["head"], layer_input_per_token=spec.preset.hidden_size * element / local_share,
                       mtp=head.get("mtp"))


@functools.cache
def _fits(spec: MeasureSpec) -> dict[str, Linear]:
    path = _cached_fits(spec)
    try:
        return {name: Linear(**fit) for name, fit in json.loads(path.read_text()).items()}
    except (OSError, ValueError, TypeError):  # not measured yet, or an unreadable entry: measured again
        pass
    points = saved_bytes_at(spec, measurement_lengths(spec))
    fits = {name: Linear.fit(p) for name, p in points.items()}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({name: dataclasses.asdict(fit) for name, fit in fits.items()}))
        os.replace(tmp, path)
    except OSError:  # a read-only cache: measured each time
        pass
    return fits


def _cached_fits(spec: MeasureSpec) -> Path:
    """Where a spec's fits are kept: its fields (the head by name) and the code that measured them."""
    head = spec.head if spec.head is None or dataclasses.is_dataclass(spec.head) else \
        f"{spec.head.__module__}.{spec.head.__qualname__}"
    key = hashlib.sha256(f"{dataclasses.replace(spec, head=head)!r}|{_code_identity()}".encode()).hexdigest()
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "megatron-mimesis" / "activation-fits" / f"{key[:32]}.json"


@functools.cache
def _code_identity() -> str:
    import megatron.core

    package = Path(__file__).resolve().parents[2]
    digest = hashlib.sha256(f"torch {torch.__version__}, megatron-core {megatron.core.__version__}".encode())
    for source in sorted(package.rglob("*.py")):
        digest.update(str(source.relative_to(package)).encode() + source.read_bytes())
    return digest.hexdigest()


def saved_bytes_at(spec: MeasureSpec, lengths) -> dict[str, list[tuple[int, int]]]:
    """Saved bytes of each module (every layer kind and the embedding; the head when the spec has one), built
    once in a one-rank world of the spec's split, at each row length: name -> [(tokens, bytes)]."""
    from types import SimpleNamespace

    world = SimpleNamespace(tensor_model_parallel_size=spec.tensor_parallel, pipeline_model_parallel_size=1,
                            virtual_pipeline_model_parallel_size=None, context_parallel_size=spec.context_parallel)
    with rank_of_world(world, spec.tensor_parallel * spec.context_parallel), gpu_saved_sets():
        modules = _modules(spec, _config(spec))
        points = {name: [] for name in modules}
        for tokens in lengths:
            for name, (module, run) in modules.items():
                with SavedTensors(exclude=list(module.parameters())) as meter:
                    kept = run(tokens // spec.context_parallel)
                points[name].append((tokens, meter.bytes))
                del kept
    return points


def _config(spec: MeasureSpec):
    from megatron_mimesis.models.config import ParallelConfig, transformer_config

    parallel = ParallelConfig(tensor_model_parallel_size=spec.tensor_parallel,
                              context_parallel_size=spec.context_parallel,
                              sequence_parallel=spec.sequence_parallel)
    recompute = {"recompute_granularity": "selective"} if spec.selective_recompute else {}
    return transformer_config(spec.preset, parallel, params_dtype=torch.bfloat16 if spec.bf16 else torch.float32,
                              calculate_per_token_loss=True, perform_initialization=False, **dict(spec.fusions),
                              **recompute)


def _modules(spec: MeasureSpec, config) -> dict:
    """name -> (module, run(tokens) -> what must stay alive until counted): every layer kind and the embedding,
    or with a head in the spec only the head (final norm, output layer, loss) and, for a trained MTP head, the MTP
    layer (its embedding lookup, norms, ``eh_proj``, decoder layer and final norm) with the same loss."""
    from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.transformer.spec_utils import build_module

    from megatron_mimesis.data.collate import packed_seq_params
    from megatron_mimesis.models.config import mark_real_vocab, padded_vocab_size

    preset, dtype = spec.preset, config.params_dtype
    sp_split = spec.tensor_parallel if spec.sequence_parallel else 1
    blocks = preset.family.block_spec(config, "local")
    small_vocab = padded_vocab_size(64, spec.tensor_parallel)  # the vocabulary's size changes no activation
    rotary = RotaryEmbedding(kv_channels=config.kv_channels, rotary_percent=preset.rotary_percent,
                             rotary_base=int(preset.rotary_base), use_cpu_initialization=True)

    def hidden(tokens):
        return torch.zeros(tokens // sp_split, 1, preset.hidden_size, dtype=dtype, requires_grad=True)

    def packed(tokens):
        return packed_seq_params({"cu_seqlens": torch.tensor([0, tokens], dtype=torch.int32), "max_seqlen": tokens})

    if spec.head is not None:
        final_norm = _zeroed(build_module(blocks.layer_norm, config=config, hidden_size=preset.hidden_size,
                                          eps=config.layernorm_epsilon))
        output_layer = ColumnParallelLinear(preset.hidden_size, small_vocab, config=config,
                                            init_method=config.init_method, bias=False, gather_output=False)
        mark_real_vocab(output_layer, 64)
        head = torch.nn.ModuleList([final_norm, output_layer])
        modules = {"head": (head, lambda tokens: spec.head(final_norm(hidden(tokens)), output_layer, config, tokens))}
        if spec.trained_mtp:
            modules["mtp"] = _mtp_module(spec, config, blocks, output_layer, hidden, rotary, packed, small_vocab)
        return modules

    types = preset.family.layer_kind_of(preset)

    modules = {}
    for kind in layer_kinds(preset):
        index = types.index(kind)
        layer = _zeroed(build_module(blocks.layer_specs[index], config=config, layer_number=index + 1))
        modules[kind] = (layer, lambda tokens, layer=layer: layer(
            hidden(tokens), attention_mask=None, rotary_pos_emb=rotary(tokens, packed_seq=True),
            packed_seq_params=packed(tokens)))
    embedding = _zeroed(LanguageModelEmbedding(config=config, vocab_size=small_vocab, max_sequence_length=1 << 20,
                                               position_embedding_type="rope"))

    def run_embedding(tokens):
        freqs = rotary(tokens, packed_seq=True)
        SavedTensors.current().keep(freqs)  # every attention layer's RoPE keeps these: one tensor, counted here
        return embedding(torch.zeros(1, tokens, dtype=torch.long), None), freqs

    modules["embedding"] = (embedding, run_embedding)
    return modules


def _mtp_module(spec: MeasureSpec, config, blocks, output_layer, hidden, rotary, packed, vocab: int):
    """megatron's MTP block of one layer, as the provider builds it for a run that trains the head, and a run of it
    on the main model's hidden states followed by the spec's loss on its output."""
    from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec_for_backend
    from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionBlock

    from megatron_mimesis.models.layer_specs import LocalBackend

    config = dataclasses.replace(config, mtp_num_layers=1)
    block = MultiTokenPredictionBlock(config=config, spec=get_gpt_mtp_block_spec_for_backend(
        config, blocks, backend=LocalBackend()))
    embedding = LanguageModelEmbedding(config=config, vocab_size=vocab, max_sequence_length=1 << 20,
                                       position_embedding_type="rope")
    module = _zeroed(torch.nn.ModuleList([block, embedding]))

    def run(tokens):
        ids = torch.zeros(1, tokens, dtype=torch.long)
        out = block(input_ids=ids, position_ids=ids, hidden_states=hidden(tokens), attention_mask=None,
                    rotary_pos_emb=rotary(tokens, packed_seq=True), packed_seq_params=packed(tokens),
                    embedding=embedding)
        return spec.head(torch.chunk(out, 2, dim=0)[1], output_layer, config, tokens)

    return module, run


def _zeroed(module):
    """Weights of zeros: the saved tensors depend on shapes only, and zeros keep every value finite."""
    with torch.no_grad():
        for p in module.parameters():
            p.zero_()
    return module
