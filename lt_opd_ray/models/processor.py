"""Chat messages + images (+ a video) -> one prompt's token ids, pixels and the query-token mask.

Images go through the family's PIL image processor (core/families.py; no torchvision needed), resized
so their area lies within [min_pixels, max_pixels] with sides in multiples of
patch x merge (Qwen's smart resize; the bounds come from the job, else the model
folder); the
chat template comes from the model's tokenizer. Each `<|image_pad|>` of the
rendered template is expanded to the image's N post-merger tokens (the family's placeholder:
`<|image_pad|>` for Qwen, `<|image|>` for GLM-4V). The query
mask marks the tokens of the user's text parts only (question and options), not
the system prompt or the chat-template scaffolding: CDPruner's query is their mean
input embedding.

A video (families with a `video_processor`: Qwen3.5, Qwen3-VL) is read as `frames` frames sampled uniformly from
the source (transformers' video readers and sampling), processed by the family's video processor, and laid out as
the model's own processor and vLLM lay it out (transformers >= 5.10): inside the template's
`<|vision_start|><|video_pad|><|vision_end|>`, the placeholder becomes, per temporal patch of two frames,
`<t seconds>` (the patch's mean time), then the patch's tokens between their own vision start and end.
"""

from __future__ import annotations

import io
import itertools
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lt_opd_ray.core.errors import InputError
from lt_opd_ray.core.families import Family, family_of_config
from lt_opd_ray.core.samples import DEFAULT_FRAMES, Clip

TEXT, IMAGE, VIDEO = 0, 1, 2  # mm_token_type_ids values, as the Qwen processors use them


