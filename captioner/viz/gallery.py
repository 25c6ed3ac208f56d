"""A static HTML page to browse generated captions, their images and the attention of every word.

The pages and everything they show live in one folder, linked relatively: the folder can be moved or copied
and still works. Files from elsewhere are copied in (a PNG, JPEG, GIF or WebP of at most COPY_SIDE pixels as
it is; others re-encoded as JPEG, so that a TIFF or PPM shows in any browser). Each image shows its caption,
the image and one attention panel at a readable size with its word under it, cropped from the strip of all its
panels (captioner.viz.sheet.Strip: one file an image); the words are stepped through with the arrow keys (once
the image is clicked or tabbed to) or by clicking them, with nothing more to fetch; images and strips load as
they scroll into view (``loading="lazy"``), so a page of large photos does not fetch all its strips at once.
PAGE_SIZE images make a page, each page links every other; the inputs that could not be captioned are listed
first, on the first page (index.html). Every file is named by captioner.viz.layout and recorded there before
it is written.
"""

from __future__ import annotations

import html
import json
import math
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from urllib.parse import quote, unquote_to_bytes

from PIL import ExifTags

from captioner.data.images import ImageError, load_rgb, open_header
from captioner.fileio import atomic_write
from captioner.viz.layout import GalleryFiles
from captioner.viz.sheet import Strip

PAGE_SIZE = 50  # captioned images per page
AS_IS = ("PNG", "JPEG", "GIF", "WEBP")  # formats every browser shows: a still, opaque RGB or grey one small enough is
# copied byte for byte (a JPEG's EXIF orientation kept: browsers apply it; another turned one is re-encoded upright)
COPY_SIDE = 1024  # copies are shrunk to this longest side (pixels)
SHOWN = (640, 320)  # images and panels are shown scaled to fit this box (width, height), small ones enlarged ...
SHOWN_MIN = 120  # ... and in a box at least this wide and high: a 4000 x 20 image keeps room for its label
# The brightness scale of the panels (captioner.viz.overlay.DIM_FLOOR): 15 % grey where a word puts no attention.
LEGEND = "linear-gradient(to right, rgb(38, 38, 38), rgb(255, 255, 255))"
MARK = "rgb(230, 120, 0)"  # the 1/L mark's colour, as on the sheets (captioner.viz.sheet.MARK)


@dataclass(frozen=True)
class Panels:
    """A caption's attention panels, one per word, in one strip file laid out as ``Strip(size, len(words))``
    says (captioner.viz.sheet.strip_picture)."""

    strip: str | Path  # the strip file
    words: tuple[str, ...]  # the caption's words, in order: panel k is word k's
    size: tuple[int, int]  # one panel's (width, height) in the strip, pixels


@dataclass(frozen=True)
class GalleryEntry:
    """One input of the gallery: its caption and attention, or the error that kept it from being captioned."""

    image: str | Path  # the image file
    caption: str | None  # None for an input that was not captioned (``error``)
    overlay: str | Path | None = None  # all panels in one image (captioner.viz.sheet.draw_overlay)
    references: tuple[str, ...] = ()  # reference captions, shown under the generated one
    image_id: int | None = None  # the heading; the image's file name when None
    panels: Panels | None = None  # the words and their attention panels
    scale: tuple[float, float] | None = None  # the panels' scale: (1/L, the top weight per cell; Shading's)
    error: str | None = None  # why the input was not captioned (the entry is listed, not shown)


