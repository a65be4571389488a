"""The one place that picks the rollout engine from the config and keeps it in step with the trainer.

The RL loops call ``build_rollout_engine`` once, ``engine.wake()`` / ``engine.sleep()`` around each step's
rollouts, and ``refresh_engine`` after each optimizer step; the only other thing that depends on the engine is
whether the sampler's log-probs can serve as the update's old log-probs (``samples_with_training_model``).
"""

from megatron_mimesis.rl.engines.generation_timeout import add_generation_timeout
from megatron_mimesis.rl.engines.local import LocalEngine
from megatron_mimesis.rl.engines.weight_sync import sync_weights


def build_rollout_engine(config, trainer, tokenizer):
    """``config.engine``: "local" samples with the training model itself; "vllm" runs vLLM in these processes."""
    if config.engine == "local":
        engine = LocalEngine(trainer.model, tokenizer, trainer.device)
    else:
        from megatron_mimesis.rl.engines.vllm import VLLMEngine

        engine = VLLMEngine.from_config(config, trainer, tokenizer)
    return add_generation_timeout(engine, config.generation_timeout_s)


def samples_with_training_model(engine, trainer) -> bool:
    """The local engine over the training model itself: no weight sync, and its log-probs are the trainer's."""
    return isinstance(engine, LocalEngine) and engine.model is trainer.model


def refresh_engine(engine, trainer) -> None:
    """After an optimizer step: give the engine the new weights unless it samples from the training model."""
    if not samples_with_training_model(engine, trainer):
        sync_weights(engine, trainer.model, trainer.config.preset, trainer.provider.padded_vocab_size)
