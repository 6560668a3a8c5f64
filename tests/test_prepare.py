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
    """An HTTP server on 127.0.0.1 that records every request (and its Host header): /x.png answers a PNG, /hop
    redirects to localhost; over TLS where given a server context."""

    def __init__(self, tls=None):
        self.tls = tls

    def __enter__(self) -> ImageHost:
        import http.server
        import threading

        host = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                host.requests.append(self.path)
                host.hosts.append(self.headers["Host"])
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

        self.requests, self.hosts, self.png = [], [], _png(9)
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        if self.tls is not None:
            self.server.socket = self.tls.wrap_socket(self.server.socket, server_side=True)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_rows_read_only_their_folder_and_fetch_only_from_named_hosts_without_redirects(tmp_path):
    """A row naming a file outside its folder (`..`, an absolute path) or a URL is refused by row, and no request
    leaves the machine, a datasets folder's image paths included (datasets' own decoding would fetch them); with
    `--allow-outside-root`, `--allowed-media-domains 127.0.0.1` and `--allowed-media-addresses 127.0.0.1` (a loopback
    address) they are read, and a redirect is still refused."""
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

        allowed = MediaAccess(allowed_domains=("127.0.0.1",), outside_root=True, allowed_addresses=("127.0.0.1",))
        assert prepare(tmp_path / "data" / "rows.jsonl", tmp_path / "out", access=allowed)["rows"] == 4
        assert [s.images[0].read() for s in read_prepared(tmp_path / "out")][1:] == [_png(1), _png(1), host.png]
        with pytest.raises(InputError, match=f"line 4: image '{url}' is a URL, not a file under the data folder"):
            read_rows(tmp_path / "data" / "rows.jsonl", tmp_path / "data", allow_outside_root=True)  # training fetches nothing
        (tmp_path / "data" / "hop.jsonl").write_text(json.dumps({"sample_uid": "r0", "question": "q", "image": f"http://127.0.0.1:{host.port}/hop"}) + "\n")
        with pytest.raises(DataError, match=f"r0: image: http://127.0.0.1:{host.port}/hop redirects \\(302\\) to http://localhost:{host.port}/x.png: redirects are not followed"):
            prepare(tmp_path / "data" / "hop.jsonl", tmp_path / "hopped", access=allowed)
        assert host.requests == ["/x.png", "/hop"]  # the redirect's target was never asked


OUT = r"leads out of the data folder through a link \(to [^)]*\); keep the files under it, or allow this"
DANGLING = r"goes through the link [^,]*, whose target [^ ]* does not exist"
# (name a row gives, refused without --allow-outside-root (a pattern; None: read), refused with it)
LINK_FORMS = [
    ("ok.png", None, None),  # a file in the folder
    ("./ok.png", None, None),
    ("inlink.png", None, None),  # a link to a file in the folder
    ("abs_in.png", None, None),  # an absolute link to a file in the folder
    ("chain_in.png", None, None),  # a link to a link to a file in the folder
    ("sub_in/x.png", None, None),  # through a link to a folder in the folder
    ("out.png", OUT, None),  # the last component a link leading out
    ("sub/outside.png", OUT, None),  # a link to a folder outside in the middle of the path
    ("chain.png", OUT, None),  # a link to a link leading out (a chain)
    ("rel_out.png", OUT, None),  # a relative link climbing out with ..
    ("dev.png", OUT, r"is a character device \(at /dev/null\), not a regular file"),  # a link to a device
    ("dangling_out.png", OUT, DANGLING),  # dangling, outside: refused without telling whether the target exists
    ("dangling.png", DANGLING, DANGLING),
    ("sub_gone/x.png", DANGLING, DANGLING),  # a dangling link in the middle of the path
    ("loop.png", "goes through a loop of links", "goes through a loop of links"),
    ("pipe", "is a FIFO, not a regular file", "is a FIFO, not a regular file"),  # would hang the reader
    ("to_pipe.png", r"is a FIFO \(at [^)]*pipe\), not a regular file", r"is a FIFO \(at [^)]*pipe\), not a regular file"),
    ("folder.png", "is a folder, not a regular file", "is a folder, not a regular file"),
    ("missing.png", "not found", "not found"),
]