@dataclass
class PromptInputs:
    """One sample's full-token prompt (unpadded)."""

    input_ids: torch.Tensor  # [L] long
    mm_token_type_ids: torch.Tensor  # [L] int: 0 text, 1 image
    query_mask: torch.Tensor  # [L] bool: user text tokens
    pixel_values: torch.Tensor | None  # [patches, C * temporal * patch * patch]; None without images
    image_grid_thw: torch.Tensor  # [images, 3] patch grid (before the 2x2 merge)
    pixel_values_videos: torch.Tensor | None = None  # the clip's patches; None without a video
    video_grid_thw: torch.Tensor | None = None  # [1, 3]: temporal patches, then the patch grid of each
    second_per_grid_ts: torch.Tensor | None = None  # [1]: seconds a temporal patch spans (families whose clip is one run)
    clip: Clip | None = None  # the sampled clip the video's pixels were made from (decoded [H, W, 3] frames), for vLLM's processor
    clip_span: tuple[int, int] | None = None  # [start, end) of the ids that replaced the video placeholder

    @property
    def num_images(self) -> int:
        return self.image_grid_thw.shape[0]

    @property
    def visual_units(self) -> list[tuple[int, tuple[int, int, int]]]:
        """(modality, patch grid) of each visual unit in prompt order: one per image, one per temporal patch of the clip
        (t = 1 each; a run of its own after its timestamp, or one of equal slices of the clip's one run); what
        selection, `reduce` and the learner's replay index by."""
        patches = _frame_grids(self.video_grid_thw)
        per_patch = int((self.mm_token_type_ids == VIDEO).sum()) // len(patches) if patches else 0
        grids = {IMAGE: iter(self.image_grid_thw.tolist()), VIDEO: iter(patches)}
        return [(kind, tuple(next(grids[kind]))) for kind, length in _runs(self.mm_token_type_ids)
                for _ in range(1 if kind == IMAGE else length // per_patch)]


def _frame_grids(video_grid_thw: torch.Tensor | None) -> list[list[int]]:
    """A clip's grid split into one (1, h, w) grid per temporal patch, as the model's rope index splits it."""
    if video_grid_thw is None:
        return []
    return [[1, h, w] for t, h, w in video_grid_thw.tolist() for _ in range(t)]


def _runs(types: torch.Tensor) -> list[tuple[int, int]]:
    """(modality, length) of each run of non-text tokens, in order."""
    return [(kind, len(list(run))) for kind, run in itertools.groupby(types.tolist()) if kind != TEXT]


def decode_image(source):
    """A fully decoded PIL image from bytes or a path, one of `IMAGE_FORMATS` only (Pillow's other plugins are never
    tried: EPS would launch Ghostscript); what stops it (another format, undecodable, truncated, or larger than PIL's
    decompression-bomb limit) raises ImageError with the reason."""
    from PIL import Image, UnidentifiedImageError

    from lt_opd_ray.core.samples import IMAGE_FORMATS

    try:
        image = Image.open(io.BytesIO(source) if isinstance(source, (bytes, bytearray)) else Path(source), formats=list(IMAGE_FORMATS))
        image.load()
        return image
    except FileNotFoundError:
        raise
    except Image.DecompressionBombError as exc:
        raise ImageError(f"refused, too many pixels (a decompression bomb?): {exc}") from None
    except UnidentifiedImageError as exc:
        refused = _refused_format(source)
        if refused:
            raise ImageError(f"is {refused}, an image format refused here: images may be {', '.join(IMAGE_FORMATS)}") from None
        raise ImageError(f"does not decode: {exc}") from None
    except (OSError, SyntaxError, ValueError) as exc:
        raise ImageError(f"does not decode: {exc}") from None


def _refused_format(source) -> str | None:
    """The Pillow format an image not of `IMAGE_FORMATS` is, from its first bytes (each plugin's own prefix test;
    nothing opened), or None."""
    from PIL import Image

    from lt_opd_ray.core.samples import IMAGE_FORMATS

    try:
        if isinstance(source, (bytes, bytearray)):
            head = bytes(source[:4096])
        else:
            with open(source, "rb") as file:
                head = file.read(4096)
    except OSError:
        return None
    Image.init()
    for name, (_, accept) in list(getattr(Image, "OPEN", {}).items()):
        if name not in IMAGE_FORMATS and accept is not None:
            try:
                if accept(head):
                    return name
            except Exception:  # a plugin's prefix test on bytes it did not expect
                continue
    return None


class ImageError(ValueError):
    pass


def load_image(source: Any, where: str = "image"):
    """Decode a PIL image from a PIL image, a path or bytes; an undecodable one is an InputError naming it."""
    from PIL import Image

    if hasattr(source, "read"):  # read on use: an image in a prepared shard (bytes), a toy item's image (PIL)
        source = source.read()
    if isinstance(source, Image.Image):
        return source.convert("RGB")
    if hasattr(source, "__array_interface__"):  # a decoded video frame: [H, W, 3] uint8
        return Image.fromarray(source).convert("RGB")
    try:
        return decode_image(source).convert("RGB")
    except FileNotFoundError:
        raise InputError(f"{where}: image file not found: {source}") from None
    except ImageError as exc:
        label = f"{len(source)} bytes" if isinstance(source, (bytes, bytearray)) else str(source)
        raise InputError(f"{where} ({label}) {exc}") from None


class VLMProcessor:
    """Tokenizer + image processor of one model folder."""

    def __init__(self, model_dir: str | Path, min_pixels: int | None = None, max_pixels: int | None = None,
                 frames: int = DEFAULT_FRAMES):
        """min_pixels / max_pixels (a job's data section) override the model folder's image resize bounds; `frames`:
        how many frames a video is sampled to."""
        import json

        import transformers

        config_path = Path(model_dir) / "config.json"
        if not config_path.exists():
            raise InputError(f"{config_path}: no model config (its model_type names the family whose image processor to use)")
        self.family = family_of_config(json.loads(config_path.read_text()), str(config_path))
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
        self.image_processor = getattr(transformers, self.family.image_processor).from_pretrained(model_dir)
        if min_pixels is not None or max_pixels is not None:
            size = self.image_processor.size
            self.image_processor.size = {
                "shortest_edge": min_pixels or size.shortest_edge,
                "longest_edge": max_pixels or size.longest_edge,
            }
        self.merge_size = self.image_processor.merge_size
        self.eos_token_ids = end_of_sequence_ids(Path(model_dir), self.tokenizer)
        self.image_token = self.family.image_token
        self.image_token_id = self.tokenizer.convert_tokens_to_ids(self.image_token)
        if self.image_token_id is None or self.image_token_id == self.tokenizer.unk_token_id:
            raise InputError(f"{model_dir}: tokenizer has no {self.image_token} token ({self.family.name}'s image placeholder)")
        self.model_dir = Path(model_dir)
        self.frames = frames
        self._video_processor = None
        self.video_start, self.video_token, self.video_end = self.tokenizer.convert_tokens_to_ids(list(self.family.video_tokens))
        self.image_start_id, self.image_end_id = self.tokenizer.convert_tokens_to_ids([self.family.image_start, self.family.image_end])

    @classmethod
    def for_data(cls, model_dir: str | Path, data) -> VLMProcessor:
        """The processor a job's data section asks for (its image bounds, its clips' frame count)."""
        return cls(model_dir, data.min_pixels, data.max_pixels, data.frames)

    @property
    def video_processor(self):
        """The family's video processor, loaded from the model folder on first use."""
        if self._video_processor is None:
            import transformers

            self._video_processor = getattr(transformers, self.family.video_processor).from_pretrained(self.model_dir)
        return self._video_processor

    def encode(self, messages: list[dict], images: list[Any], sample_id: str = "sample", video: Any = None,
               answer_at_once: bool = False) -> PromptInputs:
        """`answer_at_once`: the prompt ends where the model's answer begins, also under a chat template that opens a
        thinking block after the assistant's turn (Qwen3 / Qwen3.5 close it empty given `enable_thinking=False`;
        a template without that switch renders as it would)."""
        thinking = {"enable_thinking": False} if answer_at_once else {}
        rendered = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **thinking)
        placeholders = rendered.count(self.image_token)
        if placeholders == 0 and video is None:
            raise InputError(f"{sample_id}: prompt has no image placeholder (no {{'type': 'image'}} part in messages)")
        if placeholders != len(images):
            raise InputError(f"{sample_id}: prompt has {placeholders} image placeholder(s) but {len(images)} image(s)")
        if (video is None) != (self.family.video_tokens[1] not in rendered):
            raise InputError(f"{sample_id}: the prompt's video placeholder and its video do not match (one without the other)")
        if images and video is not None and not self.family.image_beside_clip:
            raise InputError(f"{sample_id}: {self.family.name} takes images or a video in one prompt, not both (its model marks"
                             " images and frames with one token)")
        tokens_per_image, vision = [], {}
        if images:
            pil_images = [load_image(img, f"{sample_id}: image {i}") for i, img in enumerate(images)]
            vision = self.image_processor(images=pil_images, return_tensors="pt")
            tokens_per_image = (vision["image_grid_thw"].prod(-1) // self.merge_size**2).tolist()
        clip_ids, clip_types, clip, clip_span = [], [], {}, None
        if video is not None:
            clip = self.encode_clip(read_clip(video, self.frames, f"{sample_id}: video"), f"{sample_id}: video")
            clip_ids, clip_types = clip.pop("ids"), clip.pop("types")

        encoded = self.tokenizer(rendered, return_offsets_mapping=True, add_special_tokens=False)
        query_spans = _user_text_spans(messages, rendered)
        ids, types, query = [], [], []
        image_index = 0
        for token_id, (start, end) in zip(encoded["input_ids"], encoded["offset_mapping"]):
            if token_id == self.image_token_id:
                n = tokens_per_image[image_index]
                image_index += 1
                ids += [token_id] * n
                types += [IMAGE] * n
                query += [False] * n
                continue
            if token_id == self.video_token:
                clip_span = (len(ids), len(ids) + len(clip_ids))
                ids += clip_ids
                types += clip_types
                query += [False] * len(clip_ids)
                continue
            ids.append(token_id)
            types.append(TEXT)
            query.append(any(s <= start and end <= e for s, e in query_spans) and end > start)
        if not any(query):
            raise InputError(f"{sample_id}: the user message has no question text (the selector needs a query)")
        return PromptInputs(
            input_ids=torch.tensor(ids, dtype=torch.long),
            mm_token_type_ids=torch.tensor(types, dtype=torch.int32),
            query_mask=torch.tensor(query, dtype=torch.bool),
            pixel_values=vision.get("pixel_values"),
            image_grid_thw=vision.get("image_grid_thw", torch.zeros(0, 3, dtype=torch.long)),
            pixel_values_videos=clip.get("pixel_values_videos"),
            video_grid_thw=clip.get("video_grid_thw"),
            second_per_grid_ts=clip.get("second_per_grid_ts"),
            clip=clip.get("clip"),
            clip_span=clip_span,
        )

    def encode_clip(self, clip: Clip, where: str = "video") -> dict:
        """A clip's pixels and grid from the family's video processor, and what replaces its placeholder, as the
        family's processor writes it (core/families.py `clip_layout`): per temporal patch, `<t seconds>` (the mean time
        of the patch's frames) then the patch's tokens between vision start and end (Qwen3); per patch its tokens
        between image start and end, then the whole seconds of its first frame (GLM-4V); or every patch's tokens in one
        run, with the seconds a patch spans (Qwen2.5-VL)."""
        import numpy as np

        decoded = [np.asarray(load_image(frame, f"{where} frame {i}")) for i, frame in enumerate(clip.frames)]
        if len({frame.shape for frame in decoded}) > 1:
            raise InputError(f"{where}: its frames differ in size ({', '.join(sorted({f'{f.shape[1]}x{f.shape[0]}' for f in decoded}))}); a clip's frames share one")
        frames = np.stack(decoded)
        # Qwen's processors cap each frame's pixels at the per-frame bound (GLM-4V's have no such option)
        capped = {"cap_pixels_per_frame": True} if "cap_pixels_per_frame" in typing.get_type_hints(self.video_processor.valid_kwargs) else {}
        out = self.video_processor(videos=[frames], do_sample_frames=False, return_tensors="pt", **capped)
        t, h, w = out["video_grid_thw"][0].tolist()
        per_patch = h * w // self.video_processor.merge_size**2
        step = self.video_processor.temporal_patch_size
        seconds = list(clip.seconds) + [clip.seconds[-1]] * (-len(clip.seconds) % step)  # the processor repeats the last frame
        pixels = {"pixel_values_videos": out["pixel_values_videos"], "video_grid_thw": out["video_grid_thw"],
                  "clip": Clip(frames=tuple(decoded), seconds=clip.seconds, fps=clip.fps)}
        layout = self.family.clip_layout
        if layout == "one_run":  # as transformers' Qwen2_5_VLProcessor: temporal_patch_size / the sampled frames' rate
            return {"ids": [self.video_token] * (t * per_patch), "types": [VIDEO] * (t * per_patch), **pixels,
                    "second_per_grid_ts": torch.tensor([step / clip.fps])}
        text = lambda words: self.tokenizer(words, add_special_tokens=False)["input_ids"]  # noqa: E731
        ids, types = [], []
        for patch in range(t):
            if layout == "stamp_before":
                stamp = text(f"<{(seconds[patch * step] + seconds[patch * step + step - 1]) / 2:.1f} seconds>")
                ids += [*stamp, self.video_start, *[self.video_token] * per_patch, self.video_end]
                types += [TEXT] * (len(stamp) + 1) + [VIDEO] * per_patch + [TEXT]
            else:  # stamp_after: GLM-4V's frames are image runs inside the video's start and end
                stamp = text(str(int(seconds[patch * step])))
                ids += [self.image_start_id, *[self.image_token_id] * per_patch, self.image_end_id, *stamp]
                types += [TEXT] + [VIDEO] * per_patch + [TEXT] * (1 + len(stamp))
        return {"ids": ids, "types": types, **pixels}


def read_clip(video: Any, frames: int, where: str = "video") -> Clip:
    """`frames` frames sampled uniformly (transformers' sampling: frame i * total // frames) from a video file (read with
    OpenCV; its path, or an object whose `read()` gives its bytes, as a prepared shard's video) or from a clip whose
    frames are already listed; a source with fewer frames is an InputError naming it."""
    import tempfile

    from transformers.video_utils import VideoMetadata, default_sample_indices_fn

    if isinstance(video, Clip):
        if len(video.frames) < frames:
            raise _too_short(where, "the clip", len(video.frames), frames)
        picked = default_sample_indices_fn(VideoMetadata(total_num_frames=len(video.frames), fps=None), num_frames=frames).tolist()
        rate = VideoMetadata(total_num_frames=len(video.frames), fps=video.fps, frames_indices=picked).sampled_fps
        return Clip(frames=tuple(video.frames[i] for i in picked), seconds=tuple(video.seconds[i] for i in picked), fps=rate)
    if hasattr(video, "read"):  # OpenCV decodes files: the bytes go through a temporary one, removed once decoded
        with tempfile.NamedTemporaryFile(prefix="lt-opd-clip-") as copy:
            copy.write(video.read())
            copy.flush()
            return _decode_video_file(Path(copy.name), frames, where, "the video's bytes")
    if not Path(video).is_file():
        raise InputError(f"{where}: video file not found: {video}")
    return _decode_video_file(Path(video), frames, where, str(video))


def _too_short(where: str, what: str, total: int, frames: int) -> InputError:
    return InputError(f"{where}: {what} has {total} frame(s), fewer than the {frames} a clip is sampled to (data.frames)")


def _decode_video_file(path: Path, frames: int, where: str, label: str) -> Clip:
    """`frames` frames sampled uniformly from the video file at `path`, named `label` in what goes wrong."""
    from transformers.video_utils import default_sample_indices_fn, load_video

    def pick(metadata, **_):
        if metadata.total_num_frames <= 0:
            raise InputError(f"{where} ({label}) does not decode as a video (OpenCV reads no frames from it)")
        if metadata.total_num_frames < frames:
            raise _too_short(where, label, metadata.total_num_frames, frames)
        return default_sample_indices_fn(metadata, num_frames=frames)

    try:
        pixels, metadata = load_video(str(path), backend="opencv", sample_indices_fn=pick)
    except (ValueError, OSError, RuntimeError) as exc:
        if isinstance(exc, InputError):
            raise
        raise InputError(f"{where} ({label}) does not decode: {exc}") from None
    if len(pixels) < frames:  # the container promised frames it did not deliver
        raise _too_short(where, f"{label} (decoded)", len(pixels), frames)
    fps = metadata.fps or 1.0
    return Clip(frames=tuple(pixels), seconds=tuple(i / fps for i in metadata.frames_indices), fps=metadata.sampled_fps)


def end_of_sequence_ids(model_dir: Path, tokenizer) -> tuple[int, ...]:
    """Every id that ends a response: the tokenizer's end-of-sequence token first (what a written response is closed
    with), then those the folder's generation_config.json names (GLM-4V ends at `<|user|>` and `<|observation|>`
    too, Qwen at `<|im_end|>` and `<|endoftext|>`)."""
    import json

    ids = [tokenizer.eos_token_id]
    config = model_dir / "generation_config.json"
    if config.exists():
        named = json.loads(config.read_text()).get("eos_token_id")
        ids += named if isinstance(named, list) else [named] if named is not None else []
    return tuple(dict.fromkeys(i for i in ids if i is not None))


def _user_text_spans(messages: list[dict], rendered: str) -> list[tuple[int, int]]:
    """Character spans of the user messages' text parts inside the rendered template, in order."""
    spans, cursor = [], 0
    for message in messages:
        content = message.get("content")
        parts = [content] if isinstance(content, str) else [p.get("text", "") for p in content if p.get("type") == "text"]
        for text in parts:
            if not text:
                continue
            start = rendered.find(text, cursor)
            if start < 0:
                raise InputError(f"message text {text[:40]!r} not found in the rendered chat template")
            cursor = start + len(text)
            if message.get("role") == "user":
                spans.append((start, cursor))
    return spans


def question_token_ids(ids: list[int], tokenizer, family: Family) -> list[int]:
    """The question's token ids in a rendered prompt: the text of the user turn that holds the first image.

    The same tokens `VLMProcessor.encode` marks as the query for chat prompts built
    from messages, recovered from token ids alone (a served request arrives as ids):
    the turn's opener (the family's: Qwen's `<|im_start|>user\\n`, GLM's `<|user|>\\n`) and special
    tokens are dropped.
    """
    opener, header_text = family.user_turn
    start_id = tokenizer.convert_tokens_to_ids(opener)
    ends = set(tokenizer.convert_tokens_to_ids(list(family.turn_ends)))
    image_id = tokenizer.convert_tokens_to_ids(family.image_token)
    if image_id not in ids:
        return []
    first_image = ids.index(image_id)
    start = max((i for i in range(first_image) if ids[i] == start_id), default=-1) + 1
    end = next((i for i in range(first_image, len(ids)) if ids[i] in ends), len(ids))
    turn = ids[start:end]
    header = tokenizer(header_text, add_special_tokens=False)["input_ids"]
    if turn[: len(header)] == header:
        turn = turn[len(header) :]
    special = set(tokenizer.all_special_ids) | set(tokenizer.convert_tokens_to_ids(
        [family.image_start, family.image_end, family.image_token, *family.video_tokens]))
    return [t for t in turn if t not in special]


def question_messages(question: str, system_prompt: str | None = None, images: int = 1, video: bool = False) -> list[dict]:
    """The chat layout of LT-14K rows: [system], user = the row's images in order, its video, then the question."""
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    parts = [{"type": "image"}] * images + [{"type": "video"}] * video + [{"type": "text", "text": question}]
    messages.append({"role": "user", "content": parts})
    return messages


def sample_images(sample) -> list:
    """A row's images decoded, in order; one that does not decode is an InputError naming the row and its position."""
    return [load_image(image, f"{sample.uid}: image {position}") for position, image in enumerate(sample.images)]


def encode_samples(processor: VLMProcessor, samples, system_prompt: str | None = None, answer_at_once: bool = False) -> list[PromptInputs]:
    """Training rows (uid, images, video, question) -> full-token prompts (`answer_at_once`: see `VLMProcessor.encode`)."""
    return [processor.encode(question_messages(s.question, system_prompt, len(s.images), s.video is not None), list(s.images), s.uid, s.video,
                             answer_at_once) for s in samples]
