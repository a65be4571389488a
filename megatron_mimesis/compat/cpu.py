"""The single place that lets megatron-core run on a CPU-only machine with gloo.

megatron-core is written for CUDA: it passes ``device="cuda"`` / ``torch.cuda.current_device()`` to
tensor factories (masks, p2p buffers, schedule counters, DeltaNet parameters), keeps its model-parallel
RNG streams in the CUDA generator, calls stream/event/synchronize APIs around gradient sync, and
compares ``Tensor.type()`` strings with ``'torch.cuda.FloatTensor'`` in the optimizer. None of that is
needed for correctness on CPU. Rather than forking megatron-core, this module:

- routes every CUDA device argument to the CPU through a ``TorchFunctionMode`` (factory calls,
  ``.to(...)``, ``.cuda()``), and makes ``torch.cuda.current_device()`` return the CPU device, which also
  covers autograd backward functions (function modes are not active inside the autograd engine);
- maps the CUDA RNG API onto the CPU default generator, so that the model-parallel RNG tracker forks and
  restores a real generator state and per-rank seeds take effect (a CPU build silently queues
  ``torch.cuda.manual_seed`` otherwise);
- turns streams, events and synchronisation into no-ops;
- reports CPU float tensors under their CUDA type names to megatron's string checks;
- turns ``torch.compile`` into the identity: megatron wraps small fusions in it, which on CPU buys nothing and
  costs 10-20 s of compilation in every new process (every rank of every multi-process test), and the decorator
  alone, applied as megatron-core is imported, imports TorchDynamo and Inductor: ~3 s of CPU per process;
- hides the third-party notices that a CPU run always triggers and that ask nothing of the user (Transformer
  Engine / Apex / CUDA missing, megatron-core's and torch's notices about how megatron calls them): a CPU demo
  printed ~70 such lines, every rank its own copy. :func:`prepare_cpu_process` hides them and installs the identity
  ``torch.compile`` (entry points call it before they import megatron-core, whose import already warns and
  compiles), and :func:`enable_cpu_compat` says so in one line, on rank 0.

It is switched on by :func:`enable_cpu_compat` when CUDA is absent (or when forced by a test), is
idempotent, and never runs on a GPU machine. The substitutes for the GPU-only Gated DeltaNet kernels
live beside it in :mod:`megatron_mimesis.compat.fla_fallback`.
"""

import contextlib
import logging
import os
import re
import sys
import threading
import warnings

import torch
from torch.overrides import TorchFunctionMode

_CPU = torch.device("cpu")
_lock = threading.Lock()
_enabled = False


def _is_cuda_device(device) -> bool:
    if isinstance(device, int) and not isinstance(device, bool):
        return True  # a bare index means a CUDA device
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA device arguments of any torch call to the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs = {**kwargs, "device": _CPU}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], _CPU, *args[2:])
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return _cuda_type_name(args[0])
        return func(*args, **kwargs)


_CUDA_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
}


def _cuda_type_name(tensor: torch.Tensor) -> str:
    # megatron's optimizer and grad clipping select code paths by comparing type() strings with the CUDA ones
    return _CUDA_TYPE_NAMES.get(tensor.dtype) or torch._C.TensorBase.type(tensor)


class _NullStream:
    """Stands in for torch.cuda.Stream / Event: every call is a no-op, every wait is already satisfied."""

    def __init__(self, *args, **kwargs):
        pass

    def __getattr__(self, name):
        return lambda *args, **kwargs: None

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _cpu_get_rng_state(device="cuda", clone=False, graph_safe=False):
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state, device=-1, graph_safe=False):
    torch.set_rng_state(new_state)


def _cpu_manual_seed(seed):
    # torch.manual_seed would call back into torch.cuda.manual_seed_all; seed the generator directly.
    torch.default_generator.manual_seed(int(seed))


def _patch_torch_cuda():
    cuda = torch.cuda
    # A device object rather than an index: megatron passes it as ``device=`` inside autograd backward
    # functions too, where the function mode below is not active.
    cuda.current_device = lambda: _CPU
    cuda.set_device = lambda device: None
    cuda.device_count = lambda: 1
    # ...without making CUDA look available: with PYTORCH_NVML_BASED_CUDA_CHECK=1 (vLLM sets it on import)
    # torch.cuda.is_available() is device_count() > 0, and torch's optimizers would then query a CUDA stream.
    cuda.is_available = lambda: False
    cuda.synchronize = lambda device=None: None
    cuda.empty_cache = lambda: None
    cuda.current_stream = lambda device=None: _NullStream()
    cuda.default_stream = lambda device=None: _NullStream()
    cuda.Stream = _NullStream
    cuda.Event = _NullStream
    cuda.stream = lambda stream=None: contextlib.nullcontext()
    cuda.get_rng_state = _cpu_get_rng_state
    cuda.set_rng_state = _cpu_set_rng_state
    cuda.random.get_rng_state = _cpu_get_rng_state
    cuda.random.set_rng_state = _cpu_set_rng_state
    cuda.manual_seed = _cpu_manual_seed
    cuda.manual_seed_all = _cpu_manual_seed
    cuda.random.manual_seed = _cpu_manual_seed
    cuda.random.manual_seed_all = _cpu_manual_seed
    cuda.memory_allocated = lambda device=None: 0
    cuda.max_memory_allocated = lambda device=None: 0
    cuda.memory_reserved = lambda device=None: 0
    cuda.reset_peak_memory_stats = lambda device=None: None


