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

from ..data import Sample, stable_seed
from .tasks import BACKGROUND, COLOURS, TILE, ToyItem, ToyTask

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


def circles_item(index: int, seed: int, split: str = "train") -> ToyItem:
    """Image `index` of `split` under `seed`, its question, answer and the teacher's response, all seeded."""
    import numpy as np
    from PIL import Image

    rng = random.Random(stable_seed("circles", split, seed, index))
    colours = rng.sample(list(COLOURS), len(RADII))
    discs = _place(rng)
    # pixel centres in tile units; each disc covers the pixels within its radius of its centre
    coordinate = (np.arange(IMAGE_SIZE) + 0.5) / TILE
    xs, ys = np.meshgrid(coordinate, coordinate)
    pixels = np.empty((IMAGE_SIZE, IMAGE_SIZE, 3), dtype=np.float32)
    pixels[:] = BACKGROUND
    for colour, (x, y, radius) in zip(colours, discs):
        pixels[(xs - x) ** 2 + (ys - y) ** 2 <= radius**2] = COLOURS[colour]
    shade = np.array([[rng.uniform(*SHADE) for _ in range(GRID)] for _ in range(GRID)], dtype=np.float32)
    on_disc = (pixels != np.array(BACKGROUND, dtype=np.float32)).any(axis=-1, keepdims=True)
    shaded = pixels * np.kron(shade, np.ones((TILE, TILE), dtype=np.float32))[..., None]  # one factor per tile
    pixels = np.where(on_disc, np.minimum(shaded, 255.0), pixels)
    image = Image.fromarray(pixels.astype(np.uint8))
    answer = colours[0]  # discs are placed biggest first
    reading_order = [colour for (x, y, _), colour in sorted(zip(discs, colours), key=lambda dc: (dc[0][1], dc[0][0]))]
    sample = Sample(uid=f"circles-{split}-{seed}-{index}", image=image, question=QUESTION, answer=answer)
    return ToyItem(sample, response=" ".join(reading_order) + f" <answer>{answer}</answer>")


TASK = ToyTask(name="circles", image_size=IMAGE_SIZE, item=circles_item, response_tokens=24)
