"""Compile every Triton kernel the project launches for real GPU targets, without a GPU, and report what ptxas
says about it: registers, spills, shared memory and how many CTAs fit on one SM.

``python -m megatron_mimesis.kernels.aot_check [--arch 80 90 100] [--json FILE]`` prints a Markdown table and
exits 1 when any kernel spills. CI checks sm_80 (A100), sm_90a (H100/H200) and sm_100a (B200, through the
wheel's ptxas-blackwell, which Triton itself uses for 10.x). Each kernel is compiled at the launch configuration ``launch_config.LAUNCHES``
gives its architecture (the one the launcher uses), in the training dtype (bf16), in both argument
specialisations Triton's JIT compiles at run time. Always divisible by 16 (``:16`` below): pointers (torch
allocations are 16-byte aligned), the hidden size and row strides (model widths: every preset's hidden size is a
multiple of 16, which the test checks) and the d logits row pitch (the launcher aligns it). Divisible or not
(``:16?``): the data-dependent sizes, all multiples of 16 at production shapes (``sizes x16``) or not (``sizes
any``: a ragged chunk, a last TP shard with its padding cut off, a tokenizer of odd size). Compiled through ``triton.compile(ASTSource(...), target=GPUTarget("cuda", cc, 32))``; the PTX then goes
through the ``ptxas -v`` bundled in the Triton wheel, the one Triton itself would run. Must run without
``TRITON_INTERPRET`` (the interpreter replaces the kernels by Python functions); the test runs it in a subprocess.
"""

import argparse
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass

from .launch_config import LAUNCHES

PACKAGE = __package__
DTYPE = "bf16"

# Per kernel: the module and function, its LAUNCHES key, its runtime arguments as Triton AOT signature strings
# (":16" = the value or pointer is divisible by 16) and the constexprs that do not depend on the architecture.
KERNELS = {
    "linear_logprob._forward_kernel": ("linear_logprob.forward", {
        "H": f"*{DTYPE}:16", "W": f"*{DTYPE}:16", "TARGET": "*i64:16", "PART": "*fp32:16", "num_tokens": "i32",
        "vocab": "i32:16?", "hidden_size": "i32:16", "vocab_start": "i32:16?", "tiles_per_split": "i32",
        "num_splits": "i32", "stride_h": "i32:16", "stride_w": "i32:16"}, {"PRECISION": "tf32", "UPCAST": False}),
    "linear_logprob._grad_logits_kernel": ("linear_logprob.grad_logits", {
        "H": f"*{DTYPE}:16", "W": f"*{DTYPE}:16", "TARGET": "*i64:16", "LSE": "*fp32:16", "DLOGPROB": "*fp32:16",
        "GRAD_LOGITS": f"*{DTYPE}:16", "num_tokens": "i32:16?", "vocab": "i32:16?", "hidden_size": "i32:16",
        "vocab_start": "i32:16?", "tiles_per_split": "i32", "stride_h": "i32:16", "stride_w": "i32:16",
        "grad_stride": "i32:16"},
        {"PRECISION": "tf32", "UPCAST": False}),
    "linear_logprob._accumulate_grad_weight_kernel": ("linear_logprob.grad_weight", {
        "GRAD_LOGITS": f"*{DTYPE}:16", "H": f"*{DTYPE}:16", "GRAD_W": "*fp32:16", "num_tokens": "i32:16?",
        "vocab": "i32:16?", "hidden_size": "i32:16", "stride_h": "i32:16", "grad_stride": "i32:16"}, {"PRECISION": "tf32", "UPCAST": False}),
    "logits_logprob._forward_kernel": ("logits_logprob.forward", {
        "LOGITS": f"*{DTYPE}:16", "TARGET": "*i64:16", "PART": "*fp32:16", "num_tokens": "i32", "vocab": "i32:16?",
        "vocab_start": "i32:16?", "tiles_per_split": "i32", "num_splits": "i32", "stride": "i32:16"}, {}),
    "logits_logprob._backward_kernel": ("logits_logprob.backward", {
        "LOGITS": f"*{DTYPE}:16", "TARGET": "*i64:16", "LSE": "*fp32:16", "DLOGPROB": "*fp32:16",
        "GRAD_LOGITS": f"*{DTYPE}:16", "num_tokens": "i32", "vocab": "i32:16?", "vocab_start": "i32:16?",
        "tiles_per_split": "i32", "stride": "i32:16", "grad_stride": "i32:16"}, {}),
    "group_stats_kernels.group_advantage_kernel": ("group_stats.group_advantage", {
        "REWARD": "*fp32:16", "FIRST": "*i8:16", "ORDER": "*i64:16", "STARTS": "*i64:16", "OUT": "*fp32:16",
        "num_rows": "i32", "eps": "fp32"}, {"UNBIASED": True, "ZERO_POSITIVE_FOR_NEGATIVE": False}),
    "group_stats_kernels.discounted_returns_kernel": ("group_stats.discounted_returns", {
        "REWARD": "*fp32:16", "ORDER": "*i64:16", "STARTS": "*i64:16", "OUT": "*fp32:16", "num_rows": "i32",
        "gamma": "fp32"}, {}),
}

