"""Where a run starts: from scratch, resuming a run, or a new run from the model of another.

``ckpt_path`` resumes a run: weights, optimiser, schedule, epoch and callbacks continue from a Lightning
checkpoint (a run folder means its ``checkpoints/last.ckpt``). ``init_from`` starts a new run from the
model of another (a run folder means its ``bundle.pt``, the checkpoint that run selected; a ``.ckpt`` or
bundle file is taken as given): only the weights are loaded, epoch, optimiser and schedule start afresh.

A run resumes only a checkpoint written with its own objective (``model.objective``); a checkpoint of
the other objective cannot be resumed and is taken as ``init_from``, and so is a bundle by an SCST run (a
cross-entropy run refuses a bundle as ``ckpt_path``: it cannot be resumed, and ``init_from`` says the other). So
``python train.py experiment=demo_scst ckpt_path=<cross-entropy run>`` starts self-critical training from
the cross-entropy model, and ``ckpt_path=<that SCST run>`` resumes it.

Either way the run's network (its architecture, vocabulary and image size) is the checkpoint's (with
``init_vocab=grow`` a new run's vocabulary grows with the training words it lacks: ``vocab_grows``) and how it
trains (dropout, the hard-attention estimator and schedule, which stages train) is the run's config's:
``model_settings`` gives the config values that describe the network, and for a ``ckpt_path`` taken as
``init_from`` the run's config says so (``init_from`` set to it, ``ckpt_path`` null).

``plan_start`` decides all this from the top level of each file (never its weights), so preflight refuses a file
a run cannot start from before the run's folder exists; ``resolve_start`` then loads the model.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from captioner.config import ARCHITECTURE, InitVocab, Objective, TrainConfig, to_dict
from captioner.errors import BundleError, ConfigError
from captioner.run_files import BUNDLE_NAME, CHECKPOINT_DIR, LAST_CHECKPOINT, VOCAB_FILE

if TYPE_CHECKING:
    from captioner.bundle import TrainedModel

log = logging.getLogger(__name__)

DEFAULT_OBJECTIVE = Objective.cross_entropy  # what checkpoints written before model.objective existed trained
# What each key names, as a remedy says it (a bundle given as ckpt_path starts SCST only).
TAKES = {"ckpt_path": "a run folder or a .ckpt that train.py wrote", "init_from": "a run folder, a .ckpt or a bundle"}


class StartError(ConfigError):
    """A ``ckpt_path`` or ``init_from`` a run cannot start from: what is wrong (``what``) and what to give instead
    (``remedy``), which preflight lists as one of its problems."""

    def __init__(self, what: str, remedy: str) -> None:
        super().__init__(f"{what}; {remedy}")
        self.what = what
        self.remedy = remedy


@dataclass(frozen=True)
class Start:
    """How a run starts; all None: from scratch with the config's model."""

    resume: str | None = None  # the Lightning checkpoint that training resumes
    init: str | None = None  # the checkpoint or bundle whose weights a new run starts from
    model: TrainedModel | None = None  # the model of ``init`` or ``resume``
    init_from_ckpt_path: bool = False  # ``init`` is the config's ckpt_path, which cannot be resumed


def _checkpoint_file(path: str) -> Path:
    """``path``, or the ``checkpoints/last.ckpt`` of a run folder."""
    folder = Path(path)
    return folder / CHECKPOINT_DIR / LAST_CHECKPOINT if folder.is_dir() else folder


def _weights_file(path: str) -> str:
    """The file a new run takes its model from: a run folder's ``bundle.pt`` (else its ``last.ckpt``)."""
    folder = Path(path)
    if folder.is_dir() and (folder / BUNDLE_NAME).is_file():
        return str(folder / BUNDLE_NAME)
    return str(_checkpoint_file(path))


