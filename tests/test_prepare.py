"""`lt-opd data`: LT-14K-style sources -> verified shards + manifest, refusals, resume, and the loader."""

from __future__ import annotations

import hashlib
import io
import json
import re
import tarfile

import numpy as np
import pytest
from conftest import bomb_png, random_image

from lt_opd_ray.sources.prepare import DataError, prepare, read_prepared


def _png(seed: int) -> bytes:
    buffer = io.BytesIO()
    random_image(seed, 48, 64).save(buffer, format="PNG")
    return buffer.getvalue()


def lt14k(folder, count=5, break_rows=()):
    """An LT-14K-style folder: train.parquet, media.jsonl, images/part-000.tar; `break_rows` names faults to inject."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    (folder / "images").mkdir(parents=True)
    rows, media = [], []
    faults = dict(break_rows)
    with tarfile.open(folder / "images" / "part-000.tar", "w") as archive:
        for i in range(count):
            data = bomb_png() if faults.get("bomb") == i else _png(i)
            info = tarfile.TarInfo(f"img/{i}.png")
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
            entry = {"sample_uid": f"s{i}", "path": f"img/{i}.png", "url": None, "access": "bundled", "archive": "images/part-000.tar",
                     "size_bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(), "source_media_key": f"k{i}"}
            media.append(entry)
            rows.append({"sample_uid": f"s{i}", "question": f"What is in picture {i}?", "answer": None})
    if "sha" in faults:
        media[faults["sha"]]["sha256"] = "0" * 64
    if "member" in faults:
        media[faults["member"]]["path"] = "img/missing.png"
    if "url" in faults:
        media[faults["url"]].update(access="url", url="https://example.org/x.png")
    if "question" in faults:
        rows[faults["question"]]["question"] = ""
    if "duplicate" in faults:
        rows[faults["duplicate"]]["sample_uid"] = "s0"
    pq.write_table(pa.Table.from_pylist(rows), folder / "train.parquet")
    (folder / "media.jsonl").write_text("".join(json.dumps(m) + "\n" for m in media))
    return folder


def test_an_lt14k_folder_becomes_shards_whose_images_are_the_originals(tmp_path):
    from lt_opd_ray.models.processor import load_image
    from lt_opd_ray.sources.resolve import load_samples

    source = lt14k(tmp_path / "src")
    manifest = prepare(source, tmp_path / "out", shard_rows=2)
    assert manifest["rows"] == 5 and [s["rows"] for s in manifest["shards"]] == [2, 2, 1]
    assert json.loads((tmp_path / "out" / "manifest.json").read_text()) == manifest
    samples = load_samples(str(tmp_path / "out"))
    assert [s.uid for s in samples] == [f"s{i}" for i in range(5)]
    for i, sample in enumerate(samples):
        assert np.array_equal(np.asarray(load_image(sample.images[0])), np.asarray(random_image(i, 48, 64)))
    with pytest.raises(DataError, match="already a prepared data set"):
        prepare(source, tmp_path / "out")


def test_every_bad_row_is_reported_and_nothing_is_written(tmp_path):
    source = lt14k(tmp_path / "src", count=7, break_rows={"sha": 1, "member": 2, "url": 3, "question": 4, "duplicate": 5, "bomb": 6}.items())
    with pytest.raises(DataError) as info:
        prepare(source, tmp_path / "out", shard_rows=2)
    message = str(info.value)
    for expected in ("6 problem(s), nothing written", "s1: image SHA-256", "s2: image: 'img/missing.png' is not in",
                     "s3: image: media is a url", "s4: no question", "s0: duplicate sample_uid",
                     "s6: image refused, too many pixels (a decompression bomb?)"):
        assert expected in message, message
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.incoming").exists()


def test_an_interrupted_preparation_resumes_to_the_same_data_set(tmp_path):
    source = lt14k(tmp_path / "src")
    assert prepare(source, tmp_path / "part", shard_rows=2, max_shards=1) is None
    assert not (tmp_path / "part").exists()  # no manifest, not under the final name
    assert json.loads((tmp_path / "part.incoming" / "progress.json").read_text())["uids"] == ["s0", "s1"]
    resumed = prepare(source, tmp_path / "part", shard_rows=2)
    whole = prepare(source, tmp_path / "whole", shard_rows=2)
    assert [s["sha256"] for s in resumed["shards"]] == [s["sha256"] for s in whole["shards"]]
    assert [s.uid for s in read_prepared(tmp_path / "part")] == [s.uid for s in read_prepared(tmp_path / "whole")]


def test_a_datasets_folder_and_a_jsonl_file_are_sources_too(tmp_path):
    import datasets

    images = [random_image(i, 32, 32) for i in range(3)]
    data = datasets.Dataset.from_dict(
        {"sample_uid": ["a", "b", "c"], "question": ["q1", "q2", "q3"], "answer": ["x", None, "z"], "image": images},
        features=datasets.Features({"sample_uid": datasets.Value("string"), "question": datasets.Value("string"),
                                    "answer": datasets.Value("string"), "image": datasets.Image()}),
    )
    data.save_to_disk(str(tmp_path / "hf"))
    assert prepare(tmp_path / "hf", tmp_path / "from_hf")["rows"] == 3

    (tmp_path / "pics").mkdir()
    lines = []
    for i in range(2):
        (tmp_path / "pics" / f"{i}.png").write_bytes(_png(i))
        lines.append(json.dumps({"sample_uid": f"j{i}", "question": "q", "image": f"{i}.png", "sha256": hashlib.sha256(_png(i)).hexdigest()}))
    (tmp_path / "rows.jsonl").write_text("\n".join([*lines[:1], json.dumps({**json.loads(lines[1]), "response": "It is j1."})]) + "\n")
    prepare(tmp_path / "rows.jsonl", tmp_path / "with_responses", images=tmp_path / "pics")
    assert [s.response for s in read_prepared(tmp_path / "with_responses")] == [None, "It is j1."]  # each row's own, kept
    assert [s.response for s in read_prepared(tmp_path / "from_hf")] == [None, None, None]  # a source without the column
    lines.append(json.dumps({"sample_uid": "j2", "question": "q", "image": "absent.png"}))
    (tmp_path / "rows.jsonl").write_text("\n".join(lines) + "\n")
    lines.insert(1, "[1, 2]")  # a line that is no row: named with the row problems after it, all at once
    (tmp_path / "rows.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError) as info:
        prepare(tmp_path / "rows.jsonl", tmp_path / "from_jsonl", images=tmp_path / "pics")
    assert "2 problem(s), nothing written" in str(info.value), info.value
    assert "line 2: a row must be a JSON object, got list" in str(info.value)
    assert re.search("j2: image: .*absent.png not found", str(info.value))
    with pytest.raises(DataError, match="not a source this command reads"):
        prepare(tmp_path / "pics", tmp_path / "nope")


def test_a_jobs_prepared_folder_is_read_in_an_order_that_resumes_from_a_cursor(tiny_dirs, tmp_path):
    """A job's data.path naming a prepared folder: the batches resume exactly from a cursor. (That the shards' images
    are the originals: test_an_lt14k_folder_becomes_shards_whose_images_are_the_originals.)"""
    from conftest import job_for

    from lt_opd_ray.core.batch_order import batches
    from lt_opd_ray.sources.resolve import load_samples

    prepare(lt14k(tmp_path / "src", count=5), tmp_path / "data", shard_rows=2)
    job = job_for(tiny_dirs["qwen3_5"], tmp_path / "run")
    job = job.model_copy(update={"data": job.data.model_copy(update={"path": str(tmp_path / "data")})})
    samples = load_samples(job.data.path)
    fresh = batches(samples, 2, job.data.shuffle_seed)
    order = [[s.uid for s in next(fresh)] for _ in range(4)]
    resumed = batches(samples, 2, job.data.shuffle_seed, cursor=4)
    assert [[s.uid for s in next(resumed)] for _ in range(2)] == order[2:]


class ImageHost:
    """An HTTP server on 127.0.0.1 that records every request: /x.png answers a PNG, /hop redirects to localhost."""

    def __enter__(self) -> ImageHost:
        import http.server
        import threading

        host = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                host.requests.append(self.path)
                if self.path == "/hop":
                    self.send_response(302)
                    self.send_header("Location", f"http://localhost:{host.port}/x.png")
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("Content-Length", str(len(host.png)))
                self.end_headers()
                self.wfile.write(host.png)

            def log_message(self, *args):
                pass

        self.requests, self.png = [], _png(9)
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_rows_read_only_their_folder_and_fetch_only_from_named_hosts_without_redirects(tmp_path):
    """A row naming a file outside its folder (`..`, an absolute path) or a URL is refused by row, and no request
    leaves the machine, a datasets folder's image paths included (datasets' own decoding would fetch them); with
    `--allow-outside-root` and `--allowed-media-domains 127.0.0.1` they are read, and a redirect is still refused."""
    import datasets

    from lt_opd_ray.core.errors import InputError
    from lt_opd_ray.evals.benchmarks import benchmark as benchmark_format
    from lt_opd_ray.sources.prepare import MediaAccess
    from lt_opd_ray.sources.rows import read_rows

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "0.png").write_bytes(_png(0))
    (tmp_path / "outside.png").write_bytes(_png(1))
    with ImageHost() as host:
        url = f"http://127.0.0.1:{host.port}/x.png"
        names = ["0.png", "../outside.png", str(tmp_path / "outside.png"), url]
        (tmp_path / "data" / "rows.jsonl").write_text("".join(json.dumps({"sample_uid": f"r{i}", "question": "q", "image": name}) + "\n"
                                                             for i, name in enumerate(names)))
        with pytest.raises(DataError) as refused:
            prepare(tmp_path / "data" / "rows.jsonl", tmp_path / "out")
        assert "3 problem(s), nothing written" in str(refused.value)
        assert "r1: image: path '../outside.png' climbs out of the data folder with ..; keep the files under it" in str(refused.value)
        assert f"r2: image: path '{tmp_path / 'outside.png'}' is an absolute path, outside the data folder" in str(refused.value)
        assert f"r3: image: {url} is on 127.0.0.1, and remote images are fetched only from hosts named with --allowed-media-domains" in str(refused.value)
        with pytest.raises(InputError, match=r"line 2: image '\.\./outside\.png' climbs out of the data folder with \.\.; .*data\.allow_outside_root"):
            read_rows(tmp_path / "data" / "rows.jsonl", tmp_path / "data")  # training reads the same rows by the same rule

        # a datasets folder whose image feature holds a URL: saved as a plain struct, then declared an Image (saving an
        # Image feature here would fetch and embed it: a folder made elsewhere keeps the URL)
        plain = {"bytes": datasets.Value("binary"), "path": datasets.Value("string")}
        thumb = f"http://127.0.0.1:{host.port}/thumb.png"  # a column prepare does not read: never decoded, never fetched
        datasets.Dataset.from_dict({"sample_uid": ["h0"], "question": ["q"], "image": [{"path": url, "bytes": None}],
                                    "thumb": [{"path": thumb, "bytes": None}]},
                                   features=datasets.Features({"sample_uid": datasets.Value("string"), "question": datasets.Value("string"),
                                                               "image": plain, "thumb": plain})).save_to_disk(str(tmp_path / "hf"))
        info = json.loads((tmp_path / "hf" / "dataset_info.json").read_text())
        info["features"]["image"] = info["features"]["thumb"] = {"_type": "Image"}
        (tmp_path / "hf" / "dataset_info.json").write_text(json.dumps(info))
        assert isinstance(datasets.load_from_disk(str(tmp_path / "hf")).features["image"], datasets.Image)
        with pytest.raises(DataError, match=f"h0: image: {url} is on 127.0.0.1"):
            prepare(tmp_path / "hf", tmp_path / "out")
        benchmark = tmp_path / "data" / "pope.jsonl"
        benchmark.write_text(json.dumps({"question_id": "b0", "text": "Is there a cat?", "image": "../outside.png", "label": "no"}) + "\n")
        with pytest.raises(ValueError, match=r"b0: file '\.\./outside\.png' climbs out of the benchmark's folder with \.\.: a benchmark reads only its own folder"):
            benchmark_format("pope").load(benchmark)
        assert host.requests == []  # nothing was fetched

        allowed = MediaAccess(allowed_domains=("127.0.0.1",), outside_root=True)
        assert prepare(tmp_path / "data" / "rows.jsonl", tmp_path / "out", access=allowed)["rows"] == 4
        assert [s.images[0].read() for s in read_prepared(tmp_path / "out")][1:] == [_png(1), _png(1), host.png]
        with pytest.raises(InputError, match=f"line 4: image '{url}' is a URL, not a file under the data folder"):
            read_rows(tmp_path / "data" / "rows.jsonl", tmp_path / "data", allow_outside_root=True)  # training fetches nothing
        (tmp_path / "data" / "hop.jsonl").write_text(json.dumps({"sample_uid": "r0", "question": "q", "image": f"http://127.0.0.1:{host.port}/hop"}) + "\n")
        with pytest.raises(DataError, match=f"r0: image: http://127.0.0.1:{host.port}/hop redirects \\(302\\) to http://localhost:{host.port}/x.png: redirects are not followed"):
            prepare(tmp_path / "data" / "hop.jsonl", tmp_path / "hopped", access=allowed)
        assert host.requests == ["/x.png", "/hop"]  # the redirect's target was never asked
