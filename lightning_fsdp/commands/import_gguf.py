"""``lightning-fsdp import MODEL.gguf DIR``: a GGUF file → a plain Hugging Face model directory.

What ``model_dir=MODEL.gguf`` does on first use, by hand and into a folder of your choice: the weights dequantized
to fp32 safetensors, ``config.json``, and the tokenizer with its chat template (see :mod:`lightning_fsdp.hf.gguf`).
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional

from lightning_fsdp.commands import fail


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-fsdp import",
        description="Convert a GGUF model file (llama.cpp, Ollama, LM Studio) into a Hugging Face model directory"
        " that `model.model_dir`, `strategy.pretrained_weights` and `lightning-fsdp chat` take.",
    )
    parser.add_argument("src", metavar="MODEL.gguf", help="the GGUF file")
    parser.add_argument("dst", metavar="DIR", nargs="?",
                        help="output directory (default: the shared conversion cache, printed when done)")
    parser.add_argument("--force", action="store_true", help="convert again even if DIR holds a conversion")
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    from lightning_fsdp.hf.gguf import GGUFError, import_gguf

    try:
        dst = import_gguf(args.src, args.dst, force=args.force)
    except (GGUFError, OSError) as err:
        return fail("import", err)
    print(dst)
    return 0


if __name__ == "__main__":
    sys.exit(main())
