"""Micro-benchmark of the GRPO policy loss from hidden states: ours against the usual ways of computing it.

    python -m megatron_mimesis.kernels.bench            # GPU shapes (bf16, H 4096, V 151936 / 248320, N up to 65536+)
    python -m megatron_mimesis.kernels.bench --small    # CPU (automatic without CUDA): tiny shapes, Triton interpreter

Providers, side by side on the same inputs: torch eager (materialised logits -> log_softmax -> gather -> loss), the
same under torch.compile, Liger's triton_grpo_loss (logits input), Liger's LigerFusedLinearGRPOLoss (hidden input),
Liger's LigerFusedLinearCrossEntropyFunction(reduction="none") + our loss math, and ours. All use token-mean
GRPO with eps 0.2 and no KL term (Liger's loss_type="bnpo"). Per provider: median forward and forward+backward
time (backward = their difference), peak memory above the inputs, "gemm%" = time of the 3 bare lm-head GEMMs
(N x H x V each) / forward+backward time (100% = as fast as the GEMMs alone), and max-abs / cosine errors of the
loss, per-token log-prob and grad_h against an fp32 reference computed in token chunks. A provider that fails
(OOM, missing, launch error) gets a row saying so. On CPU the times mean nothing; the error columns are the point.

Output goes to ``--output`` (default ``runs/bench-kernels``, never the checkout): the table on stdout, rows appended
to all_benchmark_data.csv there (Liger's habit: one CSV that accumulates runs), a JSON file and a PNG plot per mode.
Each run records its command and machine. A committed reference run of the mode (``docs/benchmarks/``, or
``--compare FILE``) is printed beside the new one, row for row.
"""

import argparse
import csv
import datetime
import importlib.metadata
import json
import math
import os
import platform
import shlex
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from . import reference
from .dispatch import interpreting

DEFAULT_OUTPUT = Path("runs") / "bench-kernels"
REFERENCES = Path(__file__).resolve().parents[1] / "docs" / "benchmarks"  # committed runs, one per mode
CSV_NAME = "all_benchmark_data.csv"
CLIP_EPS = 0.2


@dataclass(frozen=True)
class Shape:
    num_tokens: int
    vocab: int
    hidden: int
    seq_len: int  # tokens per sequence: Liger's logits-input kernel launches one program per (sequence, position)


def gpu_shapes():
    shapes = [Shape(n, v, 4096, min(n, 4096)) for v in (151936, 248320) for n in (4096, 16384, 65536)]
    # one 65600-token sequence: past the 65535 limit of grid dim 1 that a (batch, position) launch runs into
    return [*shapes, Shape(65600, 151936, 4096, 65600)]


def small_shapes():
    return [Shape(64, 256, 32, 32), Shape(128, 500, 32, 64), Shape(160, 300, 32, 160)]


@dataclass
class Inputs:
    hidden: torch.Tensor
    weight: torch.Tensor
    targets: torch.Tensor
    mask: torch.Tensor
    old_logprobs: torch.Tensor
    advantages: torch.Tensor


def make_inputs(shape: Shape, dtype, device, seed=0) -> Inputs:
    generator = torch.Generator(device=device).manual_seed(seed)
    hidden = torch.randn(shape.num_tokens, shape.hidden, device=device, generator=generator).to(dtype)
    weight = (torch.randn(shape.vocab, shape.hidden, device=device, generator=generator) * 2 / shape.hidden**0.5)
    targets = torch.randint(0, shape.vocab, (shape.num_tokens,), device=device, generator=generator)
    mask = (torch.rand(shape.num_tokens, device=device, generator=generator) > 0.1).long()
    num_seqs = shape.num_tokens // shape.seq_len
    advantages = torch.randn(num_seqs, device=device, generator=generator).repeat_interleave(shape.seq_len)
    # old log-probs near typical values of a sampled token, so a few ratios leave the clip range
    old = -4.0 + torch.randn(shape.num_tokens, device=device, generator=generator)
    return Inputs(hidden, weight.to(dtype), targets, mask, old, advantages)


