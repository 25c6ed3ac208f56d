"""The HTML gallery: relative links to existing files, escaped text, atomic write."""

import html
import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from urllib.parse import unquote, unquote_to_bytes

import numpy as np
import pytest
from PIL import Image

from captioner.viz import gallery
from captioner.viz.gallery import GalleryEntry, Panels, write_gallery
from conftest import Links


def make_png(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (8, 8), "red").save(path)
    return path


def test_links_are_relative_and_every_file_lies_inside_the_gallery(tmp_path):
    out = tmp_path / "gallery"
    entries = [
        GalleryEntry(
            make_png(tmp_path / "images" / "my image #2.png"),
            "a red square",
            overlay=str(make_png(out / "overlays" / "2.png")),
            references=("a square", "red"),
            image_id=2,
            panels=Panels(make_png(out / "p" / "strip.png"), ("a", "red"), (4, 8)),
        ),
        GalleryEntry(image=str(make_png(tmp_path / "images" / "1.png")), caption="a circle"),
        GalleryEntry(image=str(tmp_path / "gone.jpg"), caption=None, error="file not found"),
    ]
    index = write_gallery(out, entries)
    assert index == out / "index.html"
    parser = Links()
    parser.feed(index.read_text(encoding="utf-8"))
    assert parser.links == ["images/0000_my%20image%20%232.png", "p/strip.png", "overlays/2.png", "images/0001_1.png"]
    for link in parser.links:
        assert (out / unquote(link)).resolve().is_relative_to(out.resolve()) and (out / unquote(link)).is_file()
    with Image.open(out / "images" / "0001_1.png") as copy:  # a small PNG is copied as it is
        assert copy.format == "PNG" and copy.size == (8, 8)
    text = "".join(parser.text)
    assert text.index("a red square") < text.index("a circle")  # entries keep their order
    assert "image 2" in text and "1.png" in text  # headings: the image id, else the file name
    assert "a square" in text and not list(out.glob(".*tmp"))
    assert f"Not captioned (1){tmp_path / 'gone.jpg'}: file not found" in text


def test_a_file_name_that_is_not_utf8_keeps_its_bytes_in_the_links(tmp_path):
    """A name from an old archive (Latin-1 ``café.png``: the byte 0xE9) is linked byte for byte, inside the gallery
    and copied in, and named in the page's text with the byte escaped."""
    latin = os.fsdecode(b"caf\xe9")  # "caf\udce9": how Python names such a file
    out = tmp_path / "gallery"
    strip = make_png(out / f"{latin}.panels.png")
    entry = GalleryEntry(make_png(tmp_path / f"{latin}.png"), "a red square", panels=Panels(strip, ("a",), (8, 8)))
    write_gallery(out, [entry])
    page = (out / "index.html").read_bytes().decode("utf-8")  # UTF-8 throughout
    parser = Links()
    parser.feed(page)
    assert parser.links == ["images/0000_caf%E9.png", "caf%E9.panels.png"]
    for link in parser.links:
        assert (os.fsencode(out) + b"/" + unquote_to_bytes(link)) in {os.fsencode(p) for p in out.rglob("*")}
    assert "caf\\udce9.png" in "".join(parser.text)


def test_every_copy_gets_its_own_name(tmp_path):
    image = make_png(tmp_path / "photos" / "cat.png")
    overlay = tmp_path / "overlays" / "cat.png"
    overlay.parent.mkdir()
    Image.new("RGB", (8, 8), "blue").save(overlay)
    strip = tmp_path / "panels" / "cat.tif"
    strip.parent.mkdir()
    Image.new("RGB", (8, 8), "green").save(strip)  # a TIFF: re-encoded as JPEG
    out = tmp_path / "gallery"
    write_gallery(out, [GalleryEntry(image, "a cat", overlay=overlay, panels=Panels(strip, ("cat",), (8, 8)))])
    parser = Links()
    parser.feed((out / "index.html").read_text())
    image_link, strip_link, overlay_link = (unquote(link) for link in parser.links)
    assert len({image_link, strip_link, overlay_link}) == 3
    colours = [
        Image.open(out / link).convert("RGB").getpixel((4, 4)) for link in (image_link, strip_link, overlay_link)
    ]
    assert colours[0] == (255, 0, 0) and colours[2] == (0, 0, 255)  # the image shows the image, not the overlay
    assert colours[1][1] > 100 > colours[1][0]  # green (0, 128, 0), through JPEG
    recorded = [json.loads(line) for line in (out / ".captioner-gallery").read_text().splitlines()]
    assert sorted(recorded) == sorted([image_link, strip_link, overlay_link, "index.html"])


