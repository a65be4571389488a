"""Refuse a GPU setup known to train Gated DeltaNet wrongly, before any process group starts.

Triton from 3.4.0 up to (not including) 3.7.1 miscompiles flash-linear-attention's Gated DeltaNet backward on
Hopper (compute capability 9.x): db and dg come out wrong, silently (fla issue #640, fixed in Triton 3.7.1).
torch >= 2.12.1 ships Triton 3.7.1; many NGC containers still carry an older pair. A100 (8.x) and Blackwell (10.x)
are not affected, nor is a process without fla (it runs the CPU fallback of ``fla_fallback.py``).
"""

import importlib.util

from packaging.version import Version

FIXED_TRITON = Version("3.7.1")
FLA_ISSUE = "https://github.com/fla-org/flash-linear-attention/issues/640"


def fla_miscompile_reason(capability: tuple[int, int] | None, triton_version: str | None,
                          fla_installed: bool) -> str | None:
    """The one-line reason to refuse this combination, or None when it is safe. ``capability`` is the GPU's
    (major, minor), None without a GPU."""
    if capability is None or not fla_installed or triton_version is None or capability[0] != 9:
        return None
    if Version(triton_version).release >= FIXED_TRITON.release:
        return None
    return (f"Triton {triton_version} miscompiles flash-linear-attention's Gated DeltaNet backward on compute "
            f"capability {capability[0]}.{capability[1]} (wrong db/dg, fla issue #640: {FLA_ISSUE}); install "
            f"Triton >= {FIXED_TRITON} (torch >= 2.12.1 ships it)")


def refuse_known_miscompiles() -> None:
    """Raise ValueError with :func:`fla_miscompile_reason`'s line for this process's GPU, Triton and fla."""
    import torch

    capability = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
    triton_version = None
    if capability is not None and importlib.util.find_spec("triton") is not None:
        import triton

        triton_version = triton.__version__
    reason = fla_miscompile_reason(capability, triton_version, importlib.util.find_spec("fla") is not None)
    if reason:
        raise ValueError(reason)
