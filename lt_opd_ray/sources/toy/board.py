"""Toy task design 1, `board`: the answer is a count spread over the whole image.

Each image is a GRID x GRID board of 32 px tiles, one tile per merged visual
token; TILES_PER_IMAGE tiles carry a coloured pattern at random cells, the rest is
background. The question asks which colour is on the most tiles: the answer is a
count over tiles spread across the image. At full tokens it is all in view; a
student keeping 5% of the tokens (2 of 36) sees at most two tiles, so the budget
bites. It can only recover by making its vision encoder summarise the whole
board into the tokens that survive, which the teacher's frozen encoder never had
to do (see teacher.py). Patterns vary the tiles' look (and so the selector's
choices) but not the answer.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from lt_opd_ray.core.seeding import stable_seed
from lt_opd_ray.sources.toy.base import BACKGROUND, COLOURS, TILE, ToyTask

PATTERNS = ("solid", "hollow", "checked", "striped", "dotted")
GRID = 6  # one tile per merged visual token: 6 x 32 px = 192 px
IMAGE_SIZE = GRID * TILE  # 12 x 12 patches of 16 px -> 6 x 6 = 36 merged visual tokens
TILES_PER_IMAGE = 7
MAJORITY = 3  # tiles of the answer colour; every other colour is on at most MAJORITY - 1


def _draw_tile(draw, pattern: str, x0: int, y0: int, fill) -> None:
    """One 32 px tile with a pattern a patch embedding can tell apart (edges, stripes, checks, dots)."""
    x1, y1 = x0 + TILE - 1, y0 + TILE - 1
    if pattern == "solid":
        draw.rectangle((x0, y0, x1, y1), fill=fill)
    elif pattern == "hollow":
        draw.rectangle((x0, y0, x1, y1), outline=fill, width=5)
    elif pattern == "checked":
        for i in range(4):
            for j in range(4):
                if (i + j) % 2 == 0:
                    draw.rectangle((x0 + 8 * i, y0 + 8 * j, x0 + 8 * i + 7, y0 + 8 * j + 7), fill=fill)
    elif pattern == "striped":
        for j in range(0, TILE, 8):
            draw.rectangle((x0, y0 + j, x1, y0 + j + 3), fill=fill)
    else:  # dotted
        for i in range(4):
            for j in range(4):
                draw.ellipse((x0 + 8 * i + 1, y0 + 8 * j + 1, x0 + 8 * i + 6, y0 + 8 * j + 6), fill=fill)


@dataclass(frozen=True)
class Board:
    """Everything of an item but its pixels: the majority colour and each coloured tile's (colour, cell, pattern)."""

    answer: str
    tiles: tuple[tuple[str, int, str], ...]

    @property
    def response(self) -> str:
        return f"<answer>{self.answer}</answer>"

    @property
    def question(self) -> str:
        return QUESTION

    @property
    def written(self) -> str:
        """The row's response as a data set would hold it: the answer alone, as the teacher writes it (the task's ten
        response tokens leave no room for other words)."""
        return self.response


def layout(index: int, seed: int, split: str = "train") -> Board:
    """Board `index` of `split` under `seed` without drawing it: TILES_PER_IMAGE tiles, one colour on MAJORITY of them
    (every random draw of the item, in order)."""
    rng = random.Random(stable_seed("board", split, seed, index))
    names = list(COLOURS)
    majority = rng.choice(names)
    others = [c for c in names if c != majority]
    colours = [majority] * MAJORITY
    while len(colours) < TILES_PER_IMAGE:  # every other colour on fewer tiles than the majority
        colour = rng.choice(others)
        if colours.count(colour) < MAJORITY - 1:
            colours.append(colour)
    cells = rng.sample(range(GRID * GRID), TILES_PER_IMAGE)
    return Board(majority, tuple((colour, cell, rng.choice(PATTERNS)) for colour, cell in zip(colours, cells)))


def draw(index: int, seed: int, split: str = "train"):
    """The board's image (PIL, IMAGE_SIZE square)."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), BACKGROUND)
    canvas = ImageDraw.Draw(image)
    for colour, cell, pattern in layout(index, seed, split).tiles:
        _draw_tile(canvas, pattern, (cell % GRID) * TILE, (cell // GRID) * TILE, COLOURS[colour])
    return image


QUESTION = "Which colour is on the most tiles?"


TASK = ToyTask(name="board", image_size=IMAGE_SIZE, layout=layout, draw=draw, response_tokens=10)