def _link_folder(tmp_path):
    """The folder LINK_FORMS names files in (tmp/data), a folder beside it (tmp/outside), and (name, bytes) of the
    files each readable form reads."""
    import os

    data, outside = tmp_path / "data", tmp_path / "outside"
    (data / "real_sub").mkdir(parents=True)
    outside.mkdir()
    (data / "ok.png").write_bytes(_png(0))
    (data / "real_sub" / "x.png").write_bytes(_png(2))
    (outside / "outside.png").write_bytes(_png(1))
    links = {"inlink.png": "ok.png", "abs_in.png": str(data / "ok.png"), "chain_in.png": "inlink.png", "sub_in": "real_sub",
             "out.png": str(outside / "outside.png"), "sub": str(outside), "chain2.png": str(outside / "outside.png"), "chain.png": "chain2.png",
             "rel_out.png": "../outside/outside.png", "dev.png": "/dev/null", "dangling_out.png": str(outside / "nowhere.png"),
             "dangling.png": "nowhere.png", "sub_gone": "gone", "loop.png": "loop.png", "to_pipe.png": "pipe"}
    for name, target in links.items():
        os.symlink(target, data / name)
    os.mkfifo(data / "pipe")
    (data / "folder.png").mkdir()
    reads = {"ok.png": _png(0), "./ok.png": _png(0), "inlink.png": _png(0), "abs_in.png": _png(0), "chain_in.png": _png(0),
             "sub_in/x.png": _png(2), "out.png": _png(1), "sub/outside.png": _png(1), "chain.png": _png(1), "rel_out.png": _png(1)}
    return data, reads


def test_a_link_leaving_the_data_folder_a_dangling_link_and_a_file_that_is_no_file_are_refused_by_row(tmp_path):
    """Every file a row names is followed through its links to its real path: outside the (resolved) data folder it
    is refused unless `--allow-outside-root` (`data.allow_outside_root` for training), and a dangling link, a loop, a
    FIFO, a device or a folder is refused either way; by row, each in one sentence naming the row and the path, while
    preparing and when training reads the same rows. Links that stay in the folder, and a folder given through a
    link, are read."""
    from lt_opd_ray.core.errors import InputError
    from lt_opd_ray.sources.prepare import MediaAccess
    from lt_opd_ray.sources.rows import read_rows

    data, reads = _link_folder(tmp_path)
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"sample_uid": f"r{i}", "question": "q", "image": name}) + "\n" for i, (name, _, _) in enumerate(LINK_FORMS)))
    for allowed in (False, True):
        with pytest.raises(DataError) as refused:
            prepare(rows, tmp_path / "out", images=data, access=MediaAccess(outside_root=allowed))
        message = str(refused.value)
        expected = [(i, name, pattern) for i, (name, *patterns) in enumerate(LINK_FORMS) if (pattern := patterns[allowed])]
        assert f"{len(expected)} problem(s), nothing written" in message, message  # every refused row named, no other
        for i, name, pattern in expected:
            named = re.escape(f"{data / name} ") if pattern == "not found" else re.escape(f"path {name!r} ")
            assert re.search(f"r{i}: image: {named}{pattern}", message), (name, pattern, message)
        for i, (name, *patterns) in enumerate(LINK_FORMS):  # training reads the same rows by the same rule
            (tmp_path / "one.jsonl").write_text(json.dumps({"sample_uid": "u", "question": "q", "image": name}) + "\n")
            if (pattern := patterns[allowed]) is None:
                assert len(read_rows(tmp_path / "one.jsonl", data, allow_outside_root=allowed)) == 1, name
            elif pattern == "not found":
                with pytest.raises(InputError, match=re.escape(f"1 of 1 image file(s) not found under image_root {data} (line 1: {data / name})")):
                    read_rows(tmp_path / "one.jsonl", data, allow_outside_root=allowed)
            else:
                way_out = r".*data\.allow_outside_root: true" if pattern == OUT else ""
                with pytest.raises(InputError, match=f"line 1: image {re.escape(repr(name))} {pattern}{way_out}"):
                    read_rows(tmp_path / "one.jsonl", data, allow_outside_root=allowed)

    readable = [name for name, refused, _ in LINK_FORMS if refused is None]
    rows.write_text("".join(json.dumps({"sample_uid": name, "question": "q", "image": name}) + "\n" for name in readable))
    (tmp_path / "through").symlink_to(data)  # the folder itself given through a link: its links in it still stay in it
    prepare(rows, tmp_path / "in", images=tmp_path / "through")
    assert [s.images[0].read() for s in read_prepared(tmp_path / "in")] == [reads[name] for name in readable]
    assert len(read_rows(rows, tmp_path / "through")) == len(readable)
    everything = [name for name, _, refused in LINK_FORMS if refused is None]
    rows.write_text("".join(json.dumps({"sample_uid": name, "question": "q", "image": name}) + "\n" for name in everything))
    prepare(rows, tmp_path / "all", images=data, access=MediaAccess(outside_root=True))
    assert [s.images[0].read() for s in read_prepared(tmp_path / "all")] == [reads[name] for name in everything]


