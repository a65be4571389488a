"""The model provider: one megatron ``GPTModel`` chunk per pipeline (and virtual pipeline) stage, of any family.

megatron-core's GPT model with a heterogeneous layer list is what megatron-core's own Qwen3-Next support and
Megatron-Bridge's Qwen models use; its HybridModel splits mixer and MLP into separate layers, which would break the
one-to-one correspondence with HF's decoder layers that the parameter mapping relies on (``models/family.py``).
"""

import importlib.util
from dataclasses import dataclass

from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer import TransformerConfig

from megatron_mimesis.models.config import mark_real_vocab, padded_vocab_size
from megatron_mimesis.models.family import Preset
from megatron_mimesis.models.layer_specs import Backend, select_backend


@dataclass
class ModelProvider:
    """Callable with megatron's provider signature ``(pre_process, post_process, vp_stage) -> GPTModel``."""

    preset: Preset
    config: TransformerConfig
    backend: Backend | None = None
    make_vocab_size_divisible_by: int = 64

    @property
    def padded_vocab_size(self) -> int:
        return padded_vocab_size(
            self.preset.vocab_size, self.config.tensor_model_parallel_size, self.make_vocab_size_divisible_by
        )

    def __call__(self, pre_process: bool | None = None, post_process: bool | None = None,
                 vp_stage: int | None = None) -> GPTModel:
        if pre_process is None:
            pre_process = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
        if post_process is None:
            post_process = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
        backend = self.backend or select_backend()
        if backend == "te" and importlib.util.find_spec("transformer_engine") is None:
            # megatron-core would fail later with NameError: name 'TESpecProvider' is not defined
            raise ImportError("backend='te' needs Transformer Engine, which the [gpu] extra installs: "
                              "pip install -e '.[gpu]' (or leave the backend unset: the local modules run without it)")
        model = GPTModel(
            config=self.config,
            transformer_layer_spec=self.preset.family.block_spec(self.config, backend, vp_stage=vp_stage),
            vocab_size=self.padded_vocab_size,
            max_sequence_length=self.preset.max_position_embeddings,
            pre_process=pre_process,
            post_process=post_process,
            share_embeddings_and_output_weights=self.preset.tie_word_embeddings,
            position_embedding_type="rope",
            rotary_percent=self.preset.rotary_percent,
            rotary_base=int(self.preset.rotary_base),
            vp_stage=vp_stage,
        )
        if post_process:
            mark_real_vocab(model.output_layer, self.preset.vocab_size)
        return model
