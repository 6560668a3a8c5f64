"""Video prompts on tiny real Qwen3.5 / Qwen3-VL: the clip's layout against the model's own processor, the 100%-budget
forward against the model's own, kept positions, per-frame / per-clip / per-prompt budgets against brute force, the
clip's vision FLOPs against the counted ones, and video rows' named errors."""

import json

import numpy as np
import pytest
import torch
from conftest import random_image

from lt_opd_ray.core.curriculum import tokens_to_keep
from lt_opd_ray.core.errors import InputError
from lt_opd_ray.core.samples import Clip, Sample
from lt_opd_ray.core.seeding import stable_seed
from lt_opd_ray.core.selectors import SelectionInput, build_selector
from lt_opd_ray.models.processor import TEXT, VIDEO, encode_samples, question_messages, read_clip

VIDEO_FAMILIES = ["qwen3_5", "qwen3_vl", "qwen2_5_vl", "glm4v"]  # every family's video path (core/families.py `clip_layout`)
OWN_PROCESSOR = {"qwen3_5": "Qwen3VLProcessor", "qwen3_vl": "Qwen3VLProcessor", "qwen2_5_vl": "Qwen2_5_VLProcessor", "glm4v": "Glm4vProcessor"}
FPS = 2.0


def clip_of(frames=20, height=64, width=96, seed=0) -> Clip:
    rng = np.random.default_rng(seed)
    pixels = [rng.integers(0, 255, (height, width, 3), dtype=np.uint8) for _ in range(frames)]
    return Clip.at_rate(pixels, FPS)


def video_prompt(processor, images=1, frames=16):
    processor.frames = frames
    shown = [random_image(3, 64, 64)] * images
    return processor.encode(question_messages("What happens in the video?", "You are a helpful assistant.", images, True),
                            shown, "clip", clip_of())


@pytest.mark.parametrize("family", VIDEO_FAMILIES)
def test_a_clips_prompt_is_what_the_models_own_processor_writes(loaded, family):
    """Token ids, modality types and pixels equal transformers' own processor of the family fed the same sampled frames
    and their times: per temporal patch `<t seconds>` then the patch's tokens between vision start and end (Qwen3), per
    patch its tokens between image start and end then its first frame's whole seconds (GLM-4V), or every patch's tokens
    in one run with the seconds a patch spans (Qwen2.5-VL)."""
    import transformers
    from transformers.video_utils import VideoMetadata

    _, processor, _ = loaded[family]
    prompt = video_prompt(processor, images=0)
    picked = read_clip(clip_of(), 16)
    reference = getattr(transformers, OWN_PROCESSOR[family])(image_processor=processor.image_processor, tokenizer=processor.tokenizer,
                                                             video_processor=processor.video_processor)
    rendered = processor.tokenizer.apply_chat_template(question_messages("What happens in the video?", "You are a helpful assistant.", 0, True),
                                                       tokenize=False, add_generation_prompt=True)
    metadata = VideoMetadata(total_num_frames=20, fps=FPS, frames_indices=[round(s * FPS) for s in picked.seconds])
    capped = {"cap_pixels_per_frame": True} if family != "glm4v" else {}  # Qwen's processors cap each frame's pixels
    out = reference(text=[rendered], videos=[np.stack(picked.frames)], video_metadata=[metadata], do_sample_frames=False,
                    return_tensors="pt", **capped)
    assert prompt.input_ids.tolist() == out["input_ids"][0].tolist()
    assert prompt.mm_token_type_ids.tolist() == out["mm_token_type_ids"][0].tolist()
    assert torch.equal(prompt.pixel_values_videos, out["pixel_values_videos"]) and torch.equal(prompt.video_grid_thw, out["video_grid_thw"])
    if "second_per_grid_ts" in out:  # 2 frames per patch at the sampled rate: 16 of 20 frames at 2 fps is 1.6 fps
        assert prompt.second_per_grid_ts.tolist() == out["second_per_grid_ts"].tolist() == [2 / 1.6]
    else:
        assert prompt.second_per_grid_ts is None
    assert [kind for kind, _ in prompt.visual_units] == [VIDEO] * 8  # 16 frames = 8 temporal patches


