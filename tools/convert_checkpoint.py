"""Convert between megatron dist checkpoints and Hugging Face directories (the family read from either).

    python tools/convert_checkpoint.py import --hf DIR --out DIR [--tp N] [--dtype bf16]
    python tools/convert_checkpoint.py export --load DIR [--iteration N] --out DIR [--hf-reference DIR]
        [--tokenizer DIR] [--dtype bf16] [--max-shard-size-gb 2] [--overwrite]

The export of a user-side checkpoint serves as a user simulator as it is (``vllm serve OUT``, no ``--chat-template``): it carries a chat
template that renders a request in the user-simulator convention (system, the agent as ``user``, the simulator's
own turns as ``assistant``, as tau2-bench sends) into the user-side rendering the model was trained on, and the
generation config of the recipe (megatron_mimesis/checkpoint/serving.py).

Exit status 0 on success, 2 with a one-line reason on bad input.
"""

import argparse
import sys

from megatron_mimesis.checkpoint.conversion import ConversionError, export_to_hf, import_from_hf
from megatron_mimesis.checkpoint.reader import CheckpointError


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import", help="HF directory -> weights-only dist checkpoint (load with --finetune)")
    imp.add_argument("--hf", required=True, help="HF checkpoint directory of a supported family (its config.json's "
                                                 "model_type says which)")
    imp.add_argument("--out", required=True, help="output save root (gets iter_0000000/ and latest)")
    imp.add_argument("--tp", type=int, default=1,
                     help="pad the vocabulary as training at this tensor-parallel size does (to a multiple of 64 x TP); "
                          "the checkpoint loads at any TP/PP with that padding")
    imp.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    imp.add_argument("--overwrite", action="store_true")
    exp = sub.add_parser("export", help="dist checkpoint -> HF safetensors directory")
    exp.add_argument("--load", required=True, help="save root (uses latest) or an iter_N directory")
    exp.add_argument("--iteration", type=int, help="iteration to export instead of latest")
    exp.add_argument("--out", required=True)
    exp.add_argument("--hf-reference", help="the original HF directory the checkpoint was trained from: keep its "
                                            "config and layout (a multimodal one's vision tower and MTP weights)")
    exp.add_argument("--tokenizer", help="tokenizer directory to copy (default: the reference's, else the "
                                         "training data's)")
    exp.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    exp.add_argument("--max-shard-size-gb", type=float, default=2.0)
    exp.add_argument("--overwrite", action="store_true")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        if args.command == "import":
            out = import_from_hf(args.hf, args.out, tp=args.tp, dtype=args.dtype, overwrite=args.overwrite)
        else:
            out = export_to_hf(args.load, args.out, iteration=args.iteration, hf_reference=args.hf_reference,
                               tokenizer=args.tokenizer, dtype=args.dtype,
                               max_shard_bytes=int(args.max_shard_size_gb * 2**30), overwrite=args.overwrite)
    except (ConversionError, CheckpointError, FileNotFoundError, KeyError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