def test_an_image_with_transparency_is_copied_on_white_as_it_was_captioned(tmp_path):
    """Copied as it is, a browser showed its transparent pixels on the page's grey: a white logo on transparency,
    which the model saw as all white, showed its shape. Now re-encoded as load_rgb gives it, on white."""
    logo = tmp_path / "logo.png"
    pixels = np.zeros((8, 8, 4), np.uint8)
    pixels[2:6, 2:6] = 255  # a white square, opaque, on transparent black
    Image.fromarray(pixels, "RGBA").save(logo)
    palette = tmp_path / "palette.gif"
    Image.new("P", (8, 8), 0).save(palette, transparency=0)
    out = tmp_path / "gallery"
    write_gallery(out, [GalleryEntry(logo, "a square"), GalleryEntry(palette, "nothing")])
    parser = Links()
    parser.feed((out / "index.html").read_text())
    assert parser.links == ["images/0000_logo.jpg", "images/0001_palette.jpg"]
    for link in parser.links:
        with Image.open(out / link) as copy:
            assert copy.format == "JPEG" and np.asarray(copy).min() >= 250  # white all over, as captioned


def test_an_image_turned_by_exif_is_shown_upright_whatever_its_format(tmp_path):
    """Chromium turns a JPEG by its EXIF orientation but not a WebP, which the page showed on its side (in a box of
    the upright proportions) beside upright panels: such a copy is re-encoded upright; a JPEG is copied as it is."""
    stored = Image.new("RGB", (40, 20), "white")
    stored.paste((255, 0, 0), (0, 0, 10, 10))  # red in the stored image's top-left corner
    exif = Image.Exif()
    exif[0x0112] = 6  # turn 90 degrees clockwise to display: red in the top-right corner, 20 x 40
    for name in ("photo.webp", "photo.png", "photo.jpg"):
        stored.save(tmp_path / name, exif=exif.tobytes(), **({"lossless": True} if name.endswith("webp") else {}))
    out = tmp_path / "gallery"
    write_gallery(out, [GalleryEntry(tmp_path / name, "red") for name in ("photo.webp", "photo.png", "photo.jpg")])
    parser = Links()
    parser.feed((out / "index.html").read_text())
    assert parser.links == ["images/0000_photo.jpg", "images/0001_photo.jpg", "images/0002_photo.jpg"]
    for link in parser.links[:2]:
        with Image.open(out / link) as copy:
            assert copy.size == (20, 40) and copy.getpixel((17, 2))[1] < 80  # upright: red top right
    assert (out / parser.links[2]).read_bytes() == (tmp_path / "photo.jpg").read_bytes()


def test_a_large_gallery_pages_with_failures_first(tmp_path, monkeypatch):
    monkeypatch.setattr(gallery, "PAGE_SIZE", 2)
    images = [make_png(tmp_path / f"{k}.png") for k in range(5)]
    entries = [
        GalleryEntry(image, f"caption {k}", panels=Panels(image, ("red",), (8, 8)), scale=(0.25, 0.8))
        for k, image in enumerate(images)
    ]
    entries.insert(2, GalleryEntry(tmp_path / "broken.jpg", None, error="not an image file"))
    out = tmp_path / "gallery"
    assert write_gallery(out, entries) == out / "index.html"
    pages = ["index.html", "page002.html", "page003.html"]
    assert sorted(path.name for path in out.glob("*.html")) == pages
    shown = []
    for number, name in enumerate(pages):
        page = (out / name).read_text()
        shown.append(re.findall(r"caption \d", page))
        parser = Links()
        parser.feed(page)
        assert [link for link in parser.links if link.endswith(".html")] == [p for p in pages if p != name] * 2
        assert ("Not captioned (1)" in page) == (number == 0)
    assert shown == [["caption 0", "caption 1"], ["caption 2", "caption 3"], ["caption 4"]]
    first = (out / "index.html").read_text()
    assert "5 captioned, 1 not captioned" in first
    assert first.index("not an image file") < first.index("caption 0")  # the failures come first
    assert 'class="mark" style="left: 31.2%' in first and "orange mark: 1/L = 0.25" in first  # 0.25 / 0.8 of the scale


