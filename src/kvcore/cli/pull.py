"""`kvcore pull`: download and convert the default model (SmolLM2-135M-Instruct); print its path."""

from __future__ import annotations

import argparse
import sys

from kvcore.cli import CLIError
from kvcore.model.gguf_convert import GGUFConversionError
from kvcore.model.hub import ModelDownloadError, ensure_default_model


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quiet", action="store_true", help="print only the model directory")


def run(args: argparse.Namespace) -> int:
    def progress(message: str) -> None:
        # progress on stderr: stdout carries only the directory, for scripts
        print(message, file=sys.stderr, flush=True)

    try:
        path = ensure_default_model(None if args.quiet else progress)
    except (ModelDownloadError, GGUFConversionError, OSError) as e:
        raise CLIError(str(e)) from e
    print(path)
    return 0
