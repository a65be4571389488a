"""How every Triton kernel of the project is launched (tile sizes, warps, pipeline stages), per GPU architecture.

The one table that the launchers and the ahead-of-time resource check (``aot_check.py``, run in CI without a GPU)
both read, so what CI compiles for sm_80 / sm_90a / sm_100a is exactly what an A100 / H100 / B200 runs. Under the
Triton interpreter (the CPU tests) the tiles are small so that tiny test shapes still span several tiles with
ragged edges; warps and stages mean nothing there.

Occupancy (``aot_check`` table): the three hidden-state kernels are GEMM-shaped (a K loop over the hidden size
feeding the tensor cores, 64x128x64 / 128x128x64 tiles, 8 warps, 3 cp.async stages). They run 1 CTA of 8 warps
per SM on sm_80 (174-186 registers a thread, 48 KiB shared) and 1-2 on sm_90a (121-187 registers, 72-96 KiB),
with no spill. That is deliberate: latency is hidden by the 3-stage software pipeline, as in cuBLAS/CUTLASS's
large bf16 tiles, which also run 1-2 CTAs per SM, not by more resident warps. A second CTA on sm_80 needs at most
128 registers, i.e. half the tile (64x64), which doubles the reloads of W and h per FLOP for a kernel whose cost
is its GEMM. The logits-input kernels are memory-bound and run 2-3 CTAs of 4 warps per SM. The
``vs_lm_head_gemms`` column of ``python -m megatron_mimesis.gpu_check`` is the measurement that confirms or
refutes this on a GPU (1.0 = as fast as the bare cuBLAS GEMMs).
"""

from dataclasses import dataclass, field

from .dispatch import interpreting

INTERPRETER = "interpreter"
# Ampere (and Ada, sm_86/89, whose SMs have the same 64K registers) run the sm_80 configuration, Hopper sm_90,
# Blackwell (10.x and later) sm_100.
ARCHS = ("sm_80", "sm_90", "sm_100")


@dataclass(frozen=True)
class Launch:
    constexprs: dict = field(default_factory=dict)
    num_warps: int = 4
    num_stages: int = 3  # Triton's default on CUDA

    @property
    def options(self) -> dict:
        """Keyword arguments of ``kernel[grid](...)`` besides the kernel's own."""
        return {"num_warps": self.num_warps, "num_stages": self.num_stages}


def _same_on_gpus(interpreter: Launch, gpu: Launch, **per_arch: Launch) -> dict:
    return {INTERPRETER: interpreter, **dict.fromkeys(ARCHS, gpu), **per_arch}


LAUNCHES: dict[str, dict[str, Launch]] = {
    # sm_100a: 3 stages spill (ptxas holds it at 128 registers); 4 stages do not
    "linear_logprob.forward": _same_on_gpus(
        Launch({"BLOCK_N": 16, "BLOCK_V": 32, "BLOCK_H": 16}), Launch({"BLOCK_N": 64, "BLOCK_V": 128, "BLOCK_H": 64},
                                                                     num_warps=8),
        sm_100=Launch({"BLOCK_N": 64, "BLOCK_V": 128, "BLOCK_H": 64}, num_warps=8, num_stages=4)),
    "linear_logprob.grad_logits": _same_on_gpus(
        Launch({"BLOCK_N": 16, "BLOCK_V": 32, "BLOCK_H": 16}), Launch({"BLOCK_N": 64, "BLOCK_V": 128, "BLOCK_H": 64},
                                                                     num_warps=8)),
    "linear_logprob.grad_weight": _same_on_gpus(
        Launch({"BLOCK_V": 32, "BLOCK_H": 16, "BLOCK_K": 16}), Launch({"BLOCK_V": 128, "BLOCK_H": 128, "BLOCK_K": 64},
                                                                     num_warps=8)),
    # sm_100a: 4 warps spill at sizes that are not multiples of 16; 8 warps halve the [16, 512] tile per thread
    "logits_logprob.forward": _same_on_gpus(Launch({"BLOCK_N": 16, "BLOCK_V": 32}),
                                            Launch({"BLOCK_N": 16, "BLOCK_V": 512}),
                                            sm_100=Launch({"BLOCK_N": 16, "BLOCK_V": 512}, num_warps=8)),
    "logits_logprob.backward": _same_on_gpus(Launch({"BLOCK_N": 16, "BLOCK_V": 32}),
                                             Launch({"BLOCK_N": 16, "BLOCK_V": 512})),
    "group_stats.group_advantage": _same_on_gpus(Launch({"BLOCK": 128}), Launch({"BLOCK": 128})),
    "group_stats.discounted_returns": _same_on_gpus(Launch(), Launch()),
}


def arch_of(device) -> str:
    """The LAUNCHES column for a device: the interpreter's, or the GPU's architecture family."""
    if interpreting() or device.type != "cuda":
        return INTERPRETER
    import torch

    major, _ = torch.cuda.get_device_capability(device)
    return "sm_80" if major < 9 else "sm_90" if major == 9 else "sm_100"


def launch(kernel: str, device) -> Launch:
    return LAUNCHES[kernel][arch_of(device)]
