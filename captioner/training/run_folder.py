"""A Hydra callback that gives every run a folder of its own before Hydra writes anything into it.

Run folders are named by the second the run starts (``conf/hydra/default.yaml``), so two runs started in
the same second, or a ``hydra.run.dir`` that names an earlier run, would share a folder: the second run
would rewrite the first one's ``.hydra/`` files, metrics, bundle and checkpoints. ``NewRunFolder``
creates the folder first (``fileio.new_folder``): when it already exists the run goes to ``<dir>_1``,
``<dir>_2``, ... instead. The DDP worker processes that Lightning starts (``LOCAL_RANK`` > 0) and the
non-zero ranks of an external launcher reuse the folder of the process that started the run.
"""

from __future__ import annotations

import json
import os
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, read_write

from captioner.fileio import new_folder

RANK_VARIABLES = ("RANK", "LOCAL_RANK", "NODE_RANK", "SLURM_PROCID")


class NewRunFolder(Callback):
    """Point ``hydra.run.dir`` (``hydra.sweep.dir`` for ``-m``) at a folder this run has just created."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        """Claim the run folder."""
        _claim(config, "run")

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        """Claim the sweep folder (each job gets a numbered subfolder inside it)."""
        _claim(config, "sweep")


def _claim(config: DictConfig, mode: str) -> None:
    """Replace ``hydra.<mode>.dir`` by a newly created folder, in the process that starts the run only.

    The folder is also added to Hydra's own overrides, from which each job of a sweep is composed again.
    """
    if any(os.environ.get(name, "0") != "0" for name in RANK_VARIABLES):
        return
    HydraConfig.instance().set_config(config)  # resolves ${hydra:...} and ${now:...} in the folder name
    folder = new_folder(config.hydra[mode].dir)
    with read_write(config.hydra):
        config.hydra[mode].dir = str(folder)
        config.hydra.overrides.hydra.append(f"hydra.{mode}.dir={json.dumps(str(folder))}")
