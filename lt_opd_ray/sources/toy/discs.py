"""Toy task design 4, `discs`: the circles board asked four kinds of question, with a teacher that is not an oracle.

What the paper's setting has and `circles` lacks (issue 28): several kinds of question, one of them never asked
by the training rows; a full-token teacher that is good but not perfect, uncertain where the image is; rows whose
own responses are worded as annotators would word them, not as the teacher writes.

Each image is a circles board (`circles.paint`: 10 x 10 tiles, three textured discs of distinct colours, one
per size band). An item asks one kind of question:

    biggest    "Which colour is the biggest shape?"
    smallest   "Which colour is the smallest shape?"
    top        "Which colour is the topmost shape?"     (the disc whose edge reaches highest)
    left       "Which colour is the leftmost shape?"    (the disc whose edge reaches furthest left)

The training rows (split "train") ask the first three in turn; the held-out rows ("test") and the teacher's own
training items ("teacher") ask all four. In AMBIGUOUS of the items the two discs the question compares are close:
radii within 4-12% for a size question, edges 2-8 pixels apart for a position question; in the others
they are clearly apart. The teacher reads the close ones at full tokens only sometimes: its accuracy is its
uncertainty there. It writes the colours in reading order, then the answer (as in circles); a row's own response
says it in a sentence: `The small one is red. <answer>red</answer>`.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from lt_opd_ray.core.seeding import stable_seed
from lt_opd_ray.sources.toy.base import COLOURS, ToyTask, written_response
from lt_opd_ray.sources.toy.circles import GAP, GRID, IMAGE_SIZE, SHADE, Discs, paint

KINDS = {
    "biggest": ("Which colour is the biggest shape?", "The big one is"),
    "smallest": ("Which colour is the smallest shape?", "The small one is"),
    "top": ("Which colour is the topmost shape?", "The top one is"),
    "left": ("Which colour is the leftmost shape?", "The left one is"),
}
TRAINING_KINDS = ("biggest", "smallest", "top")  # what the training rows ask; "left" is held out
AMBIGUOUS = 1 / 3  # share of items whose compared discs are close
SMALL, MIDDLE, BIG = (0.85, 1.15), (1.5, 1.9), (2.3, 2.9)  # radius bands in tiles (clear items)
CLOSE_BIG = (1.9, 2.4)  # the biggest disc of a close "biggest" item: two discs of ~2.9 tiles do not fit the board
CLOSE_RADII = (1.04, 1.12)  # ratio of the compared radii in an ambiguous size item
CLOSE_EDGES = (0.06, 0.25)  # tiles between the compared edges of a close position item (at least 2 px: the pixels decide it)
APART_EDGES = 0.75  # ... and at least this far apart in a clear one


def kinds_of(split: str) -> tuple[str, ...]:
    return TRAINING_KINDS if split == "train" else tuple(KINDS)


@dataclass(frozen=True)
class AskedDiscs(Discs):
    """A circles board (discs in placement order, not by size) and the kind of question asked about it."""

    kind: str = "biggest"
    close: bool = False  # the compared discs are close: the item is ambiguous at full tokens too

    @property
    def question(self) -> str:
        return KINDS[self.kind][0]

    @property
    def answer(self) -> str:
        measure = {
            "biggest": lambda d: -d[2],
            "smallest": lambda d: d[2],
            "top": lambda d: d[1] - d[2],  # the highest edge: the smallest y - r
            "left": lambda d: d[0] - d[2],
        }[self.kind]
        return self.colours[min(range(len(self.discs)), key=lambda i: measure(self.discs[i]))]

    @property
    def written(self) -> str:
        return written_response(KINDS[self.kind][1], self.answer)


def _radii(rng: random.Random, kind: str, close: bool) -> list[float]:
    """(big, middle, small) radii; in a close size item the compared pair within CLOSE_RADII of each other."""
    big, middle, small = rng.uniform(*(CLOSE_BIG if close and kind == "biggest" else BIG)), rng.uniform(*MIDDLE), rng.uniform(*SMALL)
    if close and kind == "biggest":
        middle = big / rng.uniform(*CLOSE_RADII)
    if close and kind == "smallest":
        middle = small * rng.uniform(*CLOSE_RADII)
    return [big, middle, small]


def _edges_gap(discs: list[tuple[float, float, float]], kind: str) -> float:
    """Tiles between the two edges a position question compares (the extreme one and the next)."""
    axis = 1 if kind == "top" else 0
    first, second = sorted(d[axis] - d[2] for d in discs)[:2]
    return second - first


def _place(rng: random.Random, radii: list[float], kind: str, close: bool) -> list[tuple[float, float, float]]:
    """(centre x, centre y, radius) per disc, inside the board and apart; for a position question, the compared
    edges close or clearly apart as asked (rejection sampling)."""
    while True:
        discs: list[tuple[float, float, float]] = []
        for radius in radii:
            for _ in range(200):
                x, y = rng.uniform(radius, GRID - radius), rng.uniform(radius, GRID - radius)
                if all(math.hypot(x - u, y - v) >= radius + r + GAP for u, v, r in discs):
                    discs.append((x, y, radius))
                    break
        if len(discs) < len(radii):
            continue
        gap = _edges_gap(discs, kind) if kind in ("top", "left") else None
        if gap is not None and not (CLOSE_EDGES[0] < gap < CLOSE_EDGES[1] if close else gap > APART_EDGES):
            continue
        return discs


def layout(index: int, seed: int, split: str = "train") -> AskedDiscs:
    """Item `index` of `split` under `seed`, without drawing it: the kinds of the split in turn, then every random
    draw of the item, in order."""
    kinds = kinds_of(split)
    kind = kinds[index % len(kinds)]
    rng = random.Random(stable_seed("discs", split, seed, index))
    close = rng.random() < AMBIGUOUS
    colours = rng.sample(list(COLOURS), 3)
    discs = _place(rng, _radii(rng, kind, close), kind, close)
    shade = tuple(tuple(rng.uniform(*SHADE) for _ in range(GRID)) for _ in range(GRID))
    return AskedDiscs(tuple(colours), tuple(discs), shade, kind, close)


def draw(index: int, seed: int, split: str = "train"):
    """The item's image (PIL, IMAGE_SIZE square)."""
    return paint(layout(index, seed, split))


TASK = ToyTask(name="discs", image_size=IMAGE_SIZE, layout=layout, draw=draw, response_tokens=24, teacher_split="teacher")
