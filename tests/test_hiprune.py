"""HiPrune: its selection against a plain-Python reading of its definition, and the encoder attention it reads against
the attention weights transformers' own eager attention computes, on every family's tiny tower."""

import importlib
import itertools
import random

import pytest
import torch
from conftest import FAMILIES, random_image

from lt_opd_ray.core.selectors import EncoderAttention, SelectionInput, build_selector
from lt_opd_ray.core.selectors.hiprune import HiPrune, received_attention, recorded_blocks
from lt_opd_ray.models.processor import question_messages


def naive_hiprune(object_scores: list[float], last_scores: list[float], height: int, width: int, k: int, alpha: float) -> list[int]:
    """The definition read plainly: anchors by object-block rank, each one's grid neighbours (above, left, right,
    below) anchor by anchor until k, then the last block's best of the rest; ties to the lower index."""
    n = height * width
    def ranked(scores):
        return sorted(range(n), key=lambda i: (-scores[i], i))
    anchors = ranked(object_scores)[: round(alpha * k / 5)]
    chosen = list(anchors)
    for a in anchors:
        r, c = divmod(a, width)
        for dr, dc in ((-1, 0), (0, -1), (0, 1), (1, 0)):
            if 0 <= r + dr < height and 0 <= c + dc < width and (r + dr) * width + c + dc not in chosen:
                chosen.append((r + dr) * width + c + dc)
    chosen = chosen[:k]
    chosen += [i for i in ranked(last_scores) if i not in chosen][: k - len(chosen)]
    return sorted(chosen)


@pytest.mark.parametrize("seed", range(40))
def test_hiprune_equals_its_definition_read_plainly(seed):
    """Random grids, budgets and alphas (up to 1: buffers overflow k), scores drawn from few values (ties)."""
    rng = random.Random(seed)
    height, width = rng.randint(1, 12), rng.randint(1, 12)
    n = height * width
    k, alpha = rng.randint(1, n), rng.choice([0.1, 0.3, 1.0])
    levels = rng.choice([3, 1000])
    object_scores = [rng.randrange(levels) / levels for _ in range(n)]
    last_scores = [rng.randrange(levels) / levels for _ in range(n)]
    item = SelectionInput(torch.randn(n, 4), None, (height, width),
                          attention=EncoderAttention(torch.tensor(object_scores), torch.tensor(last_scores)))
    assert HiPrune(alpha).select(item, k).tolist() == naive_hiprune(object_scores, last_scores, height, width, k, alpha)


def test_anchors_bring_their_neighbours_and_registers_fill_the_rest():
    """A 5 x 5 grid, k = 25 * 0.4 = 10 at alpha 1: 2 anchors, their 4 + 3 grid neighbours (the second at the edge,
    the shared one counted once), then the last block's best of the rest."""
    object_scores = torch.zeros(25)
    object_scores[12], object_scores[14] = 2.0, 1.0  # centre, and the middle of the right edge
    last_scores = torch.arange(25, dtype=torch.float32)  # the highest index is the most attended
    item = SelectionInput(torch.randn(25, 4), None, (5, 5), attention=EncoderAttention(object_scores, last_scores))
    assert HiPrune(1.0).select(item, 10).tolist() == sorted([12, 7, 11, 13, 17, 14, 9, 19, 24, 23])


def test_hiprune_without_the_encoders_attention_is_refused_by_name():
    with pytest.raises(ValueError, match="hiprune reads the vision encoder's attention, which this path did not record"):
        build_selector("hiprune").select(SelectionInput(torch.randn(16, 4), None, (4, 4)), 3)
    with pytest.raises(ValueError, match="encoder attention for 9 tokens, features for 16"):
        build_selector("hiprune").select(SelectionInput(torch.randn(16, 4), None, (4, 4), attention=EncoderAttention(torch.ones(9), torch.ones(9))), 3)


def test_hiprune_selects_per_image_only():
    """Its buffers are an image's grid neighbours: over a union of images (scope clip or prompt) they would be flat
    index neighbours, across rows and images; refused by the selector and by the job schema."""
    from lt_opd_ray.config.schema import SelectorConfig

    for scope in ("clip", "prompt"):
        with pytest.raises(ValueError, match=f"hiprune selects each image on its own grid .*: selection scope {scope} refused; use image"):
            build_selector("hiprune", scope)
        with pytest.raises(ValueError, match=f"selector hiprune with scope {scope}: HiPrune's buffers are an image's grid neighbours"):
            SelectorConfig(name="hiprune", scope=scope)
    assert build_selector("hiprune", "image").scope == "image"