def test_a_panel_is_cropped_from_its_strip_and_the_words_step_the_crop(tmp_path):
    strip = make_png(tmp_path / "strip.png")
    entry = GalleryEntry(make_png(tmp_path / "1.png"), "a b c d e f g", panels=Panels(strip, tuple("abcdefg"), (10, 6)))
    page = write_gallery(tmp_path / "out", [entry]).read_text()
    crop = re.search(
        r'<div class="crop" style="([^"]*)"><img class="panel" loading="lazy" src="([^"]*)" [^>]*style="([^"]*)"', page
    )  # loaded as it scrolls into view: a page of large photos does not fetch every strip at once
    assert crop.group(1) == "width: 533px; height: 320px"  # 10 x 6 fitted to SHOWN (640 x 320)
    assert unquote(crop.group(2)) == "images/0000_1.panels.png"  # copied in, as the strip it is
    # five panels a row of 16 x 8 (each 10 x 6 and white to the next JPEG block), two rows: as % of one panel
    assert crop.group(3) == "width: 800.0000%; height: 266.6667%; left: 0%; top: 0%"
    data = html.unescape(re.search(r'data-strip="([^"]*)"', page).group(1))
    assert json.loads(data) == [5, 160.0, 133.3333]  # columns, one stride across and down, as % of one panel
    assert json.loads(html.unescape(re.search(r'data-words="([^"]*)"', page).group(1))) == list("abcdefg")


def test_text_is_escaped(tmp_path):
    caption = '<script>alert("x")</script> cats & dogs'
    entry = GalleryEntry(make_png(tmp_path / "3.png"), caption, references=("<b>bold</b>",), image_id=3)
    html = write_gallery(tmp_path, [entry], title="run <1>").read_text(encoding="utf-8")
    assert html.count("<script>") == 1 and "<b>" not in html and "run <1>" not in html  # the page's own script
    assert "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt; cats &amp; dogs" in html
    parser = Links()
    parser.feed(html)
    assert caption in "".join(parser.text)


def test_missing_files_raise(tmp_path):
    entry = GalleryEntry(make_png(tmp_path / "1.png"), "a", overlay=tmp_path / "missing.png")
    with pytest.raises(FileNotFoundError, match="missing.png"):
        write_gallery(tmp_path / "out", [entry])
    assert not (tmp_path / "out" / "index.html").exists()


def test_an_image_that_cannot_be_copied_is_listed_as_failed_and_the_others_are_shown(tmp_path):
    """Its copy decodes it (a TIFF: no browser shows one) and it is over the pixel limit: that entry's failure
    on the first page, not the gallery's."""
    large = tmp_path / "large.tif"
    Image.new("RGB", (60, 50), "blue").save(large)
    entries = [GalleryEntry(make_png(tmp_path / "1.png"), "a circle"), GalleryEntry(large, "a square")]
    index = write_gallery(tmp_path / "out", entries, max_pixels=2_000)
    text = index.read_text(encoding="utf-8")
    assert "1 captioned, 1 not captioned" in text and "a circle" in text and "a square" not in text
    assert f"<code>{large}</code>: cannot be shown: image too large: 60x50 is 3,000 pixels" in text


# ------------------------------------------------------------------------------ in a real browser
BROWSER = next(
    (shutil.which(name) for name in ("chromium", "chromium-browser", "google-chrome") if shutil.which(name)), None
)
# Appended to a copy of the page: checks every image, then steps through the words of the first image with the
# keyboard and a click, recording after each step which pixels of the strip the crop shows (once it has loaded):
# the corner and the size, in the strip's own pixels.
CHECKS = """<script>
window.addEventListener("load", async () => {
  const loaded = img => new Promise(done => img.complete ? done() : img.addEventListener("load", done));
  const entry = document.querySelector(".entry[data-words]");
  const panel = entry.querySelector("img.panel");
  const state = async () => {
    await loaded(panel);
    const crop = panel.parentElement.getBoundingClientRect(), whole = panel.getBoundingClientRect();
    const across = panel.naturalWidth / whole.width, down = panel.naturalHeight / whole.height;
    const shown = [crop.left - whole.left, crop.top - whole.top, crop.width, crop.height];
    return [shown.map((value, k) => Math.round(value * (k % 2 ? down : across))),
      getComputedStyle(panel.parentElement).overflow, panel.alt,
      entry.querySelector("figcaption.word").textContent, entry.querySelector(".words .current").textContent];
  };
  const key = name => entry.dispatchEvent(new KeyboardEvent("keydown", {key: name, bubbles: true}));
  const states = [await state()];
  entry.focus(); key("ArrowRight"); states.push(await state());
  entry.querySelectorAll(".words button")[2].click(); states.push(await state());
  key("ArrowLeft"); states.push(await state());
  key("ArrowLeft"); key("ArrowLeft"); states.push(await state());
  await Promise.all([...document.images].map(loaded));
  const images = [...document.images].map(img => [img.getAttribute("src"), img.naturalWidth > 0]);
  const failed = [...document.querySelectorAll(".failed li")].map(item => item.textContent);
  const result = document.createElement("pre");
  result.id = "checks";
  result.textContent = JSON.stringify({images, states, failed});
  document.body.append(result);
});
</script>"""


