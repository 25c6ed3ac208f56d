"""Lightning checkpoint files written and read through ``captioner.fileio``.

Lightning 2.6 writes checkpoints with ``_atomic_save``: an fsspec transaction that writes a temporary
file in the system temp folder and moves it into place on commit, without fsync. When that folder is on
another file system the move is a copy onto the target path, so a kill during it leaves a truncated
checkpoint where a good one was. ``AtomicCheckpointIO`` writes a temporary file beside the target,
fsyncs it and renames it (``fileio.save_torch``), and loads with ``weights_only=True`` only, with the
project's one-line messages for refused, truncated or corrupt files (``fileio.load_torch``).
"""

from __future__ import annotations

from typing import Any

from lightning.fabric.utilities.cloud_io import _is_local_file_protocol
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.io import TorchCheckpointIO

from captioner.fileio import load_torch, save_torch


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` with atomic local writes and weights-only loads (remote paths: Lightning's)."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        """Write ``checkpoint`` to ``path`` atomically: a crash leaves the previous file or the new one."""
        if storage_options is not None or not _is_local_file_protocol(path):
            super().save_checkpoint(checkpoint, path, storage_options)
            return
        save_torch(checkpoint, path)

    def load_checkpoint(
        self, path: _PATH, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Load ``path`` with ``weights_only=True`` whatever ``weights_only`` asks; BundleError if unsafe or broken."""
        if not _is_local_file_protocol(path):
            return super().load_checkpoint(path, map_location=map_location, weights_only=True)
        return load_torch(path, "checkpoint", map_location=map_location)
