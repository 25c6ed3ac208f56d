"""What ``python train.py`` prints itself: a config that cannot be composed or used as one line ``error: ...``
naming the key, the valid keys or values and the nearest match (Hydra's, OmegaConf's and the instantiated classes'
errors), and its ``--help`` page: every setting of ``captioner.config`` with its default, comment and valid range,
read from the dataclasses themselves, and the config groups a user chooses from (internal ones hidden)."""

from __future__ import annotations

import ast
import dataclasses
import difflib
import enum
import inspect
import re
import sys
import textwrap
import typing
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException, ValidationError

from captioner.config import Compile, TrainConfig
from captioner.errors import CaptionerError, ConfigError, first_line

# The start of a message about a key: ``encoder.weights='x' ...`` or ``decoder.foo is not a known key``.
_KEY = re.compile(r"[A-Za-z_][\w.]*(=| is )")
_CONSTANT = re.compile(r"\b[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+\b")  # MAX_CELLS, CAPTIONING_METHOD: named in comments
CONF = Path(__file__).resolve().parents[2] / "conf"
# Settings typed Any for Hydra whose values are an enum's (model.compile: Hydra reads `off` as false).
ANY_CHOICES: dict[str, type[enum.Enum]] = {"compile": Compile}
# Options that other options of their group start from, never chosen themselves: hidden from the choices.
INTERNAL_OPTIONS = {"data": ("base",), "model": ("base",), "trainer": ("default",)}


def group_options(group: str) -> list[str]:
    """The options a user may choose in config group ``group`` (``conf/<group>/*.yaml``, internal ones left out)."""
    hidden = INTERNAL_OPTIONS.get(group, ())
    return sorted(p.stem for p in (CONF / group).glob("*.yaml") if p.stem not in hidden)


def groups() -> list[str]:
    """The config groups a user selects (``conf/<group>/``; Hydra's own settings left out)."""
    return sorted(p.name for p in CONF.iterdir() if p.is_dir() and p.name != "hydra")


def nearest(word: str, choices: Iterable[str], prefix: str = "") -> str:
    """``"; did you mean <prefix>X?"`` for the choice X closest to ``word``, or "" when none is close."""
    match = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f"; did you mean {prefix}{match[0]}?" if match else ""


def refused_override(overrides: Sequence[str]) -> str | None:
    """The error line for a command-line override that chooses an internal option (``data=base``), or None."""
    for override in overrides:
        group, _, option = override.lstrip("+~").partition("=")
        if option in INTERNAL_OPTIONS.get(group, ()):
            return f"{group}={option} is not an option of its own (the others start from it); choose one of: " + (
                ", ".join(group_options(group))
            )
    return None


def _unknown_key(exc: ConfigKeyError | ConfigAttributeError, schema: type | None) -> str:
    """``trainer.foo is not a known key; valid keys: ...; did you mean ...?`` from the node the key was looked up
    in (its schema's fields, or the keys it holds), with the config groups at the top level."""
    parent = getattr(exc, "parent_node", None)
    if schema is not None:
        keys = [f.name for f in dataclasses.fields(schema)]
    else:
        keys = list(parent.keys()) if parent is not None else []
    keys = [key for key in keys if key not in ("_target_", "hydra")]
    if "." not in exc.full_key:
        keys = sorted({*keys, *groups()})
    prefix = exc.full_key.rpartition(".")[0]
    match = nearest(str(exc.key), keys, f"{prefix}." if prefix else "")
    line = f"{exc.full_key} is not a known key; valid keys: {', '.join(keys)}{match}"
    if schema is None and prefix:
        line += f" (a key the config does not set is added with +{exc.full_key}=VALUE)"
    return line


def error_line(exc: BaseException) -> str:
    """A Hydra or OmegaConf error (an unknown key or option, a bad override or value) as one line, from the
    exception's type and fields; a CaptionerError that Hydra wrapped as its own message."""
    if isinstance(exc, CaptionerError):
        return str(exc)
    if isinstance(exc.__cause__, CaptionerError):
        return str(exc.__cause__)
    schema = exc.object_type if dataclasses.is_dataclass(getattr(exc, "object_type", None)) else None
    if isinstance(exc, (ConfigKeyError, ConfigAttributeError)) and exc.full_key:
        return _unknown_key(exc, schema)
    if isinstance(exc, ValidationError) and schema is not None and exc.key in typing.get_type_hints(schema):
        kind = typing.get_type_hints(schema)[exc.key]
        if isinstance(kind, type) and issubclass(kind, enum.Enum):
            return f"{exc.full_key}={exc.value!r} is not valid; choose one of: {', '.join(kind.__members__)}"
        if kind is bool:
            return f"{exc.full_key}={exc.value!r} must be true or false"
        name = {int: "an int", float: "a float", str: "a string"}.get(kind, getattr(kind, "__name__", kind))
        return f"{exc.full_key}={exc.value!r} must be {name}"
    if isinstance(exc, OmegaConfBaseException):
        return f"{exc.full_key}: {first_line(exc)}" if exc.full_key else first_line(exc)
    if isinstance(exc, MissingConfigException):
        group, _, option = exc.missing_cfg_file.rpartition("/")
        choices = [o for o in exc.options or () if o not in INTERNAL_OPTIONS.get(group, ())]
        if not choices:
            return f"no config {exc.missing_cfg_file!r}"
        return f"{group}={option} is not an option; choose one of: {', '.join(choices)}{nearest(option, choices)}"
    if isinstance(exc, OverrideParseException):
        if "=" not in exc.override:
            key = exc.override.lstrip("+~")
            return f"the override {exc.override!r} has no value: write {key}=VALUE (or ~{key} to remove the key)"
        return f"cannot parse the override {exc.override!r}: {first_line(exc)}"
    if isinstance(exc, ConfigCompositionException):  # Hydra raises it while handling OmegaConf's error
        cause = exc.__cause__ or exc.__context__
        if isinstance(cause, OmegaConfBaseException):
            return error_line(cause)
    return first_line(exc)


