"""The colocated vLLM engine as the RL stages drive it: sync, score, sleep and wake."""

import time

from megatron_mimesis.gpu_check.record import StageRecorder
from megatron_mimesis.gpu_check.world import init_one_rank_megatron

VLLM_VOCAB = 520  # megatron pads it to 576
VLLM_ROWS = ([[11, 40, 7, 301, 9], [5, 6], [250, 12, 13]], [[17, 18, 19, 20], [99, 3, 7], [400, 2]])
# a small KV-cache share: the stage checks that sleep frees it, not how far it goes
VLLM_GPU_OPTIONS = {"gpu_memory_utilization": 0.2, "max_model_len": 1024, "enforce_eager": True}
# bf16 engine vs bf16 trainer, different kernels: the CPU tests measure 0.05; dummy weights are off by more than 1
VLLM_TOLERANCE = 0.15
VLLM_LOGIT_SCALE = 10.0  # on megatron's init (std 0.02) peaks the log-probs, so dummy weights score far off
WAKE_TOLERANCE = 1e-3  # the same weights back from host memory; a row restored wrong is off by far more


def stage_vllm(rec: StageRecorder) -> None:
    """The colocated engine as the RL stages drive it: a megatron trainer and vLLM (``external_launcher``) in one
    process, for each family's tiny preset (the simulator's Qwen3.5 and the agent's Qwen3) at a vocabulary megatron
    pads (520 -> 576), so a sync that kept the padding rows fails. The output layer is scaled up so that log-probs
    are peaked and tell one set of weights from another. Sleep and wake are checked on the first engine. Every check
    is a row; the stage fails after the last one when any did."""
    try:
        import vllm  # noqa: F401
    except ImportError as error:
        rec.note(f"vLLM stage not run: {error}")
        return
    from megatron_mimesis.models.presets import TINY_PRESETS

    init_one_rank_megatron()
    failures = []
    for index, name in enumerate(TINY_PRESETS):  # one per family
        failures += _check_family(rec, name, check_sleep=index == 0)
    if failures:
        raise SystemExit("vllm stage: " + "; ".join(failures))


def _check_family(rec: StageRecorder, preset_name: str, check_sleep: bool) -> list[str]:
    import gc

    import torch

    from megatron_mimesis.compat import compute_device
    from megatron_mimesis.models.config import ParallelConfig, transformer_config
    from megatron_mimesis.models.presets import get_preset
    from megatron_mimesis.models.provider import ModelProvider
    from megatron_mimesis.rl.engines.vllm import CPU_TINY_OPTIONS, VLLMEngine
    from megatron_mimesis.rl.engines.weight_sync import sync_weights
    from megatron_mimesis.rl.update.scoring import score_rows

    device = compute_device()
    preset = get_preset(preset_name).replace(vocab_size=VLLM_VOCAB)
    provider = ModelProvider(preset, transformer_config(preset, ParallelConfig(), params_dtype=torch.bfloat16))
    model = provider().to(device)
    output = model.shared_embedding_or_output_weight() if preset.tie_word_embeddings else model.output_layer.weight
    with torch.no_grad():
        output.mul_(VLLM_LOGIT_SCALE)
    prompts, responses = VLLM_ROWS
    trainer = score_rows([model], list(zip(prompts, responses, strict=True)), 4096, device)
    free_without_engine = torch.cuda.mem_get_info()[0] if device.type == "cuda" else None
    started = time.perf_counter()
    options = VLLM_GPU_OPTIONS if device.type == "cuda" else CPU_TINY_OPTIONS
    engine = VLLMEngine(preset, None, 1, {"seed": 0, **options})
    start_s = time.perf_counter() - started
    dummy = engine.score(prompts, responses)
    started = time.perf_counter()
    sync_weights(engine, [model], preset, provider.padded_vocab_size)
    sync_s = time.perf_counter() - started
    synced = engine.score(prompts, responses)
    synced_err, dummy_err = max_abs_diff(synced, trainer), max_abs_diff(dummy, trainer)
    failures = []
    if synced_err > VLLM_TOLERANCE:
        failures.append(f"{preset_name}: the engine does not score like the trainer after the sync")
    if dummy_err <= VLLM_TOLERANCE:
        failures.append(f"{preset_name}: the check cannot tell the dummy weights from the trainer's")
    rec.row(check=f"colocated sync + score ({preset_name}, vocab {VLLM_VOCAB} padded to "
            f"{provider.padded_vocab_size}, bf16)", engine_start_s=start_s, sync_s=sync_s,
            engine_vs_trainer_max_abs=synced_err, dummy_vs_trainer_max_abs=dummy_err, tolerance=VLLM_TOLERANCE,
            status="failed" if failures else "ok")
    if check_sleep:
        failures += _check_sleep(rec, engine, options, synced, free_without_engine, device)
    del engine, model
    gc.collect()
    return failures


def _check_sleep(rec: StageRecorder, engine, options: dict, synced, free_without_engine, device) -> list[str]:
    import torch

    from megatron_mimesis.rl.memory import VLLM_ASLEEP_GIB

    if not engine.sleeps:
        rec.note(f"sleep not checked: vLLM has no sleep mode on {device.type}")
        return []
    prompts, responses = VLLM_ROWS
    free = [torch.cuda.mem_get_info()[0]]
    engine.sleep()
    free.append(torch.cuda.mem_get_info()[0])
    engine.wake()
    free.append(torch.cuda.mem_get_info()[0])
    woken_err = max_abs_diff(engine.score(prompts, responses), synced)
    freed_gib = (free[1] - free[0]) / 2**30
    share_gib = options["gpu_memory_utilization"] * torch.cuda.mem_get_info()[1] / 2**30
    ok = freed_gib >= share_gib / 2 and woken_err <= WAKE_TOLERANCE
    rec.row(check="sleep frees the engine's memory, wake restores its weights", freed_by_sleep_gib=freed_gib,
            engine_share_gib=share_gib, taken_back_by_wake_gib=(free[1] - free[2]) / 2**30,
            kept_asleep_gib=(free_without_engine - free[1]) / 2**30, plan_allows_asleep_gib=VLLM_ASLEEP_GIB,
            woken_vs_synced_max_abs=woken_err, status="ok" if ok else "failed")
    rec.note("sleep level 1 drops the KV cache and moves the weights to host memory: it must free at least half "
             "the engine's share (gpu_memory_utilization x the GPU), and the woken engine score as before")
    rec.note("kept_asleep_gib is what the sleeping engine still holds, against the memory plan's allowance; this "
             "engine runs eager, and the CUDA graphs an RL config's engine captures add to it")
    return [] if ok else ["sleep kept the engine's memory or wake changed its weights"]


def max_abs_diff(rows_a, rows_b) -> float:
    """The largest |a - b| over two equally shaped lists of log-prob rows."""
    return max(abs(a - b) for row_a, row_b in zip(rows_a, rows_b, strict=True)
               for a, b in zip(row_a, row_b, strict=True))