def test_an_lt14k_archive_linked_from_outside_the_folder_is_refused(tmp_path):
    import os

    from lt_opd_ray.sources.prepare import MediaAccess

    source = lt14k(tmp_path / "src", count=2)
    os.replace(source / "images" / "part-000.tar", tmp_path / "elsewhere.tar")
    (source / "images" / "part-000.tar").symlink_to(tmp_path / "elsewhere.tar")
    with pytest.raises(DataError) as refused:
        prepare(source, tmp_path / "out")
    assert "2 problem(s), nothing written" in str(refused.value)
    assert f"s0: image: archive 'images/part-000.tar' leads out of the data folder through a link (to {tmp_path / 'elsewhere.tar'})" in str(refused.value)
    assert prepare(source, tmp_path / "out", access=MediaAccess(outside_root=True))["rows"] == 2


def test_a_file_swapped_after_its_check_is_not_read(tmp_path, monkeypatch):
    """What is read is the file checked: a path swapped between the check and the open (its last component for a link
    out, another file, a FIFO; a folder in the middle for a link out) is refused, and nothing waits on the FIFO."""
    import os

    from lt_opd_ray.sources import rows

    data, outside = tmp_path / "data", tmp_path / "outside"
    (data / "sub").mkdir(parents=True)
    outside.mkdir()
    (outside / "secret.png").write_bytes(b"secret")
    (outside / "x.png").write_bytes(b"secret")
    checked = rows.confined_file

    def replace(path, make):
        os.unlink(path) if not path.is_dir() or path.is_symlink() else os.rename(path, path.with_name(path.name + ".old"))
        make(path)

    swaps = [  # (name, swap made after the check, the refusal)
        ("a.png", lambda p: p.symlink_to(outside / "secret.png"), r"changed after it was checked and was not read \(Too many levels of symbolic links\)"),
        ("a.png", lambda p: os.replace(data / "other.png", p), r"changed after it was checked \(another file is there now\) and was not read"),
        ("a.png", lambda p: os.mkfifo(p), r"changed after it was checked \(another file is there now\) and was not read"),
        ("sub/x.png", None, r"changed after it was checked \(another file is there now\) and was not read"),
    ]
    for name, make, refusal in swaps:
        (data / "sub" / "x.png").write_bytes(_png(0))
        (data / "a.png").unlink(missing_ok=True)
        (data / "a.png").write_bytes(_png(0))
        (data / "other.png").write_bytes(b"other")  # a file that exists beside it: another inode
        if make is None:  # the folder in the middle swapped for a link to a folder outside
            def swap():
                os.rename(data / "sub", data / f"sub.{len(os.listdir(data))}")
                (data / "sub").symlink_to(outside)
        else:
            def swap(name=name, make=make):
                replace(data / name, make)

        def check_then_swap(*args, swap=swap, **kwargs):
            result = checked(*args, **kwargs)
            swap()
            return result

        monkeypatch.setattr(rows, "confined_file", check_then_swap)
        with pytest.raises(ValueError, match=f"image {re.escape(repr(name))} {refusal}"):
            rows.read_confined("image", name, data)
        monkeypatch.setattr(rows, "confined_file", checked)
        if (data / "sub").is_symlink():
            (data / "sub").unlink()
            (data / "sub").mkdir()
    assert rows.read_confined("image", "a.png", data) == _png(0)


