"""`kvcore convert GGUF OUT`: convert a llama-architecture GGUF into an HF-style model directory."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from kvcore.cli import CLIError
from kvcore.model.gguf_convert import GGUFConversionError, convert_gguf, is_model_dir
from kvcore.model.gguf_tokenizer import GGUFTokenizerError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("gguf", metavar="GGUF", help="the .gguf file")
    parser.add_argument("out", metavar="OUT",
                        help="the model directory to create (left as is if already converted)")


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if is_model_dir(out):
        print(f"{out} is already a converted model; nothing to do", file=sys.stderr)
        print(out)
        return 0
    start = time.perf_counter()
    try:
        convert_gguf(args.gguf, out, lambda m: print(m, file=sys.stderr, flush=True))
    except (GGUFConversionError, GGUFTokenizerError, OSError) as e:
        raise CLIError(str(e)) from e
    except ValueError as e:  # the gguf package's reader rejects a file that is not GGUF
        raise CLIError(f"cannot read {args.gguf!r} as GGUF: {e}") from e
    print(f"converted in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    print(out)
    return 0
