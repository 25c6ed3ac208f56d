"""A static HTML page to browse generated captions, their images and the attention of every word.

The page and everything it shows live in one folder, linked relatively: the folder can be moved or copied
and still works. Images from elsewhere are copied in (re-encoded as JPEG, so that a TIFF or PPM shows in any
browser). Each image shows its caption, the image and one attention panel at a readable size with its word
under it; the words are stepped through with the arrow keys (once the image is clicked or tabbed to) or by
clicking them. Inputs that could not be captioned are listed with their error.
"""

from __future__ import annotations

import html
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, unquote

from PIL import Image

from captioner.data.images import load_rgb
from captioner.fileio import atomic_write

COPIES = "images"  # the folder, inside the gallery's, that holds the copies of images from elsewhere
COPY_SIDE = 1024  # copies are shrunk to this longest side (pixels)
SHOWN = (640, 320)  # images and panels are shown scaled to fit this box (width, height), small ones enlarged ...
SHOWN_MIN = 120  # ... and in a box at least this wide and high: a 4000 x 20 image keeps room for its label
# The brightness scale of the panels (captioner.viz.overlay.DIM_FLOOR): 15 % grey where a word puts no attention.
LEGEND = "linear-gradient(to right, rgb(38, 38, 38), rgb(255, 255, 255))"


@dataclass(frozen=True)
class GalleryEntry:
    """One input of the gallery: its caption and attention, or the error that kept it from being captioned."""

    image: str | Path  # the image file
    caption: str
    overlay: str | Path | None = None  # all panels in one PNG (captioner.viz.overlay.draw_overlay)
    references: tuple[str, ...] = ()  # reference captions, shown under the generated one
    image_id: int | None = None  # the heading; the image's file name when None
    panels: tuple[tuple[str, str | Path], ...] = ()  # (word, its attention panel), in caption order
    error: str | None = None  # why the input was not captioned (the entry is listed, not shown)


_STYLE = """
body { font-family: sans-serif; margin: 1.5em; background: #fafafa; color: #222; }
.entry { background: white; border: 1px solid #ddd; margin: 0 0 1.5em; padding: 1em; }
.entry:focus { outline: 3px solid #4a90d9; }
.caption { font-size: 1.4em; margin: 0.3em 0 0.8em; }
.stage { display: flex; flex-wrap: wrap; gap: 1em; align-items: flex-start; }
.stage figure { margin: 0; display: flex; flex-direction: column; align-items: center; max-width: 100%; }
.stage img { max-width: 100%; object-fit: contain; background: #eee; image-rendering: pixelated; display: block; }
.stage figcaption { font-size: 1.6em; text-align: center; margin-top: 0.3em; }
.words { margin: 0.8em 0 0.3em; }
.words button { font-size: 1.1em; margin: 0 0.2em 0.3em 0; padding: 0.2em 0.6em; border: 1px solid #aaa;
                background: #f4f4f4; border-radius: 4px; cursor: pointer; }
.words button.current { background: #4a90d9; color: white; border-color: #4a90d9; }
.legend { display: flex; align-items: center; gap: 0.5em; color: #555; font-size: 0.9em; }
.legend span.bar { display: inline-block; width: 12em; height: 0.9em; border: 1px solid #999; }
.refs { color: #555; }
.failed { background: #fff4f4; border: 1px solid #e3b4b4; padding: 0.5em 1em; }
.failed code { word-break: break-all; }
"""

_SCRIPT = """
function show(entry, step) {
  const words = JSON.parse(entry.dataset.words), panels = JSON.parse(entry.dataset.panels);
  step = (step + words.length) % words.length;
  entry.dataset.step = step;
  entry.querySelector("img.panel").src = panels[step];
  entry.querySelector("img.panel").alt = "attention for: " + words[step];
  entry.querySelector("figcaption.word").textContent = words[step];
  entry.querySelectorAll(".words button").forEach((b, i) => b.classList.toggle("current", i === step));
}
document.querySelectorAll(".entry[data-words]").forEach(entry => {
  entry.querySelectorAll(".words button").forEach((b, i) => b.addEventListener("click", () => show(entry, i)));
  entry.addEventListener("keydown", event => {
    const move = {ArrowRight: 1, ArrowDown: 1, ArrowLeft: -1, ArrowUp: -1}[event.key];
    if (move === undefined) return;
    event.preventDefault();
    show(entry, Number(entry.dataset.step) + move);
  });
});
"""


def _inside(path: Path, folder: Path) -> bool:
    return path.resolve().is_relative_to(folder.resolve())


def _href(target: Path, out_dir: Path) -> str:
    """A relative, URL-quoted and HTML-escaped link from ``out_dir`` to ``target`` (a file inside it)."""
    relative = os.path.relpath(target.resolve(), out_dir.resolve())
    return html.escape(quote(Path(relative).as_posix()), quote=True)


