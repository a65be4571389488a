"""The model provider: one megatron ``GPTModel`` chunk per pipeline (and virtual pipeline) stage, of any family.

megatron-core's GPT model with a heterogeneous layer list is what megatron-core's own Qwen3-Next support and
Megatron-Bridge's Qwen models use; its HybridModel splits mixer and MLP into separate layers, which would break the
one-to-one correspondence with HF's decoder layers that the parameter mapping relies on (``models/family.py``).

A preset with MTP layers (Qwen3.5's released checkpoints have one) gets megatron's ``MultiTokenPredictionBlock`` on
the last pipeline stage, built from the last decoder layer's spec as megatron's ``get_gpt_mtp_block_spec`` builds it,
so that its weights are saved, loaded and converted under megatron's (Megatron-Bridge's) names at any layout. Two
ways, by the megatron config's ``mtp_num_layers``:
- unset (the default): the head is held frozen. Its parameters take no gradient and no optimizer state, and the
  model's forward does not run it (the block is not ``GPTModel``'s own ``mtp``); the head the model was imported with
  is exported with it, for the serving engine's speculative decoding.
- set (a run that trains the head, ``mtp_loss_scaling_factor``): it is ``GPTModel``'s own ``mtp``, which megatron runs
  and trains with its MTP loss, keeping a copy of the word embedding on the last stage (tied to the first stage's in
  gradients and checkpoints); ``training/mtp_loss.py`` computes that loss without the full logits.
"""

import dataclasses
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
        block_spec = self.preset.family.block_spec(self.config, backend, vp_stage=vp_stage)
        trained_mtp = self._mtp_spec(self.config, block_spec, backend, vp_stage) if self.config.mtp_num_layers else None
        model = GPTModel(
            config=self.config,
            transformer_layer_spec=block_spec,
            vocab_size=self.padded_vocab_size,
            max_sequence_length=self.preset.max_position_embeddings,
            pre_process=pre_process,
            post_process=post_process,
            share_embeddings_and_output_weights=self.preset.tie_word_embeddings,
            position_embedding_type="rope",
            rotary_percent=self.preset.rotary_percent,
            rotary_base=int(self.preset.rotary_base),
            vp_stage=vp_stage,
            mtp_block_spec=trained_mtp,
        )
        if post_process:
            mark_real_vocab(model.output_layer, self.preset.vocab_size)
        mtp_layers = getattr(self.preset, "mtp_num_layers", 0)
        if mtp_layers and post_process and not self.config.mtp_num_layers:
            model.mtp = self._frozen_mtp(mtp_layers, block_spec, backend, vp_stage, model.pg_collection)
        return model

    @staticmethod
    def _mtp_spec(config: TransformerConfig, block_spec, backend: Backend, vp_stage):
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec, get_gpt_mtp_block_spec_for_backend

        from megatron_mimesis.models.layer_specs import LocalBackend

        if backend == "te":
            return get_gpt_mtp_block_spec(config, block_spec, use_transformer_engine=True, vp_stage=vp_stage)
        return get_gpt_mtp_block_spec_for_backend(config, block_spec, backend=LocalBackend(), vp_stage=vp_stage)

    def _frozen_mtp(self, layers: int, block_spec, backend: Backend, vp_stage, pg_collection):
        from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionBlock

        config = dataclasses.replace(self.config, mtp_num_layers=layers)
        spec = self._mtp_spec(config, block_spec, backend, vp_stage)
        block = MultiTokenPredictionBlock(config=config, spec=spec, vp_stage=vp_stage, pg_collection=pg_collection)
        return block.requires_grad_(False)
