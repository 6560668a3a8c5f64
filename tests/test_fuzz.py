"""Fuzzing every door a user's input comes through: job YAMLs, data rows, benchmark files, images and the server's
per-request selection settings. Each input is either accepted or refused with the command's own named error;
any other exception (a traceback for the user) fails. Bounded: about 550 fixed cases, well under a minute;
LT_OPD_FUZZ_EXAMPLES=1000 runs a longer randomised hunt. (The live server gets fuzzed requests in
tests/test_export_serve.py.)"""

from __future__ import annotations

import copy
import csv
import json
import os
from pathlib import Path

import pytest
import yaml
from conftest import bomb_png
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_benchmarks import fixture

from lt_opd_ray.config.loading import JobConfigError, load_job, parse_job
from lt_opd_ray.config.schema import JobConfig
from lt_opd_ray.core.errors import InputError
from lt_opd_ray.evals.benchmarks import BENCHMARKS, benchmark
from lt_opd_ray.evals.reading import BenchmarkError
from lt_opd_ray.models.processor import ImageError, decode_image
from lt_opd_ray.sources.prepare import DataError, prepare
from lt_opd_ray.sources.rows import read_rows

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = int(os.environ.get("LT_OPD_FUZZ_EXAMPLES", 60))  # set it (e.g. 1000) for a longer, randomised hunt
FUZZ = settings(
    max_examples=EXAMPLES, deadline=None, database=None,
    derandomize="LT_OPD_FUZZ_EXAMPLES" not in os.environ,  # CI replays the same cases
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=30),
                    st.sampled_from(["", "synthetic:0", "tiny:nope", "-1", "1e400", ".nan", "../../etc/passwd", "A" * 70_000]))
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
                           max_leaves=6)


def mutate(value, data, depth: int = 0):
    """A copy of a JSON-like value with one place replaced, deleted, or given an extra key."""
    if isinstance(value, (dict, list)) and value and depth < 6 and data.draw(st.integers(0, 3)) > 0:
        keys = sorted(value, key=str) if isinstance(value, dict) else list(range(len(value)))
        key = data.draw(st.sampled_from(keys))
        action = data.draw(st.sampled_from(["replace", "delete", "recurse", "recurse"]))
        out = copy.copy(value)
        if action == "replace":
            out[key] = data.draw(json_values)
        elif action == "delete":
            del out[key]
        else:
            out[key] = mutate(value[key], data, depth + 1)
        return out
    if isinstance(value, dict):
        return {**value, data.draw(st.text(max_size=8)): data.draw(json_values)}
    return data.draw(json_values)


@pytest.mark.parametrize("name", ["train_tiny.yaml", "train_qwen35.yaml"])
@FUZZ
@given(data=st.data())
def test_mutated_job_yaml_is_accepted_or_refused_by_name(name, data):
    job = yaml.safe_load((REPO / "jobs" / name).read_text())
    for _ in range(data.draw(st.integers(1, 3))):
        job = mutate(job, data)
    try:
        assert isinstance(parse_job(yaml.safe_dump(job), source="fuzz.yaml"), JobConfig)
    except JobConfigError as exc:
        assert exc.problems and str(exc).startswith("fuzz.yaml: ")


@FUZZ
@given(edits=st.lists(st.tuples(st.integers(0, 4000), st.binary(max_size=8)), min_size=1, max_size=4))
def test_job_file_with_random_bytes_is_accepted_or_refused_by_name(edits, tmp_path_factory):
    raw = bytearray((REPO / "jobs" / "train_tiny.yaml").read_bytes())
    for position, junk in edits:
        position %= len(raw)
        raw[position : position + len(junk)] = junk
    path = tmp_path_factory.mktemp("job") / "job.yaml"
    path.write_bytes(bytes(raw))
    try:
        load_job(path)
    except JobConfigError as exc:
        assert exc.problems


ROW = {"sample_uid": "a", "image": "x.png", "question": "What is it?", "answer": "cat"}


