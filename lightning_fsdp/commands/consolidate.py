"""``lightning-fsdp consolidate SRC DST``: a sharded checkpoint → one ``.ckpt``, one ``.safetensors``, a Hugging
Face model directory (LoRA merged), a PEFT adapter, or a GGUF file for llama.cpp, Ollama and LM Studio.

Runs in one process with no process group. ``--format hf``, ``peft`` and ``gguf`` need the ``[hf]`` extra
(transformers, PEFT; ``gguf`` also the ``gguf`` package). A LoRA checkpoint's frozen base is read from the
pretrained directory it recorded (verified against its identity) or from ``--base``. ``--format gguf`` also takes a
Hugging Face model directory as SRC (``--format hf``'s export, or a download), so either can be served by llama.cpp.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

from lightning_fsdp.checkpoint.consolidate import consolidate_checkpoint
from lightning_fsdp.checkpoint.errors import CheckpointError
from lightning_fsdp.checkpoint.manifest import MANIFEST_NAME
from lightning_fsdp.checkpoint.state import WEIGHTS
from lightning_fsdp.commands import fail

FORMATS = ("ckpt", "safetensors", "hf", "peft", "gguf")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-fsdp consolidate",
        description="Turn a sharded lightning_fsdp checkpoint directory into one standard Lightning .ckpt file, the"
        " model weights in one .safetensors file, a Hugging Face model directory, a PEFT adapter, or a GGUF file.",
    )
    parser.add_argument("src", metavar="SRC", help="sharded checkpoint directory (holds manifest.json); for gguf also"
                        " a Hugging Face model directory")
    parser.add_argument("dst", metavar="DST", help="output file (ckpt, safetensors, gguf) or directory (hf, peft)")
    parser.add_argument("--format", choices=FORMATS, default="ckpt", help="output format (default: ckpt)")
    parser.add_argument("--hf-config", metavar="DIR", help="hf: take config.json and tokenizer files from DIR; gguf:"
                        " the tokenizer")
    parser.add_argument("--base", metavar="DIR", help="a LoRA checkpoint's pretrained base directory, if it moved")
    parser.add_argument("--dtype", help="hf: store the weights in this dtype (e.g. bf16); default: as trained")
    parser.add_argument("--max-shard-size", default="5GB", help="hf: largest safetensors shard (default: 5GB)")
    parser.add_argument("--merge-into", choices=("original", "quantized"), default="original",
                        help="hf, QLoRA checkpoints: merge the adapters into the original base files (default, what"
                        " is served) or into the base as training saw it (quantized to NF4 and back)")
    parser.add_argument("--weights", choices=WEIGHTS, default="model",
                        help="model: the trained weights (default); ema: ShardedEMA's average")
    parser.add_argument("--gguf-type", choices=("f32", "f16", "bf16", "q8_0"), default="f16",
                        help="gguf: weight type (default: f16); norms stay f32, q8_0 falls back to f16 for rows that"
                        " are not a multiple of 32")
    parser.add_argument("--force", action="store_true", help="gguf: replace an existing DST")
    parser.add_argument("--no-progress", action="store_true", help="do not print progress to stderr")
    return parser


def consolidate(args: argparse.Namespace) -> Path:
    if args.format == "gguf":
        from lightning_fsdp.hf import gguf_export

        if (Path(args.src) / "config.json").is_file() and not (Path(args.src) / MANIFEST_NAME).is_file():
            return gguf_export.export_gguf_from_hf_dir(args.src, args.dst, gguf_type=args.gguf_type, force=args.force)
        return gguf_export.export_gguf_from_checkpoint(
            args.src, args.dst, base=args.base, tokenizer_dir=args.hf_config, gguf_type=args.gguf_type,
            force=args.force, weights=args.weights,
        )
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
    if args.format == "gguf":
        from lightning_fsdp.hf.gguf_export import describe_gguf

        print(f"consolidate: wrote {dst} ({describe_gguf(dst)})", file=sys.stderr)
    elif args.format in ("hf", "peft") and not args.no_progress:
        print(f"consolidate: wrote {dst}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
