"""User-facing errors: each one prints as a single clear line, never a traceback."""


class CaptionerError(Exception):
    """An error caused by the user's input (a file, a config value, an argument).

    Entry points (``train.py``, ``captioner`` CLI) catch it, print ``error: <message>`` on stderr
    and exit with status 2. The message must name the file or key and say what is wrong.
    """


class ConfigError(CaptionerError, ValueError):
    """A configuration value or command-line argument is invalid.

    Also a ``ValueError``, so code that calls the API with a bad argument catches it as it would
    torchvision's or torch's own argument errors.
    """


class DataError(CaptionerError):
    """An annotation file, split file or image is missing or malformed."""


class DataProblems(DataError):
    """Every problem found in one input file at once (a user's captions file): the message is ``heading``, then
    one line each (at most ``MAX_LISTED``, then how many more); training's preflight lists ``problems`` one by one,
    each with ``remedy``."""

    MAX_LISTED = 100  # lines of the message at most: a file broken on every row still says what is wrong in a page

    def __init__(self, heading: str, problems: list[str], remedy: str) -> None:
        listed = problems[: self.MAX_LISTED]
        more = len(problems) - len(listed)
        tail = [f"... and {more:,} more"] if more else []
        super().__init__("\n".join([heading, *listed, *tail]))
        self.problems = problems
        self.remedy = remedy


class DownloadError(CaptionerError):
    """A file the config names could not be downloaded (no network, an HTTP error, a truncated or altered file);
    the message says why, the caller where the file goes."""


class BundleError(CaptionerError):
    """A checkpoint or inference bundle cannot be loaded safely or does not match."""


class RunStopped(Exception):
    """A training run stopped by a signal before it finished; the message says how to resume it.

    Not a user error: ``train.py`` prints the message and exits with ``status`` (128 + the signal's
    number, as a shell reports a process the signal ended), so a scheduler can tell it from a finished run.
    """

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.status = 128 + signum


def first_line(exc: BaseException, first_sentence: bool = False, with_type: bool = False) -> str:
    """The first line of ``exc``'s message, to report it in one line; the name of its type when it has none.

    ``with_type`` puts the type's name in front (``"RuntimeError: CUDA out of memory."``);
    ``first_sentence`` also cuts the line at its first ". " (torch's load errors go on with advice).
    """
    text = str(exc).strip()
    if first_sentence:
        text = text.split(". ")[0]
    if not text:
        return type(exc).__name__
    line = text.splitlines()[0]
    return f"{type(exc).__name__}: {line}" if with_type else line


def check_choice(name: str, value: object, choices: "tuple | list") -> None:
    """Raise ConfigError unless ``value`` is one of ``choices`` (the message lists them)."""
    if value not in choices:
        valid = ", ".join(str(c) for c in choices)
        raise ConfigError(f"{name}={value!r} is not valid; choose one of: {valid}")


def check_range(
    name: str, value: object, low: float | None = None, high: float | None = None, kind: type | tuple = (int, float)
) -> None:
    """Raise ConfigError unless ``value`` has type ``kind`` and lies in [low, high] (NaN lies nowhere)."""
    if isinstance(value, bool) or not isinstance(value, kind):
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise ConfigError(f"{name}={value!r} must be {'an' if names[0] in 'aeiou' else 'a'} {names}")
    if value != value or (low is not None and value < low) or (high is not None and value > high):
        bounds = f">= {low}" if high is None else (f"<= {high}" if low is None else f"in [{low}, {high}]")
        raise ConfigError(f"{name}={value!r} must be {bounds}")


def stop_reason(exc: BaseException) -> str | None:
    """One line for an exception that ends a run (None for a clean ``SystemExit``)."""
    if isinstance(exc, SystemExit):
        return None if exc.code in (0, None) else f"stopped with exit status {exc.code}"
    return first_line(exc, with_type=True)
