"""What every dsv41 command shares: user errors as one line and exit 2, byte formatting, consoles."""
from __future__ import annotations

import argparse
import sys

from runtime.checkpoint.safetensors_io import CheckpointError
from runtime.config import ConfigError

# Errors a user can cause and fix: printed as one line, never a traceback.
USER_ERRORS = (ConfigError, CheckpointError, ValueError, FileNotFoundError, PermissionError)


def console(stderr: bool = False):
    """A rich console; when the output is not a terminal (logs, CI) tables get 150 columns, not 80."""
    from rich.console import Console
    stream = sys.stderr if stderr else sys.stdout
    return Console(stderr=stderr, highlight=False, width=None if stream.isatty() else 150)


def fmt_bytes(n: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def run_main(parser: argparse.ArgumentParser, argv=None) -> int:
    args = parser.parse_args(argv)
    try:
        return args.fn(args)
    except USER_ERRORS as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{parser.prog}: interrupted", file=sys.stderr)
        return 130
