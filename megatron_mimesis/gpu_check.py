"""One GPU acceptance run, prepared to run right the first time on a single A100 / H100 / H200, in under 8 minutes.

    python -m megatron_mimesis.gpu_check [--out DIR] [--stages kernels parity throughput vllm]

Stages, each in its own process with its own time cap (a crash, an OOM or a hang costs that stage only), the report
(``DIR/gpu_check.json`` and ``DIR/gpu_check.md``) rewritten after every stage, and each stage writing its rows as
it goes, so a stage stopped at its cap still reports what it measured:

- kernels: the GRPO policy loss from hidden states at N=16384 tokens (4 sequences of 4096), V=248320, H=4096 and
  H=2048, bf16: forward+backward time and peak memory of ours, Liger's ``triton_grpo_loss`` and
  ``LigerFusedLinearGRPOLoss``, torch eager and torch.compile (``kernels/bench.py``'s providers), each as a ratio
  to ours and to the three bare cuBLAS lm-head GEMMs measured in the same run, with errors against fp32.
- parity: the compiled Triton kernels against the plain-PyTorch references (padded and unpadded vocab), fla's
  Gated DeltaNet against the CPU fallback on packed THD rows of several documents (outputs and gradients), and the
  Transformer Engine layer spec against the local spec on the same weights (logits, loss, gradients, bf16).
- throughput: 4 Qwen3.5-9B-width layers (3 Gated DeltaNet + 1 attention) plus the 248320-row lm head and the fused
  loss at sequence length 24576, micro-batch 1, bf16, Transformer Engine + fla on this one GPU: tokens/s,
  TFLOP/s and MFU by ``training/flops.py``, peak memory, and the extrapolation to 32 layers at TP=4 with its
  assumptions spelled out.
- vllm (where vLLM is installed): a megatron trainer and the colocated vLLM engine in one process, as the RL stages
  run them: the engine's start and weight-sync times, its log-probs after the sync against the trainer's (and, as
  the control, before it), and that sleep frees its memory (``torch.cuda.mem_get_info`` before and after) while
  wake gives back the same log-probs. The same stage runs on the CPU backend in the vLLM tests.

Without a GPU it prints one line and exits 2. Exit 1 when any stage did not finish ok.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

TOTAL_BUDGET_S = 470
# stage -> time cap (s); their sum stays under the budget, which also pays for the processes' start-up
STAGE_CAPS = {"kernels": 180, "parity": 75, "throughput": 115, "vllm": 80}
KERNEL_SHAPES = ((16384, 248320, 4096, 4096), (16384, 248320, 2048, 4096))  # tokens, vocab, hidden, seq_len
KERNEL_PROVIDERS = ("ours", "liger-triton-grpo", "liger-fused-linear-grpo", "torch-eager", "torch-compile")
THROUGHPUT_SEQ = 24576
THROUGHPUT_LAYERS = 4
PAPER_LAYERS, PAPER_TP = 32, 4
VLLM_VOCAB = 520  # megatron pads it to 576
VLLM_ROWS = ([[11, 40, 7, 301, 9], [5, 6], [250, 12, 13]], [[17, 18, 19, 20], [99, 3, 7], [400, 2]])
# a small KV-cache share: the stage checks that sleep frees it, not how far it goes
VLLM_GPU_OPTIONS = {"gpu_memory_utilization": 0.2, "max_model_len": 1024, "enforce_eager": True}
# bf16 engine vs bf16 trainer, different kernels: the CPU tests measure 0.05; dummy weights are off by more than 1
VLLM_TOLERANCE = 0.15
VLLM_LOGIT_SCALE = 10.0  # on megatron's init (std 0.02) peaks the log-probs, so dummy weights score far off
WAKE_TOLERANCE = 1e-3  # the same weights back from host memory; a row restored wrong is off by far more


# ---------------------------------------------------------------------------------------------- orchestration
def detect_gpu() -> str | None:
    """The GPU's name, or None when this process sees no CUDA device."""
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def stage_command(name: str, out_dir: Path) -> list[str]:
    return [sys.executable, "-m", "megatron_mimesis.gpu_check", "--stage", name, "--out", str(out_dir)]


def stage_file(out_dir: Path, name: str) -> Path:
    return out_dir / f"stage_{name}.json"


