"""``python train.py --help``: every setting of ``captioner.config`` with its default, comment and valid range,
read from the dataclasses themselves, and the config groups a user chooses from (internal ones hidden)."""

from __future__ import annotations

import ast
import dataclasses
import enum
import inspect
import textwrap
import typing
from typing import Any

from captioner.config import TrainConfig
from train_errors import group_options, groups

USAGE = """usage: python train.py [GROUP=OPTION ...] [KEY=VALUE ...] [+KEY=VALUE ...] [-m] [--cfg job] [--hydra-help]

    python train.py                                    the built-in demo on the CPU, a few minutes
    python train.py experiment=coco_soft               the paper's COCO recipe (see docs/datasets.md)
    python train.py experiment=coco_soft --cfg job     print the composed config, run nothing
    python train.py model.decoder.dropout=0.2 -m model=soft,hard   a sweep

Lightning's own settings (trainer.*, callbacks.*, logger.*) are those of conf/trainer, conf/callbacks and
conf/logger; --hydra-help shows Hydra's own page."""


def _comments(cls: type) -> dict[str, str]:
    """The comment of each field of ``cls``: the one at the end of its line, after those on the lines above it."""
    lines = inspect.getsource(cls).splitlines()
    comments: dict[str, str] = {}
    above: list[str] = []
    for line in lines:
        text = line.strip()
        if text.startswith("#"):
            above.append(text.lstrip("# "))
            continue
        name, colon, rest = text.partition(":")
        if colon and name.isidentifier() and not text.startswith(("def ", "class ")):
            after = rest.partition("  # ")[2]
            comments[name] = "; ".join(part for part in (" ".join(above), after) if part)
        above = []
    return comments


def _ranges(cls: type) -> dict[str, str]:
    """The range ``check`` tests for each field of ``cls`` (its ``check_range`` calls: ``>= 1``, ``in [0, 1]``)."""
    if "check" not in vars(cls):
        return {}
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls.check)))
    ranges: dict[str, str] = {}

    def visit(node: ast.AST, names: list[str] | None) -> None:
        if isinstance(node, ast.For) and isinstance(node.iter, ast.Tuple):
            loop = [item.value for item in node.iter.elts if isinstance(item, ast.Constant)]
            for child in node.body:
                visit(child, loop)
            return
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "check_range":
            first = node.args[0]
            fields = [first.value] if isinstance(first, ast.Constant) else (names or [])
            bounds = [ast.unparse(arg) for arg in node.args[2:4]]
            low, high = (bounds + ["None", "None"])[:2]
            low, high = (None if b == "None" else b.replace("self.", "") for b in (low, high))
            text = f">= {low}" if high is None else (f"<= {high}" if low is None else f"in [{low}, {high}]")
            for field in fields:
                ranges[field] = text
        for child in ast.iter_child_nodes(node):
            visit(child, names)

    visit(tree, None)
    return ranges


def _value(value: Any) -> str:
    """A default as a user writes it in an override."""
    if isinstance(value, enum.Enum):
        return value.value
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def _settings(cls: type, prefix: str) -> list[str]:
    """One line per setting of ``cls`` (nested settings under their key): ``key=default  range; comment``."""
    hints = typing.get_type_hints(cls)
    comments, ranges = {}, {}
    for klass in reversed(cls.__mro__):
        if dataclasses.is_dataclass(klass):
            comments.update(_comments(klass))
            ranges.update(_ranges(klass))
    lines = []
    for item in dataclasses.fields(cls):
        if item.name == "_target_" or hints[item.name] is Any:
            continue
        kind = hints[item.name]
        key = f"{prefix}{item.name}"
        if dataclasses.is_dataclass(kind):
            lines.append(f"  {key}.*  {comments.get(item.name, '')}".rstrip())
            lines += _settings(kind, f"{key}.")
            continue
        default = item.default if item.default is not dataclasses.MISSING else item.default_factory()
        notes = []
        if isinstance(kind, type) and issubclass(kind, enum.Enum):
            notes.append("one of: " + ", ".join(kind.__members__))
        if item.name in ranges:
            notes.append(ranges[item.name])
        if comments.get(item.name):
            notes.append(comments[item.name])
        lines.append(f"  {key}={_value(default)}" + (f"  ({'; '.join(notes)})" if notes else ""))
    return lines


def help_page() -> str:
    """The text of ``python train.py --help``."""
    choices = [f"  {group}: {', '.join(group_options(group))}" for group in groups()]
    settings = _settings(TrainConfig, "")
    return "\n".join(
        [
            USAGE,
            "",
            "config groups (GROUP=OPTION; conf/GROUP/OPTION.yaml):",
            *choices,
            "",
            "settings (KEY=VALUE; the defaults of captioner/config.py, which data, model and experiment options "
            "change; --cfg job shows the composed values):",
            *settings,
        ]
    )