def _patch_megatron_rng():
    from megatron.core.tensor_parallel import random as mcore_random

    mcore_random._get_cuda_rng_state = _cpu_get_rng_state
    mcore_random._set_cuda_rng_state = _cpu_set_rng_state
    # The tracker warns when the CPU generator moves inside a forked "CUDA" stream; here they are one generator.
    logging.getLogger(mcore_random.__name__).addFilter(
        lambda record: "CPU RNG state changed within GPU RNG context" not in record.getMessage()
    )


# Python warnings (message prefixes) that every CPU run triggers and that concern neither the user nor the result
CPU_NOTICES = (
    "Transformer Engine and Apex are not installed",  # megatron-core, at import: torch optimizers used instead
    "Apex is not installed",  # megatron-core's layer specs: torch norms used instead
    "megatron_mimesis.kernels: Triton or CUDA unavailable",  # the fused losses run their PyTorch references
    "MimoModelConfig is experimental",  # megatron-core, at import, of a model we do not use
    "full scope is deprecated",  # megatron-core's CUDA-graph default (no CUDA graphs here)
    "The .grad attribute of a Tensor that is not a leaf Tensor",  # megatron-core's DDP inspecting its buffers
    "`torch.distributed.reduce_scatter_tensor` is deprecated",  # megatron-core's collectives
    "`torch.distributed.all_gather_into_tensor` is deprecated",
    # megatron-core's sequence-parallel hint for GPUs, which the launchers follow there (launch/common.sh)
    "When using sequence parallelism it is recommended to set the environment variable CUDA_DEVICE_MAX_CONNECTIONS",
    "When using async grad allreduce it is recommended to set the environment variable CUDA_DEVICE_MAX_CONNECTIONS",
)
# logger name -> message prefix of the logged notices of the same kind
CPU_LOG_NOTICES = {
    "torch.utils.cpp_extension": "No CUDA runtime is found",
    "megatron.core.models.gpt.gpt_model": "GPTModel IS DEPRECATED",  # megatron-core's move to HybridModel
    "megatron.core.distributed.distributed_data_parallel": "DistributedDataParallel: full_param_layout not provided",
    "megatron.core.dist_checkpointing.strategies.torch": "MCore's async save is deprecated",
}
CPU_NOTICE = ("cpu: megatron-core on gloo, without the GPU-only packages (Transformer Engine, Apex, Triton "
              "kernels: PyTorch references instead); their notices are hidden")
_notices_hidden = False


def prepare_cpu_process() -> bool:
    """On a machine without CUDA, what a process needs before it imports megatron-core: ``CPU_NOTICES`` /
    ``CPU_LOG_NOTICES`` hidden and ``torch.compile`` the identity, for the rest of the process; returns whether it
    did (never on a GPU machine). Idempotent."""
    global _notices_hidden
    if cuda_is_usable():
        return False
    if _notices_hidden:
        return True
    _compile_nothing()
    for prefix in CPU_NOTICES:
        warnings.filterwarnings("ignore", message=re.escape(prefix))
    for name, prefix in CPU_LOG_NOTICES.items():
        logging.getLogger(name).addFilter(lambda record, prefix=prefix: not record.getMessage().startswith(prefix))
    _notices_hidden = True
    return True


def _compile_nothing() -> None:
    def compile_nothing(model=None, **options):
        return model if model is not None else (lambda fn: fn)

    torch.compile = compile_nothing
    if "torch._dynamo" in sys.modules:  # megatron-core was imported first: what it compiled runs eagerly
        torch._dynamo.config.disable = True


def cuda_is_usable() -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() > 0


def enable_cpu_compat(force: bool = False, announce: bool = True) -> bool:
    """Make megatron-core usable on this CPU-only process; returns whether the adaptation is active.

    A no-op when CUDA is usable, unless ``force`` (tests of the adaptation itself, and the memory plan, which
    measures on the CPU on any machine). ``announce``: say so in one line on rank 0 (a plan is no CPU run, and its
    refusal must stay one line). Safe to call many times.
    """
    global _enabled
    with _lock:
        if _enabled:
            return True
        if cuda_is_usable() and not force:
            return False
        prepare_cpu_process()
        _compile_nothing()  # again: forced on a GPU machine, the call above did nothing
        _patch_torch_cuda()
        _patch_megatron_rng()
        from megatron_mimesis.compat.fla_fallback import install_fla_fallback

        install_fla_fallback()
        _CudaToCpuMode().__enter__()  # process-wide: stays pushed for the life of the process
        _enabled = True
        if announce and os.environ.get("RANK", "0") == "0":
            print(CPU_NOTICE, file=sys.stderr)
        return True


def cpu_compat_enabled() -> bool:
    return _enabled


def enable_cpu_compat_in_thread() -> None:
    """In a thread of its own (the RL rollout worker): torch function modes are per thread, so a thread started
    after :func:`enable_cpu_compat` pushes its own CUDA-to-CPU mode before it runs megatron-core. A no-op where the
    adaptation is off."""
    if _enabled:
        _CudaToCpuMode().__enter__()  # for the life of the thread


def compute_device() -> torch.device:
    """The device model tensors live on: the local GPU, or the CPU when the adaptation is active."""
    if cuda_is_usable() and not _enabled:
        return torch.device("cuda", torch.cuda.current_device())
    return _CPU
