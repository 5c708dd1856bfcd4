"""``lightning-fsdp consolidate SRC DST``: a sharded checkpoint → one ``.ckpt``, one ``.safetensors``, a Hugging
Face model directory (LoRA merged) or a PEFT adapter.

Runs in one process with no process group. ``--format hf`` and ``--format peft`` need the ``[hf]`` extra
(transformers, PEFT). A LoRA checkpoint's frozen base is read from the pretrained directory it recorded (verified
against its identity) or from ``--base``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

from lightning_fsdp.checkpoint.consolidate import consolidate_checkpoint
from lightning_fsdp.checkpoint.errors import CheckpointError
from lightning_fsdp.checkpoint.state import WEIGHTS
from lightning_fsdp.commands import fail

FORMATS = ("ckpt", "safetensors", "hf", "peft")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-fsdp consolidate",
        description="Turn a sharded lightning_fsdp checkpoint directory into one standard Lightning .ckpt file, the"
        " model weights in one .safetensors file, a Hugging Face model directory, or a PEFT adapter.",
    )
    parser.add_argument("src", metavar="SRC", help="sharded checkpoint directory (holds manifest.json)")
    parser.add_argument("dst", metavar="DST", help="output file (ckpt, safetensors) or directory (hf, peft)")
    parser.add_argument("--format", choices=FORMATS, default="ckpt", help="output format (default: ckpt)")
    parser.add_argument("--hf-config", metavar="DIR", help="hf: take config.json and tokenizer files from DIR")
    parser.add_argument("--base", metavar="DIR", help="a LoRA checkpoint's pretrained base directory, if it moved")
    parser.add_argument("--dtype", help="hf: store the weights in this dtype (e.g. bf16); default: as trained")
    parser.add_argument("--max-shard-size", default="5GB", help="hf: largest safetensors shard (default: 5GB)")
    parser.add_argument("--merge-into", choices=("original", "quantized"), default="original",
                        help="hf, QLoRA checkpoints: merge the adapters into the original base files (default, what"
                        " is served) or into the base as training saw it (quantized to NF4 and back)")
    parser.add_argument("--weights", choices=WEIGHTS, default="model",
                        help="model: the trained weights (default); ema: ShardedEMA's average")
    parser.add_argument("--no-progress", action="store_true", help="do not print progress to stderr")
    return parser


def consolidate(args: argparse.Namespace) -> Path:
    if args.format in ("hf", "peft"):
        from lightning_fsdp.hf.export import export_hf, export_peft

        if args.format == "peft":
            return export_peft(args.src, args.dst, weights=args.weights)
        return export_hf(
            args.src, args.dst, hf_config=args.hf_config, base=args.base, dtype=args.dtype,
            max_shard_size=args.max_shard_size, weights=args.weights, merge_into=args.merge_into,
        )
    from lightning_fsdp.hf.export import base_entries

    src = Path(args.src)
    return consolidate_checkpoint(
        src,
        args.dst,
        format=args.format,
        progress=not args.no_progress,
        base_tensors=lambda reference: base_entries(reference, Path(args.base or reference.path), src),
        weights=args.weights,
    )


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        dst = consolidate(args)
    except (CheckpointError, ValueError) as err:
        return fail("consolidate", err)
    if args.format in ("hf", "peft") and not args.no_progress:
        print(f"consolidate: wrote {dst}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
