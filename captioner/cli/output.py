"""What the captioning commands print: one row per input on stdout, errors and a summary line on stderr."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Sequence

from captioner.data.dataset import Skipped
from captioner.inference import Captioned

# A tab-separated field holds no separator: these characters are written as their escapes (backslash first).
_ESCAPES = str.maketrans({"\\": "\\\\", "\t": "\\t", "\n": "\\n", "\r": "\\r"})


def tsv_line(*fields: object) -> str:
    """Fields joined by tabs, each with its backslashes, tabs, newlines and carriage returns escaped."""
    return "\t".join(str(item).translate(_ESCAPES) for item in fields)


def stdout_gone() -> None:
    """Point stdout at the null device once its reader went away (``captioner caption ... | head``), so that nothing
    written to it later, nor the interpreter's flush at exit, raises BrokenPipeError again."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


class Output:
    """The rows of a captioning command and the counts of its closing summary.

    stdout gets one row per input: ``PATH<TAB>CAPTION[<TAB>more]`` (escaped by ``tsv_line``; with n-best captions
    one such row for each, best first) or, with ``as_json``, a JSON object per line (``n_best``: the list of
    ``{"caption", "score", "tokens"}``), ``{"path", "error"}`` for an input that failed. Each failure is
    also one line ``error: PATH: REASON`` on stderr. ``rows=False`` only counts the captioned images. ``files``: the
    command's work is the files it writes (a gallery, a results file), so a reader of stdout that goes away (``|
    head``) ends the rows, not the command; else BrokenPipeError ends it.
    """

    def __init__(self, as_json: bool = False, rows: bool = True, files: bool = False) -> None:
        self.as_json = as_json
        self.rows = rows
        self.files = files
        self.captioned = 0
        self.failed = 0
        self.failed_inputs: list[Skipped] = []  # the inputs that could not be used, in order
        self.skipped: list[str] = []  # files of folders that are not images
        self.images = 0  # image paths to caption
        self.decoding = ""  # where the images were decoded, when the device decoded JPEGs (DecodeTally.report)
        self.started = time.perf_counter()

    def start(self, images: int) -> None:
        """Captioning of ``images`` paths starts (the model is loaded): the clock of the images/s figure."""
        self.images = images
        self.started = time.perf_counter()

    def caption(self, result: Captioned, *more: object, image_id: int | None = None) -> None:
        """The row of a captioned image (``more``: further TSV fields, such as the overlay's file)."""
        self.captioned += 1
        if not self.rows:
            return
        if self.as_json:
            row = {"image_id": image_id} if image_id is not None else {}
            row.update(path=result.path, caption=result.caption, score=round(result.score, 4), tokens=result.words)
            if result.n_best is not None:
                row["n_best"] = [
                    {"caption": one.caption, "score": round(one.score, 4), "tokens": one.words} for one in result.n_best
                ]
            self._row(json.dumps(row))
        else:
            for caption in [result.caption] if result.n_best is None else [one.caption for one in result.n_best]:
                self._row(tsv_line(result.path, caption, *more))

    def _row(self, line: str) -> None:
        """Print ``line`` on stdout, while its reader is there (``files``: once it has gone, no more rows)."""
        if not self.rows:
            return
        try:
            print(line, flush=True)
        except BrokenPipeError:
            if not self.files:
                raise
            stdout_gone()
            self.rows = False

    def note(self, line: str) -> None:
        """A line on stderr that the user should read, but no failure (what a folder search left out)."""
        print(line, file=sys.stderr, flush=True)

    def failure(self, failed: Skipped) -> None:
        """An input that could not be used: one line on stderr, and its JSON record with ``as_json``."""
        self.failed += 1
        self.failed_inputs.append(failed)
        print(f"error: {failed.path}: {failed.reason}", file=sys.stderr, flush=True)
        if self.as_json:
            self._row(json.dumps({"path": failed.path, "error": failed.reason}))

    def failures(self, failed: Sequence[Skipped]) -> None:
        """``failure`` for each of ``failed``."""
        for item in failed:
            self.failure(item)

    def summary(self) -> str:
        """The closing line: images captioned, failed, skipped (with the first skipped file), images/s, and where
        the images were decoded when the device decoded JPEGs (``decoding``)."""
        seconds = max(time.perf_counter() - self.started, 1e-9)
        skipped = f"{len(self.skipped)} skipped"
        if self.skipped:
            skipped += f" (files in folders that are not images, e.g. {self.skipped[0]})"
        rate = self.captioned / seconds
        decoding = f"; {self.decoding}" if self.decoding else ""
        return f"summary: {self.captioned} captioned, {self.failed} failed, {skipped}, {rate:.1f} images/s{decoding}"

    def close(self) -> int:
        """Print the summary on stderr (also after input that named no image: an empty folder or glob, empty
        standard input); the exit status: 1 when an input failed or nothing was captioned."""
        print(self.summary(), file=sys.stderr, flush=True)
        return 1 if self.failed or not self.captioned else 0
