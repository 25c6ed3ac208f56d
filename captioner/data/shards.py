"""WebDataset tar shards in img2dataset's layout: the shard list, each shard's size, the captions of a sample, the
epoch's split of the samples over every reader, and the source (``data=webdataset``) that trains from them.

A shard ``00000.tar`` holds per sample ``key.jpg`` (or another image format) with ``key.txt`` (a caption per line)
and/or ``key.json`` (a list of captions under ``captions``, or one string under ``caption``); beside it,
``00000_stats.json`` gives its ``successes`` (the samples it holds). Shards are named by brace patterns of local
paths or of anything the ``webdataset`` library opens (``pipe:`` commands, ``http(s)://``), several joined by ``::``.
The ``webdataset`` library does the reading (``pip install captioner[shards]``).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import math
import re
import tarfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from captioner.data.readers import Record
from captioner.data.sources import Holds, Source, SourcePath, check_paths
from captioner.data.vocab import has_words
from captioner.errors import ConfigError, DataError, check_range

if TYPE_CHECKING:
    pass

log = logging.getLogger(__name__)

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp")  # a sample's image member, the first of these it has
_REMOTE = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)  # pipe:, http:, s3:, ... (not a local path)


def _webdataset() -> Any:
    """The ``webdataset`` module, or ConfigError saying how to install it."""
    try:
        return importlib.import_module("webdataset")
    except ImportError:
        raise ConfigError("data=webdataset needs the webdataset package: pip install 'captioner[shards]'") from None


@dataclass(frozen=True)
class Shard:
    """One tar shard: where it is, how many samples it holds, and the position of its first sample among all the
    pattern's samples (in pattern order: a sample's ``index``)."""

    url: str
    size: int
    offset: int


@dataclass(frozen=True)
class Piece:
    """The part of a shard one reader takes in an epoch: samples ``skip`` .. ``skip + take - 1`` of ``shard``."""

    shard: Shard
    skip: int
    take: int


def is_local(url: str) -> bool:
    """Whether ``url`` is a path on this machine (not ``pipe:``, ``http:``, ...)."""
    return not _REMOTE.match(url) or bool(re.match(r"^[a-z]:[\\/]", url, re.IGNORECASE))


def expand(patterns: str) -> list[str]:
    """The shard urls of ``patterns`` (brace patterns joined by ``::``), in order; ConfigError when none."""
    urls = _webdataset().shardlists.expand_urls(patterns)
    if not urls:
        raise ConfigError(f"data.source.train={patterns!r} names no shard")
    return urls


def stats_url(url: str) -> str:
    """Where img2dataset writes the stats of the shard ``url``: ``00000.tar`` -> ``00000_stats.json`` (also inside
    a ``pipe:`` command)."""
    head, found, tail = url.rpartition(".tar")
    return f"{head}_stats.json{tail}" if found else f"{url}_stats.json"


def _stated_size(url: str) -> int | None:
    """The ``successes`` of the shard's ``_stats.json``, or None when there is none (or it cannot be read)."""
    where = stats_url(url)
    if is_local(url) and not Path(where).is_file():
        return None
    if where.startswith("pipe:"):
        where += " 2>/dev/null"  # a shard without stats is no error: the command's complaint is not shown
    try:
        with _webdataset().gopen(where, "rb") as stream:
            successes = json.loads(stream.read()).get("successes")
    except Exception:  # a missing object, a failing command, not JSON: the shard is counted instead
        return None
    return successes if isinstance(successes, int) and not isinstance(successes, bool) and successes >= 0 else None


def why_unread(exc: BaseException) -> str:
    """Why a shard could not be read, in a few words: the exception's first argument without what ``webdataset``
    appends (`` @ <stream>``), and for a ``pipe:`` command that failed, its exit status (webdataset's message holds
    the call's arguments: ``(('aws s3 cp ...',), {'shell': True, ...}): exit 1 (read) {}``)."""
    text = str(exc.args[0]).split(" @ ")[0] if exc.args else type(exc).__name__
    if (status := re.search(r"\): exit (-?\d+) \(read\)", text)) is not None:
        return f"the command exited with status {status.group(1)}"
    return text


def count_samples(url: str) -> int:
    """The samples of the shard ``url``, counted from its members' names (no member is decoded)."""
    keys = set()
    base_plus_ext = _webdataset().tariterators.base_plus_ext
    try:
        with _webdataset().gopen(url, "rb") as stream, tarfile.open(fileobj=stream, mode="r|*") as tar:
            for member in tar:
                key, _ = base_plus_ext(member.name)
                if member.isreg() and key is not None and not key.startswith("__"):
                    keys.add(key)
    except (OSError, tarfile.TarError) as exc:
        raise DataError(f"{url}: cannot read the shard ({why_unread(exc)})") from None
    return len(keys)


