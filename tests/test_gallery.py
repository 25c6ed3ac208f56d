"""The HTML gallery: relative links to existing files, escaped text, atomic write."""

from pathlib import Path
from urllib.parse import unquote

import pytest
from PIL import Image

from captioner.viz.gallery import GalleryEntry, write_gallery
from conftest import Links


def make_png(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (8, 8), "red").save(path)
    return path


def test_links_are_relative_and_point_to_existing_files(tmp_path):
    out = tmp_path / "gallery"
    entries = [
        GalleryEntry(
            make_png(tmp_path / "images" / "my image #2.png"),
            "a red square",
            overlay=str(make_png(out / "overlays" / "2.png")),
            references=("a square", "red"),
            image_id=2,
        ),
        GalleryEntry(image=str(make_png(tmp_path / "images" / "1.png")), caption="a circle"),
    ]
    index = write_gallery(out, entries)
    assert index == out / "index.html"
    parser = Links()
    parser.feed(index.read_text(encoding="utf-8"))
    assert len(parser.links) == 6  # link + img for two images and one overlay
    for link in parser.links:
        assert not Path(link).is_absolute() and "://" not in link
        assert (out / unquote(link)).resolve().is_file()
    assert parser.links[0] == "../images/my%20image%20%232.png"
    assert parser.links[2] == "overlays/2.png"
    text = "".join(parser.text)
    assert text.index("a red square") < text.index("a circle")  # entries keep their order
    assert "image 2" in text and "1.png" in text  # headings: the image id, else the file name
    assert "a square" in text and not list(out.glob(".*tmp"))


def test_text_is_escaped(tmp_path):
    caption = '<script>alert("x")</script> cats & dogs'
    entry = GalleryEntry(make_png(tmp_path / "3.png"), caption, references=("<b>bold</b>",), image_id=3)
    html = write_gallery(tmp_path, [entry], title="run <1>").read_text(encoding="utf-8")
    assert "<script>" not in html and "<b>" not in html and "run <1>" not in html
    assert "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt; cats &amp; dogs" in html
    parser = Links()
    parser.feed(html)
    assert caption in "".join(parser.text)


def test_missing_files_raise(tmp_path):
    entry = GalleryEntry(make_png(tmp_path / "1.png"), "a", overlay=tmp_path / "missing.png")
    with pytest.raises(FileNotFoundError, match="missing.png"):
        write_gallery(tmp_path / "out", [entry])
    assert not (tmp_path / "out" / "index.html").exists()
