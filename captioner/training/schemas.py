"""The settings dataclasses of ``captioner.config`` as the schemas of the Hydra configs in ``conf/``."""

from __future__ import annotations

import dataclasses
import enum

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from captioner.config import SCHEMAS, ShapesSpec


def register_schemas() -> None:
    """Store each schema as ``<name>_schema`` (``conf/config.yaml`` reads ``train_schema``, the groups theirs),
    and the built-in dataset's source as ``shapes_source_schema``: ``ShapesSource`` with ``ShapesSpec``'s
    fields and defaults, its kind of scenes by name (``conf/data/shapes.yaml`` sets its root only,
    ``conf/data/scenes.yaml`` the cluttered scenes).

    Stored outside any group, so that ``python train.py --help`` lists only the groups a user selects.
    Storing again replaces the same node, so any number of calls is one registration.
    """
    store = ConfigStore.instance()
    for name, schema in SCHEMAS.items():
        store.store(name=f"{name}_schema", node=schema)
    spec = {k: v.value if isinstance(v, enum.Enum) else v for k, v in dataclasses.asdict(ShapesSpec()).items()}
    source = {"_target_": "captioner.data.sources.ShapesSource", "root": MISSING, **spec}
    store.store(name="shapes_source_schema", node=source)