@pytest.mark.parametrize("family", VIDEO_FAMILIES)
@torch.no_grad()
def test_an_image_and_a_clip_at_full_budget_equal_the_models_forward(loaded, family):
    """An image and a clip (GLM-4V, whose model takes one or the other: a clip alone) through the adapter at 100%."""
    model, processor, vlm = loaded[family]
    prompt = video_prompt(processor, images=int(vlm.family.image_beside_clip))
    response = torch.tensor([40, 41, 42, 43])
    features = vlm.visual_features(prompt)
    assert [e.shape[0] for e in features.embeds] == [n for n in (t * h * w // 4 for _, (t, h, w) in prompt.visual_units)]
    reduced = vlm.reduce(prompt, features, vlm.keep_all(features))
    ours = vlm.lm_head(vlm.response_hidden([reduced], [response])[0])
    # the model's own forward over prompt + response, the prompt at the positions of its own rope index and the response
    # where its generation puts it: after the prompt's largest position (transformers' rope_deltas, vLLM's
    # mrope_position_delta). A forward left to place the response itself puts it after the prompt's last text token
    # instead, which for Qwen2.5-VL's clip, whose temporal positions run past the text after it, is elsewhere.
    spans = {"second_per_grid_ts": prompt.second_per_grid_ts} if prompt.second_per_grid_ts is not None else {}
    types = torch.cat([prompt.mm_token_type_ids, torch.zeros(4, dtype=torch.int32)])[None]
    mrope, _ = model.model.get_rope_index(input_ids=prompt.input_ids[None], mm_token_type_ids=prompt.mm_token_type_ids[None],
                                          image_grid_thw=prompt.image_grid_thw, video_grid_thw=prompt.video_grid_thw, **spans)
    mrope = torch.cat([mrope, (mrope.max() + 1 + torch.arange(4)).expand(3, 1, 4)], dim=-1)
    reference = model(
        input_ids=torch.cat([prompt.input_ids, response])[None], mm_token_type_ids=types,
        position_ids=torch.cat([torch.arange(mrope.shape[-1]).expand(1, 1, -1), mrope]),  # [text index; t, h, w]
        pixel_values=prompt.pixel_values, image_grid_thw=prompt.image_grid_thw,
        pixel_values_videos=prompt.pixel_values_videos, video_grid_thw=prompt.video_grid_thw, **spans,
    ).logits[0, -5:-1]
    assert (ours - reference).abs().max().item() <= 1e-5


@pytest.mark.parametrize("scope", ["image", "clip", "prompt"])
@pytest.mark.parametrize("family", VIDEO_FAMILIES)
@torch.no_grad()
def test_each_scope_keeps_its_budget_at_the_full_sequences_positions(loaded, family, scope):
    """Brute force per scope: `image` runs the selector on each image and each temporal patch alone; `clip` on the image
    alone and on the clip's patches concatenated; `prompt` on everything concatenated. Every kept token keeps the
    position it has in the full sequence."""
    _, processor, vlm = loaded[family]
    images = int(vlm.family.image_beside_clip)  # GLM-4V: a clip alone
    prompt = video_prompt(processor, images=images)
    features = vlm.visual_features(prompt)
    kept = vlm.select(prompt, features, build_selector("cdpruner", scope), 1000, 2, seed=9)
    query, sizes = vlm.query_embedding(prompt), [e.shape[0] for e in features.embeds]
    units = images + 8  # 16 frames = 8 temporal patches
    groups = {"image": [[i] for i in range(units)], "clip": [[0]] * images + [list(range(images, units))], "prompt": [list(range(units))]}[scope]
    expected = []
    for group in groups:
        union = torch.cat([features.embeds[i].float() for i in group])
        grid = (features.merged_grids[group[0]][1], features.merged_grids[group[0]][2]) if len(group) == 1 else (1, union.shape[0])
        picks = build_selector("cdpruner").select(SelectionInput(union, query, grid, seed=stable_seed(9, group[0])),
                                                  tokens_to_keep(union.shape[0], 1000, 2))
        offsets = np.cumsum([0] + [sizes[i] for i in group])
        expected += [picks[(picks >= lo) & (picks < hi)] - lo for lo, hi in zip(offsets, offsets[1:])]
    assert [k.tolist() for k in kept] == [e.tolist() for e in expected]
    reduced = vlm.reduce(prompt, features, kept)
    visual = prompt.mm_token_type_ids != TEXT
    keep = ~visual
    at = torch.nonzero(visual).flatten()  # the prompt's visual tokens, unit after unit (a clip's one run: patch after patch)
    for start, indices in zip(np.cumsum([0] + sizes[:-1]).tolist(), kept):
        keep[at[start + indices]] = True
    full = vlm.full_positions(prompt)
    assert torch.equal(reduced.positions, full[:, keep]) and reduced.next_position == int(full.max()) + 1


@pytest.mark.parametrize("family", VIDEO_FAMILIES)
@torch.no_grad()
def test_a_clips_vision_flops_are_the_counted_ones(loaded, tiny_dirs, family):
    """Each temporal patch attends within itself, so a clip costs the vision tower what its patches as images would."""
    from torch.utils.flop_counter import FlopCounterMode

    from lt_opd_ray.planning.efficiency import vision_attention_flops, vision_projection_flops

    model, processor, vlm = loaded[family]
    model.set_attn_implementation("eager")
    try:
        prompt = video_prompt(processor, images=0)
        with FlopCounterMode(display=False) as counter:
            vlm.visual_features(prompt)
    finally:
        model.set_attn_implementation("sdpa")
    config = json.loads((tiny_dirs[family] / "config.json").read_text())
    grid = tuple(prompt.video_grid_thw[0].tolist())
    assert counter.get_total_flops() == vision_projection_flops(config, grid) + vision_attention_flops(config, grid)
    one = (1, grid[1], grid[2])
    assert vision_attention_flops(config, grid) == grid[0] * vision_attention_flops(config, one)


def test_clips_are_sampled_uniformly_and_a_short_one_is_named():
    picked = read_clip(clip_of(frames=20), 16)
    assert [round(s * FPS) for s in picked.seconds] == [i * 20 // 16 for i in range(16)]  # frame i * total // frames
    with pytest.raises(InputError, match=r"row-7: video: the clip has 5 frame\(s\), fewer than the 16 a clip is sampled to \(data.frames\)"):
        read_clip(clip_of(frames=5), 16, "row-7: video")


def test_a_video_file_is_read_and_sampled(tmp_path):
    path = tmp_path / "clip.avi"
    write_avi(path, clip_of(frames=24), 4.0)
    picked = read_clip(path, 8)
    assert len(picked.frames) == 8 and picked.frames[0].shape == (64, 96, 3)
    assert list(picked.seconds) == [i * 24 // 8 / 4.0 for i in range(8)]
    with pytest.raises(InputError, match=r"row 3: video: .*clip.avi has 24 frame\(s\), fewer than the 32"):
        read_clip(path, 32, "row 3: video")
    (tmp_path / "broken.mp4").write_bytes(b"not a video")
    with pytest.raises(InputError, match="row 4: video"):
        read_clip(tmp_path / "broken.mp4", 8, "row 4: video")
    with pytest.raises(InputError, match="video file not found"):
        read_clip(tmp_path / "missing.mp4", 8)


def test_video_rows_are_read_and_their_problems_named(tmp_path):
    from lt_opd_ray.sources.rows import read_rows

    for i in range(4):
        random_image(i, 32, 32).save(tmp_path / f"f{i}.png")
    rows = [
        {"sample_uid": "a", "video": ["f0.png", "f1.png", "f2.png", "f3.png"], "fps": 2, "question": "q?"},
        {"sample_uid": "b", "image": "f0.png", "video": "movie.mp4", "question": "q?"},
    ]
    (tmp_path / "rows.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    with pytest.raises(InputError, match=r"1 of 6 image or video file\(s\) not found.*line 2 video: .*movie.mp4"):
        read_rows(tmp_path / "rows.jsonl", tmp_path)
    rows[1]["video"] = ["f0.png", "f1.png"]
    bad = rows + [{"sample_uid": "c", "video": [], "question": "q?"}, {"sample_uid": "d", "video": "x.mp4", "fps": 3, "question": "q?"},
                  {"sample_uid": "e", "video": ["f0.png", 3], "question": "q?"}, {"sample_uid": "f", "question": "q?"}]
    (tmp_path / "bad.jsonl").write_text("\n".join(json.dumps(r) for r in bad))
    with pytest.raises(InputError) as error:
        read_rows(tmp_path / "bad.jsonl", tmp_path)
    message = str(error.value)
    assert "line 3: `video` must be a video file's path or a non-empty list" in message
    assert "line 4: `fps` is for a `video` list of frames" in message
    assert "line 5: `video` frames 1 are not paths" in message
    assert "line 6: missing field(s) image (or images, or video)" in message
    (tmp_path / "rows.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    first, second = read_rows(tmp_path / "rows.jsonl", tmp_path)
    assert first.images == () and first.video.seconds == (0.0, 0.5, 1.0, 1.5)
    assert len(second.images) == 1 and len(second.video.frames) == 2


def test_an_image_beside_a_clip_is_refused_by_name_where_the_model_takes_one_or_the_other(loaded, tmp_path):
    """GLM-4V's model marks images and frames with one token: such rows are named before the job starts (preflight),
    and a prompt that reaches the processor anyway is refused naming its row."""
    from lt_opd_ray.config.loading import parse_job
    from lt_opd_ray.core.families import FAMILIES
    from lt_opd_ray.runtime.job_inputs import family_problems, read_job_inputs

    _, processor, _ = loaded["glm4v"]
    with pytest.raises(InputError, match=r"g: GLM-4.1V / GLM-4.6V-Flash takes images or a video in one prompt, not both"):
        encode_samples(processor, [Sample("g", (random_image(1, 64, 64),), "What happens?", video=clip_of())])
    for i in range(3):
        random_image(i, 32, 32).save(tmp_path / f"f{i}.png")
    rows = [{"sample_uid": "both", "image": "f0.png", "video": ["f1.png", "f2.png"], "question": "q?"},
            {"sample_uid": "clip", "video": ["f1.png", "f2.png"], "question": "q?"}, {"sample_uid": "image", "image": "f0.png", "question": "q?"}]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    job = parse_job(f"""
model: {{path: "tiny:glm4v"}}
data: {{path: "{tmp_path / 'rows.jsonl'}", image_root: "{tmp_path}"}}
sampling: {{prompts_per_step: 2}}
""")
    inputs, problems = read_job_inputs(job)
    assert problems == [] and family_problems(job, FAMILIES["qwen3_5"], inputs) == []
    assert family_problems(job, FAMILIES["glm4v"], inputs) == [
        f"1 rows of {str(tmp_path / 'rows.jsonl')!r} show images and a video (both), but GLM-4.1V / GLM-4.6V-Flash takes one or the"
        " other in a prompt: split them into rows of images and rows of video"]


def test_frames_of_different_sizes_are_named(loaded):
    _, processor, _ = loaded["qwen3_5"]
    processor.frames = 2
    frames = clip_of(frames=2).frames
    clip = Clip.at_rate((frames[0], frames[1][:32]), 1.0)
    with pytest.raises(InputError, match=r"s1: video: its frames differ in size \(96x32, 96x64\)"):
        encode_samples(processor, [Sample("s1", (), "What happens?", video=clip)])


def write_avi(path, clip: Clip, fps: float) -> None:
    import cv2

    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"MJPG"), fps, (clip.frames[0].shape[1], clip.frames[0].shape[0]))
    for frame in clip.frames:
        writer.write(frame)
    writer.release()


def test_video_rows_go_into_prepared_shards_and_come_back_as_the_same_prompts(loaded, tmp_path):
    """`lt-opd data` packs a row's video file (its bytes) or its frames (each frame's bytes, at the row's fps); the
    prepared rows encode to exactly the prompts the JSONL rows do (the same sampled frames at the same times), and
    a frame or a video that does not decode is named by row, nothing written."""
    from lt_opd_ray.sources.prepare import DataError, prepare, read_prepared
    from lt_opd_ray.sources.rows import read_rows

    _, processor, _ = loaded["qwen3_5"]
    processor.frames = 4
    clip = clip_of(frames=12)
    write_avi(tmp_path / "movie.avi", clip, 4.0)
    for i in range(6):
        random_image(i, 64, 96).save(tmp_path / f"f{i}.png")
    rows = [{"sample_uid": "frames", "image": "f5.png", "video": [f"f{i}.png" for i in range(5)], "fps": 2, "question": "What moves?"},
            {"sample_uid": "file", "video": "movie.avi", "question": "What happens?", "answer": "x"}]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    prepare(tmp_path / "rows.jsonl", tmp_path / "data")
    direct, prepared = read_rows(tmp_path / "rows.jsonl", tmp_path), read_prepared(tmp_path / "data")
    assert [s.uid for s in prepared] == ["frames", "file"] and prepared[0].video.seconds == (0.0, 0.5, 1.0, 1.5, 2.0)
    for ours, theirs in zip(encode_samples(processor, prepared), encode_samples(processor, direct)):
        assert torch.equal(ours.input_ids, theirs.input_ids) and torch.equal(ours.video_grid_thw, theirs.video_grid_thw)
        assert torch.equal(ours.pixel_values_videos, theirs.pixel_values_videos)
    (tmp_path / "f3.png").write_bytes(b"not a png")
    (tmp_path / "broken.avi").write_bytes(b"not a video")
    rows.append({"sample_uid": "broken", "video": "broken.avi", "question": "What happens?"})
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(DataError) as info:
        prepare(tmp_path / "rows.jsonl", tmp_path / "bad")
    assert "2 problem(s), nothing written" in str(info.value) and "frames: video frame 3 does not decode" in str(info.value)
    assert "broken: video (the video's bytes) does not decode as a video" in str(info.value) and not (tmp_path / "bad").exists()


def test_video_rows_for_vllm_engines_need_room_for_a_clip():
    """vLLM engines reserve room for a clip only when data.max_videos asks: without it the rows are named; with it
    they pass."""
    from lt_opd_ray.config.loading import parse_job
    from lt_opd_ray.runtime.job_inputs import read_job_inputs

    def problems(max_videos):
        job = parse_job(f"""
model: {{path: "tiny:qwen3_5"}}
data: {{path: "synthetic-video:4", max_videos: {max_videos}}}
sampling: {{prompts_per_step: 2}}
pools: {{rollout: {{backend: vllm}}}}
""")
        return read_job_inputs(job, draw_generated=False)[1]

    assert any("'synthetic-video:4' draws videos, but data.max_videos is 0 and pools.rollout run vLLM" in p for p in problems(0))
    assert problems(1) == []


def test_synthetic_clips_ask_about_their_start_or_end():
    """The answer is the colour drawn at the asked quadrant's shape centre in the clip's first or last frame."""
    from lt_opd_ray.sources.resolve import load_samples
    from lt_opd_ray.sources.synthetic import COLOURS, QUADRANTS

    samples = load_samples("synthetic-video:8")
    assert all(s.images == () and len(s.video.frames) == 16 and s.video.seconds == tuple(float(i) for i in range(16)) for s in samples)
    assert {s.question.split(",")[0] for s in samples} == {"At the start of the video", "At the end of the video"}
    for s in samples:
        frame = s.video.frames[0] if "start" in s.question else s.video.frames[-1]
        q = next(i for i, name in enumerate(QUADRANTS) if f"the {name} corner" in s.question)
        centre = ((q % 2) * 64 + 16 + 16, (q // 2) * 64 + 16 + 16)  # the shape's box centre on a 128 x 128 board
        assert frame.getpixel(centre) == COLOURS[s.answer]


@pytest.mark.parametrize("family, scope", [("qwen2_5_vl", "image"), ("qwen2_5_vl", "clip"), ("glm4v", "image")])
def test_a_clip_trains_and_the_learner_replays_the_rollouts_picks(tiny_dirs, tmp_path, family, scope):
    """Video rows of the families the distributed test (test_runtime.py, Qwen3-VL) leaves out through one single-process
    update: the learner's forward on each rollout's kept tokens (its replayed per-patch indices, into Qwen2.5-VL's one
    run or GLM-4V's runs, at the full sequence's positions) gives the rollout's own log-probs, so the importance weight
    is 1 before any update, and the update is finite."""
    import math

    from conftest import job_for

    from lt_opd_ray.core.batch_order import batches
    from lt_opd_ray.reference import ReferenceTrainer
    from lt_opd_ray.sources.resolve import load_samples

    job = job_for(tiny_dirs[family], tmp_path, data="synthetic-video:4", extra=f"selector: {{scope: {scope}}}\n")
    report = ReferenceTrainer(job).update(next(batches(load_samples(job.data.path), 2, job.data.shuffle_seed)))
    assert report.stats.importance_weight == pytest.approx(1.0, abs=1e-5) and report.stats.tokens > 0
    assert math.isfinite(report.stats.loss) and report.grad_norm > 0