def list_shards(patterns: str) -> list[Shard]:
    """Every shard of ``patterns`` with its size: from its ``_stats.json`` where there is one, else counted once
    by listing its members (logged: a shard without stats is read through once more)."""
    shards, counted, offset = [], 0, 0
    for url in expand(patterns):
        size = _stated_size(url)
        if size is None:
            size, counted = count_samples(url), counted + 1
        shards.append(Shard(url, size, offset))
        offset += size
    if counted:
        log.info(
            "%d of %d shards have no _stats.json: their samples were counted from their members", counted, len(shards)
        )
    if offset == 0:
        raise DataError(f"the shards of {patterns!r} hold no sample")
    return shards


def image_id(key: str) -> int:
    """A sample's image id: its key as a number (img2dataset's keys are digits), else a stable 63-bit hash."""
    if key.isdigit():
        return int(key)
    return int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[:8], "big") >> 1


def _given_captions(sample: Mapping[str, Any], captions_field: str) -> list[Any]:
    """What a sample gives as its captions, unchecked: the list under ``captions_field`` of its json, else the
    non-blank lines of its txt (as bytes when it is not UTF-8), else the json's ``caption``."""
    meta = _json(sample.get("json"))
    listed = meta.get(captions_field)
    if isinstance(listed, list):
        return listed
    if "txt" in sample:
        try:
            lines: list[Any] = sample["txt"].decode("utf-8").splitlines()
        except UnicodeDecodeError:
            lines = sample["txt"].splitlines()
        return [line for line in lines if line.strip()]
    return [meta["caption"]] if "caption" in meta else []


def _is_caption(given: Any) -> bool:
    """Whether ``given`` is a caption: text with a word (``has_words``)."""
    return isinstance(given, str) and has_words(given)


def sample_captions(sample: Mapping[str, Any], captions_field: str) -> list[str]:
    """The captions of a sample (its members' bytes by extension): the list under ``captions_field`` of its json,
    else the lines of its txt, else the json's ``caption``; what is not text with a word left out (a json entry that
    is no string, a txt not in UTF-8, an empty caption, one of punctuation only: ``stream_captions`` counts them)."""
    return [given.strip() for given in _given_captions(sample, captions_field) if _is_caption(given)]


def _json(data: bytes | None) -> dict[str, Any]:
    """A sample's json member as a dict ({} when absent or not a JSON object)."""
    if data is None:
        return {}
    try:
        value = json.loads(data)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def broken_off(url: str) -> Callable[[Exception], bool]:
    """The ``webdataset`` handler for the shard ``url`` breaking off mid-read (a truncated tar, a failed command):
    one warning naming the shard and why, and the reading goes on with what came before (a reader pads for it)."""

    warned = []  # webdataset's layers each hand the same break on: one warning a read

    def handler(exc: Exception) -> bool:
        reason = why_unread(exc)
        if not warned:
            log.warning("%s: the shard breaks off (%s): its samples up to there are read", url, reason)
            warned.append(reason)
        return True

    return handler


def stream_captions(shards: Sequence[Shard], captions_field: str) -> Iterator[list[str]]:
    """Each sample's captions of ``shards``, in order: one pass that reads their txt and json members only (a shard
    that breaks off: ``broken_off``). The captions ``sample_captions`` leaves out are counted in one warning at the
    end of the pass, naming the first few."""
    wds = _webdataset()
    select = re.compile(r".*\.(txt|json)$", re.IGNORECASE).match
    left_out, shown = 0, []  # the count, and the first few with their samples' names
    for shard in shards:
        samples = wds.tariterators.tarfile_samples(
            [{"url": shard.url}], handler=broken_off(shard.url), select_files=select
        )
        for sample in samples:
            bad = [given for given in _given_captions(sample, captions_field) if not _is_caption(given)]
            left_out += len(bad)
            shown += [f"{shard.url}#{sample['__key__']} {given!r}" for given in bad[: 5 - len(shown)]]
            yield sample_captions(sample, captions_field)
    if left_out:
        more = f" and {left_out - len(shown):,} more" if left_out > len(shown) else ""
        log.warning(
            "%s captions of the shards left out (not text, not UTF-8, empty, or without a word): %s%s",
            f"{left_out:,}", "; ".join(shown), more,
        )  # fmt: skip


READERS_REMEDY = "give at least as many shards as readers (more shards, fewer data.num_workers or fewer devices)"


def too_few_shards(shards: int, ranks: int, workers: int) -> str | None:
    """What is wrong when ``shards`` shards are fewer than the readers (``ranks`` x ``workers``), else None."""
    readers = ranks * workers
    if shards >= readers:
        return None
    return f"data.source.train has {shards} shards for {ranks} ranks x {workers} loader workers = {readers} readers"


