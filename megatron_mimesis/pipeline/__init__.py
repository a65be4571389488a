"""The MIMESIS loop as one pipeline: mid-training -> SFT -> simulator RL -> export -> a served simulator -> agent RL
against it -> evaluation, from one definition (``launch/pipelines/*.yaml``), run here in one command or submitted
to SLURM as a chain of dependent jobs (``python -m megatron_mimesis.pipeline --help``)."""
