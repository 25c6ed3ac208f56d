"""A static HTML page to browse generated captions next to their images and attention overlays."""

from __future__ import annotations

import html
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from captioner.fileio import atomic_write


@dataclass(frozen=True)
class GalleryEntry:
    """One image of the gallery: its generated caption, optional overlay and reference captions."""

    image: str | Path  # the image file
    caption: str
    overlay: str | Path | None = None  # the attention overlay PNG (captioner.viz.overlay.draw_overlay)
    references: tuple[str, ...] = ()  # reference captions, shown under the generated one
    image_id: int | None = None  # the heading; the image's file name when None


_STYLE = """
body { font-family: sans-serif; margin: 1.5em; background: #fafafa; }
.entry { background: white; border: 1px solid #ddd; margin: 0 0 1.5em; padding: 1em; }
.entry img { max-height: 320px; max-width: 100%; margin-right: 1em; vertical-align: top; }
.caption { font-size: 1.2em; margin: 0.5em 0; }
.refs { color: #555; }
"""


def _link(target: str | Path, out_dir: Path) -> str:
    """A relative, URL-quoted and HTML-escaped link from ``out_dir`` to ``target`` (which must exist)."""
    target = Path(target)
    if not target.is_file():
        raise FileNotFoundError(f"gallery file not found: {target}")
    relative = os.path.relpath(target.resolve(), out_dir.resolve())
    return html.escape(quote(Path(relative).as_posix()), quote=True)


def write_gallery(
    out_dir: str | os.PathLike, entries: Sequence[GalleryEntry], title: str = "captioner gallery"
) -> Path:
    """Write ``out_dir/index.html`` atomically, one section per entry in the given order; return its path.

    Images and overlays are linked relative to ``out_dir`` (the folder can be moved together with
    them) and all text is HTML-escaped. Raises FileNotFoundError for a missing image or overlay.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en">',
        '<head><meta charset="utf-8">',
        f"<title>{html.escape(title)}</title>",
        f"<style>{_STYLE}</style>",
        "</head>",
        "<body>",
        f"<h1>{html.escape(title)}</h1>",
    ]
    for number, entry in enumerate(entries):
        caption = html.escape(entry.caption)
        name = html.escape(f"image {entry.image_id}" if entry.image_id is not None else Path(entry.image).name)
        parts.append(f'<section class="entry" id="entry-{number}">')
        parts.append(f"<h2>{name}</h2>")
        image = _link(entry.image, out_dir)
        parts.append(f'<a href="{image}"><img src="{image}" alt="{name}"></a>')
        if entry.overlay is not None:
            overlay = _link(entry.overlay, out_dir)
            parts.append(f'<a href="{overlay}"><img src="{overlay}" alt="attention for: {caption}"></a>')
        parts.append(f'<p class="caption">{caption}</p>')
        if entry.references:
            items = "".join(f"<li>{html.escape(ref)}</li>" for ref in entry.references)
            parts.append(f'<ul class="refs">{items}</ul>')
        parts.append("</section>")
    parts += ["</body>", "</html>", ""]
    index = out_dir / "index.html"
    with atomic_write(index, "wb") as handle:
        handle.write("\n".join(parts).encode("utf-8"))
    return index