@FUZZ
@given(data=st.data())
def test_mutated_data_rows_are_read_or_refused_by_line(data, tmp_path_factory):
    lines = []
    for i in range(data.draw(st.integers(1, 4))):
        kind = data.draw(st.sampled_from(["row", "mutated", "value", "bytes"]))
        if kind == "bytes":
            lines.append(data.draw(st.binary(max_size=40)).replace(b"\n", b" "))
        else:
            row = {**ROW, "sample_uid": f"s{i}"}
            value = row if kind == "row" else mutate(row, data) if kind == "mutated" else data.draw(json_values)
            lines.append(json.dumps(value).encode())
    path = tmp_path_factory.mktemp("rows") / "rows.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    try:
        read_rows(path)
    except InputError as exc:
        assert str(exc).startswith(str(path))


@pytest.mark.parametrize("name", sorted(BENCHMARKS))
@settings(FUZZ, max_examples=max(5, EXAMPLES // 4))
@given(data=st.data())
def test_mutated_benchmark_files_are_read_or_refused_naming_rows(name, data, tmp_path_factory):
    folder = tmp_path_factory.mktemp(name)
    path, _, _ = fixture(name, folder)
    if path.suffix == ".tsv":
        with path.open(newline="") as handle:
            rows = list(csv.DictReader(handle, delimiter="\t"))
        row = data.draw(st.sampled_from(rows))
        row[data.draw(st.sampled_from(sorted(row)))] = data.draw(st.text(max_size=30) | st.sampled_from(["", "nan", "Z", "A" * 70_000]))
        with path.open("w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(rows[0]), delimiter="\t")
            writer.writeheader()
            writer.writerows(rows)
    elif path.suffix == ".jsonl":
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        mutated = mutate(rows, data)
        path.write_text("".join(json.dumps(r) + "\n" for r in (mutated if isinstance(mutated, list) else [mutated])))
    else:
        path.write_text(json.dumps(mutate(json.loads(path.read_text()), data)))
    try:
        benchmark(name).load(path)
    except BenchmarkError as exc:
        assert str(exc).startswith(str(path))


@FUZZ
@given(data=st.data())
def test_prepare_refuses_bad_rows_by_name_and_writes_nothing(data, tmp_path_factory):
    folder = tmp_path_factory.mktemp("prep")
    (folder / "x.png").write_bytes(data.draw(st.sampled_from([b"", b"junk", bomb_png()])))
    rows = [mutate({**ROW, "sample_uid": f"s{i}"}, data) for i in range(data.draw(st.integers(1, 3)))]
    (folder / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises((DataError, InputError)):  # every image here is broken, so no row can be prepared
        prepare(folder / "rows.jsonl", folder / "out", images=folder)
    assert not (folder / "out").exists()


@FUZZ
@given(blob=st.binary(max_size=300), prefix=st.sampled_from([b"", b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff", b"GIF89a", b"BM"]))
def test_random_image_bytes_decode_or_are_refused_with_a_reason(blob, prefix):
    try:
        decode_image(prefix + blob)
    except ImageError as exc:
        assert str(exc)


@FUZZ
@given(settings_=st.dictionaries(st.sampled_from(["lt_opd_budget_bps", "lt_opd_k_min", "lt_opd_selector", "lt_opd_seed", "lt_opd_nonce",
                                                   "lt_opd_query_ids", "lt_opd_other", "max_pixels"]), json_values, max_size=4))
def test_selection_settings_of_a_request_are_valid_or_refused_by_field(settings_):
    from lt_opd_ray.engines.vllm.selection import SELECTOR_NAMES, SelectionRequest

    vocab = 1000
    try:
        request, rest = SelectionRequest.split(settings_, vocab)
    except ValueError as exc:
        assert str(exc).startswith(("lt_opd_", "unknown selection setting")), exc
        return
    assert 1 <= request.budget_bps <= 10_000 and request.k_min >= 1 and request.selector in SELECTOR_NAMES
    assert all(type(i) is int and 0 <= i < vocab for i in request.query_ids)
    assert set(rest) == {k for k in settings_ if not k.startswith("lt_opd_")}
