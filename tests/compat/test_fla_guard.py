"""The fla #640 guard: Hopper + flash-linear-attention + Triton < 3.7.1 is refused in one line, at config
validation; everything else passes. The GPU, Triton version and fla presence are passed in."""

import pytest

from megatron_mimesis.compat.fla_guard import fla_miscompile_reason


@pytest.mark.parametrize("triton_version", ["3.4.0", "3.6.0", "3.7.0", "3.7.0+git4f6a1b2"])
@pytest.mark.parametrize("capability", [(9, 0), (9, 2)])
def test_hopper_with_fla_on_a_broken_triton_is_refused(capability, triton_version):
    reason = fla_miscompile_reason(capability, triton_version, fla_installed=True)
    assert reason is not None and "\n" not in reason
    assert f"Triton {triton_version}" in reason and "#640" in reason
    assert "Triton >= 3.7.1" in reason and "torch >= 2.12.1" in reason
    assert f"{capability[0]}.{capability[1]}" in reason


@pytest.mark.parametrize(("capability", "triton_version", "fla_installed"), [
    ((9, 0), "3.7.1", True),  # the fix
    ((9, 0), "3.8.0", True),
    ((8, 0), "3.5.0", True),  # A100 runs fla's Triton path, not the miscompiled one
    ((10, 0), "3.5.0", True),
    ((9, 0), "3.5.0", False),  # no fla: the CPU fallback
    (None, None, True),  # no GPU
])
def test_other_setups_pass(capability, triton_version, fla_installed):
    assert fla_miscompile_reason(capability, triton_version, fla_installed) is None


def test_config_validation_calls_the_guard(monkeypatch):
    """The trainer's validation raises ConfigError with the guard's line (the GPU seen through the guard's one
    process-reading function, not through fake modules)."""
    from megatron_mimesis.compat import fla_guard
    from megatron_mimesis.training import config as training_config

    def broken_hopper():
        raise ValueError(fla_miscompile_reason((9, 0), "3.6.0", True))

    with monkeypatch.context() as patched, pytest.raises(training_config.ConfigError, match="fla issue #640"):
        patched.setattr(fla_guard, "refuse_known_miscompiles", broken_hopper)
        training_config.TrainConfig().validate_model_and_optimizer(1)
    assert fla_guard.refuse_known_miscompiles() is None  # this CPU machine: nothing to refuse
