"""The prompt row every role reads: torch-free, so the schema and the data readers import it without torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

DEFAULT_FRAMES = 16  # frames a clip is sampled to unless the job says otherwise (data.frames): MVBench's protocol
# the image formats anything here decodes (Pillow's names): training and data rows (models/processor.py `decode_image`)
# and a served request's images (serving/limits.py); Pillow's others stay shut (its EPS plugin would launch Ghostscript)
IMAGE_FORMATS = ("BMP", "GIF", "JPEG", "PNG", "WEBP")


@dataclass(frozen=True)
class Clip:
    """A video as the model sees it: frames sampled uniformly from the source (models/processor.py `read_clip`), each
    with its time in the source, in seconds (what Qwen3's timestamps between frames are written from), and the rate
    the frames stand for (what Qwen2.5-VL's temporal positions are spaced by)."""

    frames: tuple[Any, ...]  # each a path, bytes, a PIL image or an [H, W, 3] uint8 array
    seconds: tuple[float, ...]
    fps: float  # listed frames: their rate; sampled ones: transformers' `sampled_fps`, frames kept / the source's seconds

    def __post_init__(self):
        if len(self.frames) != len(self.seconds):
            raise ValueError(f"a clip of {len(self.frames)} frames has {len(self.seconds)} timestamps")
        if not self.fps > 0:
            raise ValueError(f"a clip's fps must be positive, got {self.fps}")

    @classmethod
    def at_rate(cls, frames, fps: float) -> Clip:
        """Frames taken `fps` to the second, the first at 0 s."""
        frames = tuple(frames)
        return cls(frames=frames, seconds=tuple(i / fps for i in range(len(frames))), fps=fps)


@dataclass(frozen=True)
class Sample:
    """One prompt: driver -> rollout workers and teacher (the update's samples), and every evaluation."""

    uid: str
    images: tuple[Any, ...]  # in the order the prompt shows them, before the video: each a path, bytes or a PIL image
    question: str
    answer: str | None = None  # what an evaluation checks (exact match on <answer>...</answer>)
    response: str | None = None  # a whole response written for the row (its annotators, another model): sft / fixed_prefix train on it
    video: Any = None  # a clip the prompt shows after its images: a video file's path (or its bytes read on use), or a Clip
    kind: str | None = None  # the kind of question the row asks (a toy task's): evaluations report accuracy per kind too

    def __post_init__(self):
        if not self.images and self.video is None:
            raise ValueError(f"{self.uid}: a prompt row needs at least one image or a video")
