"""The embedded default data set: coloured shapes on a grid, questions that name what to look at, short answers, and
a response written for each row (what `objective.mode` sft and fixed_prefix train on).

It needs no files and is identical on every machine for a given seed.
"""

from __future__ import annotations

from lt_opd_ray.core.samples import Clip, Sample
from lt_opd_ray.core.seeding import stable_seed

COLOURS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (40, 80, 220), "yellow": (235, 210, 40)}
SHAPES = ("square", "circle")


def synthetic_sample(index: int, seed: int = 0, size: int | tuple[int, int] = 128, images: int = 1) -> Sample:
    """`images` images (size: side, or (width, height)), each with a shape in each quadrant; the question asks for the
    colour at one quadrant of one image ("In image 2, ..." when there are several)."""
    import random

    rng = random.Random(stable_seed("synthetic", seed, index))
    boards = [_board(rng, size) for _ in range(images)]
    shown = rng.randrange(images) if images > 1 else 0  # one image draws nothing: the rows of one image stay as they were
    answers, shapes = boards[shown][1:]
    asked = rng.choice(QUADRANTS)
    where = f"In image {shown + 1}, what" if images > 1 else "What"
    question = f"{where} colour is the shape in the {asked} corner? Answer with one word."
    response = f"A {answers[asked]} {shapes[asked]}. <answer>{answers[asked]}</answer>"
    uid = f"synthetic-{seed}-{index}" if images == 1 else f"synthetic{images}-{seed}-{index}"
    return Sample(uid=uid, images=tuple(board[0] for board in boards), question=question, answer=answers[asked], response=response)


QUADRANTS = ("top left", "top right", "bottom left", "bottom right")
CLIP_FRAMES = 16  # frames of a synthetic clip, one per second: MVBench's count


def synthetic_video_sample(index: int, seed: int = 0, size: int | tuple[int, int] = 128) -> Sample:
    """A clip of CLIP_FRAMES frames, one per second: one board, then from a random frame on another; the question asks
    for the colour at one quadrant at the start or at the end of the clip."""
    import random

    rng = random.Random(stable_seed("synthetic-video", seed, index))
    first, second = _board(rng, size), _board(rng, size)
    cut = rng.randrange(4, CLIP_FRAMES - 4)
    when = rng.choice(("start", "end"))
    answers, shapes = (first if when == "start" else second)[1:]
    asked = rng.choice(QUADRANTS)
    question = f"At the {when} of the video, what colour is the shape in the {asked} corner? Answer with one word."
    response = f"A {answers[asked]} {shapes[asked]}. <answer>{answers[asked]}</answer>"
    frames = tuple((first if frame < cut else second)[0] for frame in range(CLIP_FRAMES))
    return Sample(uid=f"synthetic-video-{seed}-{index}", images=(), question=question, answer=answers[asked], response=response,
                  video=Clip.at_rate(frames, 1.0))


def _board(rng, size):
    """(image, colour per quadrant, shape per quadrant) of one drawn image."""
    from PIL import Image, ImageDraw

    width, height = (size, size) if isinstance(size, int) else size
    image = Image.new("RGB", (width, height), (245, 245, 245))
    draw = ImageDraw.Draw(image)
    answers, shapes = {}, {}
    half_w, half_h = width // 2, height // 2
    for q, name in enumerate(QUADRANTS):
        colour = rng.choice(list(COLOURS))
        shape = rng.choice(SHAPES)
        x0, y0 = (q % 2) * half_w + half_w // 4, (q // 2) * half_h + half_h // 4
        box = (x0, y0, x0 + half_w // 2, y0 + half_h // 2)
        (draw.rectangle if shape == "square" else draw.ellipse)(box, fill=COLOURS[colour])
        answers[name], shapes[name] = colour, shape
    return image, answers, shapes