_STYLE = """
body { font-family: sans-serif; margin: 1.5em; background: #fafafa; color: #222; }
.entry { background: white; border: 1px solid #ddd; margin: 0 0 1.5em; padding: 1em; }
.entry:focus { outline: 3px solid #4a90d9; }
.caption { font-size: 1.4em; margin: 0.3em 0 0.8em; }
.stage { display: flex; flex-wrap: wrap; gap: 1em; align-items: flex-start; }
.stage figure { margin: 0; display: flex; flex-direction: column; align-items: center; max-width: 100%; }
.stage img { max-width: 100%; object-fit: contain; background: #eee; image-rendering: pixelated; display: block; }
.stage .frame { display: flex; align-items: center; justify-content: center; background: #eee; }
.stage .crop { position: relative; overflow: hidden; }
.stage .crop img { position: absolute; max-width: none; background: none; }
.stage figcaption { font-size: 1.6em; text-align: center; margin-top: 0.3em; }
.words { margin: 0.8em 0 0.3em; }
.words button { font-size: 1.1em; margin: 0 0.2em 0.3em 0; padding: 0.2em 0.6em; border: 1px solid #aaa;
                background: #f4f4f4; border-radius: 4px; cursor: pointer; }
.words button.current { background: #4a90d9; color: white; border-color: #4a90d9; }
.legend { display: flex; flex-wrap: wrap; align-items: center; gap: 0.5em; color: #555; font-size: 0.9em; }
.legend > * { white-space: nowrap; }
.legend span.bar { display: inline-block; position: relative; width: 12em; height: 0.9em; border: 1px solid #999; }
.legend span.mark { position: absolute; top: -0.3em; bottom: -0.3em; width: 3px; margin-left: -1px; }
.legend b { font-weight: bold; }
nav.pages { margin: 0.5em 0 1em; } nav.pages a, nav.pages b { margin-right: 0.4em; }
.refs { color: #555; }
.failed { background: #fff4f4; border: 1px solid #e3b4b4; padding: 0.5em 1em; }
.failed code { word-break: break-all; }
"""

