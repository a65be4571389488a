"""A model family: everything the rest of the project asks about a model, in one object per family.

The trainers, the RL stages, the memory plan, checkpointing and the tools never name a family. They hold a preset
(a record of sizes, :class:`Preset`) and ask ``preset.family`` for what depends on the architecture: the megatron
``TransformerConfig`` fields and layer specs, the one HF <-> megatron mapping table, the HF config both ways, the
layer kinds the memory plan measures, the FLOPs per token, and the names vLLM and transformers know the model by.
A family lives in its own folder (``qwen3_5/``, ``qwen3/``), as torchtitan keeps one folder per model; the registry
(``presets.py``) finds a family by preset name, by the ``family`` a checkpoint records, or by an HF config's
``model_type``.

Every family builds megatron-core's ``GPTModel`` with Megatron-Bridge's module layout (v0.6 builds Qwen3 and Qwen3.5
that way), so a dist checkpoint's keys are Bridge's. megatron-core 0.19 deprecates ``GPTModel`` for ``HybridModel``;
Bridge's move of Qwen to ``HybridModel`` is an open PR stack and megatron's automatic GPT -> Hybrid checkpoint
translation excludes Gated DeltaNet layers, so the model layer stays on ``GPTModel`` until that lands.
"""

import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

# Element-wise work is left out of the FLOPs; matrix products count 2 FLOPs per multiply-add.
FLOPS_PER_MAC = 2


@dataclass(frozen=True, kw_only=True)
class Preset:
    """The sizes every family has. A family's preset adds its own fields; ``family_name`` says whose it is."""

    family_name: ClassVar[str]

    name: str
    vocab_size: int
    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    rotary_base: float
    rotary_percent: float = 1.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int

    @property
    def family(self) -> "ModelFamily":
        from megatron_mimesis.models.presets import FAMILIES

        return FAMILIES[self.family_name]

    def replace(self, **changes) -> "Preset":
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class ChatFormat:
    """How a family's own chat template writes an agent's turn, which the agent-RL stage follows.

    ``tool_call_parser`` is the name vLLM's OpenAI server gives the text format of the family's tool calls
    (``--tool-call-parser``): ``qwen3_coder`` (XML parameters, Qwen3-Coder and Qwen3.5) or ``hermes`` (one JSON object
    per ``<tool_call>``, Qwen2.5 and Qwen3). ``opens_think_in_prompt``: the generation prompt opens the think block
    (Qwen3.5's thinking template) rather than the model writing ``<think>`` itself (Qwen3). ``own_template``: agent
    contexts are rendered by the tokenizer's own chat template (a released checkpoint carries it), not piece by piece
    in the ChatML layout of the training data. ``reasoning_parser`` is vLLM's ``--reasoning-parser`` for the family's
    ``<think>`` blocks (``qwen3``), which returns a served model's thoughts as ``reasoning_content``."""

    tool_call_parser: str
    opens_think_in_prompt: bool
    own_template: bool
    reasoning_parser: str