def section_error(section: str, error: BaseException, message: str) -> ConfigError:
    """The ConfigError for an object of config ``section`` that could not be built: ``error`` said ``message``.

    This project's own messages start with the key they are about: a key inside ``section``
    (``encoder.weights=...`` of ``model``) gets the section in front, one that already names it is kept; any
    other message (Lightning's, a class's TypeError, one of ours about no key) follows ``section: ``.
    """
    if isinstance(error, CaptionerError) and message.startswith(f"{section}."):
        return ConfigError(message)
    if isinstance(error, CaptionerError) and _KEY.match(message):
        return ConfigError(f"{section}.{message}")
    return ConfigError(f"{section}: {message}")


USAGE = """usage: python train.py [GROUP=OPTION ...] [KEY=VALUE ...] [+KEY=VALUE ...] [-m] [--cfg job [--resolve]]
                       [--hydra-help]

    python train.py                                    the built-in demo: about 5 minutes on 2 CPU cores
    python train.py experiment=coco_soft               the paper's COCO recipe (see docs/datasets.md)
    python train.py experiment=coco_soft --cfg job --resolve   print the composed config, run nothing
    python train.py model.decoder.dropout=0.2 -m model=soft,hard   a sweep
    python train.py -m hydra/launcher=slurm hydra.launcher.partition=gpu model=soft,hard   a sweep of SLURM jobs

--cfg job prints the config as conf/ writes it, interpolations such as ${paths.output_dir} unresolved; with
--resolve, their values (paths.output_dir, the run's folder, is null there: a run makes it when it starts).
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
            before, after = " ".join(above), rest.partition("  # ")[2]
            if before.endswith(".") and after:  # a sentence above, then the line's own comment: two sentences
                after = after[0].upper() + after[1:]
            comments[name] = (" " if before.endswith(".") else "; ").join(part for part in (before, after) if part)
        above = []
    return comments


def _constants(text: str, cls: type) -> str:
    """``text`` with each constant it names (``MAX_CELLS``) of the module of ``cls`` or of a base class's (where an
    inherited field's comment or range was written) replaced by its value: a user reading ``--help`` sees the number,
    and the number stays written in one place."""
    names = {
        key: value for klass in reversed(cls.__mro__) for key, value in vars(sys.modules[klass.__module__]).items()
    }

    def value(match: re.Match) -> str:
        found = names.get(match.group())
        if isinstance(found, enum.Enum):
            return str(found.value)
        return str(found) if isinstance(found, (int, float, str)) and not isinstance(found, bool) else match.group()

    return _CONSTANT.sub(value, text)


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


def _settings(cls: type, prefix: str, chosen: dict[str, list[str]] | None = None) -> list[str]:
    """One line per setting of ``cls`` (nested settings under their key): ``key=default  range; comment``; a
    setting that a config group fills (``trainer``) shows the options ``chosen`` for it (``group_defaults``)."""
    hints = typing.get_type_hints(cls)
    comments, ranges = {}, {}
    for klass in reversed(cls.__mro__):
        if dataclasses.is_dataclass(klass):
            comments.update(_comments(klass))
            ranges.update(_ranges(klass))
    lines = []
    for item in dataclasses.fields(cls):
        kind = hints[item.name]
        key = f"{prefix}{item.name}"
        if item.name == "_target_":
            continue
        if key == "data.source":
            lines += _source_settings(comments.get(item.name, ""))
            continue
        if kind is Any and item.name in ANY_CHOICES:  # typed Any for Hydra, its values an enum's
            kind = ANY_CHOICES[item.name]
        if dataclasses.is_dataclass(kind):
            lines.append(f"  {key}.*  {comments.get(item.name, '')}".rstrip())
            lines += _settings(kind, f"{key}.")
            continue
        if chosen is not None and key in chosen:  # filled by its config group, not by the dataclass
            several = len(chosen[key]) > 1  # a list of options (logger=[csv,tensorboard])
            group = f"{'a list of' if several else 'one of'}: {', '.join(group_options(key))}"
            notes = "; ".join(part for part in (group, comments.get(item.name), f"its keys: {key}.KEY=VALUE") if part)
            lines.append(f"  {key}={_group_value(chosen[key])}  ({notes})")
            continue
        default = item.default if item.default is not dataclasses.MISSING else item.default_factory()
        notes = []
        if isinstance(kind, type) and issubclass(kind, enum.Enum):
            notes.append("one of: " + ", ".join(member.value for member in kind))  # as an override writes it
        if item.name in ranges:
            notes.append(_constants(ranges[item.name], cls))
        if comments.get(item.name):
            notes.append(_constants(comments[item.name], cls))
        lines.append(f"  {key}={_value(default)}" + (f"  ({'; '.join(notes)})" if notes else ""))
    return lines


def _source_settings(comment: str) -> list[str]:
    """The ``data.source.*`` keys, by the source class each ``data=`` option builds (``conf/data/*.yaml``): the
    built-in set's generator (``ShapesSpec``, its defaults), a captions file's reading (``CaptionsSpec``, after the
    keys its config writes), the others' keys as their configs write them."""
    from omegaconf import OmegaConf

    from captioner.config import CaptionsSpec, ShapesSpec

    by_class: dict[str, list[str]] = {}
    keys: dict[str, list[str]] = {}
    for option in group_options("data"):
        node = OmegaConf.load(CONF / "data" / f"{option}.yaml")
        source = OmegaConf.to_container(node.get("source") or {}, resolve=False)
        name = source.get("_target_", "ShapesSource").rpartition(".")[2]  # shapes, scenes: shapes_source_schema
        by_class.setdefault(name, []).append(option)
        keys.setdefault(name, _source_keys(source, "data.source."))
    lines = [f"  data.source.*  ({comment}; by data=: " + "; ".join(
        f"{', '.join(options)}: {name}" for name, options in by_class.items()) + ")"]  # fmt: skip
    for name, options in by_class.items():
        if name == "ShapesSource":
            lines.append(
                f"  data.source.root  ({name}; data={', '.join(options)}: the set's folder, generated there on first "
                "use; the keys below are its generator's, ShapesSpec, with the demo's defaults)"
            )
            lines += _settings(ShapesSpec, "data.source.")
        else:
            lines += [f"  {key}  ({name}; data={', '.join(options)})" for key in keys[name]]
        if name == "CaptionsSource":
            lines += _settings(CaptionsSpec, "data.source.")
    return lines


def _source_keys(node: dict[str, Any], prefix: str) -> list[str]:
    """The dotted keys of a ``data.source`` node's values (``_target_`` left out), each split written <split>."""
    found = []
    for key, value in node.items():
        name = "<split>" if prefix.endswith(".splits.") else key
        if isinstance(value, dict):
            found += [k for k in _source_keys(value, f"{prefix}{name}.") if k not in found]
        elif key != "_target_":
            found.append(f"{prefix}{name}")
    return found


def group_defaults() -> dict[str, list[str]]:
    """The options of each config group that ``python train.py`` composes when the command line names none:
    conf/config.yaml's defaults list, with the overrides of the experiment it names (``override /trainer:
    cpu``); a group that holds a list (``logger: [csv, tensorboard]``) several, one set to null none."""
    from omegaconf import OmegaConf

    def entries(path: Path) -> dict[str, Any]:
        listed = OmegaConf.to_container(OmegaConf.load(path)).get("defaults", [])
        return {key: value for entry in listed if isinstance(entry, dict) for key, value in entry.items()}

    chosen = entries(CONF / "config.yaml")
    if chosen.get("experiment"):
        for key, value in entries(CONF / "experiment" / f"{chosen['experiment']}.yaml").items():
            if key.startswith("override /"):
                chosen[key.removeprefix("override /")] = value
    selectable = groups()  # Hydra's own groups (hydra: default) left out
    listed = {
        group: value if isinstance(value, list) else [] if value is None else [value] for group, value in chosen.items()
    }
    return {group: options for group, options in listed.items() if group in selectable}


def _group_value(options: list[str]) -> str:
    """A group's options as an override chooses them: ``cpu``, ``[csv,tensorboard]``, ``null``."""
    return "null" if not options else options[0] if len(options) == 1 else f"[{','.join(options)}]"


def help_page() -> str:
    """The text of ``python train.py --help``."""
    chosen = group_defaults()
    choices = []
    for group in groups():
        marked = [f"{option}*" if option in chosen.get(group, []) else option for option in group_options(group)]
        several = f"  (several at once: {group}=[a,b])" if len(chosen.get(group, [])) > 1 else ""
        none = "  (none by default)" if not chosen.get(group) else ""
        choices.append(f"  {group}: {', '.join(marked)}{several}{none}")
    settings = _settings(TrainConfig, "", chosen)
    return "\n".join(
        [
            USAGE,
            "",
            "config groups (GROUP=OPTION; conf/GROUP/OPTION.yaml; * what python train.py composes, its experiment's",
            "choices included):",
            *choices,
            "",
            "settings (KEY=VALUE; the defaults of captioner/config/ (a package of dataclasses, one module per "
            "concern), which data, model and experiment options change; --cfg job --resolve shows the composed "
            "values):",
            *settings,
        ]
    )
