"""The settings dataclasses of ``captioner.config`` as the schemas of the Hydra configs in ``conf/``, and the
resolver that names the built-in set's folder."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from omegaconf import MISSING, DictConfig, OmegaConf

from captioner.config import SCHEMAS, CaptionsSpec, ShapesSpec
from captioner.data.sources import CONFIG_KEY, shapes_folder

SHAPES_ROOT = "shapes_root"  # the resolver that names the built-in set's folder: conf/data/shapes.yaml


def register_schemas() -> None:
    """Store each schema as ``<name>_schema`` (``conf/config.yaml`` reads ``train_schema``, the groups theirs),
    and the built-in dataset's source as ``shapes_source_schema``: ``ShapesSource`` with ``ShapesSpec``'s
    fields and defaults, its kind of scenes by name (``conf/data/shapes.yaml`` sets its root only,
    ``conf/data/scenes.yaml`` the cluttered scenes), and a user's captions file's as ``captions_source_schema``
    (``CaptionsSource`` with ``CaptionsSpec``'s fields: ``conf/data/captions.yaml``).

    Stored outside any group, so that ``python train.py --help`` lists only the groups a user selects.
    Storing again replaces the same node, so any number of calls is one registration. Also registers the
    resolver ``${shapes_root:<folder>}`` (``_shapes_root``).
    """
    store = ConfigStore.instance()
    for name, schema in SCHEMAS.items():
        store.store(name=f"{name}_schema", node=schema)
    spec = {k: v.value if isinstance(v, enum.Enum) else v for k, v in dataclasses.asdict(ShapesSpec()).items()}
    source = {"_target_": "captioner.data.sources.ShapesSource", "root": MISSING, **spec}
    store.store(name="shapes_source_schema", node=source)
    own = {"captions": None, "split_from": None, "write_split": None}  # CaptionsSource's keys besides its spec
    captions = {"_target_": "captioner.data.sources.CaptionsSource", **own, **dataclasses.asdict(CaptionsSpec())}
    store.store(name="captions_source_schema", node=captions)
    OmegaConf.register_new_resolver(SHAPES_ROOT, _shapes_root, replace=True)


def _shapes_root(base: str, *, _parent_: DictConfig) -> str:
    """``${shapes_root:<folder>}`` in a ``data.source`` of the built-in set: ``sources.shapes_folder`` of the
    parameters of that source that the command line sets (``data.source.n_train=64``: ``<folder>_64_250_250``)."""
    # as typed, unresolved: an override's value may be an interpolation that does not resolve
    overrides = OmegaConf.to_container(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []
    keys = {override.split("=", 1)[0].lstrip("+~") for override in overrides}
    given = {key.removeprefix(f"{CONFIG_KEY}.") for key in keys if key.startswith(f"{CONFIG_KEY}.")}
    params: dict[str, Any] = {key: _parent_[key] for key in _parent_ if key != "root"}
    return shapes_folder(base, params, given)