class ModelFamily(ABC):
    """The interface; each family's folder subclasses it. Attributes are facts, methods derive from a preset."""

    name: ClassVar[str]  # recorded in every checkpoint's run_config.json
    title: ClassVar[str]  # in messages
    hf_model_types: ClassVar[tuple[str, ...]]  # an HF config.json's model_type values this family reads
    hf_architecture: ClassVar[str]  # the text-only causal LM that exports declare and vLLM builds
    tiny_preset: ClassVar[str]  # the CPU-sized twin (tests, demos, vLLM's CPU backend)
    presets: ClassVar[dict]
    layer_kinds: ClassVar[dict[str, str]]  # layer kind -> what the memory plan calls it, in the plan's order
    gpu_kernels: ClassVar[str]  # the GPU kernels whose saved sets the plan declares (training/memory/gpu_kernels.py)
    measured_eagerly: ClassVar[str]  # what megatron torch.compiles on a GPU that the plan measures eagerly ("": none)
    chat: ClassVar[ChatFormat]

    # ------------------------------------------------------------------ HF
    @abstractmethod
    def preset_from_hf_config(self, hf_config, name: str = "hf") -> Preset:
        """The preset of a transformers config of this family; a one-line ValueError naming the field the model layer
        does not support."""

    @abstractmethod
    def hf_config(self, preset: Preset, **extra):
        """The equivalent transformers config (text-only); ``extra`` adds or overrides fields."""

    def hf_model_class(self):
        """transformers' causal LM class of :attr:`hf_architecture`."""
        import transformers

        return getattr(transformers, self.hf_architecture)

    def hf_model(self, preset: Preset, **config_extra):
        """A randomly initialised transformers model of ``preset``."""
        return self.hf_model_class()(self.hf_config(preset, **config_extra))

    def engine_hf_config(self, preset: Preset, recurrent_state_dtype: str | None):
        """The config a vLLM engine is built from: the text-only architecture in bf16, with the recurrent state in
        ``recurrent_state_dtype`` (None: the released configs') where the family has one."""
        return self.hf_config(preset, architectures=[self.hf_architecture], dtype="bfloat16")

    # ------------------------------------------------------------------ megatron
    def layout_problems(self, preset: Preset, tp: int, cp: int) -> list[tuple[bool, str]]:
        """(ok, reason) checks of a tensor/context-parallel split that only this family has."""
        return []

    @abstractmethod
    def transformer_fields(self, preset: Preset) -> dict:
        """The megatron ``TransformerConfig`` fields that make this architecture (on top of the shared ones)."""

    @abstractmethod
    def block_spec(self, config, backend: str, vp_stage=None, pp_rank=None):
        """The decoder block spec of one pipeline stage (and virtual stage), for Transformer Engine or local modules."""

    @abstractmethod
    def mapping(self, preset: Preset, padded_vocab: int) -> list:
        """The HF <-> megatron parameter table (``mapping.py``'s entries, each usable in both directions)."""

    # ------------------------------------------------------------------ planning
    @abstractmethod
    def layer_kind_of(self, preset: Preset) -> list[str]:
        """The kind (a key of :attr:`layer_kinds`) of every decoder layer, in order."""

    @abstractmethod
    def matmul_params(self, preset: Preset) -> int:
        """Parameters that multiply every token: the layers' projections and the output layer."""

    @abstractmethod
    def sequence_flops_per_token(self, preset: Preset, seq_length: int) -> float:
        """Forward FLOPs per token beyond the projections (attention scores and values, recurrences), at a row of
        ``seq_length`` tokens."""

    def forward_flops_per_token(self, preset: Preset, seq_length: int) -> float:
        return FLOPS_PER_MAC * self.matmul_params(preset) + self.sequence_flops_per_token(preset, seq_length)

    def mtp_forward_flops_per_token(self, preset: Preset, seq_length: int) -> float:
        """Forward FLOPs per token of the multi-token-prediction head, for a run that trains it: none for a family
        without one."""
        return 0.0

    def engine_cache_sizes(self, preset: Preset) -> dict:
        """What an inference engine caches for the whole model (each divides by its TP): per token, the attention
        layers' K and V in bf16; per sequence, the recurrent states (in fp32 and in bf16) and the causal convs' taps
        of a family that has them. Here every layer is attention and nothing is recurrent."""
        return {"kv_bf16_bytes_per_token": 2 * preset.num_layers * preset.num_query_groups * preset.head_dim * 2,
                "recurrent_fp32_bytes": 0, "recurrent_bf16_bytes": 0, "conv_bf16_bytes": 0}


def parameter_count(preset: Preset) -> int:
    """Trained parameters, up to norms and biases (<0.1%): the matmul weights plus an untied input embedding."""
    return preset.family.matmul_params(preset) + (0 if preset.tie_word_embeddings else
                                                  preset.hidden_size * preset.vocab_size)


def mlp_params(p: Preset) -> int:
    """SwiGLU: gate, up and down projections."""
    return 3 * p.hidden_size * p.ffn_hidden_size


def attention_params(p: Preset, output_gate: bool) -> int:
    """q (and its sigmoid gate), k, v and o projections of grouped-query attention."""
    q = p.num_attention_heads * p.head_dim * (2 if output_gate else 1)
    kv = 2 * p.num_query_groups * p.head_dim
    return p.hidden_size * (q + kv) + p.num_attention_heads * p.head_dim * p.hidden_size


def causal_attention_flops(p: Preset, seq_length: int) -> float:
    """Forward QK^T + AV FLOPs per token of one full-attention layer: each costs 2*S*H*d per token over a full row,
    and a causal row sees S/2 keys on average."""
    return 2 * 2 * seq_length * p.num_attention_heads * p.head_dim / 2