def resolve_start(ckpt_path: str | None, init_from: str | None, objective: str, scst_after_epochs: int) -> Start:
    """Decide how a run with ``model.objective=objective`` starts from ``ckpt_path`` and ``init_from``
    (``plan_start``) and load the model it starts from.

    Raises StartError as ``plan_start`` does, and BundleError for a model file that cannot be loaded.
    """
    start = plan_start(ckpt_path, init_from, objective, scst_after_epochs)
    source = start.init or start.resume
    if source is None:
        return start
    from captioner.bundle import load_trained

    if start.init_from_ckpt_path:
        log.info(
            "ckpt_path=%s was not written by a model.objective=%s run: a new run starts from its "
            "weights, as init_from=%s (the run's config says so)",
            ckpt_path,
            objective,
            start.init,
        )
    log.info(
        "%s %s, with its architecture, vocabulary and image size",
        "starting from the weights of" if start.init else "resuming",
        source,
    )
    return replace(start, model=load_trained(source))


def plan_start(ckpt_path: str | None, init_from: str | None, objective: str, scst_after_epochs: int) -> Start:
    """How a run with ``model.objective=objective`` starts from ``ckpt_path`` and ``init_from``, its model not
    loaded: each file's top level only is read (``bundle.peek_model_file``, whatever its size), so preflight
    refuses what a run cannot start from before the run's folder exists.

    Raises StartError for a run folder without the file it would read, a file that is neither a checkpoint nor a
    bundle of this project, a bundle given to resume a run, ``init_from`` beside a ``ckpt_path`` that cannot be
    resumed, and SCST with neither and no cross-entropy epochs first (``scst_after_epochs``: it fine-tunes a
    trained model).
    """
    from captioner.bundle import is_bundle

    resume = init = None
    from_ckpt_path = False
    if init_from is not None:
        init = _weights_file(init_from)
        _peek("init_from", init_from, Path(init))
    if ckpt_path is not None:
        ckpt = _checkpoint_file(ckpt_path)
        raw = _peek("ckpt_path", ckpt_path, ckpt)
        bundle = is_bundle(raw)
        if bundle and (objective != Objective.scst or scst_after_epochs > 0):  # a run that starts with cross-entropy
            raise StartError(
                f"ckpt_path={ckpt_path!r} is an inference bundle (weights for captioning, no optimiser or training "
                "state), which no run resumes",
                f"to resume a run give its folder or its {CHECKPOINT_DIR}/{LAST_CHECKPOINT}; to start a new run "
                f"from this bundle's weights give init_from={ckpt_path} instead",
            )
        if not bundle and (raw.get("hyper_parameters") or {}).get("objective", DEFAULT_OBJECTIVE) == objective:
            resume = str(ckpt)
        elif init is not None:
            raise StartError(
                f"ckpt_path={ckpt_path!r} cannot be resumed by a model.objective={objective} run "
                f"and would start it from its weights, as init_from={init_from!r} does",
                "give one of the two",
            )
        else:
            init, from_ckpt_path = _weights_file(ckpt_path), True
    if init is None and resume is None and objective == Objective.scst and scst_after_epochs == 0:
        raise StartError(
            "model.objective=scst fine-tunes a trained captioner",
            f"give ckpt_path=<a cross-entropy run folder, its checkpoint or {BUNDLE_NAME}>, or train with "
            "cross-entropy first in the same run (model.scst.after_epochs=N)",
        )
    return Start(resume=resume, init=init, init_from_ckpt_path=from_ckpt_path)


def _peek(key: str, given: str, file: Path) -> dict:
    """The top level of ``file``, the model file that ``key``'s value ``given`` names (a run folder names a file
    in it); StartError when it is not there or is no bundle or checkpoint of this project."""
    from captioner.bundle import peek_model_file

    folder = Path(given)
    if folder.is_dir() and not file.is_file():
        if key == "init_from":
            raise StartError(
                f"init_from={given!r} is a folder with neither {BUNDLE_NAME} nor {CHECKPOINT_DIR}/{LAST_CHECKPOINT}",
                "give the folder of a run that saved a checkpoint, a .ckpt or a bundle",
            )
        instead = (
            f"; to start a new run from its {BUNDLE_NAME} give init_from={given} instead"
            if (folder / BUNDLE_NAME).is_file()
            else ""
        )
        raise StartError(
            f"ckpt_path={given!r} is a folder without {CHECKPOINT_DIR}/{LAST_CHECKPOINT}, the checkpoint a run "
            "resumes from (a run saves it as it trains)",
            f"give the folder of a run that saved one, or one of its .ckpt files{instead}",
        )
    try:
        return peek_model_file(file, "checkpoint" if key == "ckpt_path" else "model file")
    except BundleError as exc:
        raise StartError(f"{key}={given!r}: {exc}", f"give {TAKES[key]}") from None