def _grpo_from_logprobs(logprobs, x: Inputs):
    return reference.policy_loss_from_logprobs(logprobs, logprobs, x.mask, x.old_logprobs, x.advantages,
                                               clip_eps_low=CLIP_EPS, clip_eps_high=CLIP_EPS)[0]


def eager(hidden, weight, x: Inputs):
    logits = hidden @ weight.t()
    logprobs = torch.log_softmax(logits.float(), -1).gather(-1, x.targets[:, None])[:, 0]
    return _grpo_from_logprobs(logprobs, x), logprobs


_compiled_eager = torch.compile(eager)


def compiled(hidden, weight, x: Inputs):
    return _compiled_eager(hidden, weight, x)


def liger_triton_grpo(hidden, weight, x: Inputs, seq_len: int):
    from liger_kernel.transformers.grpo_loss import triton_grpo_loss

    num_seqs = hidden.shape[0] // seq_len
    # Liger reads logits [B, L + 1, V] and ignores the last position: pad one position per sequence
    padded = torch.nn.functional.pad(hidden.view(num_seqs, seq_len, -1), (0, 0, 0, 1))
    logits = padded @ weight.t()
    loss, _ = triton_grpo_loss(logits, x.old_logprobs.view(num_seqs, seq_len), None, x.targets.view(num_seqs, seq_len),
                               x.advantages.view(num_seqs, seq_len)[:, 0].contiguous(),
                               x.mask.view(num_seqs, seq_len).contiguous(), temperature=1.0, beta=0.0,
                               eps_low=CLIP_EPS, eps_high=CLIP_EPS, inplace=True, loss_type="bnpo", reduce=True)
    return loss, None


def liger_fused_linear_grpo(hidden, weight, x: Inputs, seq_len: int):
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    num_seqs = hidden.shape[0] // seq_len
    module = LigerFusedLinearGRPOLoss(beta=0.0, compiled=hidden.is_cuda, use_ref_model=False, loss_type="bnpo",
                                      epsilon_low=CLIP_EPS, epsilon_high=CLIP_EPS, temperature=1.0)
    loss, _ = module(hidden.view(num_seqs, seq_len, -1), weight, x.targets.view(num_seqs, seq_len),
                     x.mask.view(num_seqs, seq_len), x.advantages.view(num_seqs, seq_len)[:, 0].contiguous(),
                     old_per_token_logps=x.old_logprobs.view(num_seqs, seq_len))
    return loss, None


def liger_flce_plus_loss(hidden, weight, x: Inputs):
    from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction

    out = LigerFusedLinearCrossEntropyFunction.apply(hidden, weight, x.targets, None, None, -100, 0.0, 0.0, "none")
    logprobs = -(out[0] if isinstance(out, tuple) else out).float()
    return _grpo_from_logprobs(logprobs, x), logprobs


def ours(hidden, weight, x: Inputs):
    """What fused_linear_policy_loss(impl="triton") runs, called one level down to also get the log-probs."""
    from .linear_logprob import linear_logprob

    logprobs, _ = linear_logprob(hidden, weight, x.targets)
    return _grpo_from_logprobs(logprobs, x), logprobs


PROVIDERS = {
    "torch-eager": lambda h, w, x, s: eager(h, w, x),
    "torch-compile": lambda h, w, x, s: compiled(h, w, x),
    "liger-triton-grpo": liger_triton_grpo,
    "liger-fused-linear-grpo": liger_fused_linear_grpo,
    "liger-flce+loss": lambda h, w, x, s: liger_flce_plus_loss(h, w, x),
    "ours": lambda h, w, x, s: ours(h, w, x),
}


def fp32_reference(x: Inputs, chunk: int):
    """Loss, per-token log-probs and grad_h in fp32, a chunk of tokens at a time: token-mean GRPO is a sum of
    per-token terms over a known denominator, so chunks never hold more than [chunk, V] fp32 logits."""
    weight = x.weight.float()
    denominator = x.mask.float().sum().clamp(min=1.0)
    loss = torch.zeros((), dtype=torch.float64, device=weight.device)
    logprobs, grad_h = [], []
    for start in range(0, x.hidden.shape[0], chunk):
        rows = slice(start, start + chunk)
        hidden = x.hidden[rows].float().requires_grad_()
        lp = torch.log_softmax(hidden @ weight.t(), -1).gather(-1, x.targets[rows, None])[:, 0]
        per_token = reference.grpo_per_token_loss(lp, x.old_logprobs[rows], x.advantages[rows],
                                                  clip_eps_low=CLIP_EPS, clip_eps_high=CLIP_EPS)
        part = torch.where(x.mask[rows].bool(), per_token, 0.0).sum() / denominator
        (grad,) = torch.autograd.grad(part, hidden)
        loss += part.detach().double()
        logprobs.append(lp.detach())
        grad_h.append(grad)
    return loss.float(), torch.cat(logprobs), torch.cat(grad_h)


