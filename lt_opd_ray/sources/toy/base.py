"""What every toy task is: a `ToyTask` whose items are pure functions of (index, seed, split), so every process and
machine draws the same images, questions and answers; the tile grid and colours the designs share."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lt_opd_ray.core.samples import Sample

TILE = 32  # pixels per merged visual token at Qwen's 16 px patches and 2 x 2 merge
COLOURS = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (235, 205, 30),
    "purple": (140, 50, 170),
    "orange": (245, 140, 20),
}
BACKGROUND = (128, 128, 128)  # mid-grey: zero after the processor's normalisation, so empty patches carry no signal


def reading_order_response(places, colours, answer: str) -> str:
    """What a toy teacher writes: the shapes' colours in reading order (by centre: row, then column), then the answer.
    `places`: (centre x, centre y, size) per shape, in `colours`' order."""
    order = [colour for (x, y, _), colour in sorted(zip(places, colours), key=lambda pc: (pc[0][1], pc[0][0]))]
    return " ".join(order) + f" <answer>{answer}</answer>"


def written_response(opening: str, answer: str) -> str:
    """A row's own response, as a data set's annotators would word it: a sentence the teacher does not write."""
    return f"{opening} {answer}. <answer>{answer}</answer>"


@dataclass(frozen=True)
class ToyImage:
    """A toy item's image, drawn when read: a toy data set is a few numbers per row until an engine needs the pixels
    (what `load_samples` returns, and what crosses the object store, stays small)."""

    draw: Callable[[int, int, str], Any]  # the task's module-level `draw` (pickled by name)
    index: int
    seed: int
    split: str

    def read(self):
        """The PIL image."""
        return self.draw(self.index, self.seed, self.split)


@dataclass(frozen=True)
class ToyItem:
    sample: Sample
    response: str  # what the full-token teacher is trained to write, ending in <answer>...</answer>


@dataclass(frozen=True)
class ToyTask:
    """A task's items are pure functions of (index, seed, split): `layout` draws every random choice of an item
    (whatever has `.question`, `.answer`, `.response`, what the teacher writes, and `.written`, the row's own
    response in other words), `draw` its pixels from them, only when an image is read."""

    name: str
    image_size: int  # pixels per side: (image_size / TILE)^2 visual tokens at full resolution
    layout: Callable[[int, int, str], Any]  # (index, seed, split) -> the item's choices: .question, .answer, .response, .written
    draw: Callable[[int, int, str], Any]  # (index, seed, split) -> its PIL image
    response_tokens: int  # at least the tokens of any reference response (the toy tokenizer's)
    teacher_split: str = "train"  # the split the full-token teacher is trained on

    def item(self, index: int, seed: int = 0, split: str = "train") -> ToyItem:
        """Item `index` of `split` under `seed`: question, answer and the teacher's response; its image a ToyImage."""
        chosen = self.layout(index, seed, split)
        image = ToyImage(self.draw, index, seed, split)
        sample = Sample(uid=f"{self.name}-{split}-{seed}-{index}", images=(image,), question=chosen.question, answer=chosen.answer,
                        response=chosen.written, kind=getattr(chosen, "kind", None))
        return ToyItem(sample, chosen.response)

    def kind_of(self, sample: Sample) -> str | None:
        """The kind of question a sample of this task asks, where the task asks several (`discs`), else None."""
        image = sample.images[0]
        return getattr(self.layout(image.index, image.seed, image.split), "kind", None)

    def items(self, count: int, split: str = "train", seed: int = 0) -> list[ToyItem]:
        return [self.item(i, seed, split) for i in range(count)]

    def samples(self, count: int, split: str = "train", seed: int = 0) -> list[Sample]:
        return [item.sample for item in self.items(count, split, seed)]
