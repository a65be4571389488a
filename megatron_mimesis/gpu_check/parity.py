"""The compiled kernels, fla's Gated DeltaNet and the Transformer Engine spec against their references."""

from megatron_mimesis.gpu_check.record import StageRecorder
from megatron_mimesis.gpu_check.world import init_one_rank_megatron


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


def _te_vs_local_parity(rec: StageRecorder) -> None:
    """Each family's tiny preset built with the Transformer Engine spec and with the local spec, on the same (HF)
    weights."""
    import torch
    import torch.nn.functional as F

    from megatron_mimesis.models.config import ParallelConfig, transformer_config
    from megatron_mimesis.models.hf_weights import gather_hf_tensors, load_hf_weights
    from megatron_mimesis.models.presets import TINY_PRESETS, get_preset
    from megatron_mimesis.models.provider import ModelProvider

    init_one_rank_megatron()
    for name in TINY_PRESETS:
        preset = get_preset(name)
        torch.manual_seed(0)
        state = preset.family.hf_model(preset).state_dict()
        tokens = torch.randint(0, preset.vocab_size, (2, 256), device="cuda")
        positions = torch.arange(256, device="cuda").expand(2, 256)
        results = {}
        for backend in ("te", "local"):
            # no DDP here, so no main_grad for TE's fused wgrad accumulation to write into: gradients land in .grad
            config = transformer_config(preset, ParallelConfig(), params_dtype=torch.bfloat16,
                                        gradient_accumulation_fusion=False)
            provider = ModelProvider(preset, config, backend=backend)
            model = provider().cuda()
            load_hf_weights(model, state, preset, provider.padded_vocab_size)
            logits = model(tokens, positions, None)[..., :preset.vocab_size].float()
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
            loss.backward()
            results[backend] = (logits.detach(), loss.item(),
                                gather_hf_tensors(model, preset, provider.padded_vocab_size, grads=True))
        (te_logits, te_loss, te_grads), (local_logits, local_loss, local_grads) = results["te"], results["local"]
        rec.row(check=f"TE spec vs local spec ({name} preset, bf16, same weights)",
                logits_max_abs=(te_logits - local_logits).abs().max().item(), loss_abs=abs(te_loss - local_loss),
                grad_max_rel=max(_max_rel(te_grads[k], grad) for k, grad in local_grads.items()))