def readers_needed(shards: Sequence[Shard], readers: int, ranks: int, workers: int) -> None:
    """ConfigError unless there are at least as many shards as ``readers`` (``ranks`` x ``workers``): a reader
    would otherwise only read parts of shards that others read too."""
    if (problem := too_few_shards(len(shards), ranks, workers)) is not None:
        raise ConfigError(f"{problem}; {READERS_REMEDY}")


def epoch_plan(shards: Sequence[Shard], epoch: int, seed: int, readers: int) -> list[list[Piece]]:
    """What each of ``readers`` reads in ``epoch``: the shards in an order drawn from (``seed``, ``epoch``), their
    samples laid end to end and cut into ``readers`` runs whose lengths differ by one at most; reader r takes run r.

    Every sample falls in exactly one run, whatever the shard sizes; a shard cut between two runs is read by both
    (the second skips the first's part without decoding it), at most ``readers - 1`` shards an epoch.
    """
    order = np.random.default_rng([seed, epoch]).permutation(len(shards))
    total = sum(shard.size for shard in shards)
    bounds = [reader * total // readers for reader in range(readers + 1)]
    plan: list[list[Piece]] = [[] for _ in range(readers)]
    start, reader = 0, 0  # the position of the shard's first sample in the epoch's order; the reader it falls to
    for index in order:
        shard = shards[index]
        low, end = start, start + shard.size
        while low < end:
            while bounds[reader + 1] <= low:  # that reader's run is full
                reader += 1
            high = min(end, bounds[reader + 1])
            plan[reader].append(Piece(shard, low - start, high - low))
            low = high
        start = end
    return plan


def items_per_reader(shards: Sequence[Shard], readers: int, batch_size: int) -> int:
    """The items every reader yields an epoch: its run's samples (the longest run's) padded to whole batches."""
    total = sum(shard.size for shard in shards)
    return math.ceil(math.ceil(total / readers) / batch_size) * batch_size


def build_source(node: Source | Mapping[str, Any]) -> Source:
    """A source, or the source a config mapping describes (its ``_target_`` called with its other keys)."""
    if not isinstance(node, Mapping):
        return node
    module, _, name = str(node["_target_"]).rpartition(".")
    return getattr(importlib.import_module(module), name)(**{k: v for k, v in node.items() if k != "_target_"})


@dataclass
class WebDatasetSource:
    """Training samples streamed from WebDataset tar shards; validation and test from another source.

    ``train``: brace patterns of the shards (``data/cc3m/{00000..00331}.tar``, ``pipe:aws s3 cp
    s3://bucket/{00000..00331}.tar -``), several joined by ``::``. ``eval_source``: the source of val and test (a
    folder source: ``CocoSource``, ``KarpathySource``, ``ShapesSource``...), built from its ``_target_`` mapping.
    """

    train: str
    eval_source: Any
    captions_field: str = "captions"  # the key of a sample's json that lists its captions
    shuffle_buffer: int = 1000  # samples each loader worker shuffles among (after the epoch's shard order)
    seed: int = 0  # the epoch's shard order and shuffle are drawn from (seed, epoch): a resumed run repeats them
    streams: ClassVar[bool] = True  # the training split is streamed (``stream``), never listed as records
    _built: Source | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        check_range("shuffle_buffer", self.shuffle_buffer, 1, kind=int)
        check_range("seed", self.seed, 0, kind=int)
        self._built = build_source(self.eval_source)

    @cached_property
    def shards(self) -> list[Shard]:
        """The training shards with their sizes (listed once)."""
        return list_shards(self.train)

    def paths(self) -> list[SourcePath]:
        """The local training shards, then the evaluation source's files under ``eval_source.``."""
        remedy = "give the shards' brace pattern (data/shards/{00000..00099}.tar) as data.source.train"
        local = [url for url in expand(self.train) if is_local(url)]
        own = [SourcePath("train", url, "file", Holds.images, remedy) for url in local]
        held_out = [
            SourcePath(f"eval_source.{p.key}", p.path, p.kind, p.holds, p.remedy, p.generated)
            for p in self._built.paths()
        ]
        return own + held_out

    def prepare(self) -> None:
        """Check the local shards exist; prepare the evaluation source."""
        check_paths([path for path in self.paths() if path.key == "train"], DataError)
        self._built.prepare()

    def records(self, split: str) -> list[Record]:
        """The records of val or test (the evaluation source's); the training split streams (DataError)."""
        if split == "train":
            raise DataError("the training split streams from shards (data.source.train): it has no record list")
        return self._built.records(split)

    @property
    def held_out(self) -> Source:
        """The source of val and test."""
        return self._built

    def captions(self) -> Iterator[list[str]]:
        """Each training sample's captions, in one pass over the shards that decodes no image (for the vocabulary
        and the samples' caption counts)."""
        return stream_captions(self.shards, self.captions_field)
