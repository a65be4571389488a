"""``python -m data_prep.midtrain``: user-side mid-training corpora -> packed megatron indexed datasets.

With no ``--input`` it builds the embedded chit-chat corpus into ``.cache/data/chitchat-midtrain`` and reuses
that build while its inputs and options are unchanged. From Python::

    from data_prep.midtrain import build
    result = build(seq_length=2048, max_conversations=500)   # -> BuildResult(output_dir, manifest, reused)
"""

import sys

from data_prep import cli, pipeline


def build(**options) -> pipeline.BuildResult:
    """Build (or reuse) mid-training data; ``options`` are ``data_prep.pipeline.PrepConfig`` fields."""
    return pipeline.build(pipeline.PrepConfig(task="midtrain", **options))


def main(argv: list[str] | None = None) -> int:
    """The CLI (``python -m data_prep.midtrain``, or the ``mimesis-prep-midtrain`` console script)."""
    return cli.main("midtrain", argv)


if __name__ == "__main__":
    sys.exit(main())
