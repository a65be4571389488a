"""The one place that picks the rollout engine from the config and keeps it in step with the trainer.

The RL loops call ``build_rollout_engine`` once, ``engine.wake()`` / ``engine.sleep()`` around each step's
rollouts, and ``refresh_engine`` after each step's update; the only other thing that depends on the engine is
whether the sampler's log-probs can serve as the update's old log-probs (``samples_with_training_model``).
"""

from megatron_mimesis.rl.engines.generation_timeout import add_generation_timeout
from megatron_mimesis.rl.engines.local import LocalEngine
from megatron_mimesis.rl.engines.weight_sync import sync_weights


def build_rollout_engine(config, trainer, tokenizer, group):
    """``config.engine``: "local" samples with the training model itself; "vllm" runs vLLM in these processes;
    "served" sends requests to a vLLM server of the policy on devices of its own, from the first rank of ``group``.
    With a rollout worker (``max_staleness`` set) the local engine samples from its own copy of the policy, and any
    engine takes the trainer's weights between two generate calls (``rl/rollout_worker.py``)."""
    if config.engine == "local":
        model = trainer.model if config.max_staleness is None else policy_copy(trainer)
        engine = LocalEngine(model, tokenizer, trainer.device)
    elif config.engine == "served":
        from megatron_mimesis.rl.engines.served import ServedEngine

        engine = ServedEngine(config.engine_options, tokenizer, config.seed, group)
        engine.check_server()
    else:
        from megatron_mimesis.rl.engines.vllm import VLLMEngine

        engine = VLLMEngine.from_config(config, trainer, tokenizer)
    engine = add_generation_timeout(engine, config.generation_timeout_s)
    if config.max_staleness is not None:
        from megatron_mimesis.rl.rollout_worker import VersionedEngine

        engine = VersionedEngine(engine, group)
    return engine


def policy_copy(trainer) -> list:
    """The policy's architecture and layout with weights of its own, frozen (filled by the first weight sync)."""
    chunks = trainer.build_chunks()
    for chunk in chunks:
        chunk.eval()
        chunk.requires_grad_(False)
    return chunks


def samples_with_training_model(engine, trainer) -> bool:
    """The local engine over the training model itself: no weight sync, and its log-probs are the trainer's."""
    return isinstance(engine, LocalEngine) and engine.model is trainer.model


def samples_with_policy_copy(engine) -> bool:
    """The local engine over the rollout worker's copy of the policy: a row it sampled at the trainer's current
    version has the trainer's own log-probs (the same weights through the same forward)."""
    from megatron_mimesis.rl.rollout_worker import VersionedEngine

    return isinstance(engine, VersionedEngine) and isinstance(engine.engine, LocalEngine)


def refresh_engine(engine, trainer, version: int) -> None:
    """The trainer's weights after ``version`` updates into the engine, unless it samples from the training model."""
    from megatron_mimesis.rl.engines.served import ServedEngine

    preset, padded_vocab = trainer.config.preset, trainer.provider.padded_vocab_size
    if isinstance(engine, ServedEngine):
        engine.update_weights(trainer.model, preset, padded_vocab, version)
    elif not samples_with_training_model(engine, trainer):
        sync_weights(engine, trainer.model, preset, padded_vocab)
