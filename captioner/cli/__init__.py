"""The ``captioner`` command: caption images, draw attention overlays, evaluate a model on a dataset.

One module per job: ``parser`` (the arguments and the help text; imports no torch, so ``captioner --help``
answers at once), ``inputs`` (files, folders, globs and standard input to image paths), ``output`` (the rows
on stdout, errors and the summary on stderr), ``options`` (the shared options checked, the model and the
device), and one module per command (``caption``, ``attend``, ``evaluate``), imported when it runs.
"""

from __future__ import annotations

import importlib
import io
import sys
from collections.abc import Sequence

from captioner.cli.parser import build_parser, parse
from captioner.errors import CaptionerError

__all__ = ["build_parser", "main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command and return its exit status: 0 done, 1 some input image failed (or none was given), 2 a
    bad argument, model file or dataset (one line on stderr, never a traceback), 130 interrupted."""
    for stream in (sys.stdin, sys.stdout):  # a file name that is not UTF-8 (caf\xe9.jpg) is read and printed as its
        if isinstance(stream, io.TextIOWrapper):  # bytes, as a C.UTF-8 locale has it, not a UnicodeError
            stream.reconfigure(errors="surrogateescape")
    try:
        args = parse(argv)
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2), already printed
        return exc.code
    try:
        command = importlib.import_module(f"captioner.cli.{args.command}")
        return command.run(args)
    except CaptionerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader of stdout went away (`captioner caption ... | head`)
        from captioner.cli.output import stdout_gone  # loaded with the command: --help imports no torch

        stdout_gone()
        return 1
    except OSError as exc:  # e.g. an --out folder that cannot be written
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