# (address, why it is refused (None: fetched), --allowed-media-addresses values)
ADDRESSES = [
    ("127.0.0.1", "127.0.0.1 is a loopback address", ()),
    ("127.8.9.10", "127.8.9.10 is a loopback address", ()),
    ("::1", "::1 is a loopback address", ()),
    ("10.1.2.3", "10.1.2.3 is a private address", ()),
    ("172.16.0.1", "172.16.0.1 is a private address", ()),
    ("172.31.255.255", "172.31.255.255 is a private address", ()),
    ("172.32.0.1", None, ()),  # just past 172.16.0.0/12: public
    ("192.168.1.1", "192.168.1.1 is a private address", ()),
    ("169.254.169.254", "169.254.169.254 is a link-local address", ()),  # a cloud's metadata service
    ("fe80::1", "fe80::1 is a link-local address", ()),
    ("fe80::1%eth0", "fe80::1%eth0 is a link-local address", ()),
    ("fc00::1", "fc00::1 is a private address", ()),  # unique local
    ("::ffff:127.0.0.1", "::ffff:127.0.0.1 (IPv4 127.0.0.1 inside it) is a loopback address", ()),
    ("::ffff:169.254.169.254", "::ffff:169.254.169.254 (IPv4 169.254.169.254 inside it) is a link-local address", ()),
    ("::ffff:8.8.8.8", None, ()),  # a public IPv4 address, mapped
    ("64:ff9b::a00:1", "64:ff9b::a00:1 (IPv4 10.0.0.1 inside it) is a private address", ()),  # NAT64
    ("64:ff9b::808:808", None, ()),
    ("2002:7f00:1::", "2002:7f00:1:: (IPv4 127.0.0.1 inside it) is a loopback address", ()),  # 6to4
    ("::127.0.0.1", "::127.0.0.1 is a reserved address", ()),  # IPv4-compatible (deprecated)
    ("0.0.0.0", "0.0.0.0 is an unspecified address", ()),
    ("::", ":: is an unspecified address", ()),
    ("100.64.0.1", "100.64.0.1 is a non-global (shared or special-purpose) address", ()),  # carrier-grade NAT
    ("224.0.0.1", "224.0.0.1 is a multicast address", ()),
    ("ff02::1", "ff02::1 is a multicast address", ()),
    ("240.0.0.1", r"240.0.0.1 is a (private|reserved) address", ()),
    ("255.255.255.255", r"255.255.255.255 is a (private|reserved) address", ()),
    ("192.0.2.1", "192.0.2.1 is a private address", ()),  # documentation
    ("198.18.0.1", "198.18.0.1 is a private address", ()),  # benchmarking
    ("8.8.8.8", None, ()),
    ("93.184.215.14", None, ()),
    ("2606:4700:4700::1111", None, ()),
    ("127.0.0.1", None, ("127.0.0.1",)),
    ("10.1.2.3", None, ("10.0.0.0/8",)),
    ("10.1.2.3", "10.1.2.3 is a private address", ("10.0.0.0/16",)),  # another network
    ("::ffff:127.0.0.1", None, ("127.0.0.1",)),  # the IPv4 address inside it listed
    ("::1", "::1 is a loopback address", ("127.0.0.1",)),  # IPv6's loopback is not IPv4's
    ("169.254.169.254", "169.254.169.254 is a link-local address", ("10.0.0.0/8,127.0.0.1",)),  # a listing allows only itself
    ("fe80::1%eth0", None, ("fe80::/10",)),
]


@pytest.mark.parametrize("address,refused,allowed", ADDRESSES)
def test_which_addresses_an_allowed_host_may_resolve_to(address, refused, allowed):
    from lt_opd_ray.sources.fetch import address_problem

    problem = address_problem(address, allowed)
    assert problem is None if refused is None else problem == refused or re.fullmatch(refused, problem), problem