def write_json(path: Path, payload) -> None:
    """Atomically: a reader (or a later stage) never sees half a file."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=1, default=str))
    os.replace(tmp, path)


def run_stage(name: str, out_dir: Path, cap_s: float) -> dict:
    """Run one stage in a child process (its own session, so a timeout kills everything it started)."""
    log = out_dir / f"stage_{name}.log"
    started = time.monotonic()
    with log.open("w") as sink:
        child = subprocess.Popen(stage_command(name, out_dir), stdout=sink, stderr=subprocess.STDOUT,
                                 start_new_session=True)
        try:
            rc = child.wait(timeout=cap_s)
            status = "ok" if rc == 0 else f"failed (rc {rc}): {_last_line(log)}"
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            status = f"timeout after {cap_s:.0f} s (partial results kept)"
    results = json.loads(stage_file(out_dir, name).read_text()) if stage_file(out_dir, name).exists() else {}
    return {"status": status, "seconds": round(time.monotonic() - started, 1), "log": log.name, **results}


def _last_line(path: Path) -> str:
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1][:200] if lines else "no output"


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    return "-" if value is None else str(value)


def markdown(report: dict) -> str:
    lines = [f"# GPU check: {report['device']}", "", f"{report['started']}; " +
             ", ".join(f"{k} {v}" for k, v in report["versions"].items()), ""]
    for name, stage in report["stages"].items():
        lines += [f"## {name}: {stage['status']} ({stage.get('seconds', 0):.0f} s)", ""]
        rows = stage.get("rows", [])
        if rows:
            columns = list(dict.fromkeys(key for row in rows for key in row))
            lines += ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
            lines += ["| " + " | ".join(_cell(row.get(c)) for c in columns) + " |" for row in rows]
            lines.append("")
        lines += [f"- {note}" for note in stage.get("notes", [])]
        lines.append("")
    return "\n".join(lines)


def _versions() -> dict:
    import importlib.metadata

    out = {}
    for package in ("torch", "triton", "transformer-engine", "flash-linear-attention", "liger-kernel", "vllm"):
        try:
            out[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            out[package] = "missing"
    return out


def orchestrate(out_dir: Path, stages: list[str], device: str) -> int:
    out_dir.mkdir(parents=True, exist_ok=True)
    report = {"device": device, "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
              "versions": _versions(), "stages": {}}
    deadline = time.monotonic() + TOTAL_BUDGET_S
    for name in stages:
        stage_file(out_dir, name).unlink(missing_ok=True)
        left = deadline - time.monotonic()
        if left < 15:
            report["stages"][name] = {"status": "skipped: total time budget spent"}
        else:
            report["stages"][name] = run_stage(name, out_dir, min(STAGE_CAPS[name], left))
        write_json(out_dir / "gpu_check.json", report)
        (out_dir / "gpu_check.md").write_text(markdown(report))
        print(f"gpu_check: {name}: {report['stages'][name]['status']}", flush=True)
    print(f"gpu_check: wrote {out_dir / 'gpu_check.json'} and {out_dir / 'gpu_check.md'}")
    return 0 if all(s["status"] == "ok" for s in report["stages"].values()) else 1


# ------------------------------------------------------------------------------------------------ the stages
class StageRecorder:
    """Rows and notes of one stage, written to its file after every addition."""

    def __init__(self, out_dir: Path, name: str):
        self.path, self.data = stage_file(out_dir, name), {"rows": [], "notes": []}

    def row(self, **fields):
        self.data["rows"].append(fields)
        write_json(self.path, self.data)

    def note(self, text: str):
        self.data["notes"].append(text)
        write_json(self.path, self.data)


def stage_kernels(rec: StageRecorder) -> None:
    import torch

    from megatron_mimesis.kernels import bench

    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference must be fp32
    device = torch.device("cuda")
    for tokens, vocab, hidden, seq_len in KERNEL_SHAPES:
        shape = bench.Shape(tokens, vocab, hidden, seq_len)
        x = bench.make_inputs(shape, torch.bfloat16, device)
        expected = bench.fp32_reference(x, chunk=4096)
        lm_ms = bench.lm_head_ms(x, reps=3)
        ours_ms = None
        for provider in KERNEL_PROVIDERS:
            r = bench.bench_provider(provider, shape, x, expected, lm_ms, reps=3)
            if provider == "ours":
                ours_ms = r.fwd_bwd_ms
            rec.row(provider=provider, N=tokens, V=vocab, H=hidden, status=r.status, fwd_bwd_ms=r.fwd_bwd_ms,
                    peak_gib=None if r.peak_mb is None else r.peak_mb / 1024,
                    vs_ours=None if r.fwd_bwd_ms is None or not ours_ms else r.fwd_bwd_ms / ours_ms,
                    vs_lm_head_gemms=None if r.fwd_bwd_ms is None else r.fwd_bwd_ms / lm_ms,
                    loss_err=r.loss_abs_err, grad_h_max_abs=r.grad_h_max_abs, grad_h_cos=r.grad_h_cos)
        rec.note(f"N={tokens} H={hidden}: the 3 bare cuBLAS lm-head GEMMs (logits, grad_h, grad_W) take "
                 f"{lm_ms:.1f} ms; vs_lm_head_gemms = provider time / that (1.0 = as fast as the GEMMs alone)")
        del x, expected
        torch.cuda.empty_cache()


def _max_rel(actual, expected) -> float:
    return ((actual.float() - expected.float()).abs().max() / expected.float().abs().max()).item()


def stage_parity(rec: StageRecorder) -> None:
    """Each check on its own: one that fails is a row saying so, and the next still runs."""
    for check in (_kernel_parity, _fla_parity, _te_vs_local_parity):
        try:
            check(rec)
        except Exception as error:  # noqa: BLE001 - a failed check is a result
            rec.row(check=check.__name__.strip("_"), status=f"failed: {type(error).__name__}: {error}"[:300])


def _kernel_parity(rec: StageRecorder) -> None:
    import torch

    from megatron_mimesis.kernels import reference
    from megatron_mimesis.kernels.linear_logprob import linear_logprob
    from megatron_mimesis.kernels.logits_logprob import logits_logprob

    torch.backends.cuda.matmul.allow_tf32 = False
    device = torch.device("cuda")
    generator = torch.Generator(device=device).manual_seed(0)
    n, hidden_size = 4096, 4096
    for rows, vocab_size in ((32768, None), (32768, 32000)):
        hidden = torch.randn(n, hidden_size, device=device, generator=generator).bfloat16().requires_grad_()
        weight = (torch.randn(rows, hidden_size, device=device, generator=generator) * 2 / hidden_size**0.5)
        weight = weight.bfloat16().requires_grad_()
        targets = torch.randint(0, vocab_size or rows, (n,), device=device, generator=generator)
        grad_out = torch.randn(n, device=device, generator=generator)
        ours, entropy = linear_logprob(hidden, weight, targets, None, vocab_size)
        (ours * grad_out).sum().backward()
        h32, w32 = hidden.detach().float().requires_grad_(), weight.detach().float().requires_grad_()
        ref, ref_entropy = reference.linear_logprob(h32, w32, targets, None, vocab_size)
        (ref * grad_out).sum().backward()
        rec.row(check="linear_logprob vs reference", vocab=f"{vocab_size or rows} of {rows} rows",
                logprob_max_abs=(ours - ref).abs().max().item(), entropy_max_abs=(entropy - ref_entropy).abs().max().item(),
                grad_h_max_rel=_max_rel(hidden.grad, h32.grad), grad_w_max_rel=_max_rel(weight.grad, w32.grad),
                padding_grad_max=0.0 if vocab_size is None else weight.grad[vocab_size:].abs().max().item())
        logits = (hidden.detach() @ weight.detach().t()).requires_grad_()
        lp, _ = logits_logprob(logits, targets, None, vocab_size)
        (lp * grad_out).sum().backward()
        l32 = logits.detach().float().requires_grad_()
        ref_lp, _ = reference.logprob_and_entropy_from_logits(l32, targets, None, vocab_size)
        (ref_lp * grad_out).sum().backward()
        rec.row(check="logits_logprob vs reference", vocab=f"{vocab_size or rows} of {rows} rows",
                logprob_max_abs=(lp - ref_lp).abs().max().item(), grad_logits_max_rel=_max_rel(logits.grad, l32.grad))
        del hidden, weight, logits
    rec.note("tolerances of the CPU tests: log-probs 1e-5 absolute in fp32 accumulation; bf16 gradients 2e-2 of "
             "the largest fp32 entry; padding rows exactly 0")


def _fla_parity(rec: StageRecorder) -> None:
    import torch

    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError as error:
        rec.note(f"fla Gated DeltaNet parity not run: {error}")
        return
    from megatron_mimesis.compat import fla_fallback

    device = torch.device("cuda")
    generator = torch.Generator(device=device).manual_seed(1)
    cu_seqlens = torch.tensor([0, 300, 1100, 1400, 2048], device=device, dtype=torch.int32)
    length, heads, dk, dv = 2048, 4, 128, 128

    def rand(*shape):
        return torch.randn(*shape, device=device, generator=generator)

    inputs = {"q": rand(1, length, heads, dk), "k": rand(1, length, heads, dk), "v": rand(1, length, heads, dv),
              "g": -torch.rand(1, length, heads, device=device, generator=generator),
              "beta": torch.rand(1, length, heads, device=device, generator=generator)}
    grad_out = rand(1, length, heads, dv)
    results = {}
    for name, fn in (("fla", chunk_gated_delta_rule), ("fallback", fla_fallback.chunk_gated_delta_rule)):
        leaves = {k: v.clone().requires_grad_() for k, v in inputs.items()}
        out, _ = fn(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"], cu_seqlens=cu_seqlens,
                    use_qk_l2norm_in_kernel=True)
        (out.float() * grad_out).sum().backward()
        results[name] = (out.detach().float(), {k: v.grad.float() for k, v in leaves.items()})
    (out_fla, grads_fla), (out_ref, grads_ref) = results["fla"], results["fallback"]
    rec.row(check="fla chunk_gated_delta_rule vs CPU fallback (fp32, 4 packed documents)",
            out_max_rel=_max_rel(out_fla, out_ref), **{f"d{k}_max_rel": _max_rel(grads_fla[k], grads_ref[k])
                                                       for k in grads_ref})
    rec.note("fla #640 (Triton 3.4.0 to 3.7.0 on Hopper) shows as dbeta/dg far off while the outputs agree")


def _init_one_rank_megatron() -> None:
    """A world of one rank (NCCL on the GPU; gloo through the CPU adaptation where there is none, which is how the
    vLLM stage is tested here), with the rank variables vLLM's ``external_launcher`` reads."""
    import socket

    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_mimesis.compat import enable_cpu_compat

    cpu = enable_cpu_compat()
    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
        if not cpu:
            torch.cuda.set_device(0)
        dist.init_process_group("gloo" if cpu else "nccl", rank=0, world_size=1)
        parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(0)