def _local(target: str | Path, out_dir: Path, number: int) -> str:
    """The link to ``target`` from the page: the file itself when it lies inside ``out_dir``, else a copy
    written into ``out_dir/images`` (as JPEG, at most COPY_SIDE pixels). FileNotFoundError when it is missing."""
    target = Path(target)
    if not target.is_file():
        raise FileNotFoundError(f"gallery file not found: {target}")
    if _inside(target, out_dir):
        return _href(target, out_dir)
    copy = out_dir / COPIES / f"{number:04d}_{target.stem}.jpg"
    copy.parent.mkdir(parents=True, exist_ok=True)
    picture = load_rgb(target)
    picture.thumbnail((COPY_SIDE, COPY_SIDE))
    with atomic_write(copy, "wb") as handle:
        picture.save(handle, format="JPEG", quality=90)
    return _href(copy, out_dir)


def _shown(link: str, out_dir: Path) -> str:
    """The ``style`` that shows the image of ``link`` (in ``out_dir``) scaled to fit SHOWN, in a box of at least
    SHOWN_MIN pixels each way (the image centred in it, its aspect ratio kept)."""
    with Image.open(out_dir / unquote(html.unescape(link))) as image:
        width, height = image.size
    scale = min(SHOWN[0] / width, SHOWN[1] / height)
    return f"width: {max(SHOWN_MIN, round(width * scale))}px; height: {max(SHOWN_MIN, round(height * scale))}px"


def _entry(number: int, entry: GalleryEntry, out_dir: Path) -> list[str]:
    """The HTML of one captioned input."""
    caption = html.escape(entry.caption)
    name = html.escape(f"image {entry.image_id}" if entry.image_id is not None else Path(entry.image).name)
    image = _local(entry.image, out_dir, number)
    words = [word for word, _ in entry.panels]
    panels = [_local(panel, out_dir, number) for _, panel in entry.panels]
    data = ""
    if panels:
        unquoted = [html.unescape(link) for link in panels]
        data = (
            f' tabindex="0" data-step="0" data-words="{html.escape(json.dumps(words), quote=True)}"'
            f' data-panels="{html.escape(json.dumps(unquoted), quote=True)}"'
        )
    parts = [f'<section class="entry" id="entry-{number}"{data}>', f"<h2>{name}</h2>"]
    parts.append(f'<p class="caption">{caption}</p>')
    parts.append('<div class="stage">')
    parts.append(
        f'<figure><img src="{image}" alt="{name}" style="{_shown(image, out_dir)}"><figcaption>image</figcaption>'
        "</figure>"
    )
    if panels:
        first = html.escape(words[0])
        parts.append(
            f'<figure><img class="panel" src="{panels[0]}" alt="attention for: {first}" '
            f'style="{_shown(panels[0], out_dir)}"><figcaption class="word">{first}</figcaption></figure>'
        )
    parts.append("</div>")
    if panels:
        current = ' class="current"'
        buttons = "".join(
            f'<button type="button"{current if k == 0 else ""}>{html.escape(word)}</button>'
            for k, word in enumerate(words)
        )
        parts.append(f'<div class="words">{buttons}</div>')
        parts.append(
            '<p class="legend">attention: <span>none</span><span class="bar" style="background: '
            f"{LEGEND}\"></span><span>the caption's highest</span> &middot; click a word, or click the image "
            "and step with the arrow keys</p>"
        )
    if entry.overlay is not None:
        parts.append(f'<p><a href="{_local(entry.overlay, out_dir, number)}">every word in one image</a></p>')
    if entry.references:
        items = "".join(f"<li>{html.escape(ref)}</li>" for ref in entry.references)
        parts.append(f'<ul class="refs">{items}</ul>')
    parts.append("</section>")
    return parts


def write_gallery(
    out_dir: str | os.PathLike, entries: Sequence[GalleryEntry], title: str = "captioner gallery"
) -> Path:
    """Write ``out_dir/index.html`` atomically, one section per entry in the given order and a list of the
    entries with an error; return its path.

    Every file the page shows lies in ``out_dir`` (images from elsewhere are copied in), linked relatively,
    so the folder can be moved; all text is HTML-escaped. Raises FileNotFoundError for a missing image,
    overlay or panel.
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
    failed = [entry for entry in entries if entry.error is not None]
    for number, entry in enumerate(entries):
        if entry.error is None:
            parts += _entry(number, entry, out_dir)
    if failed:
        items = "".join(
            f"<li><code>{html.escape(str(entry.image))}</code>: {html.escape(entry.error)}</li>" for entry in failed
        )
        parts.append(f'<section class="failed"><h2>Not captioned ({len(failed)})</h2><ul>{items}</ul></section>')
    parts += [f"<script>{_SCRIPT}</script>", "</body>", "</html>", ""]
    index = out_dir / "index.html"
    with atomic_write(index, "wb") as handle:
        handle.write("\n".join(parts).encode("utf-8"))
    return index
