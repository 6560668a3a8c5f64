"""The reduced-sequence adapter and the transformers backend, on tiny real Qwen VLMs."""

import pytest
import torch
from conftest import FAMILIES, random_image

from lt_opd_ray.core.objective import gather_log_probs
from lt_opd_ray.core.selectors import build_selector
from lt_opd_ray.models.processor import IMAGE, question_messages
from lt_opd_ray.models.sampler import SamplingParams, sample

QUESTIONS = ["How many circles are there?", "Which letter is written at the bottom right?", "Is there a red square?"]
SIZES = [(128, 128), (96, 160), (160, 128)]


def prompts_for(processor, count=3, system="You are a helpful assistant."):
    return [
        processor.encode(question_messages(QUESTIONS[i % 3], system), [random_image(i, *SIZES[i % 3])], f"s{i}")
        for i in range(count)
    ]


def full_forward_inputs(prompt, response):
    return dict(
        input_ids=torch.cat([prompt.input_ids, response])[None],
        mm_token_type_ids=torch.cat([prompt.mm_token_type_ids, torch.zeros(response.numel(), dtype=torch.int32)])[None],
        pixel_values=prompt.pixel_values,
        image_grid_thw=prompt.image_grid_thw,
    )


@pytest.mark.parametrize("images", [1, 2])
@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_all_tokens_kept_equals_model_forward(loaded, family, images):
    model, processor, vlm = loaded[family]
    prompt = prompts_for(processor, 1)[0] if images == 1 else two_image_prompt(processor)
    assert prompt.num_images == images
    response = torch.tensor([40, 41, 42, 43])
    features = vlm.visual_features(prompt)
    reduced = vlm.reduce(prompt, features, vlm.keep_all(features))
    ours = vlm.lm_head(vlm.response_hidden([reduced], [response])[0])
    reference = model(**full_forward_inputs(prompt, response)).logits[0, -5:-1]
    assert (ours - reference).abs().max().item() <= 1e-5


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_all_tokens_kept_greedy_equals_generate(loaded, family):
    model, processor, vlm = loaded[family]
    prompt = prompts_for(processor, 1)[0]
    features = vlm.visual_features(prompt)
    reduced = vlm.reduce(prompt, features, vlm.keep_all(features))
    ours = sample(vlm, [reduced], SamplingParams(max_new_tokens=10, greedy=True, stop=()), [0], processor.tokenizer)[0]
    generated = model.generate(
        input_ids=prompt.input_ids[None],
        attention_mask=torch.ones_like(prompt.input_ids)[None],
        mm_token_type_ids=prompt.mm_token_type_ids[None],
        pixel_values=prompt.pixel_values,
        image_grid_thw=prompt.image_grid_thw,
        do_sample=False,
        max_new_tokens=10,
        eos_token_id=None,
    )[0, prompt.input_ids.numel() :]
    assert ours.token_ids.tolist() == generated.tolist()


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_reduced_sampler_logprobs_equal_teacher_forced_forward(loaded, family):
    """Batched, left-padded rollouts at a 25% budget agree with one unpadded forward per sequence."""
    _, processor, vlm = loaded[family]
    prompts = prompts_for(processor, 3)
    reduced = []
    for i, prompt in enumerate(prompts):
        features = vlm.visual_features(prompt)
        selected = vlm.select(prompt, features, build_selector("cdpruner"), budget_bps=2500, k_min=2)
        assert all(len(s) < f.shape[0] for s, f in zip(selected, features.embeds))
        reduced.append(vlm.reduce(prompt, features, selected))
    assert len({r.length for r in reduced}) > 1, "prompts of different lengths exercise the padding"
    params = SamplingParams(max_new_tokens=12, top_k_logprobs=5, stop=())
    completions = sample(vlm, reduced, params, seeds=[1, 2, 3], tokenizer=processor.tokenizer)
    for red, completion in zip(reduced, completions):
        hidden = vlm.response_hidden([red], [completion.token_ids])[0]  # alone: no padding at all
        weight = vlm.lm_head.weight
        scored = gather_log_probs(hidden, weight, completion.token_ids[:, None], chunk_size=4)[:, 0]
        assert (scored - completion.logprobs).abs().max().item() <= 1e-5
        full = torch.log_softmax(vlm.lm_head(hidden), -1)
        assert torch.equal(torch.topk(full, 5, dim=-1).indices, completion.top_ids)


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_reduced_positions_keep_original_mrope(loaded, family):
    _, processor, vlm = loaded[family]
    prompt = prompts_for(processor, 1)[0]
    features = vlm.visual_features(prompt)
    full = vlm.full_positions(prompt)
    n = features.embeds[0].shape[0]
    kept = torch.tensor([0, 3, n - 1])
    reduced = vlm.reduce(prompt, features, [kept])
    is_image = prompt.mm_token_type_ids == IMAGE
    start = int(torch.nonzero(is_image)[0])
    # kept visual tokens keep their (t, h, w); text keeps its full-sequence positions, never rebased
    expected_keep = (~is_image).clone()
    expected_keep[start + kept] = True
    assert torch.equal(reduced.positions, full[:, expected_keep])
    assert reduced.length == prompt.input_ids.numel() - n + 3
    text_after = reduced.positions[:, -1]
    assert int(text_after[0]) == int(full[0, -1])
    assert reduced.next_position == int(full.max()) + 1
    assert torch.equal(reduced.inputs_embeds[reduced.visual_mask], features.embeds[0][kept])
    if family == "qwen3_vl":
        for layer_full, layer_kept in zip(features.deepstack[0], reduced.deepstack):
            assert torch.equal(layer_kept, layer_full[kept])


