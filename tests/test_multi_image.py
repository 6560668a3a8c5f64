"""Rows that show several images: read from every source with each image named on error, checked against the job's
data.max_images, prepared into shards and read back, and trained through the distributed runtime as the reference."""

import json

import numpy as np
import pytest
from conftest import random_image

from lt_opd_ray.config.loading import parse_job
from lt_opd_ray.core.errors import InputError
from lt_opd_ray.models.processor import load_image
from lt_opd_ray.runtime.job_inputs import read_job_inputs
from lt_opd_ray.sources.prepare import prepare, read_prepared
from lt_opd_ray.sources.resolve import load_samples
from lt_opd_ray.sources.rows import read_rows


def write_images(folder, names):
    for i, name in enumerate(names):
        random_image(i, 48, 64).save(folder / name)


def test_jsonl_rows_take_an_image_or_a_list_and_name_each_bad_one(tmp_path):
    write_images(tmp_path, ["a.png", "b.png", "c.png"])
    rows = [{"sample_uid": "one", "image": "a.png", "question": "Q?"},
            {"sample_uid": "two", "images": ["b.png", "c.png"], "question": "Which one?"}]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    one, two = read_rows(tmp_path / "rows.jsonl", tmp_path)
    assert one.images == (tmp_path / "a.png",) and two.images == (tmp_path / "b.png", tmp_path / "c.png")

    bad = [{"sample_uid": "both", "image": "a.png", "images": ["b.png"], "question": "Q?"},
           {"sample_uid": "empty", "images": [], "question": "Q?"},
           {"sample_uid": "hole", "images": ["a.png", ""], "question": "Q?"},
           {"sample_uid": "gone", "images": ["a.png", "missing.png"], "question": "Q?"}]
    (tmp_path / "bad.jsonl").write_text("".join(json.dumps(r) + "\n" for r in bad))
    with pytest.raises(InputError) as info:
        read_rows(tmp_path / "bad.jsonl", tmp_path)
    message = str(info.value)
    assert "line 1: both `image` and `images`" in message and "line 2: `images` must be a non-empty list" in message
    assert "line 3: `images` entries 1 are empty" in message
    assert f"1 of 2 image file(s) not found under image_root {tmp_path} (line 4 image 1: {tmp_path / 'missing.png'})" in message


def test_an_image_that_does_not_decode_names_its_row_and_position(tmp_path):
    from lt_opd_ray.models.processor import sample_images

    write_images(tmp_path, ["a.png"])
    (tmp_path / "broken.png").write_bytes(b"not a png")
    (tmp_path / "rows.jsonl").write_text(json.dumps({"sample_uid": "r", "images": ["a.png", "broken.png"], "question": "Q?"}) + "\n")
    (sample,) = read_rows(tmp_path / "rows.jsonl", tmp_path)
    with pytest.raises(InputError, match=r"r: image 1 \(.*broken.png\) does not decode"):
        sample_images(sample)


def test_prepared_shards_keep_every_image_in_order_and_name_a_bad_one(tmp_path):
    write_images(tmp_path, ["a.png", "b.png", "c.png"])
    rows = [{"sample_uid": "one", "image": "a.png", "question": "Q?"},
            {"sample_uid": "two", "images": ["b.png", "c.png", "a.png"], "question": "Which one?", "response": "The second."}]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    manifest = prepare(tmp_path / "rows.jsonl", tmp_path / "prepared")
    assert manifest["format"] == 2 and manifest["rows"] == 2
    one, two = read_prepared(tmp_path / "prepared")
    assert len(one.images) == 1 and len(two.images) == 3 and two.response == "The second."
    for image, name in zip(two.images, ["b.png", "c.png", "a.png"]):
        assert np.array_equal(np.asarray(load_image(image)), np.asarray(load_image(tmp_path / name)))

    (tmp_path / "broken.png").write_bytes(b"not a png")
    (tmp_path / "bad.jsonl").write_text(json.dumps({"sample_uid": "x", "images": ["a.png", "broken.png", "gone.png"], "question": "Q?"}) + "\n")
    with pytest.raises(ValueError) as info:
        prepare(tmp_path / "bad.jsonl", tmp_path / "nothing")
    assert "x: image 1 does not decode" in str(info.value) and "x: image 2: " in str(info.value) and "gone.png not found" in str(info.value)
    assert not (tmp_path / "nothing").exists()


