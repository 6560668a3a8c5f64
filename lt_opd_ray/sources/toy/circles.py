"""Toy task design 3, `circles`: "which colour is the biggest shape?", for discs, after listing them.

Each image is a 320 px board of 10 x 10 tiles, one tile per merged visual token
(100 tokens; 5% keeps 5). Three discs of distinct colours lie on a flat grey
background, one from each size band (radius ~0.95, ~1.8 and ~2.75 tiles), each
tile of a disc a little lighter or darker, so a disc is a textured object that
spans up to ~30 tokens. The teacher writes the colours in reading order (by each
disc's centre), then the answer: `blue red green <answer>red</answer>`.

Why discs (design 2 used squares): a square's tile says nothing of the square's
size, so a budget that keeps one tile per square destroys the comparison. A
disc's rim tiles show its curvature, which is its radius: like a part of an
object in a photograph, a kept rim token still carries evidence about the whole.
The teacher reads sizes from extents and rims at once; pruned to 5 tokens, the
extents are gone but the rims a diverse selector tends to keep remain, so what
pruning removes is partly recoverable by a student that learns to read them.

Measured (teacher trained by RECIPES["circles"], 512 held-out items): full-token
accuracy 1.000; untrained at 5% 0.445 with CDPruner, 0.473 with DivPrune, 0.715
with random selection (256 items) (random keeps tokens in proportion to area, which is the
teacher's main cue; the diverse selectors keep about one token per object and
many rim tokens). Smaller discs (radius ~0.7 / 1.5 / 2.5) left CDPruner at 0.273,
below chance: most of its 5 tokens fell on the background.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from lt_opd_ray.core.seeding import stable_seed
from lt_opd_ray.sources.toy.base import BACKGROUND, COLOURS, TILE, ToyTask, reading_order_response, written_response

GRID = 10  # tiles per side: 10 x 32 px = 320 px
IMAGE_SIZE = GRID * TILE
RADII = ((0.8, 1.1), (1.6, 2.0), (2.5, 3.0))  # radius bands in tiles, one disc per band: the biggest is unique
GAP = 0.25  # tiles between two discs' rims
SHADE = (0.7, 1.15)  # per-tile brightness factor range
QUESTION = "Which colour is the biggest shape?"


def _place(rng: random.Random) -> list[tuple[float, float, float]]:
    """(centre x, centre y, radius) in tiles per disc, biggest first, inside the board and apart (rejection sampling)."""
    while True:
        discs: list[tuple[float, float, float]] = []
        for low, high in reversed(RADII):
            radius = rng.uniform(low, high)
            for _ in range(200):
                x, y = rng.uniform(radius, GRID - radius), rng.uniform(radius, GRID - radius)
                if all(math.hypot(x - u, y - v) >= radius + r + GAP for u, v, r in discs):
                    discs.append((x, y, radius))
                    break
        if len(discs) == len(RADII):
            return discs


@dataclass(frozen=True)
class Discs:
    """Everything of an item but its pixels: each disc's colour and (centre x, centre y, radius) in tiles, biggest
    first, and each tile's brightness factor."""

    colours: tuple[str, ...]
    discs: tuple[tuple[float, float, float], ...]
    shade: tuple[tuple[float, ...], ...]  # [GRID rows][GRID columns]

    @property
    def answer(self) -> str:
        return self.colours[0]  # discs are placed biggest first

    @property
    def response(self) -> str:
        return reading_order_response(self.discs, self.colours, self.answer)

    @property
    def question(self) -> str:
        return QUESTION

    @property
    def written(self) -> str:
        return written_response("The big one is", self.answer)


def layout(index: int, seed: int, split: str = "train") -> Discs:
    """Item `index` of `split` under `seed`, without drawing it (every random draw of the item, in order)."""
    rng = random.Random(stable_seed("circles", split, seed, index))
    colours = rng.sample(list(COLOURS), len(RADII))
    discs = _place(rng)
    shade = tuple(tuple(rng.uniform(*SHADE) for _ in range(GRID)) for _ in range(GRID))
    return Discs(tuple(colours), tuple(discs), shade)


def draw(index: int, seed: int, split: str = "train"):
    """The item's image (PIL, IMAGE_SIZE square)."""
    return paint(layout(index, seed, split))


def paint(item: Discs):
    """The board of `item`'s discs (PIL, IMAGE_SIZE square): each disc in its colour, each of its tiles shaded."""
    import numpy as np
    from PIL import Image

    coordinate = (np.arange(IMAGE_SIZE) + 0.5) / TILE  # pixel centres in tile units
    tile_of = np.arange(IMAGE_SIZE) // TILE  # each pixel row's (column's) tile
    shade = np.array(item.shade, dtype=np.float32)  # one brightness factor per tile
    pixels = np.empty((IMAGE_SIZE, IMAGE_SIZE, 3), dtype=np.uint8)
    pixels[...] = np.array(BACKGROUND, dtype=np.uint8)
    for colour, (x, y, radius) in zip(item.colours, item.discs):
        # a disc covers the pixels within its radius of its centre; only its bounding box (and a pixel more) is tested
        rows = slice(max(0, int((y - radius) * TILE) - 1), min(IMAGE_SIZE, int((y + radius) * TILE) + 2))
        cols = slice(max(0, int((x - radius) * TILE) - 1), min(IMAGE_SIZE, int((x + radius) * TILE) + 2))
        inside = (coordinate[None, cols] - x) ** 2 + (coordinate[rows, None] - y) ** 2 <= radius**2
        # its colour times each pixel's tile factor in float32, capped at 255, truncated to a byte
        shaded = np.minimum(np.array(COLOURS[colour], dtype=np.float32) * shade[tile_of[rows]][:, tile_of[cols], None], 255.0)
        np.copyto(pixels[rows, cols], shaded.astype(np.uint8), where=inside[..., None])
    return Image.fromarray(pixels)


TASK = ToyTask(name="circles", image_size=IMAGE_SIZE, layout=layout, draw=draw, response_tokens=24)
