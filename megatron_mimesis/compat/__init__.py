"""Adapters that let the real megatron-core code run where it was not written to run (CPU + gloo).

Everything that knows about this lives in this package; the rest of the project calls
:func:`enable_cpu_compat` once at start-up and is otherwise device-agnostic.
"""

from megatron_mimesis.compat.cpu import (
    compute_device,
    cpu_compat_enabled,
    cuda_is_usable,
    enable_cpu_compat,
    enable_cpu_compat_in_thread,
    prepare_cpu_process,
)

__all__ = ["compute_device", "cpu_compat_enabled", "cuda_is_usable", "enable_cpu_compat", "enable_cpu_compat_in_thread",
           "prepare_cpu_process"]
