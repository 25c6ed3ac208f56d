"""How a cluttered scene (``captioner.data.cluttered``) is drawn: its background's pixels, the clutter marks, then
the objects, each filling its box with a darker outline."""

from __future__ import annotations

import numpy as np
from PIL import Image, ImageDraw

from captioner.config import ShapesSpec
from captioner.data.cluttered import COLOURS, Background, ClutteredScene, Item
from captioner.data.scenes import _rng

_NOISE = 14  # a noisy background's pixel noise amplitude, in grey levels


def render_cluttered(scene: ClutteredScene, spec: ShapesSpec, split: str, index: int) -> Image.Image:
    """Draw ``scene`` (the image ``index`` of ``split``): background, clutter, then the objects."""
    width, height = spec.size
    pixels = _background_pixels(scene.background, width, height, _rng(spec, split, index, stream=1))
    image = Image.fromarray(pixels)
    draw = ImageDraw.Draw(image)
    for mark in scene.clutter:
        grey = (mark.grey,) * 3
        if mark.kind == "line":
            draw.line(mark.xy, fill=grey, width=1)
        elif mark.kind == "dot":
            draw.ellipse(mark.xy, fill=grey)
        else:
            draw.ellipse(mark.xy, outline=grey, width=1)
    for item in scene.shapes:
        _draw(draw, item)
    return image


def _background_pixels(background: Background, width: int, height: int, rng: np.random.Generator) -> np.ndarray:
    """The background as a uint8 array (height, width, 3); ``rng`` draws a noisy one's noise."""
    light, dark = (np.asarray(tone, dtype=np.float64) for tone in background.tones)  # (3,) each
    ys, xs = np.mgrid[0:height, 0:width]  # (H, W) each
    if background.style == "gradient":
        mix = xs / max(1, width - 1) if background.direction == 0 else ys / max(1, height - 1)
    elif background.style == "striped":
        along = (xs, ys, xs + ys)[background.direction]
        mix = ((along // (background.period / 2)) % 2).astype(np.float64)  # alternating bands of half a period
    else:  # plain or noisy: the light tone
        mix = np.zeros((height, width))
    pixels = light + mix[..., None] * (dark - light)  # (H, W, 3)
    if background.style == "noisy":
        pixels = pixels + rng.integers(-_NOISE, _NOISE + 1, size=(height, width, 1))  # same noise in R, G, B
    return np.clip(np.rint(pixels), 0, 255).astype(np.uint8)


def _draw(draw: ImageDraw.ImageDraw, item: Item) -> None:
    """Draw one object filling its box, with a darker one-pixel outline."""
    x0, y0, w, h = item.box
    x1, y1 = x0 + w - 1, y0 + h - 1
    fill = COLOURS[item.colour]
    outline = tuple(int(v * 0.6) for v in fill)
    cx, cy, r = x0 + (w - 1) / 2, y0 + (h - 1) / 2, (w - 1) / 2
    if item.shape == "circle":
        draw.ellipse((x0, y0, x1, y1), fill=fill, outline=outline)
    elif item.shape == "square":
        draw.rectangle((x0, y0, x1, y1), fill=fill, outline=outline)
    elif item.shape == "triangle":
        draw.polygon([(cx, y0), (x1, y1), (x0, y1)], fill=fill, outline=outline)
    elif item.shape == "diamond":
        draw.polygon([(cx, y0), (x1, cy), (cx, y1), (x0, cy)], fill=fill, outline=outline)
    elif item.shape == "star":
        angles = -np.pi / 2 + np.arange(10) * np.pi / 5  # (10,) outer and inner points, alternating
        radii = np.where(np.arange(10) % 2 == 0, r, 0.45 * r)  # (10,)
        draw.polygon(list(zip(cx + radii * np.cos(angles), cy + radii * np.sin(angles))), fill=fill, outline=outline)
    else:  # cross: a plus sign with arms a third of the side thick
        t = w / 3
        arms = [(x0 + t, y0), (x1 - t, y0), (x1 - t, y0 + t), (x1, y0 + t), (x1, y1 - t), (x1 - t, y1 - t)]
        arms += [(x1 - t, y1), (x0 + t, y1), (x0 + t, y1 - t), (x0, y1 - t), (x0, y0 + t), (x0 + t, y0 + t)]
        draw.polygon(arms, fill=fill, outline=outline)