_SCRIPT = """
function show(entry, step) {
  const words = JSON.parse(entry.dataset.words), [columns, across, down] = JSON.parse(entry.dataset.strip);
  step = (step + words.length) % words.length;
  entry.dataset.step = step;
  const panel = entry.querySelector("img.panel");
  panel.style.left = -(step % columns) * across + "%";
  panel.style.top = -Math.floor(step / columns) * down + "%";
  panel.alt = "attention for: " + words[step];
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


def _href(target: Path, out_dir: Path) -> str:
    """A relative, URL-quoted and HTML-escaped link from ``out_dir`` to ``target`` (a file inside it)."""
    return _link(Path(os.path.relpath(target.resolve(), out_dir.resolve())).as_posix())


def _link(relative: str) -> str:
    """The link to the file of the POSIX path ``relative``: URL-quoted byte for byte, as the file system names it
    (a name that is not UTF-8, from an old archive, keeps its bytes: ``caf%E9.jpg``), and HTML-escaped."""
    return html.escape(quote(os.fsencode(relative)), quote=True)


def _linked(link: str) -> str:
    """The relative path a link of :func:`_link` names."""
    return os.fsdecode(unquote_to_bytes(html.unescape(link)))


def _local(
    target: str | Path, files: GalleryFiles, number: int, image: str | Path, role: str, max_pixels: int | None = None
) -> str:
    """The link to ``target`` from the pages: the file itself when it lies inside the gallery, else its copy
    ``files.copy(number, image, role, ...)`` (recorded, then written). FileNotFoundError when it is missing."""
    target = Path(target)
    if not target.is_file():
        raise FileNotFoundError(f"gallery file not found: {target}")
    inside = files.relative(target)  # links resolved, as _href resolves them
    if Path(inside).parts[0] != "..":
        return _link(inside)
    with open_header(target) as header:
        # as captioned, as shown: the first frame, RGB, transparency on white (a browser shows it on the page's grey)
        still = not getattr(header, "is_animated", False) and header.mode != "CMYK" and not header.has_transparency_data
        # upright: every browser turns a JPEG by its EXIF orientation, not every one another format (Chromium a WebP)
        upright = header.format == "JPEG" or header.getexif().get(ExifTags.Base.Orientation, 1) == 1
        as_is = header.format in AS_IS and still and upright and max(header.size) <= COPY_SIDE
        suffix = {"JPEG": ".jpg"}.get(header.format, f".{str(header.format).lower()}") if as_is else ".jpg"
    copy = files.record(files.copy(number, image, role, suffix))
    if as_is:
        with atomic_write(copy, "wb", durable=False) as handle, open(target, "rb") as source:
            shutil.copyfileobj(source, handle)
    else:
        try:
            picture = load_rgb(target, max_pixels, size=COPY_SIDE)
        except ImageError:  # over the limit at the scale that keeps COPY_SIDE: at the one it was drawn at
            picture = load_rgb(target, max_pixels)
        picture.thumbnail((COPY_SIDE, COPY_SIDE))
        with atomic_write(copy, "wb", durable=False) as handle:
            picture.save(handle, format="JPEG", quality=90)
    return _href(copy, files.stage)


def _fitted(size: tuple[int, int]) -> tuple[int, int]:
    """A picture of ``size`` (width, height) scaled to fit SHOWN, its aspect ratio kept (at least a pixel)."""
    scale = min(SHOWN[0] / size[0], SHOWN[1] / size[1])
    return (max(1, round(size[0] * scale)), max(1, round(size[1] * scale)))


def _box(size: tuple[int, int]) -> str:
    """The ``style`` of the box that shows a picture of ``size`` fitted (:func:`_fitted`) and centred: at least
    SHOWN_MIN pixels each way."""
    width, height = _fitted(size)
    return f"width: {max(SHOWN_MIN, width)}px; height: {max(SHOWN_MIN, height)}px"


def _shown(link: str, files: GalleryFiles) -> str:
    """The ``style`` that shows the image of ``link`` (in the gallery of ``files``) in its :func:`_box`, as a
    browser turns it (EXIF orientation)."""
    with open_header(files.current(_linked(link))) as image:
        width, height = image.size
        if image.getexif().get(ExifTags.Base.Orientation, 1) in (5, 6, 7, 8):  # a browser turns it on its side
            width, height = height, width
    return _box((width, height))


def _panel(panels: Panels, link: str) -> tuple[str, str]:
    """The first word's panel, cropped from the strip at ``link``: its HTML, and the ``data-strip`` that steps
    the crop to another word's (columns, and one panel's stride across and down as % of a panel)."""
    strip = Strip(panels.size, len(panels.words))
    (width, height), (across, down), (whole_width, whole_height) = panels.size, strip.stride, strip.picture_size
    fitted = _fitted(panels.size)
    first = html.escape(panels.words[0])
    whole = f"width: {100 * whole_width / width:.4f}%; height: {100 * whole_height / height:.4f}%"
    figure = (
        f'<figure><div class="frame" style="{_box(panels.size)}"><div class="crop" style="width: {fitted[0]}px; '
        f'height: {fitted[1]}px"><img class="panel" loading="lazy" src="{link}" alt="attention for: {first}" '
        f'style="{whole}; left: 0%; top: 0%"></div></div><figcaption class="word">{first}</figcaption></figure>'
    )
    return figure, json.dumps([strip.columns, round(100 * across / width, 4), round(100 * down / height, 4)])


def _legend(scale: tuple[float, float] | None) -> str:
    """The panels' brightness scale, as the sheets' colour bar gives it: 0 to the caption's top weight per
    cell, uniform attention (1/L) marked."""
    if scale is None:
        return (
            f'attention: <span>none</span><span class="bar" style="background: {LEGEND}"></span>'
            "<span>the caption's highest</span>"
        )
    uniform, top = scale
    mark = f'<span class="mark" style="left: {100 * uniform / top:.1f}%; background: {MARK}"></span>'
    return (
        f'attention weight per cell: <span>0</span><span class="bar" style="background: {LEGEND}">{mark}</span>'
        f"<span>{top:.3g} (this caption's highest)</span><span>&middot;</span>"
        f'<span><b style="color: {MARK}">orange mark: 1/L = {uniform:.3g}</b>, uniform attention</span>'
    )


def _entry(number: int, entry: GalleryEntry, files: GalleryFiles, max_pixels: int | None) -> list[str]:
    """The HTML of one captioned input."""
    caption = html.escape(entry.caption)
    name = html.escape(f"image {entry.image_id}" if entry.image_id is not None else Path(entry.image).name)
    image = _local(entry.image, files, number, entry.image, "", max_pixels)
    words = list(entry.panels.words) if entry.panels is not None else []
    data, panel = "", ""
    if words:
        panel, strip = _panel(entry.panels, _local(entry.panels.strip, files, number, entry.image, "panels"))
        data = (
            f' tabindex="0" data-step="0" data-words="{html.escape(json.dumps(words), quote=True)}"'
            f' data-strip="{html.escape(strip, quote=True)}"'
        )
    parts = [f'<section class="entry" id="entry-{number}"{data}>', f"<h2>{name}</h2>"]
    parts.append(f'<p class="caption">{caption}</p>')
    parts.append('<div class="stage">')
    parts.append(
        f'<figure><img loading="lazy" src="{image}" alt="{name}" style="{_shown(image, files)}">'
        "<figcaption>image</figcaption></figure>"
    )
    parts.append(panel)
    parts.append("</div>")
    if words:
        current = ' class="current"'
        buttons = "".join(
            f'<button type="button"{current if k == 0 else ""}>{html.escape(word)}</button>'
            for k, word in enumerate(words)
        )
        parts.append(f'<div class="words">{buttons}</div>')
        parts.append(
            f'<p class="legend">{_legend(entry.scale)}<span>&middot;</span><span>click a word, or click the image and '
            "step with the arrow keys</span></p>"
        )
    if entry.overlay is not None:
        sheet = _local(entry.overlay, files, number, entry.image, "sheet")
        parts.append(f'<p><a href="{sheet}">every word in one image</a></p>')
    if entry.references:
        items = "".join(f"<li>{html.escape(ref)}</li>" for ref in entry.references)
        parts.append(f'<ul class="refs">{items}</ul>')
    parts.append("</section>")
    return parts


def _navigation(index: int, pages: int, files: GalleryFiles) -> str:
    """The links to every page, the current one in bold (nothing for a single page)."""
    if pages == 1:
        return ""
    links = [
        f"<b>{k + 1}</b>" if k == index else f'<a href="{_href(files.page(k), files.stage)}">{k + 1}</a>'
        for k in range(pages)
    ]
    return f'<nav class="pages">page {" ".join(links)}</nav>'


def page_count(images: int) -> int:
    """How many pages a gallery of ``images`` captioned images has (at least one)."""
    return max(1, math.ceil(images / PAGE_SIZE))


def write_gallery(
    out_dir: str | os.PathLike,
    entries: Sequence[GalleryEntry],
    title: str = "captioner gallery",
    files: GalleryFiles | None = None,
    max_pixels: int | None = None,
) -> Path:
    """Write the gallery's pages atomically (``index.html`` first, PAGE_SIZE captioned entries a page, in the
    given order; entry ``n`` named ``n`` by ``files``); return the first page's path.

    The first page starts with a count of the entries and the list of those with an error. Every file the
    pages show lies in ``out_dir`` (files from elsewhere are copied in), linked relatively, so the folder can
    be moved; all text is HTML-escaped. ``files``: the folder's names and record (default: ``out_dir``'s), and
    where the files are written (its stage, when one is set: ``GalleryFiles.move_in`` moves them in).
    Raises FileNotFoundError for a missing image, overlay or panel, and FileExistsError where a file that no
    gallery wrote (captioner.viz.layout's record) is in the way: it is never replaced. ``max_pixels``: the
    pixel limit of the images copied in (``captioner.data.images.load_rgb``'s).
    """
    files = files if files is not None else GalleryFiles(out_dir)
    files.stage.mkdir(parents=True, exist_ok=True)
    failed = [entry for entry in entries if entry.error is not None]
    shown = []  # the HTML of each entry shown: one whose image cannot be read to copy it is listed as failed
    for number, entry in enumerate(entries):
        try:
            shown += [_entry(number, entry, files, max_pixels)] if entry.error is None else []
        except ImageError as exc:
            failed.append(replace(entry, error=f"cannot be shown: {exc.reason}"))
    pages = page_count(len(shown))
    bodies = [[part for parts in shown[k * PAGE_SIZE : (k + 1) * PAGE_SIZE] for part in parts] for k in range(pages)]
    for index, body in enumerate(bodies):
        parts = [
            "<!DOCTYPE html>",
            '<html lang="en">',
            '<head><meta charset="utf-8">',
            f"<title>{html.escape(title)}{f' ({index + 1}/{pages})' if pages > 1 else ''}</title>",
            f"<style>{_STYLE}</style>",
            "</head>",
            "<body>",
            f"<h1>{html.escape(title)}</h1>",
        ]
        if index == 0:
            parts.append(f"<p>{len(shown)} captioned, {len(failed)} not captioned</p>")
            if failed:
                items = "".join(
                    f"<li><code>{html.escape(str(entry.image))}</code>: {html.escape(str(entry.error))}</li>"
                    for entry in failed
                )
                parts.append(
                    f'<section class="failed"><h2>Not captioned ({len(failed)})</h2><ul>{items}</ul></section>'
                )
        navigation = _navigation(index, pages, files)
        parts += [navigation, *body, navigation, f"<script>{_SCRIPT}</script>", "</body>", "</html>", ""]
        with atomic_write(files.record(files.page(index)), "wb") as handle:
            handle.write("\n".join(parts).encode("utf-8", "backslashreplace"))  # a name not UTF-8: caf\\udce9.jpg
    return files.page(0)