@pytest.mark.parametrize("family", FAMILIES)
def test_a_packed_row_gives_each_sequence_what_its_own_forward_gives(loaded, family):
    """Sequences of very different lengths (one image or two, responses of 1, 70 and 9 tokens: Qwen3.5's delta rule runs
    in chunks of 64) laid end to end in one row (`pools.learner.packing`) give each sequence the logits transformers'
    own forward of it alone gives, and the weights the gradients those forwards give: nothing crosses from one
    sequence to the next (attention, Qwen3.5's convolution window and recurrent state). The left-padded batch agrees
    with both."""
    model, processor, vlm = loaded[family]
    prompts = [*prompts_for(processor, 2), two_image_prompt(processor)]
    responses = [torch.tensor([40]), torch.arange(40, 110), torch.arange(90, 99)]
    weights = [torch.randn(r.numel(), model.config.text_config.vocab_size, generator=torch.Generator().manual_seed(i)) for i, r in enumerate(responses)]

    def full(prompt):
        features = vlm.visual_features(prompt)
        return vlm.reduce(prompt, features, vlm.keep_all(features))

    def ours(packed: bool) -> tuple[list[torch.Tensor], dict]:
        model.zero_grad(set_to_none=True)
        logits = [vlm.lm_head(h) for h in vlm.response_hidden([full(p) for p in prompts], responses, packed=packed)]
        sum((rows * w).sum() for rows, w in zip(logits, weights)).backward()
        return [rows.detach() for rows in logits], {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    model.zero_grad(set_to_none=True)
    alone = []
    for prompt, response, w in zip(prompts, responses, weights):
        logits = model(**full_forward_inputs(prompt, response)).logits[0, -response.numel() - 1 : -1]
        (logits * w).sum().backward()  # the gradients add up over the three forwards
        alone.append(logits.detach())
    expected = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert len({p.input_ids.numel() + r.numel() for p, r in zip(prompts, responses)}) == 3
    for packed in (True, False):
        logits, grads = ours(packed)
        for got, want in zip(logits, alone):
            assert (got - want).abs().max().item() <= 1e-5, (family, packed)
        assert grads.keys() == expected.keys() and any(n.startswith("model.visual") for n in grads)
        for name, grad in expected.items():
            error, size = float((grads[name] - grad).norm()), float(grad.norm())
            # fp32 rounding of other batch shapes: <= 1.1e-6 of each parameter's gradient (measured), but for the decays of
            # Qwen3.5's gated delta rule (A_log, dt_bias and in_proj_a, which make them), whose chunked cumulative sums lose
            # digits: up to 1.2e-4 packed, 9.2e-4 padded (left padding adds decaying steps). Anything crossing a bound, or
            # a gradient lost, is off by O(1).
            decay = name.endswith(("A_log", "dt_bias", "in_proj_a.weight"))
            assert error <= (5e-3 if decay else 1e-5) * size + 1e-9, (family, packed, name, error / size)
    model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_responses_packed_after_a_cached_prompt_each_continue_it_alone(loaded, family):
    """The teacher's continuation: responses of 1, 70 and 9 tokens after one full-token prompt's cache, end to end in one
    row (`pools.teacher.packing`), each see the prompt and themselves only: their logits are transformers' own forward of
    the prompt and that response alone, as the right-padded rows' are; so does a row of one 1-token response (Qwen3.5's
    decoding step). The prompt's cache is left as it was."""
    import copy

    from lt_opd_ray.engines.transformers.teacher import teacher_prefix

    model, processor, vlm = loaded[family]
    prompt = two_image_prompt(processor)
    responses = [torch.tensor([40]), torch.arange(40, 110), torch.arange(90, 99)]
    prefix = teacher_prefix(vlm, prompt)
    kept = copy.deepcopy(prefix.cache)
    for packed, responses in [(True, responses), (False, responses), (True, responses[:1])]:
        hidden = vlm.continue_hidden(prefix.full, prefix.cache, 0, prefix.mask, responses, packed=packed)
        for h, response in zip(hidden, responses):
            alone = model(**full_forward_inputs(prompt, response)).logits[0, -response.numel() :]  # predicting the next token
            assert (vlm.lm_head(h) - alone).abs().max().item() <= 1e-5, (family, packed, response.numel())
    def tensors(cache) -> list[torch.Tensor]:  # attention keys and values; Gated DeltaNet conv and recurrent states
        return [t for layer in cache.layers for value in vars(layer).values()
                for t in (value.values() if isinstance(value, dict) else [value]) if isinstance(t, torch.Tensor)]

    assert len(tensors(kept)) >= 2 and all(torch.equal(a, b) for a, b in zip(tensors(kept), tensors(prefix.cache), strict=True))


def two_image_prompt(processor):
    """One question about two images of different sizes, each after its own placeholder run."""
    images = [random_image(7, 96, 128), random_image(8, 128, 160)]
    return processor.encode(question_messages("Which image has a red square?", "You are a helpful assistant.", images=2), images, "two")


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_two_images_pruned_each_at_the_budget_keep_their_own_positions(loaded, family):
    """Each image keeps k = tokens_to_keep(N_i) of its own N_i tokens (the paper's per-image protocol), at the
    positions those tokens have in the full two-image sequence; the second image's text after it is never rebased."""
    from lt_opd_ray.core.curriculum import tokens_to_keep

    _, processor, vlm = loaded[family]
    prompt = two_image_prompt(processor)
    features = vlm.visual_features(prompt)
    kept = vlm.select(prompt, features, build_selector("cdpruner"), 2500, 2)
    assert [k.numel() for k in kept] == [tokens_to_keep(e.shape[0], 2500, 2) for e in features.embeds]
    reduced = vlm.reduce(prompt, features, kept)
    is_image = prompt.mm_token_type_ids == IMAGE
    starts = [int(i) for i in torch.nonzero(is_image & ~torch.cat([torch.zeros(1, dtype=torch.bool), is_image[:-1]]))]
    expected_keep = (~is_image).clone()
    for start, indices in zip(starts, kept):
        expected_keep[start + indices] = True
    full = vlm.full_positions(prompt)
    assert torch.equal(reduced.positions, full[:, expected_keep]) and reduced.next_position == int(full.max()) + 1
    visual = torch.cat([features.embeds[i][kept[i]] for i in range(2)])
    assert torch.equal(reduced.inputs_embeds[reduced.visual_mask], visual)  # image 0's kept tokens, then image 1's


@pytest.mark.parametrize("name", ["cdpruner", "divprune", "uniform"])
def test_a_prompt_scoped_budget_is_the_selection_over_the_union_split_per_image(loaded, name):
    """Brute force: the selector run on the two images' tokens concatenated keeps k = tokens_to_keep(N_0 + N_1); each
    image keeps the union's picks that fall in its range. One image alone picks the same in either scope."""
    from lt_opd_ray.core.curriculum import tokens_to_keep
    from lt_opd_ray.core.seeding import stable_seed
    from lt_opd_ray.core.selectors import SelectionInput

    _, processor, vlm = loaded["qwen3_vl"]
    prompt = two_image_prompt(processor)
    features = vlm.visual_features(prompt)
    n0, n1 = (e.shape[0] for e in features.embeds)
    kept = vlm.select(prompt, features, build_selector(name, "prompt"), 1000, 2, seed=5)
    union = torch.cat([e.float() for e in features.embeds])
    picks = build_selector(name).select(SelectionInput(union, vlm.query_embedding(prompt), (1, n0 + n1), seed=stable_seed(5, 0)),
                                        tokens_to_keep(n0 + n1, 1000, 2)).tolist()
    assert kept[0].tolist() == [i for i in picks if i < n0] and kept[1].tolist() == [i - n0 for i in picks if i >= n0]
    assert sum(k.numel() for k in kept) == tokens_to_keep(n0 + n1, 1000, 2)
    reduced = vlm.reduce(prompt, features, kept)
    assert reduced.length == prompt.input_ids.numel() - (n0 + n1) + tokens_to_keep(n0 + n1, 1000, 2)
    one = prompts_for(processor, 1)[0]
    alone = vlm.visual_features(one)
    assert [k.tolist() for k in vlm.select(one, alone, build_selector(name, "prompt"), 1000, 2, seed=5)] == [
        k.tolist() for k in vlm.select(one, alone, build_selector(name), 1000, 2, seed=5)]


def test_query_mask_covers_only_the_question(loaded):
    _, processor, _ = loaded["qwen3_5"]
    prompt = processor.encode(question_messages("Is there a red square?", "You are a helpful assistant."), [random_image(0)])
    question = processor.tokenizer.decode(prompt.input_ids[prompt.query_mask])
    assert question == "Is there a red square?"


@pytest.mark.parametrize("family", FAMILIES)
def test_visual_features_have_grid_token_count(loaded, family):
    _, processor, vlm = loaded[family]
    prompt = prompts_for(processor, 1)[0]
    features = vlm.visual_features(prompt)
    t, h, w = features.merged_grids[0]
    assert features.embeds[0].shape[0] == t * h * w == int((prompt.mm_token_type_ids == IMAGE).sum())


@torch.no_grad()
def test_rows_end_at_their_first_eos_or_stop_string_and_the_others_run_on(loaded):
    """Brute force: the streams sampled without any end, cut where each row first meets an EOS id or a stop string."""
    _, processor, vlm = loaded["qwen3_5"]
    tokenizer = processor.tokenizer
    reduced = []
    for prompt in prompts_for(processor, 3):
        features = vlm.visual_features(prompt)
        reduced.append(vlm.reduce(prompt, features, vlm.keep_all(features)))
    rows, seeds, steps = reduced * 2, [5, 6, 7, 8, 9, 10], 12
    free = [c.token_ids.tolist() for c in sample(vlm, rows, SamplingParams(max_new_tokens=steps, stop=()), seeds, tokenizer)]
    eos = free[0][3]  # row 0 ends at step 3 at the latest
    stop = tokenizer.decode(free[1][4:8])  # row 1 meets this text by step 7

    def cut(tokens):
        for t, token in enumerate(tokens):
            if token == eos:
                return t + 1, "eos"
            if stop in tokenizer.decode(tokens[: t + 1]):
                return t + 1, "stop"
        return len(tokens), "length"

    params = SamplingParams(max_new_tokens=steps, stop=(stop,), eos_token_ids=(eos,))
    ended = sample(vlm, rows, params, seeds, tokenizer)
    for tokens, completion in zip(free, ended):
        length, reason = cut(tokens)
        assert (completion.token_ids.tolist(), completion.finish_reason) == (tokens[:length], reason)
        assert completion.logprobs.shape == (length,) and completion.top_ids.shape[0] == length
    assert [c.finish_reason for c in ended[:3]] == ["eos", "stop", "length"]  # rows ending apart, one running on



@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 0.8)])
def test_each_token_is_drawn_as_often_as_its_probability_and_tokens_outside_top_p_never(temperature, top_p):
    """20,000 draws over 7 tokens against the probabilities written out by hand: softmax(logits / T), the smallest
    prefix of the sorted tokens whose mass reaches top_p kept and renormalised. Each count within 5 binomial standard
    deviations; a token outside the nucleus is never drawn."""
    from lt_opd_ray.models.sampler import choose_tokens

    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, -4.0, 0.0, 1.0])
    log_probs = torch.log_softmax(logits, -1)
    p = torch.exp(logits.double() / temperature)
    p /= p.sum()
    kept, mass = [], 0.0
    for token in sorted(range(7), key=lambda i: -p[i]):
        if mass >= top_p:
            break
        kept.append(token)
        mass += float(p[token])
    expected = torch.zeros(7, dtype=torch.float64)
    expected[kept] = p[kept] / p[kept].sum()
    draws = 20_000
    uniforms = torch.rand(draws, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    drawn = choose_tokens(log_probs.expand(draws, 7), SamplingParams(temperature=temperature, top_p=top_p), uniforms)
    counts = torch.bincount(drawn, minlength=7).double()
    spread = 5 * (draws * expected * (1 - expected)).sqrt()
    assert ((counts - draws * expected).abs() <= spread + 1e-9).all(), (counts.tolist(), (draws * expected).tolist())
    assert (counts[expected == 0] == 0).all()
    if top_p < 1.0:
        assert (expected == 0).sum() >= 2  # the nucleus leaves tokens out
