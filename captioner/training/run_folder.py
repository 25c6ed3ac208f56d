"""A training run's folder: created new for every run, holding the composed config, marked when the run fails.

A Hydra callback gives every run a folder of its own before Hydra writes anything into it.

Run folders are named by the second the run starts (``conf/hydra/default.yaml``), so two runs started in
the same second, or a ``hydra.run.dir`` that names an earlier run, would share a folder: the second run
would rewrite the first one's ``.hydra/`` files, metrics, bundle and checkpoints. ``NewRunFolder``
creates the folder first (``fileio.new_folder``): when it already exists the run goes to ``<dir>_1``,
``<dir>_2``, ... instead (``hydra.run.dir=DIR`` chooses ``<dir>``; ``paths.output_dir``, which names the folder
to the run, is refused when given: it would bypass this). The DDP worker processes that Lightning starts
(``LOCAL_RANK`` > 0) and the non-zero ranks of an external launcher reuse the folder of the process that started
the run.

The run prints its composed config as a tree and saves it (resolved) as ``config.yaml``; a run that fails
writes its one-line error into its log file and into ``FAILED``, so a failed run's folder says so, and a run
stopped by a signal (Ctrl-C, SIGTERM) writes how to resume it into its log file and into ``STOPPED``.

A sweep (``-m``) gets a folder of its own the same way, each job a numbered folder inside it
(``conf/hydra/default.yaml``). A job that fails is marked so and the sweep goes on with the others, wherever
the launcher runs them (``conf/hydra/launcher``: one after another in the sweep's process, or each in a
process of its own); when the sweep ends, its process ends with every failed or stopped job's line
(``JobsFailed``).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, read_write

from captioner.fileio import atomic_write, new_folder
from captioner.run_files import CONFIG_FILE, FAILED_FILE, STOPPED_FILE

RANK_VARIABLES = ("RANK", "LOCAL_RANK", "NODE_RANK", "SLURM_PROCID")
TREE_ORDER = ("data", "model", "trainer", "callbacks", "logger", "paths")  # printed first, in this order

log = logging.getLogger("train")


def first_process() -> bool:
    """True in the process that started the run (not a DDP worker or a non-zero rank of a launcher)."""
    return all(os.environ.get(name, "0") == "0" for name in RANK_VARIABLES)


class NewRunFolder(Callback):
    """Point ``hydra.run.dir`` (``hydra.sweep.dir`` for ``-m``) at a folder this run has just created."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        """Claim the run folder."""
        _claim(config, "run")

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        """Claim the sweep folder (each job gets a numbered subfolder inside it)."""
        _claim(config, "sweep")

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        """Say which jobs of the sweep failed or were stopped (their folders, on stdout) and raise JobsFailed with
        their lines (a stopped job's: how to resume it)."""
        if not first_process():
            return
        sweep = Path(config.hydra.sweep.dir)
        markers = [*sweep.glob(f"*/{FAILED_FILE}"), *sweep.glob(f"*/{STOPPED_FILE}")]
        ended = sorted(markers, key=lambda p: (len(p.parent.name), p.parent.name))  # by job number: 10 after 9
        for marker in ended:
            how = "failed" if marker.name == FAILED_FILE else "was stopped"
            print(f"job {marker.parent.name} of the sweep {how}: {marker}", flush=True)
        if ended:
            raise JobsFailed("".join(marker.read_text() for marker in ended))


class JobsFailed(SystemExit):
    """Jobs of a sweep failed or were stopped: their lines (each job's ``FAILED`` or ``STOPPED``, in job order),
    carried past Hydra, which turns a callback's Exception into a warning; ``train.py`` prints them. A SystemExit
    with status 2."""

    def __init__(self, message: str) -> None:
        super().__init__(2)
        self.message = message


def _claim(config: DictConfig, mode: str) -> None:
    """Replace ``hydra.<mode>.dir`` by a newly created folder, in the process that starts the run only.

    The folder is also added to Hydra's own overrides, from which each job of a sweep is composed again.
    """
    if not first_process():
        return
    HydraConfig.instance().set_config(config)  # resolves ${hydra:...} and ${now:...} in the folder name
    folder = new_folder(config.hydra[mode].dir)
    with read_write(config.hydra):
        config.hydra[mode].dir = str(folder)
        config.hydra.overrides.hydra.append(f"hydra.{mode}.dir={json.dumps(str(folder))}")


def _ordered(config: Mapping[str, Any]) -> dict[str, Any]:
    """The config's sections in ``TREE_ORDER``, then the rest in their own order."""
    return {
        **{key: config[key] for key in TREE_ORDER if key in config},
        **{key: value for key, value in config.items() if key not in TREE_ORDER},
    }


def print_config_tree(config: Mapping[str, Any], folder: str | os.PathLike) -> None:
    """Print the resolved config ``config`` (plain data) as a tree and save it as ``folder/config.yaml``.

    The tree is drawn with rich when it is installed (one branch per section, as the Lightning-Hydra
    template does), else printed as YAML under a heading. Only the first process of a run does either.
    """
    if not first_process():
        return
    ordered = _ordered(config)
    text = OmegaConf.to_yaml(ordered)
    with atomic_write(Path(folder) / CONFIG_FILE, "w") as handle:
        handle.write(text)
    print(f"config (saved as {Path(folder) / CONFIG_FILE}):", flush=True)
    if importlib.util.find_spec("rich") is None:
        print(text, flush=True)
        return
    import rich
    from rich.syntax import Syntax
    from rich.tree import Tree

    tree = Tree("config")
    for key, value in ordered.items():
        if isinstance(value, (dict, list)):
            tree.add(key).add(Syntax(OmegaConf.to_yaml(value).rstrip("\n"), "yaml", word_wrap=True))
        else:
            tree.add(OmegaConf.to_yaml({key: value}).rstrip("\n"))
    rich.print(tree)


def mark_failed(folder: str | os.PathLike, message: str) -> None:
    """Record that the run in ``folder`` failed: ``message`` (one line) into its log files and ``FAILED``.

    Only the log files get the line (the console has it on stderr already). Only the first process of a
    run writes.
    """
    _mark(folder, FAILED_FILE, "failed", message)


def mark_stopped(folder: str | os.PathLike, message: str) -> None:
    """Record that the run in ``folder`` was stopped by a signal (Ctrl-C, SIGTERM), as ``mark_failed`` records a
    failure: ``message`` (one line: how to resume it) into its log files and ``STOPPED``. A stopped run has not
    failed: it resumes from its last checkpoint."""
    _mark(folder, STOPPED_FILE, "stopped", message)


def _mark(folder: str | os.PathLike, marker: str, how: str, message: str) -> None:
    """``message`` into the log files (``run <how>: <message>``) and the file ``marker`` of the run in ``folder``,
    by the first process of the run only."""
    if not first_process():
        return
    record = log.makeRecord(log.name, logging.ERROR, __file__, 0, f"run {how}: %s", (message,), None)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)
    with atomic_write(Path(folder) / marker, "w") as handle:
        handle.write(message + "\n")
