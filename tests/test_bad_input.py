"""Bad input gets a clear error naming what is wrong and where."""

import json

import pytest
import torch
from conftest import bomb_png, random_image

from lt_opd_ray.data import load_samples, read_rows
from lt_opd_ray.models.adapter import QwenVLM, UnsupportedArchitectureError
from lt_opd_ray.models.processor import InputError, question_messages
from lt_opd_ray.selectors import SelectionInput, build_selector


def test_undecodable_image_names_the_sample_and_file(loaded, tmp_path):
    _, processor, _ = loaded["qwen3_5"]
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"\x89PNG\r\n\x1a\n not really a png")
    with pytest.raises(InputError, match=r"uid-7: image 0 \(.*broken.png\) does not decode"):
        processor.encode(question_messages("Is there a cat?"), [broken], "uid-7")
    with pytest.raises(InputError, match=r"uid-8: image 0 \(5 bytes\) does not decode"):
        processor.encode(question_messages("Is there a cat?"), [b"hello"], "uid-8")
    with pytest.raises(InputError, match=r"uid-10: image 0 \(\d+ bytes\) refused, too many pixels \(a decompression bomb\?\)"):
        processor.encode(question_messages("Is there a cat?"), [bomb_png()], "uid-10")
    with pytest.raises(InputError, match=r"uid-9: image 0: image file not found"):
        processor.encode(question_messages("Is there a cat?"), [tmp_path / "missing.jpg"], "uid-9")


def test_prompt_without_image_placeholder_is_refused(loaded):
    _, processor, _ = loaded["qwen3_5"]
    messages = [{"role": "user", "content": [{"type": "text", "text": "How many cats?"}]}]
    with pytest.raises(InputError, match="uid-1: prompt has no image placeholder"):
        processor.encode(messages, [random_image(0)], "uid-1")
    with pytest.raises(InputError, match="uid-2: prompt has 1 image placeholder"):
        processor.encode(question_messages("How many cats?"), [random_image(0), random_image(1)], "uid-2")


def test_prompt_without_question_text_is_refused(loaded):
    _, processor, _ = loaded["qwen3_5"]
    messages = [{"role": "user", "content": [{"type": "image"}]}]
    with pytest.raises(InputError, match="uid-3: the user message has no question text"):
        processor.encode(messages, [random_image(0)], "uid-3")


def test_k_above_n_is_refused_by_the_selector(loaded):
    _, processor, vlm = loaded["qwen3_vl"]
    prompt = processor.encode(question_messages("Which letter?"), [random_image(0)], "uid-4")
    features = vlm.visual_features(prompt)
    n = features.embeds[0].shape[0]
    with pytest.raises(ValueError, match=rf"cannot keep k = {n + 1} of N = {n}"):
        item = SelectionInput(features.embeds[0].detach(), vlm.query_embedding(prompt), (1, n))
        build_selector("cdpruner").select(item, n + 1)


def test_selected_index_outside_the_image_is_refused(loaded):
    _, processor, vlm = loaded["qwen3_vl"]
    prompt = processor.encode(question_messages("Which letter?"), [random_image(0)], "uid-5")
    features = vlm.visual_features(prompt)
    n = features.embeds[0].shape[0]
    with pytest.raises(ValueError, match=rf"image 0: selected index outside \[0, {n}\)"):
        vlm.reduce(prompt, features, [torch.tensor([0, n])])


def test_architecture_without_pruning_support_is_named():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))
    with pytest.raises(UnsupportedArchitectureError, match="model_type 'qwen2' \\(Qwen2ForCausalLM\\) has no visual-token pruning support"):
        QwenVLM(model)


def test_data_rows_report_file_and_line(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text(
        json.dumps({"sample_uid": "a", "image": "a.png", "question": "q?"})
        + "\n"
        + json.dumps({"sample_uid": "b", "image": "b.png"})
        + "\n"
    )
    with pytest.raises(InputError, match=r"rows.jsonl: line 2: missing field\(s\) question"):
        read_rows(rows)
    rows.write_text(
        json.dumps({"sample_uid": "a", "image": "a.png", "question": "q?"})
        + "\n\n"
        + json.dumps({"sample_uid": "a", "image": "c.png", "question": "r?"})
        + "\n{oops\n"
    )
    with pytest.raises(InputError, match=r"rows.jsonl: line 4: not valid JSON"):
        read_rows(rows)
    rows.write_text(rows.read_text().replace("{oops\n", ""))
    with pytest.raises(InputError, match=r"line 3: duplicate sample_uid 'a' \(first at line 1\)"):
        read_rows(rows)
    with pytest.raises(InputError, match="data file not found"):
        read_rows(tmp_path / "nope.jsonl")
    with pytest.raises(InputError, match="synthetic:<positive count>"):
        load_samples("synthetic:zero")


def test_jsonl_rows_resolve_images_against_the_root(tmp_path):
    random_image(0).save(tmp_path / "img.png")
    (tmp_path / "rows.jsonl").write_text(json.dumps({"sample_uid": "x", "image": "img.png", "question": "What?"}) + "\n")
    [sample] = read_rows(tmp_path / "rows.jsonl", image_root=tmp_path)
    assert sample.image == tmp_path / "img.png" and sample.question == "What?"


def test_parquet_rows_are_read_and_checked(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    random_image(1).save(tmp_path / "a.png")
    pq.write_table(pa.table({"sample_uid": ["a", "b"], "image": ["a.png", "a.png"], "question": ["Which colour?", "How many?"]}), tmp_path / "rows.parquet")
    samples = read_rows(tmp_path / "rows.parquet", image_root=tmp_path)
    assert [s.uid for s in samples] == ["a", "b"] and samples[1].question == "How many?"
    pq.write_table(pa.table({"sample_uid": ["a", "b"], "image": ["a.png", "a.png"], "question": ["Which colour?", ""]}), tmp_path / "bad.parquet")
    with pytest.raises(InputError, match=r"bad.parquet: row 2: missing field\(s\) question"):
        read_rows(tmp_path / "bad.parquet")