def time_ms(fn, device, reps):
    """Median milliseconds: triton.testing.do_bench on the GPU, wall clock on the CPU."""
    if device.type == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, return_mode="median")
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def lm_head_ms(x: Inputs, reps):
    """The 3 GEMMs every exact lm-head loss needs (logits, grad_h, grad_W), timed on a chunk of at most 4096 tokens
    and scaled to N, so the [N, V] logits need not fit."""
    rows = min(4096, x.hidden.shape[0])
    hidden = x.hidden[:rows]
    grad_logits = torch.empty(rows, x.weight.shape[0], dtype=x.weight.dtype, device=x.weight.device)

    def gemms():
        torch.matmul(hidden, x.weight.t(), out=grad_logits)
        grad_logits @ x.weight
        grad_logits.t() @ hidden

    return time_ms(gemms, x.hidden.device, reps) * x.hidden.shape[0] / rows


def _errors(actual, expected):
    if actual is None:
        return None, None
    actual, expected = actual.float().flatten(), expected.float().flatten()
    cosine = torch.nn.functional.cosine_similarity(actual, expected, dim=0).item()
    return (actual - expected).abs().max().item(), cosine


@dataclass
class Row:
    provider: str
    num_tokens: int
    vocab: int
    hidden: int
    seq_len: int
    dtype: str
    status: str = "ok"
    fwd_ms: float | None = None
    bwd_ms: float | None = None
    fwd_bwd_ms: float | None = None
    peak_mb: float | None = None
    lm_head_fraction: float | None = None
    loss_abs_err: float | None = None
    logprob_max_abs: float | None = None
    logprob_cos: float | None = None
    grad_h_max_abs: float | None = None
    grad_h_cos: float | None = None


def bench_provider(name, shape: Shape, x: Inputs, expected, lm_ms, reps) -> Row:
    row = Row(name, shape.num_tokens, shape.vocab, shape.hidden, shape.seq_len, str(x.hidden.dtype).split(".")[-1])
    fn = PROVIDERS[name]
    device = x.hidden.device
    hidden = x.hidden.detach().clone().requires_grad_()
    weight = x.weight.detach().clone().requires_grad_()
    try:
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            baseline = torch.cuda.memory_allocated()
        loss, logprobs = fn(hidden, weight, x, shape.seq_len)
        loss.backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
            row.peak_mb = (torch.cuda.max_memory_allocated() - baseline) / 2**20
        ref_loss, ref_logprobs, ref_grad_h = expected
        row.loss_abs_err = abs(loss.item() - ref_loss.item())
        row.logprob_max_abs, row.logprob_cos = _errors(logprobs, ref_logprobs)
        row.grad_h_max_abs, row.grad_h_cos = _errors(hidden.grad, ref_grad_h)
        del logprobs

        def forward():
            return fn(hidden, weight, x, shape.seq_len)[0]

        def forward_backward():
            forward().backward()

        # backward = (forward + backward) - forward: re-running one backward with retain_graph is not possible
        # for every provider (torch.compile donates its buffers), and Liger's FLCE does its work in forward.
        row.fwd_ms = time_ms(forward, device, reps)
        row.fwd_bwd_ms = time_ms(forward_backward, device, reps)
        row.bwd_ms = row.fwd_bwd_ms - row.fwd_ms
        row.lm_head_fraction = lm_ms / row.fwd_bwd_ms
    except Exception as error:  # noqa: BLE001 - a failing provider is a result, not a crash
        row.status = f"failed: {type(error).__name__}: {str(error).splitlines()[0][:120] if str(error) else ''}"
    finally:
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return row


