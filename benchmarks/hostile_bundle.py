"""What loading a crafted model file costs before it is refused: the peak RSS that ``load_model`` adds.

Writes the demo network's bundle with every weight zeroed and a 192 MiB embedding that does not fit its
vocabulary, once as torch.save writes it (stored zip members) and once with its members deflate-compressed (a
few hundred KiB: zeros compress), and loads each in this process (Linux: /proc/self/status VmHWM, reset before
each row; ``peak.PeakMemory``)::

    python benchmarks/hostile_bundle.py
"""

from __future__ import annotations

import argparse
import tempfile
import zipfile
from pathlib import Path

import torch

from captioner.bundle import save_bundle
from captioner.config import NetConfig
from captioner.data.vocab import Vocabulary
from captioner.errors import BundleError
from captioner.inference import load_model
from captioner.model.captioner import build_captioner
from peak import MiB, PeakMemory
from tables import print_table


def _crafted(folder: Path, embedding_mib: int) -> tuple[Path, Path]:
    """The stored and the deflated bundle of zeros with an embedding of ``embedding_mib`` MiB."""
    vocab = Vocabulary(["a", "red", "circle"])
    honest = folder / "honest.pt"
    save_bundle(honest, build_captioner(NetConfig(), len(vocab)), vocab, NetConfig(), {"image_size": 96})
    raw = torch.load(honest, weights_only=True)
    raw["state_dict"] = {key: torch.zeros_like(value) for key, value in raw["state_dict"].items()}
    raw["state_dict"]["decoder.embedding.weight"] = torch.zeros(embedding_mib * MiB // 4)
    stored, deflated = folder / "stored.pt", folder / "deflated.pt"
    torch.save(raw, stored)
    with zipfile.ZipFile(stored) as plain, zipfile.ZipFile(deflated, "w", zipfile.ZIP_DEFLATED) as packed:
        for info in plain.infolist():
            packed.writestr(info.filename, plain.read(info))
    return stored, deflated


def main(argv: list[str] | None = None) -> None:
    """Craft the two files, load each, print what it cost and how it was refused."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--embedding-mib", type=int, default=192, help="the crafted embedding's size (MiB)")
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="hostile-bundle-") as folder:
        for path in _crafted(Path(folder), args.embedding_mib):
            with PeakMemory(torch.device("cpu")) as peak:
                try:
                    load_model(path)
                    refused = "loaded"
                except BundleError as exc:
                    refused = str(exc).split(": ", 1)[-1][:90]
            rows.append([path.stem, path.stat().st_size / 1024, peak.added_mib, refused])
    print(f"## Loading a crafted bundle ({args.embedding_mib} MiB embedding of zeros)")
    print_table("Peak RSS added by load_model", ["members", "file KiB", "peak RSS added MiB", "outcome"], rows)


if __name__ == "__main__":
    main()