@pytest.mark.slow
@pytest.mark.skipif(BROWSER is None, reason="no Chromium on this machine (apt-get install chromium)")
def test_a_moved_gallery_works_in_a_real_browser(tmp_path):
    from captioner import cli
    from conftest import write_bundle

    words = ["a", "red", "blue", "circle", "square"]
    bundle = write_bundle(tmp_path / "model.pt", words)
    photos = tmp_path / "photos"
    photos.mkdir()
    Image.new("RGB", (10, 6), "red").save(photos / "square.png")  # panels of 10 x 6: 16 x 8 in the strip
    Image.new("RGB", (4000, 20), "blue").save(photos / "wide.tif")  # a TIFF: browsers show only its copy
    (photos / "broken.jpg").write_text("not an image")
    args = ["attend", str(photos), "--model", str(bundle), "--out", str(tmp_path / "made"), "--max-len", "7"]
    assert cli.main([*args, "--workers", "0"]) == 1  # the broken file
    moved = tmp_path / "elsewhere" / "gallery"
    moved.parent.mkdir()
    shutil.move(tmp_path / "made", moved)
    shutil.rmtree(photos)  # the page must not need the originals
    page = moved / "checks.html"
    page.write_text((moved / "index.html").read_text().replace("</body>", CHECKS + "</body>"))
    proc = subprocess.run(
        [BROWSER, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=10000", "--dump-dom",
         "--window-size=1200,3000", page.as_uri()],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    found = re.search(r'<pre id="checks">(.*?)</pre>', proc.stdout, re.DOTALL)
    assert found, proc.stdout[-2000:] + proc.stderr[-2000:]
    checks = json.loads(html.unescape(found.group(1)))
    images = checks["images"]
    assert len(images) == 2 * 2 and all(ok for _, ok in images), images  # two images and their strips
    assert {src for src, _ in images} == {  # 0000: broken.jpg
        "images/0001_square.png", "0001_square.panels.jpg", "images/0002_wide.jpg", "0002_wide.panels.jpg"
    }  # fmt: skip
    corners = [[0, 0], [16, 0], [32, 0], [16, 0], [16, 8]]  # steps 0, 1, 2, 1, then back round to 6: 2nd row
    assert [shown for shown, *_ in checks["states"]] == [[*corner, 10, 6] for corner in corners]
    assert all(overflow == "hidden" for _, overflow, *_ in checks["states"])
    for _, _, alt, word, button in checks["states"]:
        assert alt == f"attention for: {word}" and word == button  # the label and the highlighted word agree
    assert checks["failed"] == [f"{photos / 'broken.jpg'}: not an image file (Pillow cannot identify its format)"]


def test_the_record_takes_an_images_files_in_one_write_and_never_a_users_file(tmp_path):
    from captioner.viz.layout import MANIFEST, GalleryFiles

    files = GalleryFiles(tmp_path / "out")
    written = [files.sheet(3, "cat.png"), files.strip(3, "cat.png"), files.page(0)]
    assert files.record_all([*written, written[0]]) == [*written, written[0]]
    names = ["0003_cat.jpg", "0003_cat.panels.jpg", "index.html"]
    assert (tmp_path / "out" / MANIFEST).read_text().splitlines() == [f'"{name}"' for name in names]
    assert files.record_all(written) == written and len((tmp_path / "out" / MANIFEST).read_text().splitlines()) == 3
    mine = make_png(files.strip(4, "dog.png"))  # a user's file where entry 4's strip goes
    with pytest.raises(FileExistsError, match="no gallery wrote it"):
        files.record_all([files.sheet(4, "dog.png"), mine])
    assert not files.ours(files.sheet(4, "dog.png"))  # nothing of that call recorded
    assert GalleryFiles(tmp_path / "out").earlier == set(names)


def test_a_recorded_name_resolves_links_below_the_folder(tmp_path):
    from captioner.viz.layout import GalleryFiles

    out = tmp_path / "out"
    (out / "real").mkdir(parents=True)
    (out / "link").symlink_to(out / "real")
    files = GalleryFiles(out)
    assert files.relative(out / "0001_a" / "01.jpg") == "0001_a/01.jpg"
    assert files.relative(out / "link" / "01.jpg") == "real/01.jpg"  # one file, one name
    assert files.relative(out / "x" / ".." / "real" / "01.jpg") == "real/01.jpg"
    assert files.relative(tmp_path / "elsewhere.jpg") == "../elsewhere.jpg"
    files.record(out / "link" / "01.jpg")
    assert files.ours(out / "real" / "01.jpg")