def _fmt(value, spec):
    return format("-", f">{spec.split('.')[0]}") if value is None else format(value, spec)


def print_table(rows):
    header = (f"{'provider':<24}{'N':>7}{'V':>8}{'fwd ms':>10}{'bwd ms':>10}{'f+b ms':>10}{'peak MB':>10}"
              f"{'gemm%':>8}{'loss err':>10}{'lp err':>10}{'lp cos':>10}{'gh err':>10}{'gh cos':>10}  status")
    print(header)
    print("-" * len(header))
    for r in rows:
        fraction = None if r.lm_head_fraction is None else 100 * r.lm_head_fraction
        print(f"{r.provider:<24}{r.num_tokens:>7}{r.vocab:>8}{_fmt(r.fwd_ms, '10.2f')}{_fmt(r.bwd_ms, '10.2f')}"
              f"{_fmt(r.fwd_bwd_ms, '10.2f')}{_fmt(r.peak_mb, '10.0f')}{_fmt(fraction, '8.1f')}"
              f"{_fmt(r.loss_abs_err, '10.1e')}{_fmt(r.logprob_max_abs, '10.1e')}{_fmt(r.logprob_cos, '10.6f')}"
              f"{_fmt(r.grad_h_max_abs, '10.1e')}{_fmt(r.grad_h_cos, '10.6f')}  {r.status}")


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def environment(device):
    def version(package):
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return "missing"

    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "machine": f"{_cpu_name()}, {os.cpu_count()} cores",
        "command": shlex.join(["python", "-m", "megatron_mimesis.kernels.bench", *sys.argv[1:]]),
        "torch": torch.__version__,
        "triton": version("triton"),
        "liger_kernel": version("liger-kernel"),
        "triton_interpret": interpreting(),
        "timestamp": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def append_csv(path: Path, env, rows):
    fields = [*env, *asdict(rows[0])]
    new = not path.exists()
    with path.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        if new:
            writer.writeheader()
        for row in rows:
            writer.writerow({**env, **asdict(row)})


PLOTTED = (("fwd_bwd_ms", "forward + backward (ms, median)"), ("peak_mb", "peak memory above inputs (MB)"),
           ("grad_h_max_abs", "grad_h max-abs error vs fp32"))


