"""The tests' name for the library's gloo launcher (test bodies run on N spawned gloo ranks)."""

from megatron_mimesis.gloo import run_gloo_processes as run_distributed

__all__ = ["run_distributed"]