def _te_vs_local_parity(rec: StageRecorder) -> None:
    """The tiny preset built with the Transformer Engine spec and with the local spec, on the same (HF) weights."""
    import torch
    import torch.nn.functional as F
    from transformers import Qwen3_5ForCausalLM

    from megatron_mimesis.models.config import ParallelConfig, transformer_config
    from megatron_mimesis.models.hf_weights import gather_hf_tensors, load_hf_weights
    from megatron_mimesis.models.presets import get_preset
    from megatron_mimesis.models.provider import ModelProvider

    _init_one_rank_megatron()
    preset = get_preset("tiny")
    torch.manual_seed(0)
    state = Qwen3_5ForCausalLM(preset.to_hf_config()).state_dict()
    tokens = torch.randint(0, preset.vocab_size, (2, 256), device="cuda")
    positions = torch.arange(256, device="cuda").expand(2, 256)
    results = {}
    for backend in ("te", "local"):
        provider = ModelProvider(preset, transformer_config(preset, ParallelConfig(), params_dtype=torch.bfloat16),
                                 backend=backend)
        model = provider().cuda()
        load_hf_weights(model, state, preset, provider.padded_vocab_size)
        logits = model(tokens, positions, None)[..., :preset.vocab_size].float()
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        results[backend] = (logits.detach(), loss.item(),
                            gather_hf_tensors(model, preset, provider.padded_vocab_size, grads=True))
    (te_logits, te_loss, te_grads), (local_logits, local_loss, local_grads) = results["te"], results["local"]
    rec.row(check="TE spec vs local spec (tiny preset, bf16, same weights)",
            logits_max_abs=(te_logits - local_logits).abs().max().item(), loss_abs=abs(te_loss - local_loss),
            grad_max_rel=max(_max_rel(te_grads[name], grad) for name, grad in local_grads.items()))