def plot(path: Path, rows, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = sorted({(r.num_tokens, r.vocab) for r in rows})
    providers = list(dict.fromkeys(r.provider for r in rows))
    fig, axes = plt.subplots(1, len(PLOTTED), figsize=(18, 5))
    width = 0.8 / len(providers)
    for i, provider in enumerate(providers):
        by_shape = {(r.num_tokens, r.vocab): r for r in rows if r.provider == provider}
        positions = [s + i * width for s in range(len(shapes))]
        for ax, (metric, _) in zip(axes, PLOTTED, strict=True):
            values = [getattr(by_shape[s], metric) if s in by_shape else None for s in shapes]
            ax.bar(positions, [math.nan if v is None else v for v in values], width, label=provider)
    labels = [f"N={n}\nV={v}" for n, v in shapes]
    for ax, (metric, ylabel) in zip(axes, PLOTTED, strict=True):
        ax.set_xticks([s + 0.4 - width / 2 for s in range(len(shapes))], labels, fontsize=7)
        ax.set_ylabel(ylabel)
        if any(getattr(r, metric) for r in rows):
            ax.set_yscale("log")
        else:
            ax.set_yticks([])
            ax.text(0.5, 0.5, "not measured on this device", transform=ax.transAxes, ha="center")
    axes[0].legend(fontsize=7)
    fig.suptitle(title + " (missing bar: provider failed)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def reference_path(mode: str) -> Path:
    return REFERENCES / f"kernels-{mode}.json"


def print_comparison(rows, reference: dict, source: Path) -> None:
    """The new run's rows beside the reference's rows of the same provider and shape."""
    theirs = {(r["provider"], r["num_tokens"], r["vocab"]): r for r in reference["rows"]}
    env = reference["env"]
    print(f"\nbeside the reference run {source} ({env.get('machine', env['device'])}, {env['timestamp']}, "
          f"{env.get('command', 'command not recorded')}):")
    header = f"{'provider':<24}{'N':>7}{'V':>8}{'f+b ms':>10}{'ref':>10}{'lp err':>10}{'ref':>10}{'gh err':>10}{'ref':>10}"
    print(header)
    print("-" * len(header))
    for r in rows:
        ref = theirs.get((r.provider, r.num_tokens, r.vocab), {})
        print(f"{r.provider:<24}{r.num_tokens:>7}{r.vocab:>8}{_fmt(r.fwd_bwd_ms, '10.2f')}"
              f"{_fmt(ref.get('fwd_bwd_ms'), '10.2f')}{_fmt(r.logprob_max_abs, '10.1e')}"
              f"{_fmt(ref.get('logprob_max_abs'), '10.1e')}{_fmt(r.grad_h_max_abs, '10.1e')}"
              f"{_fmt(ref.get('grad_h_max_abs'), '10.1e')}")


def run(small: bool, output: Path, providers, reps: int, reference: Path | None = None):
    device = torch.device("cuda" if torch.cuda.is_available() and not small else "cpu")
    dtype = torch.bfloat16
    shapes = small_shapes() if small else gpu_shapes()
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference must be fp32
    rows = []
    for shape in shapes:
        x = make_inputs(shape, dtype, device)
        expected = fp32_reference(x, chunk=min(4096, shape.num_tokens))
        lm_ms = lm_head_ms(x, reps)
        for name in providers:
            if name == "ours" and device.type == "cpu" and not interpreting():
                rows.append(Row(name, shape.num_tokens, shape.vocab, shape.hidden, shape.seq_len, "bfloat16",
                                status="skipped: Triton needs CUDA or TRITON_INTERPRET=1"))
                continue
            started = time.perf_counter()
            rows.append(bench_provider(name, shape, x, expected, lm_ms, reps))
            print(f"  {name} N={shape.num_tokens} V={shape.vocab}: {rows[-1].status} "
                  f"({time.perf_counter() - started:.1f} s)", flush=True)
        del x, expected
    env = environment(device)
    output.mkdir(parents=True, exist_ok=True)
    mode = "small" if small else "gpu"
    append_csv(output / CSV_NAME, env, rows)
    (output / f"policy_loss_{mode}.json").write_text(json.dumps({"env": env, "rows": [asdict(r) for r in rows]},
                                                                indent=1))
    plot(output / f"policy_loss_{mode}.png", rows, f"GRPO policy loss from hidden states, {env['device']}")
    print(f"\n{env}")
    print_table(rows)
    reference = reference or reference_path(mode)
    if reference.exists():
        print_comparison(rows, json.loads(reference.read_text()), reference)
    print(f"\nwrote {output / CSV_NAME}, policy_loss_{mode}.json, policy_loss_{mode}.png")
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true",
                        help="tiny shapes on the CPU under the Triton interpreter (automatic without CUDA)")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="where the CSV, JSON and PNG go")
    parser.add_argument("--compare", type=Path,
                        help="a previous run's JSON to print beside this one (default: docs/benchmarks/kernels-MODE.json)")
    parser.add_argument("--providers", nargs="+", default=list(PROVIDERS), choices=list(PROVIDERS))
    parser.add_argument("--reps", type=int, default=3, help="timing repetitions on the CPU (GPU: do_bench)")
    args = parser.parse_args(argv)
    if args.compare is not None and not args.compare.is_file():
        parser.error(f"--compare {args.compare}: no such file")
    small = args.small or not torch.cuda.is_available()
    if small and not args.small:
        print("no CUDA device: running the small CPU comparison")
    if small and not interpreting():
        # Triton reads TRITON_INTERPRET when it is imported (torch.compile already imported it), so restart with it
        os.environ["TRITON_INTERPRET"] = "1"
        given = sys.argv[1:] if argv is None else argv
        os.execv(sys.executable, [sys.executable, "-m", "megatron_mimesis.kernels.bench",
                                  *([] if "--small" in given else ["--small"]), *given])
    run(small, args.output, args.providers, args.reps, args.compare)


if __name__ == "__main__":
    main()
