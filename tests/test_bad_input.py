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


def test_data_files_that_are_not_rows_are_named_by_line(tmp_path):
    cases = {
        "list.jsonl": (b'{"sample_uid": "a", "image": "x.png", "question": "Q?"}\n[1, 2]\n', "line 2: a row must be a JSON object, got list"),
        "latin1.jsonl": ('{"sample_uid": "a", "image": "x.png", "question": "caf\xe9?"}\n'.encode("latin-1"), "line 1: not UTF-8 text (byte 0xe9)"),
        "deep.jsonl": (b"[" * 100_000 + b"]" * 100_000 + b"\n", "line 1: JSON nested too deeply"),
        "long.jsonl": (json.dumps({"sample_uid": "a", "image": "x.png", "question": "Q" * 70_000}).encode() + b"\n",
                       "line 1: question has 70,000 characters, above the 65,536"),
        "dict.jsonl": (json.dumps({"sample_uid": "a", "image": "x.png", "question": {"q": 1}}).encode() + b"\n", "line 1: question must be text, got dict"),
        "broken.parquet": (b"PAR1 not really parquet", "not a readable parquet file"),
    }
    for name, (data, expected) in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(InputError) as info:
            read_rows(tmp_path / name)
        assert str(info.value).startswith(f"{tmp_path / name}: ") and expected in str(info.value), (name, str(info.value))


def test_benchmark_file_that_is_not_utf8_is_named(tmp_path):
    from lt_opd_ray.evals.benchmarks import BenchmarkError, benchmark

    path = tmp_path / "pope.jsonl"
    path.write_bytes('{"question_id": 1, "text": "caf\xe9"}\n'.encode("latin-1"))
    with pytest.raises(BenchmarkError, match=r"pope.jsonl: not UTF-8 text \(byte 0xe9"):
        benchmark("pope").load(path)


def test_prepare_refuses_an_out_that_is_a_file_or_a_full_folder_before_any_work(tmp_path):
    from lt_opd_ray.prepare import DataError, prepare

    source = tmp_path / "rows.jsonl"
    source.write_text(json.dumps({"sample_uid": "a", "image": "x.png", "question": "Q?"}) + "\n")
    (tmp_path / "file").write_text("x")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    with pytest.raises(DataError, match="file is a file; --out must be a new or empty folder"):
        prepare(source, tmp_path / "file")
    with pytest.raises(DataError, match="full is a folder that is not empty"):
        prepare(source, tmp_path / "full")
    assert (tmp_path / "full" / "keep.txt").read_text() == "mine" and not (tmp_path / "full.incoming").exists()
