"""``python -m data_prep.sft``: thought-supervised SFT corpora (ThoughtTrace shape) -> packed datasets.

Supervised user turns are those with ``thinking``; each becomes one sample whose target is
``<think>\\n{thinking}\\n</think>\\n\\n{utterance}<|im_end|>``, after the history rendered without thoughts
(as the template shows it), so tokens grow with turns x context while loss tokens stay small. With no ``--input``
it builds a small demo from the first 128 conversations of the embedded chit-chat corpus with *synthetic*
thinking (marked so in the manifest) into ``.cache/data/chitchat-sft``. From Python::

    from data_prep.sft import build
    result = build(seq_length=2048)   # -> BuildResult(output_dir, manifest, reused)
"""

import sys

from data_prep import cli, pipeline


def build(**options) -> pipeline.BuildResult:
    """Build (or reuse) SFT data; ``options`` are ``data_prep.pipeline.PrepConfig`` fields."""
    return pipeline.build(pipeline.PrepConfig(task="sft", **options))


def main(argv: list[str] | None = None) -> int:
    """The CLI (``python -m data_prep.sft``, or the ``mimesis-prep-sft`` console script)."""
    return cli.main("sft", argv)


if __name__ == "__main__":
    sys.exit(main())