def test_a_datasets_folder_with_an_images_column_keeps_every_image(tmp_path):
    import datasets

    data = datasets.Dataset.from_dict(
        {"sample_uid": ["a", "b"], "question": ["q1", "q2"], "images": [[random_image(0, 32, 32)], [random_image(1, 32, 32), random_image(2, 48, 32)]]},
        features=datasets.Features({"sample_uid": datasets.Value("string"), "question": datasets.Value("string"),
                                    "images": datasets.Sequence(datasets.Image())}),
    )
    data.save_to_disk(str(tmp_path / "hf"))
    assert prepare(tmp_path / "hf", tmp_path / "prepared")["rows"] == 2
    one, two = read_prepared(tmp_path / "prepared")
    assert len(one.images) == 1 and len(two.images) == 2 and load_image(two.images[1]).size == (32, 48)


def test_a_format_1_shard_reads_as_one_image_per_row(tmp_path):
    """Folders `lt-opd data` prepared before rows could show several images (an `image` column) still load."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = (tmp_path / "a.png")
    random_image(0, 48, 64).save(data)
    (tmp_path / "old").mkdir()
    pq.write_table(pa.table({"sample_uid": ["u"], "question": ["Q?"], "answer": [None], "image": [data.read_bytes()], "sha256": ["x"]}),
                   tmp_path / "old" / "shard-00000.parquet")
    (tmp_path / "old" / "manifest.json").write_text(json.dumps({"format": 1, "rows": 1, "shards": [{"file": "shard-00000.parquet", "rows": 1}]}))
    (sample,) = read_prepared(tmp_path / "old")
    assert len(sample.images) == 1 and np.array_equal(np.asarray(load_image(sample.images[0])), np.asarray(load_image(data)))


def test_synthetic_rows_with_several_images_ask_about_one_of_them():
    samples = load_samples("synthetic:6*3", seed=1)
    assert all(len(s.images) == 3 and s.question.startswith("In image ") for s in samples)
    assert load_samples("synthetic:2")[0].uid == "synthetic-0-0" and len(load_samples("synthetic:2")[0].images) == 1
    with pytest.raises(InputError, match=r"expected synthetic:<n>\[@<width>x<height>\]\*<images from 1 to 16>"):
        load_samples("synthetic:4*0")


def test_rows_with_more_images_than_the_job_allows_are_refused_before_it_starts():
    job = parse_job('model: {path: "tiny:qwen3_5"}\ndata: {path: "synthetic:8*2"}\nsampling: {prompts_per_step: 2}\n')
    assert read_job_inputs(job, draw_generated=False)[1] == [
        "data.path 'synthetic:8*2' shows 2 images per row, more than data.max_images (1): raise data.max_images"]
    (problem,) = read_job_inputs(job)[1]
    assert problem.startswith("8 rows of 'synthetic:8*2' show more than data.max_images (1) images (synthetic2-0-0,") and "the most is 2" in problem
    allowed = parse_job('model: {path: "tiny:qwen3_5"}\ndata: {path: "synthetic:8*2", max_images: 2}\nsampling: {prompts_per_step: 2}\n')
    assert read_job_inputs(allowed)[1] == []


def test_a_prompt_scoped_budget_is_refused_where_it_cannot_run():
    base = 'model: {path: "tiny:qwen3_5"}\ndata: {path: "synthetic:8*2", max_images: 2}\n'
    assert parse_job(base + "selector: {scope: prompt}\n").selector.scope == "prompt"
    for scope in ("prompt", "clip"):
        with pytest.raises(ValueError, match=f"selector.scope {scope} selects across a prompt's images or frames in the transformers engines"):
            parse_job(base + f"selector: {{scope: {scope}}}\npools: {{rollout: {{backend: vllm}}}}\n")
        with pytest.raises(ValueError, match=f"scope {scope} with merge learnable"):
            parse_job(base + f"selector: {{scope: {scope}, merge: learnable}}\n")
