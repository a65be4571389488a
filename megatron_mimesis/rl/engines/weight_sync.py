"""Trainer -> rollout engine weight sync after each optimizer step, through the one HF parameter mapping.

The trainer's shards are gathered one parameter at a time over its TP group and turned into HF-named full
tensors (:func:`iter_hf_tensors`), so the extra memory is one parameter, and the engine loads them by HF name:
the interface vLLM's ``load_weights`` has, and the local engine's too when it samples from its own copy.
"""

from megatron_mimesis.models.hf_weights import iter_hf_tensors


def sync_weights(engine, model_chunks, preset, padded_vocab: int) -> None:
    """Collective over the trainer's TP group (and its pipeline stage): every rank passes its own chunks."""
    for chunk in model_chunks:
        engine.load_weights(iter_hf_tensors(getattr(chunk, "module", chunk), preset, padded_vocab), preset,
                            padded_vocab)