def stage_throughput(rec: StageRecorder) -> None:
    import torch

    from megatron_mimesis.models.config import ParallelConfig, transformer_config
    from megatron_mimesis.models.presets import get_preset
    from megatron_mimesis.models.provider import ModelProvider
    from megatron_mimesis.training.flops import device_peak_flops, train_flops_per_token
    from megatron_mimesis.training.loss import lm_loss_output_processor

    _init_one_rank_megatron()
    preset = get_preset("9b").replace(num_layers=THROUGHPUT_LAYERS, mtp_num_layers=0)
    config = transformer_config(preset, ParallelConfig(), params_dtype=torch.bfloat16)
    model = ModelProvider(preset, config, backend="te")().cuda()
    tokens = torch.randint(0, preset.vocab_size, (1, THROUGHPUT_SEQ), device="cuda")
    positions = torch.arange(THROUGHPUT_SEQ, device="cuda")[None]
    mask = torch.ones(1, THROUGHPUT_SEQ, device="cuda")

    def step():
        loss = model(tokens, positions, None, labels=tokens, loss_mask=mask, output_processor=lm_loss_output_processor)
        loss.backward()

    for _ in range(2):  # warm-up: Triton autotuning and compilation, TE workspace
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    reps = 5
    started = time.perf_counter()
    for _ in range(reps):
        step()
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - started) / reps
    peak_flops = device_peak_flops(torch.cuda.get_device_name(0))
    tokens_per_s = THROUGHPUT_SEQ / seconds
    flops = train_flops_per_token(preset, THROUGHPUT_SEQ) * tokens_per_s
    rec.row(layers=f"{THROUGHPUT_LAYERS} (3 DeltaNet + 1 attention) + lm head", seq=THROUGHPUT_SEQ,
            step_s=seconds, tokens_per_s=tokens_per_s, tflops=flops / 1e12, mfu=flops / peak_flops,
            peak_gib=torch.cuda.max_memory_allocated() / 2**30, gpu_gib=torch.cuda.get_device_properties(0).total_memory / 2**30)
    # the lm head + fused loss alone, to separate it from the per-layer cost in the extrapolation
    hidden = torch.randn(THROUGHPUT_SEQ, preset.hidden_size, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = model.output_layer.weight
    from megatron_mimesis.kernels import fused_linear_cross_entropy

    def head():
        fused_linear_cross_entropy(hidden, weight, tokens[0], mask[0], vocab_size=preset.vocab_size)[0].backward()

    head()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(reps):
        head()
    torch.cuda.synchronize()
    head_s = (time.perf_counter() - started) / reps
    per_layer_s = (seconds - head_s) / THROUGHPUT_LAYERS
    full = get_preset("9b")
    full_step_s = (PAPER_LAYERS * per_layer_s + head_s) / PAPER_TP
    full_tokens_per_gpu = THROUGHPUT_SEQ / full_step_s / PAPER_TP
    full_mfu = full_tokens_per_gpu * train_flops_per_token(full, THROUGHPUT_SEQ) / peak_flops
    rec.row(layers=f"extrapolated: {PAPER_LAYERS} layers at TP={PAPER_TP}", seq=THROUGHPUT_SEQ, step_s=full_step_s,
            tokens_per_s=full_tokens_per_gpu, mfu=full_mfu)
    rec.note(f"measured lm head + fused loss alone: {head_s * 1e3:.1f} ms; per layer (averaged over the 3:1 mix): "
             f"{per_layer_s * 1e3:.1f} ms")
    rec.note(f"extrapolation assumes: layers cost the same as the measured 3:1 mix, TP={PAPER_TP} splits every "
             "layer's and the head's work perfectly with no communication cost, no pipeline bubble, embedding and "
             "optimizer step not counted: an upper bound; tokens_per_s of that row is per GPU")


def stage_vllm(rec: StageRecorder) -> None:
    """The colocated engine as the RL stages drive it: a megatron trainer and vLLM (``external_launcher``) in one
    process, the tiny preset at a vocabulary megatron pads (520 -> 576), so a sync that kept the padding rows fails.
    The output layer is scaled up so that log-probs are peaked and tell one set of weights from another. Every
    check is a row; the stage fails after the last one when any did."""
    import torch

    try:
        import vllm  # noqa: F401
    except ImportError as error:
        rec.note(f"vLLM stage not run: {error}")
        return
    from megatron_mimesis.compat import compute_device
    from megatron_mimesis.models.config import ParallelConfig, transformer_config
    from megatron_mimesis.models.presets import get_preset
    from megatron_mimesis.models.provider import ModelProvider
    from megatron_mimesis.rl.scoring import score_rows
    from megatron_mimesis.rl.vllm_engine import CPU_TINY_OPTIONS, VLLMEngine
    from megatron_mimesis.rl.weight_sync import sync_weights

    _init_one_rank_megatron()
    device = compute_device()
    preset = get_preset("tiny").replace(vocab_size=VLLM_VOCAB)
    provider = ModelProvider(preset, transformer_config(preset, ParallelConfig(), params_dtype=torch.bfloat16))
    model = provider().to(device)
    output = model.shared_embedding_or_output_weight() if preset.tie_word_embeddings else model.output_layer.weight
    with torch.no_grad():
        output.mul_(VLLM_LOGIT_SCALE)
    prompts, responses = VLLM_ROWS
    trainer = score_rows([model], list(zip(prompts, responses, strict=True)), 4096, device)
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
        failures.append("the engine does not score like the trainer after the sync")
    if dummy_err <= VLLM_TOLERANCE:
        failures.append("the check cannot tell the dummy weights from the trainer's")
    rec.row(check=f"colocated sync + score (tiny, vocab {VLLM_VOCAB} padded to {provider.padded_vocab_size}, "
            "bf16)", engine_start_s=start_s, sync_s=sync_s, engine_vs_trainer_max_abs=synced_err,
            dummy_vs_trainer_max_abs=dummy_err, tolerance=VLLM_TOLERANCE, status="failed" if failures else "ok")
    if engine.sleeps:
        free = [torch.cuda.mem_get_info()[0]]
        engine.sleep()
        free.append(torch.cuda.mem_get_info()[0])
        engine.wake()
        free.append(torch.cuda.mem_get_info()[0])
        woken_err = max_abs_diff(engine.score(prompts, responses), synced)
        freed_gib = (free[1] - free[0]) / 2**30
        share_gib = options["gpu_memory_utilization"] * torch.cuda.mem_get_info()[1] / 2**30
        ok = freed_gib >= share_gib / 2 and woken_err <= WAKE_TOLERANCE
        if not ok:
            failures.append("sleep kept the engine's memory or wake changed its weights")
        rec.row(check="sleep frees the engine's memory, wake restores its weights", freed_by_sleep_gib=freed_gib,
                engine_share_gib=share_gib, taken_back_by_wake_gib=(free[1] - free[2]) / 2**30,
                woken_vs_synced_max_abs=woken_err, status="ok" if ok else "failed")
        rec.note("sleep level 1 drops the KV cache and moves the weights to host memory: it must free at least half "
                 "the engine's share (gpu_memory_utilization x the GPU), and the woken engine score as before")
    else:
        rec.note(f"sleep not checked: vLLM has no sleep mode on {device.type}")
    if failures:
        raise SystemExit("vllm stage: " + "; ".join(failures))


def max_abs_diff(rows_a, rows_b) -> float:
    """The largest |a - b| over two equally shaped lists of log-prob rows."""
    return max(abs(a - b) for row_a, row_b in zip(rows_a, rows_b, strict=True)
               for a, b in zip(row_a, row_b, strict=True))


STAGES = {"kernels": stage_kernels, "parity": stage_parity, "throughput": stage_throughput, "vllm": stage_vllm}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("gpu_check"), help="report directory (default: gpu_check)")
    parser.add_argument("--stages", nargs="+", choices=list(STAGES), default=list(STAGES), help="stages to run")
    parser.add_argument("--stage", choices=list(STAGES), help=argparse.SUPPRESS)  # one stage, in this process
    args = parser.parse_args(argv)
    if args.stage:
        STAGES[args.stage](StageRecorder(args.out, args.stage))
        return 0
    device = detect_gpu()
    if device is None:
        print("gpu_check: no CUDA GPU visible to this process (torch.cuda.is_available() is False); nothing run")
        return 2
    return orchestrate(args.out, args.stages, device)


if __name__ == "__main__":
    sys.exit(main())
