"""Shared tolerances and comparison helpers of the kernel tests.

Tolerances (measured under the interpreter, set a few times above the worst seen):
- fp32 inputs: log-probs, entropy, losses atol 1e-5; gradients within 1e-5 of the largest reference entry.
- bf16 inputs (reference on the same bf16 values in fp32): log-probs atol 1e-5 (fp32 accumulation; seen 2e-6);
  gradients within 2e-2 of the largest entry of the fp32 gradient (seen 7.5e-3: d logits is rounded to bf16 before
  the two GEMMs and the result is returned in bf16, whose relative step is 7.8e-3).
"""

import torch

FORWARD_ATOL = 1e-5
GRAD_REL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def assert_close_to_scale(actual, expected, rel):
    """max |actual - expected| <= rel * max |expected|: a per-tensor relative bound that near-zero entries of a
    gradient cannot blow up."""
    error = (actual.float() - expected.float()).abs().max().item()
    scale = expected.float().abs().max().item()
    assert error <= rel * scale, f"max error {error:.3e} > {rel:.1e} x scale {scale:.3e}"


def random_problem(num_tokens, vocab, hidden_size, dtype, seed=0):
    """hidden, weight (logits of order a few units, like a trained lm head) and targets."""
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_tokens, hidden_size, generator=generator).to(dtype)
    weight = (torch.randn(vocab, hidden_size, generator=generator) * 3 / hidden_size**0.5).to(dtype)
    targets = torch.randint(0, vocab, (num_tokens,), generator=generator)
    return hidden, weight, targets
