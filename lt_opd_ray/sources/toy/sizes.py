"""Toy task design 2, `sizes`: "which colour is the biggest shape?", after listing the shapes.

Each image is a 320 px board of 10 x 10 tiles, one tile per merged visual token
(100 tokens; 5% keeps 5). Three squares of distinct colours and distinct sides
(2, 3 and 4 tiles: 4, 9 and 16 tokens) sit on a flat grey background, each tile a
little lighter or darker than its square's colour, so a square looks like a
textured object and a larger one offers a selector more distinct tokens, as in a
photograph. The teacher answers after writing the colours in reading order (by
each square's top-left tile), so the answer follows a response the model writes
itself: `yellow orange red <answer>orange</answer>`.

What pruning does: a budget of 5 tokens keeps a tile or two of most squares
(listing survives, partly) but not their extents (the size comparison does not).
What training can do: the vision tower sees every patch before selection (full
attention), so a student's encoder can learn to write a square's size into each
of its tiles, which the teacher's encoder never needed to.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from lt_opd_ray.core.seeding import stable_seed
from lt_opd_ray.sources.toy.base import BACKGROUND, COLOURS, TILE, ToyTask, reading_order_response, written_response

GRID = 10  # tiles per side: 10 x 32 px = 320 px
IMAGE_SIZE = GRID * TILE
SIDES = (1, 3, 5)  # each square's side in tiles; distinct, so the biggest is unique
SHADE = (0.7, 1.15)  # per-tile brightness factor range
QUESTION = "Which colour is the biggest shape?"


def _place(rng: random.Random) -> list[tuple[int, int, int]]:
    """(x, y, side) per square, in SIDES order, on distinct tiles (rejection sampling, always terminates in practice)."""
    while True:
        taken: set[tuple[int, int]] = set()
        squares = []
        for side in SIDES:
            for _ in range(100):
                x, y = rng.randrange(GRID - side + 1), rng.randrange(GRID - side + 1)
                tiles = {(x + i, y + j) for i in range(side) for j in range(side)}
                if not tiles & taken:
                    taken |= tiles
                    squares.append((x, y, side))
                    break
        if len(squares) == len(SIDES):
            return squares


@dataclass(frozen=True)
class Squares:
    """Everything of an item but its pixels: each square's colour and (x, y, side) in tiles, in SIDES order, and
    each of its tiles' brightness factor (column by column)."""

    colours: tuple[str, ...]
    squares: tuple[tuple[int, int, int], ...]
    shades: tuple[tuple[float, ...], ...]  # per square: side x side factors, i-major

    @property
    def answer(self) -> str:
        return self.colours[SIDES.index(max(SIDES))]

    @property
    def response(self) -> str:
        return reading_order_response(self.squares, self.colours, self.answer)

    @property
    def question(self) -> str:
        return QUESTION

    @property
    def written(self) -> str:
        return written_response("The big one is", self.answer)


def layout(index: int, seed: int, split: str = "train") -> Squares:
    """Item `index` of `split` under `seed`, without drawing it (every random draw of the item, in order)."""
    rng = random.Random(stable_seed("sizes", split, seed, index))
    colours = rng.sample(list(COLOURS), len(SIDES))
    squares = _place(rng)
    shades = tuple(tuple(rng.uniform(*SHADE) for _ in range(side * side)) for _, _, side in squares)
    return Squares(tuple(colours), tuple(squares), shades)


def draw(index: int, seed: int, split: str = "train"):
    """The item's image (PIL, IMAGE_SIZE square)."""
    from PIL import Image, ImageDraw

    item = layout(index, seed, split)
    image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), BACKGROUND)
    canvas = ImageDraw.Draw(image)
    for colour, (x, y, side), shades in zip(item.colours, item.squares, item.shades):
        for k, shade in enumerate(shades):
            i, j = divmod(k, side)
            fill = tuple(min(255, int(channel * shade)) for channel in COLOURS[colour])
            left, top = (x + i) * TILE, (y + j) * TILE
            canvas.rectangle((left, top, left + TILE - 1, top + TILE - 1), fill=fill)
    return image


TASK = ToyTask(name="sizes", image_size=IMAGE_SIZE, layout=layout, draw=draw, response_tokens=24)