# compute capability -> (LAUNCHES column, registers per SM, shared memory per SM in bytes, threads per SM)
TARGETS = {80: ("sm_80", 65536, 164 * 1024, 2048), 90: ("sm_90", 65536, 228 * 1024, 2048),
           100: ("sm_100", 65536, 228 * 1024, 2048)}
MAX_CTAS_PER_SM = 32
SHARED_RESERVED_PER_CTA = 1024  # the driver keeps 1 KiB of each CTA's shared memory


@dataclass
class Resources:
    kernel: str
    target: str
    launch: str
    registers: int
    spill_stores: int
    spill_loads: int
    shared_bytes: int
    threads: int
    ctas_per_sm: int
    sizes: str


def _resident_ctas(capability: int, registers: int, shared: int, threads: int) -> int:
    """Occupancy from the three per-SM budgets; registers are allocated per warp in units of 256."""
    _, regs_per_sm, shared_per_sm, threads_per_sm = TARGETS[capability]
    warps = threads // 32
    regs_per_warp = -(-registers * 32 // 256) * 256
    by_regs = regs_per_sm // (regs_per_warp * warps)
    by_shared = shared_per_sm // (shared + SHARED_RESERVED_PER_CTA)
    return min(by_regs, by_shared, threads_per_sm // threads, MAX_CTAS_PER_SM)


def _ptxas_report(ptx: str, capability: int) -> dict:
    from triton.backends.nvidia.compiler import get_ptxas

    arch = re.search(r"^\.target\s+(\S+)", ptx, re.MULTILINE).group(1)
    with tempfile.TemporaryDirectory() as tmp:
        source = os.path.join(tmp, "kernel.ptx")
        with open(source, "w") as f:
            f.write(ptx)
        done = subprocess.run([get_ptxas(capability).path, "-v", f"-arch={arch}", source, "-o",
                               os.path.join(tmp, "kernel.cubin")], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"ptxas {arch} failed: {done.stderr.strip().splitlines()[-1]}")
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", done.stderr)
    return {"target": arch, "registers": int(re.search(r"Used (\d+) registers", done.stderr).group(1)),
            "spill_stores": int(spills.group(1)), "spill_loads": int(spills.group(2))}


def compile_one(kernel: str, capability: int, aligned_sizes: bool) -> Resources:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    module_name, fn_name = kernel.rsplit(".", 1)
    fn = getattr(importlib.import_module(f"{PACKAGE}.{module_name}"), fn_name)
    launch_key, arguments, fixed = KERNELS[kernel]
    launch = LAUNCHES[launch_key][TARGETS[capability][0]]
    constexprs = {**fixed, **launch.constexprs}
    signature = {name: arguments[name].split(":")[0] if name in arguments else "constexpr" for name in fn.arg_names}
    unknown = set(fn.arg_names) - set(arguments) - set(constexprs)
    if unknown:
        raise KeyError(f"{kernel}: arguments {sorted(unknown)} have no AOT signature in aot_check.KERNELS")
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name, spec in arguments.items()
             if spec.endswith(":16") or (aligned_sizes and spec.endswith(":16?"))}
    compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget("cuda", capability, 32),
                              options=launch.options)
    report = _ptxas_report(compiled.asm["ptx"], capability)
    threads = 32 * launch.num_warps
    shared = compiled.metadata.shared
    return Resources(kernel=kernel, launch=launch_key, shared_bytes=shared, threads=threads,
                     ctas_per_sm=_resident_ctas(capability, report["registers"], shared, threads),
                     sizes="x16" if aligned_sizes else "any", **report)


def check(capabilities, workers: int = 2) -> list[Resources]:
    jobs = [(kernel, cc, aligned) for cc in capabilities for kernel in KERNELS for aligned in (True, False)]
    with ProcessPoolExecutor(workers) as pool:
        return list(pool.map(compile_one, *zip(*jobs, strict=True)))


def table(rows: list[Resources]) -> str:
    lines = ["| kernel | target | sizes | regs | spill stores / loads (B) | shared (KiB) | threads | CTAs/SM |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| `{r.kernel}` | {r.target} | {r.sizes} | {r.registers} | {r.spill_stores} / {r.spill_loads} "
                     f"| {r.shared_bytes / 1024:.1f} | {r.threads} | {r.ctas_per_sm} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, nargs="+", default=sorted(TARGETS), choices=sorted(TARGETS),
                        help="compute capabilities to compile for (default: 80 90 100 = A100, H100/H200, B200)")
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--workers", type=int, default=2, help="parallel compilations (default: 2)")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        parser.error("unset TRITON_INTERPRET: the interpreter does not compile kernels")
    rows = check(args.arch, args.workers)
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=1)
    spilling = [f"{r.kernel} on {r.target} (sizes {r.sizes})" for r in rows if r.spill_stores or r.spill_loads]
    if spilling:
        print(f"register spills in {len(spilling)} kernel(s): {', '.join(spilling)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
