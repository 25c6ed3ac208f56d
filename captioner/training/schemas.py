"""The settings dataclasses of ``captioner.config`` as the schemas of the Hydra configs in ``conf/``."""

from __future__ import annotations

from hydra.core.config_store import ConfigStore

from captioner.config import SCHEMAS


def register_schemas() -> None:
    """Store each schema as ``<name>_schema`` (``conf/config.yaml`` reads ``train_schema``, the groups theirs).

    Stored outside any group, so that ``python train.py --help`` lists only the groups a user selects.
    Storing again replaces the same node, so any number of calls is one registration.
    """
    store = ConfigStore.instance()
    for name, schema in SCHEMAS.items():
        store.store(name=f"{name}_schema", node=schema)