@pytest.mark.parametrize("value,expected", [
    ("127.0.0.1", ["127.0.0.1/32"]),
    ("10.0.0.0/8,127.0.0.1", ["10.0.0.0/8", "127.0.0.1/32"]),
    (" 10.0.0.0/8 , ::1 ", ["10.0.0.0/8", "::1/128"]),
    ("fd00::/8", ["fd00::/8"]),
    ("10.0.0.1/8", "'10.0.0.1/8' has host bits set; write the network's first address (10.0.0.0/8)"),
    ("localhost", "'localhost' is not an IP address or network (a host name is allowed with --allowed-media-domains, its addresses here)"),
    ("10.0.0.0/33", "'10.0.0.0/33' is not an IP address or network"),
    ("999.1.1.1", "'999.1.1.1' is not an IP address or network"),
    ("", "'' has an empty entry; give addresses or networks separated by commas"),
    ("10.0.0.0/8,", "'10.0.0.0/8,' has an empty entry"),
])
def test_allowed_media_addresses_are_parsed_and_a_bad_one_is_a_usage_error(tmp_path, capsys, value, expected):
    from lt_opd_ray.cli.main import main
    from lt_opd_ray.sources.fetch import parse_networks

    if isinstance(expected, list):
        assert [str(network) for network in parse_networks(value)] == expected
        return
    with pytest.raises(ValueError, match=re.escape(expected)):
        parse_networks(value)
    (tmp_path / "rows.jsonl").write_text("")
    with pytest.raises(SystemExit) as exited:
        main(["data", str(tmp_path / "rows.jsonl"), "--out", str(tmp_path / "out"), "--allowed-media-addresses", value])
    assert exited.value.code == 2
    assert f"argument --allowed-media-addresses: {expected}" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_an_allowed_host_resolving_to_a_loopback_address_is_refused_unless_listed_and_the_address_checked_is_the_one_asked(tmp_path, monkeypatch, capsys):
    """`localhost` is an allowed host but resolves to a loopback address: refused, nothing asked; with the address
    listed it is fetched (the command line too). A name is resolved once: the connection goes to the address checked,
    with the name as Host header, while a second lookup would answer elsewhere (DNS rebinding); a name with any
    non-public address among its answers is refused."""
    import socket

    from lt_opd_ray.cli.main import main
    from lt_opd_ray.sources.fetch import fetch

    with ImageHost() as host:
        url = f"http://localhost:{host.port}/x.png"
        with pytest.raises(ValueError, match=re.escape(f"{url}: localhost resolves to ") + r"(127\.0\.0\.1|::1) is a loopback address, and remote images"
                           r" are fetched only from public addresses unless --allowed-media-addresses lists it"):
            fetch(url, ("localhost",))
        assert host.requests == []
        assert fetch(url, ("localhost",), ("127.0.0.0/8", "::1")) == host.png
        (tmp_path / "rows.jsonl").write_text(json.dumps({"sample_uid": "r0", "question": "q", "image": url}) + "\n")
        assert main(["data", str(tmp_path / "rows.jsonl"), "--out", str(tmp_path / "refused"), "--allowed-media-domains", "localhost"]) == 2
        assert "r0: image: " + url + ": localhost resolves to" in capsys.readouterr().err
        assert main(["data", str(tmp_path / "rows.jsonl"), "--out", str(tmp_path / "out"), "--allowed-media-domains", "localhost",
                     "--allowed-media-addresses", "127.0.0.0/8,::1"]) == 0
        assert [s.images[0].read() for s in read_prepared(tmp_path / "out")] == [host.png]

        lookups, real = [], socket.getaddrinfo

        def rebinding(name, *args, **kwargs):  # images.example: 127.0.0.1 when first asked, 10.9.9.9 after
            if name != "images.example":
                return real(name, *args, **kwargs)
            lookups.append(name)
            address = "127.0.0.1" if len(lookups) == 1 else "10.9.9.9"
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (address, args[0] if args else kwargs.get("port")))]

        monkeypatch.setattr(socket, "getaddrinfo", rebinding)
        assert fetch(f"http://images.example:{host.port}/x.png", ("images.example",), ("127.0.0.1",)) == host.png
        assert lookups == ["images.example"] and host.hosts[-1] == f"images.example:{host.port}"

        def mixed(name, port, *args, **kwargs):  # a public answer first, a loopback one after it
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (address, port)) for address in ("93.184.215.14", "127.0.0.1")]

        monkeypatch.setattr(socket, "getaddrinfo", mixed)
        requests = len(host.requests)
        with pytest.raises(ValueError, match="images.example resolves to 127.0.0.1 is a loopback address"):
            fetch(f"http://images.example:{host.port}/x.png", ("images.example",))
        assert len(host.requests) == requests


def test_an_https_image_is_fetched_from_the_address_checked_with_its_name_sent_and_its_certificate_checked(tmp_path, monkeypatch):
    """Over TLS the connection goes to the checked address too, the name given as SNI and checked against the
    certificate: a certificate for the name is accepted, one for another name is refused."""
    import datetime
    import socket
    import ssl

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    from lt_opd_ray.sources import fetch as fetching

    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)

    def certificate(name):
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
                .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(days=1))
                .not_valid_after(now + datetime.timedelta(days=1))
                .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
                .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True).sign(key, hashes.SHA256()))
        (tmp_path / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        (tmp_path / "key.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                             serialization.NoEncryption()))
        return tmp_path / f"{name}.pem"

    served, trusted = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER), ssl.create_default_context(cafile=certificate("images.example"))
    names = []
    served.sni_callback = lambda sock, name, context: names.append(name)
    served.load_cert_chain(tmp_path / "images.example.pem", tmp_path / "key.pem")
    monkeypatch.setattr(fetching, "tls_context", lambda: trusted)
    real = socket.getaddrinfo
    monkeypatch.setattr(socket, "getaddrinfo", lambda name, *args, **kwargs: real("127.0.0.1" if name.endswith(".example") else name, *args, **kwargs))
    with ImageHost(served) as host:
        assert fetching.fetch(f"https://images.example:{host.port}/x.png", ("images.example",), ("127.0.0.1",)) == host.png
        assert names == ["images.example"] and host.hosts == [f"images.example:{host.port}"]
        with pytest.raises(ValueError, match=f"https://other.example:{host.port}/x.png: .*certificate verify failed"):
            fetching.fetch(f"https://other.example:{host.port}/x.png", ("other.example",), ("127.0.0.1",))
        assert host.requests == ["/x.png"]