def test_received_attention_is_each_segments_softmax_summed_over_its_queries():
    """Against the [S, S] matrix in float64 with the segments as a block-diagonal mask, on several chunk sizes."""
    from lt_opd_ray.core.selectors import hiprune

    generator = torch.Generator().manual_seed(0)
    query, key = torch.randn(3, 23, 8, generator=generator), torch.randn(3, 23, 8, generator=generator)
    bounds = [0, 5, 6, 23]
    segment = torch.repeat_interleave(torch.arange(3), torch.tensor([5, 1, 17]))
    logits = query.double() @ key.double().transpose(1, 2) / 8**0.5
    logits = logits.masked_fill(segment[:, None] != segment[None, :], -torch.inf)
    want = logits.softmax(-1).mean(0).sum(0)
    for elements in (3 * 23, 3 * 23 * 4, 1 << 24):  # one query row at a time, four, all at once
        hiprune.SCORE_ELEMENTS = elements
        try:
            got = received_attention(query, key, bounds)
        finally:
            hiprune.SCORE_ELEMENTS = 1 << 24
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)


def eager_attention_received(model, family, prompt) -> list[EncoderAttention]:
    """The reference: the tower run on transformers' eager attention, each recorded block's weights taken from it
    (every segment's [H, S, S] softmax), summed over queries, averaged over heads, un-windowed with the model's own
    window index and averaged over each merged token's patches, one token at a time."""
    module = importlib.import_module(type(model).__module__)
    visual = model.model.visual
    blocks = dict.fromkeys(recorded_blocks(len(visual.blocks)))
    weights = {b: [] for b in blocks}
    eager = module.eager_attention_forward

    def recording(attention, *args, **kwargs):
        output, w = eager(attention, *args, **kwargs)
        for b in blocks:
            if attention is visual.blocks[b].attn:
                weights[b].append(w[0].double())
        return output, w

    implementation = visual.config._attn_implementation
    module.eager_attention_forward, visual.config._attn_implementation = recording, "eager"
    try:
        model.model.get_image_features(prompt.pixel_values, prompt.image_grid_thw, return_dict=True)
    finally:
        module.eager_attention_forward, visual.config._attn_implementation = eager, implementation
    merge = visual.spatial_merge_size
    per_block = {}
    for b in blocks:
        patches = torch.cat([w.sum(dim=1).mean(dim=0) for w in weights[b]])  # per segment: received, head mean
        if family == "qwen2_5_vl":
            from transformers.vision_utils import get_vision_window_index

            window_index, _ = get_vision_window_index(prompt.image_grid_thw, spatial_merge_size=merge, window_size=visual.window_size, patch_size=visual.patch_size)
            groups = [None] * len(window_index)
            for slot, group in enumerate(window_index.tolist()):  # the blocks held group `group` at `slot`
                groups[group] = patches[slot * merge**2 : (slot + 1) * merge**2]
        else:
            groups = [patches[g * merge**2 : (g + 1) * merge**2] for g in range(len(patches) // merge**2)]
        per_block[b] = torch.tensor([sum(group.tolist()) / merge**2 for group in groups], dtype=torch.float64)
    object_block, last_block = (per_block[b] for b in recorded_blocks(len(visual.blocks)))
    sizes = [t * h * w // merge**2 for t, h, w in prompt.image_grid_thw.tolist()]
    bounds = list(itertools.accumulate(sizes, initial=0))
    return [EncoderAttention(object_block[lo:hi], last_block[lo:hi]) for lo, hi in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_the_recorded_encoder_attention_is_what_the_towers_eager_attention_computes(loaded, family):
    """Two images of different sizes (Qwen2.5-VL's windowed block among the recorded ones), every family; HiPrune's
    choice through the adapter equals its plain reading of the scores it was given."""
    model, processor, vlm = loaded[family]
    images = [random_image(7, 96, 128), random_image(8, 128, 160)]
    prompt = processor.encode(question_messages("Which image has a red square?", "You are a helpful assistant.", images=2), images, "two")
    features = vlm.visual_features(prompt, with_attention=True)
    reference = eager_attention_received(model, family, prompt)
    assert len(features.attention) == len(reference) == 2
    for got, want in zip(features.attention, reference):
        torch.testing.assert_close(got.object_block.double(), want.object_block, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(got.last_block.double(), want.last_block, rtol=1e-4, atol=1e-6)
    kept = vlm.select(prompt, features, HiPrune(1.0), 5000, 1)
    for indices, scores, (_, h, w) in zip(kept, features.attention, features.merged_grids):
        expected = naive_hiprune(scores.object_block.tolist(), scores.last_block.tolist(), h, w, indices.numel(), 1.0)
        assert indices.tolist() == expected, family
