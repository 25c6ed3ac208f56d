"""The ImageNet weights of torchvision's CNNs: their names, where torchvision caches their files, and the download.

A weights name ("DEFAULT", "IMAGENET1K_V2", "ResNet101_Weights.IMAGENET1K_V2") is one of torchvision's weights
enums; its file is ``$TORCH_HOME/hub/checkpoints/<file name of its URL>``. Building an ``Encoder`` only reads that
file; ``download`` fetches a missing one the way torchvision does (``torch.hub.download_url_to_file``: a ``.partial``
file beside the target, renamed into place once its SHA-256 starts with the hash its name carries, deleted
otherwise), one process at a time: a DDP run's processes of one machine, started together, download it once.
Training downloads where ``model.encoder.download`` is on (``training/preflight.py``, then ``CaptionerModule``).
"""

from __future__ import annotations

import contextlib
import http.client
import os
import socket
import sys
import urllib.error
from collections.abc import Iterator
from urllib.parse import urlparse

import torch
from filelock import FileLock
from torchvision.models import WeightsEnum, get_model_weights

from captioner.errors import ConfigError, DownloadError, first_line

DOWNLOAD_TIMEOUT = 60.0  # seconds a download waits for the server (to connect, or for its next bytes) before failing


def weight_file(weights: WeightsEnum) -> str:
    """Where torchvision looks for ``weights`` on disk: ``$TORCH_HOME/hub/checkpoints/<file>``."""
    return os.path.join(torch.hub.get_dir(), "checkpoints", os.path.basename(urlparse(weights.url).path))


def resolve_weights(name: str, weights: str | None) -> WeightsEnum | None:
    """Turn "DEFAULT", "IMAGENET1K_V2" or "ResNet101_Weights.IMAGENET1K_V2" into the weights enum of ``name``."""
    if weights is None:
        return None
    if not isinstance(weights, str):
        raise ConfigError(f"encoder.weights={weights!r} must be a weights name such as 'DEFAULT', or null")
    enum = get_model_weights(name)
    valid = ["DEFAULT"] + [member.name for member in enum]
    owner, _, member = weights.rpartition(".")
    if owner not in ("", enum.__name__) or member not in valid:
        choices = ", ".join(valid + [f"{enum.__name__}.{v}" for v in valid[1:]])
        raise ConfigError(f"encoder.weights={weights!r} is not a weights name of {name}; choose one of: {choices}")
    return enum[member]


def not_on_disk(name: str, given: str, weights: WeightsEnum, why: str = "") -> tuple[str, str]:
    """What is wrong and its remedy, for the file of ``weights`` (written ``given`` in the config) of model ``name``
    that is not on disk: ``why`` (" (...)" or " and ...") follows what is wrong."""
    return (
        f"encoder.weights={given!r}: the ImageNet weights of {name} are not on disk{why}",
        f"download {weights.url} and save it as {weight_file(weights)} (TORCH_HOME moves that folder)",
    )


def fetch(name: str, weights: str | None) -> None:
    """``download`` the file of the weights ``weights`` of model ``name`` if it is missing (nothing for None);
    ConfigError in one line, saying why the download failed and where the file goes, when it fails."""
    resolved = resolve_weights(name, weights)
    if resolved is None:
        return
    try:
        download(resolved)
    except DownloadError as exc:
        raise ConfigError("; ".join(not_on_disk(name, weights, resolved, f" and the download failed: {exc}"))) from None


def download(weights: WeightsEnum) -> str:
    """The path of the file of ``weights``, downloaded there first if it is missing; returns at once if it is there.

    torchvision's own download, its hash check included; its progress bar goes to stdout, with training's. Processes
    that share the cache take turns (a lock file beside the weights, ``<file>.lock``): the first downloads, the
    others then find the file. DownloadError says why a download failed (no network, an HTTP error, a server silent
    for ``DOWNLOAD_TIMEOUT`` seconds, a download cut short or altered, which the hash check finds); nothing is left
    at the path then.
    """
    path = weight_file(weights)
    if os.path.isfile(path):
        return path
    match = torch.hub.HASH_REGEX.search(os.path.basename(path))  # as torch.hub's check_hash=True reads it
    prefix = match.group(1) if match else None
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with FileLock(f"{path}.lock"):
            if not os.path.isfile(path):  # not downloaded by another process meanwhile
                print(f'Downloading: "{weights.url}" to {path}', flush=True)
                with contextlib.redirect_stderr(sys.stdout), _socket_timeout(DOWNLOAD_TIMEOUT):  # the progress bar
                    torch.hub.download_url_to_file(weights.url, path, hash_prefix=prefix, progress=True)
    except (OSError, http.client.HTTPException, RuntimeError) as exc:  # RuntimeError: torch.hub's hash check
        raise DownloadError(_reason(exc, prefix)) from None
    return path


@contextlib.contextmanager
def _socket_timeout(seconds: float) -> Iterator[None]:
    """New sockets give up after ``seconds`` without progress (torch.hub's download sets no timeout of its own)."""
    previous = socket.getdefaulttimeout()
    socket.setdefaulttimeout(seconds)
    try:
        yield
    finally:
        socket.setdefaulttimeout(previous)


def _reason(exc: BaseException, prefix: str | None) -> str:
    """Why a download failed, in a few words; ``prefix``: the SHA-256 prefix the file's name carries."""
    if isinstance(exc, TimeoutError) or isinstance(getattr(exc, "reason", None), TimeoutError):
        return f"the server sent nothing for {DOWNLOAD_TIMEOUT:g} s"
    if isinstance(exc, urllib.error.HTTPError):
        return f"the server answered HTTP {exc.code} {exc.reason}"
    if isinstance(exc, urllib.error.URLError):
        return f"no connection: {exc.reason}"
    if isinstance(exc, RuntimeError):
        return f"the file received does not match the SHA-256 prefix {prefix} in its name (cut short or altered)"
    return first_line(exc, with_type=True)