def model_settings(start: Start, config: dict[str, Any], output_dir: Path) -> dict[str, Any]:
    """The config values (dotted keys -> value) that make the network of ``start.model`` the run's.

    Its architecture (``ARCHITECTURE``: what its weights fit) and image size, and its vocabulary, written to
    ``<output_dir>/vocab.json`` for ``data.vocab_file``; for a ``ckpt_path`` taken as ``init_from``,
    ``init_from`` (and ``ckpt_path`` null). How the run trains (dropout, the hard-attention estimator and its
    schedule, which stages train, ...) stays the run's config's. Both kinds of value where the config
    (``config``, composed and plain) and the checkpoint differ are logged, each with the other's value.
    """
    model = start.model
    net = to_dict(model.config)
    vocab_file = Path(output_dir) / VOCAB_FILE
    model.vocab.save(vocab_file)
    settings = {f"model.{key}": _at(net, key) for key in ARCHITECTURE}
    settings.update({"data.image_size": model.image_size, "data.vocab_file": str(vocab_file)})
    taken = [f"{key}={_text(value)} (the config's: {_text(_at(config, key))})"
             for key, value in settings.items() if _at(config, key) != value]  # fmt: skip
    kept = [
        f"model.{key}={_text(value)} (the checkpoint's: {_text(_at(net, key))})"
        for key in _leaf_keys(net)
        if key not in ARCHITECTURE and (value := _at(config, f"model.{key}")) is not None and value != _at(net, key)
    ]
    if start.init_from_ckpt_path:
        settings.update({"ckpt_path": None, "init_from": start.init})
        taken += [f"ckpt_path=null, init_from={start.init}"]
    if taken:
        log.info("from the checkpoint (the network it trained), not the config: %s", ", ".join(taken))
    if kept:
        log.info("from the config (how this run trains), not the checkpoint: %s", ", ".join(kept))
    return settings


def vocab_grows(start: Start, settings: TrainConfig) -> bool:
    """Whether the vocabulary of the model the run starts from grows with the training words (``init_vocab=grow``
    with ``init_from``, or a ``ckpt_path`` taken as it). ConfigError for a run that resumes: its vocabulary is its
    checkpoint's (one without ``init_from`` or ``ckpt_path`` is refused by ``TrainConfig.check``)."""
    if settings.init_vocab is not InitVocab.grow:
        return False
    if start.init is None:
        raise ConfigError(
            "init_vocab=grow grows the vocabulary of the model a new run starts from (init_from); "
            f"ckpt_path={settings.ckpt_path} resumes a run, whose vocabulary is its checkpoint's: leave init_vocab=keep"
        )
    return True


def _at(values: Any, key: str) -> Any:
    """The value at the dotted ``key`` of nested mappings ``values``; None where there is none."""
    for part in key.split("."):
        values = values.get(part) if isinstance(values, dict) else None
    return values


def _leaf_keys(values: dict[str, Any], prefix: str = "") -> list[str]:
    """The dotted keys of the values (not mappings) of nested mappings, in their order."""
    keys = []
    for key, value in values.items():
        keys += _leaf_keys(value, f"{prefix}{key}.") if isinstance(value, dict) else [f"{prefix}{key}"]
    return keys


def _text(value: Any) -> str:
    """A config value as the command line writes it."""
    return "null" if value is None else str(value)
