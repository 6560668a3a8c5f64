"""Bad input gets a clear error naming what is wrong and where."""

import json
from pathlib import Path

import pytest
import torch
from conftest import bomb_png, random_image

from lt_opd_ray.core.errors import InputError
from lt_opd_ray.core.families import UnsupportedArchitectureError
from lt_opd_ray.core.selectors import SelectionInput, build_selector
from lt_opd_ray.models.adapter import QwenVLM
from lt_opd_ray.models.processor import question_messages
from lt_opd_ray.sources.resolve import load_samples
from lt_opd_ray.sources.rows import read_rows


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
    with pytest.raises(UnsupportedArchitectureError, match="Qwen2ForCausalLM: model_type 'qwen2' has no visual-token pruning support; supported: qwen3_5 \\(Qwen3.5\\)"):
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
    with pytest.raises(InputError, match=r"rows.jsonl: line 3: duplicate sample_uid 'a' \(first at line 1\); line 4: not valid JSON"):
        read_rows(rows)  # every problem of the file at once
    rows.write_text(rows.read_text().replace("{oops\n", ""))
    with pytest.raises(InputError, match=r"line 3: duplicate sample_uid 'a' \(first at line 1\)"):
        read_rows(rows)
    with pytest.raises(InputError, match="data file not found"):
        read_rows(tmp_path / "nope.jsonl")
    with pytest.raises(InputError, match="expected synthetic:<count from 1 to 100,000>"):
        load_samples("synthetic:zero")


def test_jsonl_rows_resolve_images_against_the_root(tmp_path):
    random_image(0).save(tmp_path / "img.png")
    (tmp_path / "rows.jsonl").write_text(json.dumps({"sample_uid": "x", "image": "img.png", "question": "What?"}) + "\n")
    [sample] = read_rows(tmp_path / "rows.jsonl", image_root=tmp_path)
    assert sample.images == (tmp_path / "img.png",) and sample.question == "What?"


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
        "response.jsonl": (json.dumps({"sample_uid": "a", "image": "x.png", "question": "Q?", "response": 7}).encode() + b"\n",
                           "line 1: response must be text, got int"),
        "broken.parquet": (b"PAR1 not really parquet", "not a readable parquet file"),
    }
    for name, (data, expected) in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(InputError) as info:
            read_rows(tmp_path / name)
        assert str(info.value).startswith(f"{tmp_path / name}: ") and expected in str(info.value), (name, str(info.value))


def test_benchmark_file_that_is_not_utf8_is_named(tmp_path):
    from lt_opd_ray.evals.benchmarks import benchmark
    from lt_opd_ray.evals.reading import BenchmarkError

    path = tmp_path / "pope.jsonl"
    path.write_bytes('{"question_id": 1, "text": "caf\xe9"}\n'.encode("latin-1"))
    with pytest.raises(BenchmarkError, match=r"pope.jsonl: not UTF-8 text \(byte 0xe9"):
        benchmark("pope").load(path)


def test_prepare_refuses_an_out_that_is_a_file_or_a_full_folder_before_any_work(tmp_path):
    from lt_opd_ray.sources.prepare import DataError, prepare

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


def test_validate_names_every_input_train_would_refuse_and_sizes_no_job_needs(tmp_path, capsys):
    """What `train` would stop on later (a folder as data, a file of another kind, a prepared folder whose manifest is
    damaged, missing images, fewer rows than an update's prompts, a missing model folder, eval rows that cannot be
    scored) and absurd sizes are named by `validate`."""
    from lt_opd_ray.cli.main import main

    job = tmp_path / "job.yaml"
    job.write_text(open("jobs/train_tiny.yaml").read())
    (tmp_path / "folder").mkdir()
    (tmp_path / "prepared").mkdir()
    (tmp_path / "prepared" / "manifest.json").write_bytes(bytes(range(256)))
    random_image(2).save(tmp_path / "a.png")
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps({"sample_uid": u, "image": f"{u}.png", "question": "Q?"}) + "\n" for u in "abc"))
    cases = {
        f"data.path={tmp_path / 'folder'}": f"{tmp_path / 'folder'}: a folder without manifest.json",
        f"data.path={tmp_path / 'a.png'}": f"{tmp_path / 'a.png'}: a .png file; rows are read from .jsonl or .parquet files",
        f"data.path={tmp_path / 'prepared'}": f"{tmp_path / 'prepared' / 'manifest.json'}: not a manifest `lt-opd data` wrote",
        f"data.image_root={tmp_path}": "2 of 3 image file(s) not found",
        "sampling.n=1000000000": "sampling.n (--set): Input should be less than or equal to 1024",
        "sampling.stop=['a','b','c','d','e']": "sampling.stop (--set): List should have at most 4 items after validation, not 5",
        "sampling.stop=['']": "sampling.stop.0 (--set): String should have at least 1 character",
        "selector.name=fastx": "selector.name (--set): Input should be 'cdpruner', 'divprune', 'fastv', 'hiprune', 'random' or 'uniform'",
        "selector.name=fastv": "selector fastv prunes inside the language model, after the layer whose attention ranks the tokens",
        "pools.rollout.backend=vllm": "eval.selectors fastv prunes inside the language model, which vLLM's model runner does not",
        "pools.rollout.workers=1000000": "pools.rollout.workers (--set): Input should be less than or equal to 4096",
        "sampling.prompts_per_step=65": "sampling.prompts_per_step (65) is more than the 64 rows of data.path 'synthetic:64'",
        f"model.path={tmp_path / 'nomodel'}": f"model.path '{tmp_path / 'nomodel'}': no config.json there",  # train's preflight: the same check
        f"eval.data={tmp_path / 'a-rows.jsonl'}": f"1 of the 1 rows of eval.data '{tmp_path / 'a-rows.jsonl'}' carry no reference answer (a)",
        "objective.mode=grpo": "objective.mode grpo trains on rewards: set reward.name",
        "reward.overlong_buffer=4": "reward.overlong_buffer shapes a reward: set reward.name",
        "reward.name=judge": "reward.name judge asks the judge model reward.judge: set both, or neither",
        "reward.dynamic_sampling_rounds=2": "reward.dynamic_sampling_rounds replaces prompts whose rewards give no advantage",
        "optimizer.steps_per_update=40": "optimizer.steps_per_update (40) splits each of the",
    }
    (tmp_path / "a-rows.jsonl").write_text(json.dumps({"sample_uid": "a", "image": "a.png", "question": "Q?"}) + "\n")
    for override, expected in cases.items():
        extra = [f"data.path={tmp_path / 'rows.jsonl'}"] if "image_root" in override else [f"data.image_root={tmp_path}"] if "eval.data" in override else []
        extra += ["eval.selectors=['cdpruner','fastv']"] if override == "pools.rollout.backend=vllm" else []
        assert main(["validate", str(job), "--set", override, *(f"--set={e}" for e in extra)]) == 1, override
        err = capsys.readouterr().err
        assert expected in err, (override, err)
    assert main(["validate", str(job), "--schema-only", "--set", f"data.path={tmp_path / 'folder'}"]) == 0
    judged = ["objective.mode=grpo", "reward.name=judge", f"reward.judge={tmp_path / 'nojudge'}"]  # a judge folder that is not there
    assert main(["validate", str(job), *(f"--set={o}" for o in judged)]) == 1
    assert f"reward.judge '{tmp_path / 'nojudge'}': no judge model there" in capsys.readouterr().err


def test_the_dataset_response_modes_are_refused_rows_without_responses_by_name(tmp_path, capsys):
    """`sft` and `fixed_prefix` train on the rows' own responses: rows without one are named before anything starts."""
    from lt_opd_ray.cli.main import main

    job = tmp_path / "job.yaml"
    job.write_text(open("jobs/train_tiny.yaml").read())
    rows = [{"sample_uid": u, "image": "a.png", "question": "Q?"} for u in "abcd"]
    rows[0]["response"] = "It is red. <answer>red</answer>"
    random_image(2).save(tmp_path / "a.png")
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    settings = [f"data.path={tmp_path / 'rows.jsonl'}", f"data.image_root={tmp_path}", "sampling.n=1", "objective.mode=sft"]
    assert main(["validate", str(job), *(f"--set={s}" for s in settings)]) == 1
    err = capsys.readouterr().err
    assert (f"objective.mode sft trains on the rows' own responses, but 3 of the 4 rows of data.path '{tmp_path / 'rows.jsonl'}'"
            " carry none (b, c, d): give each row a `response`, or train on the teacher's (sequence_kd, teacher_prefix)") in err, err
    assert main(["validate", str(job), *(f"--set={s}" for s in settings[:3]), "--set=objective.mode=teacher_prefix"]) == 0


def test_train_refuses_before_ray_starts_with_one_line(tmp_path, capsys):
    """A folder as data and a job that needs more CPUs than this machine: one line each, exit 2, no Ray started."""
    import ray

    from lt_opd_ray.cli.main import main

    job = tmp_path / "job.yaml"
    job.write_text(open("jobs/train_tiny.yaml").read().replace("dir: runs/tiny", f"dir: {tmp_path / 'run'}"))
    (tmp_path / "folder").mkdir()
    assert main(["train", str(job), "--set", f"data.path={tmp_path / 'folder'}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: job 'tiny' cannot start:\n  {tmp_path / 'folder'}: a folder without manifest.json") and "Traceback" not in err
    assert main(["train", str(job), "--set", "pools.rollout.workers=4000", "--set", "pools.rollout.cpus=1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: job 'tiny' does not fit this machine (a local Ray cluster of its ") and "CPU: the pools need 4001.5 (rollout 4000" in err
    assert not ray.is_initialized()


def test_an_unforeseen_error_is_one_line_and_its_traceback_is_kept_in_the_run_folder(tmp_path, capsys, monkeypatch):
    """The CLI's last resort (what is under test here is its handling, so the run itself is replaced by a failure)."""
    import lt_opd_ray.runtime.launch as launch
    from lt_opd_ray.cli.main import main

    def fails(*args, **kwargs):
        raise ZeroDivisionError("a bug nobody foresaw\nsecond line")

    monkeypatch.setattr(launch, "train", fails)
    job = tmp_path / "job.yaml"
    job.write_text(open("jobs/train_tiny.yaml").read().replace("dir: runs/tiny", f"dir: {tmp_path / 'run'}"))
    assert main(["train", str(job)]) == 1
    err = capsys.readouterr().err
    log = tmp_path / "run" / "error.log"
    assert err == f"error: ZeroDivisionError: a bug nobody foresaw (traceback in {log}; no checkpoint was written, so a new run starts from the beginning)\n"
    assert "Traceback (most recent call last)" in log.read_text() and "in fails" in log.read_text()


# command line -> a fragment of the one sentence it must print (argparse's own refusals print the usage above it)
BAD_COMMAND_LINES = [
    ("eval {tmp}/nomodel --bench pope={pope} --out {tmp}/e", "eval: model.path '{tmp}/nomodel': no config.json there"),
    ("eval tiny:qwen3_5 --bench pope={pope} --budgets 20000 --out {tmp}/e", "argument --budgets: 20000 is out of range: from 1 to 10000"),
    ("eval tiny:qwen3_5 --bench pope={pope} --limit -1 --out {tmp}/e", "argument --limit: -1 is out of range: 1 or more"),
    ("plan jobs/train_qwen35.yaml --gpus 3", "plan: no split of 3 A100-80GB SXM GPUs holds the learner's states"),
    ("plan jobs/train_qwen35.yaml --gpus 0", "argument --gpus: 0 is out of range: 1 or more"),
    ("plan jobs/train_qwen35.yaml --gpus -4", "argument --gpus: -4 is out of range: 1 or more"),
    ("plan jobs/train_qwen35.yaml --gpus 8 --efficiency link=7", "plan: --efficiency 'link=7': a fraction, more than 0 and at most 1"),
    ("plan jobs/train_qwen35.yaml --gpus 6 --gpu h200 --preset qwen3.5-4b --set objective.mode=grpo --set optimizer.steps_per_update=1"
     " --set reward.name=judge --set reward.judge={tmp}/brokenjudge --set pools.reward.gpus=1",
     "plan: reward.judge {tmp}/brokenjudge/config.json: not a readable config.json"),
    ("efficiency {tmp}/llama", "efficiency: {tmp}/llama/config.json: model_type 'llama' has no visual-token pruning support; supported:"),
    ("efficiency --preset qwen3.5-4b --budgets 0 20000", "argument --budgets: 0 is out of range: from 1 to 10000"),
    ("efficiency --preset qwen3.5-4b --text-tokens -5", "argument --text-tokens: -5 is out of range: 0 or more"),
    ("timeline {run} --out {tmp}/missing/t.png", "timeline: {tmp}/missing does not exist; --out names a PNG file in an existing folder"),
    ("timeline {run} --out {tmp}", "timeline: {tmp} is a folder; --out names the PNG file to draw"),
    ("timeline {run} --out {tmp}/notes.png", "timeline: {tmp}/notes.png exists and is not a chart lt-opd timeline drew: it is left alone"),
    ("timeline {run} --last 0", "argument --last: 0 is out of range: 1 or more"),
    ("timeline {run} --last -3", "argument --last: -3 is out of range: 1 or more"),
    ("check-cluster jobs/train_tiny.yaml {tmp}/nocluster.yaml", "check-cluster: {tmp}/nocluster.yaml: no such file or directory"),
    ("serve {tmp} --port 99999", "argument --port: 99999 is out of range: from 1 to 65535"),
    ("serve {toy} --engine vllm", "attention head size 16; vLLM's CPU attention runs head sizes 32, 64,"),  # refused before vLLM starts
    ("serve {toy} --engine tgi", "argument --engine: invalid choice: 'tgi'"),
    ("serve {toy} --api-key-file {tmp}/no-key", "--api-key-file {tmp}/no-key: cannot be read"),
    ("serve {toy} --max-body-mb 0", "argument --max-body-mb: 0 is out of range"),
    ("data {tmp}/notes.png --out {tmp}/d --allowed-media-domains", "argument --allowed-media-domains: expected at least one argument"),
    ("serve {toy} -- --trust-request-mm-kwargs", "options after -- are vLLM's (--trust-request-mm-kwargs); the transformers engine takes none"),
    ("data {tmp}/rows.jsonl --out {tmp}/d --shard-rows 0", "argument --shard-rows: 0 is out of range: 1 or more"),
    ("data {tmp}/rows.jsonl --out {tmp}/d --shard-rows -2", "argument --shard-rows: -2 is out of range: 1 or more"),
    ("export jobs/train_tiny.yaml --out {tmp}/x --step -1", "argument --step: -1 is out of range: 1 or more"),
    ("validate jobs/train_tiny.yaml --set sampling.temperature=1000000", "sampling.temperature (--set): Input should be less than or equal to 10"),
    ("validate {tmp}/twice.yaml", "seed (lines {seed} and {seed_again}): given twice; keep one"),
    ("ablation jobs/toy_discs.yaml --out {tmp}/study --lr-scales 1 1", "ablation: --lr-scales 1.0 1.0: distinct positive scales"),
    ("ablation jobs/toy_discs.yaml --out {tmp}/study --arms grpo --lr-scales 1 --rl-variants 3x_clip",
     "ablation: --rl-variants 3x_clip: distinct names of 2x_group, 0.5x_clip, 2x_clip"),
    ("ablation jobs/toy_discs.yaml --out {tmp}/study --arms grpo --rl-variants 2x_group",
     "ablation: --rl-variants are tried at each RL arm's learning rates chosen on validation rows: give --lr-scales too"),
    ("ablation jobs/toy_discs.yaml --out {tmp}/study --choices-from {tmp}/no-study.json",
     "ablation: --choices-from {tmp}/no-study.json: not a study's results.json"),
    ("ablation jobs/toy_discs.yaml --out {tmp}/study --choices-from {tmp}/no-study.json --arms grpo --rl-variants 2x_group",
     "ablation: --choices-from trains at an earlier study's choices: give it without --lr-scales and --rl-variants"),
    ("ablation --plan {tmp}/no-plan.yaml", "ablation: {tmp}/no-plan.yaml: No such file or directory"),
    ("ablation --plan docs/ablation/discs_contrast/plan.yaml --seeds 3 --arms grpo", "ablation: --plan names the study whole; --arms belong in the plan file"),
    ("ablation --plan {tmp}/twice.yaml", "ablation: {tmp}/twice.yaml: job: Field required"),
]


def test_every_command_refuses_bad_input_in_a_sentence_without_a_traceback(tmp_path, capsys, monkeypatch):
    """Each bad command line: exit 2 (`validate`: 1, a job that does not validate), its sentence on stderr, no
    traceback, nothing written. No pool starts: the table runs in seconds."""
    from test_benchmarks import fixture

    from lt_opd_ray.cli.main import main
    from lt_opd_ray.sources.resolve import resolve_model_dir

    monkeypatch.chdir(Path(__file__).resolve().parents[1])  # the lines name the repository's jobs/
    pope, _, _ = fixture("pope", tmp_path)
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text('{"model_type": "llama"}')
    (tmp_path / "brokenjudge").mkdir()
    (tmp_path / "brokenjudge" / "config.json").write_text("{not json")
    (tmp_path / "notes.png").write_bytes(random_image(0).tobytes())
    run = tmp_path / "run"
    run.mkdir()
    span = {"role": "rollout", "actor": "rollout-0", "label": "u0", "start": 0.0, "end": 1.0}
    (run / "steps.jsonl").write_text(json.dumps({"step": 0, "phases": {"step": 1.0}, "timeline": [span]}) + "\n")
    lines = Path("jobs/train_tiny.yaml").read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("seed:"))
    (tmp_path / "twice.yaml").write_text("\n".join([*lines[:at], "seed: 3", *lines[at:]]) + "\n")
    toy = resolve_model_dir("toy:circles")  # the README's first run's teacher and student shape (head size 16)
    where = {"tmp": str(tmp_path), "pope": str(pope), "run": str(run), "seed": at + 1, "seed_again": at + 2, "toy": toy}
    before = sorted(p.name for p in tmp_path.iterdir())
    for line, fragment in BAD_COMMAND_LINES:
        argv = line.format(**where).split()
        try:
            code = main(argv)
        except SystemExit as exit_:  # argparse's refusal of an option's value
            code = exit_.code
        err = capsys.readouterr().err
        assert code == (1 if argv[0] == "validate" else 2), (line, code, err)
        assert fragment.format(**where) in err and "Traceback" not in err, (line, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written beside the inputs


def test_a_run_whose_metrics_port_another_program_holds_is_refused_before_ray_starts(tmp_path, capsys, monkeypatch):
    """Ray's metrics agent ends its node when metrics.export_port is taken, which Ray reports as a start-up timeout
    naming neither (seen with a second run beside another): refused first, naming the field and the port."""
    import socket

    import ray

    from lt_opd_ray.cli.main import main

    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert not ray.is_initialized()
    earlier = tmp_path / "run"
    earlier.mkdir()
    (earlier / "steps.jsonl").write_text('{"step": 0}\n')  # an earlier run, which --force would move aside
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        code = main(["train", "jobs/train_tiny.yaml", "--force", "--set", f"metrics.export_port={port}", "--set", f"checkpoint.dir={earlier}"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"error: job 'tiny' exports its metrics on metrics.export_port {port}, which another program on this machine holds" in err, err
    assert "Traceback" not in err and not ray.is_initialized()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"] and sorted(p.name for p in earlier.iterdir()) == ["steps.jsonl"]  # nothing moved or written

    # a study the same way, before its teacher is evaluated or its folder made (ablation takes no --set: a job file)
    study_job = tmp_path / "toy.yaml"
    study_job.write_text(Path("jobs/toy_circles_quick.yaml").read_text().replace("export_port: 8091", f"export_port: {port}"))
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.bind(("127.0.0.1", port))
        holder.listen()
        code = main(["ablation", str(study_job), "--arms", "lt_opd", "--seeds", "1", "--out", str(tmp_path / "study")])
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"ablation: job 'toy-circles-quick' exports its metrics on metrics.export_port {port}, which another program" in err, err
    assert "Traceback" not in err and "teacher:" not in capsys.readouterr().out and not ray.is_initialized()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run", "toy.yaml"]  # no study folder


def test_validate_names_a_model_folder_the_vllm_engines_would_refuse_wherever_they_run(tmp_path, capsys, tiny_dirs):
    """A folder of an architecture the vLLM plugin does not serve, or a GLM-4V config without `attention_bias` (vLLM
    would drop its q/k/v biases), is named by `validate` for the roles that run vLLM, not when their engines start;
    on the transformers backends the same folder passes."""
    import shutil

    from lt_opd_ray.cli.main import main

    job = tmp_path / "job.yaml"
    job.write_text(open("jobs/train_tiny_vllm.yaml").read())
    for family, edit, expected in [
        ("qwen3_vl", lambda c: c.update(architectures=["SomeOtherVLM"]), "architecture SomeOtherVLM has no visual-token pruning support"),
        ("glm4v", lambda c: c["text_config"].pop("attention_bias"), "text_config.attention_bias is not true"),
    ]:
        folder = tmp_path / family
        shutil.copytree(tiny_dirs[family], folder)
        config = json.loads((folder / "config.json").read_text())
        edit(config)
        (folder / "config.json").write_text(json.dumps(config))
        settings = [f"model.path={folder}", "model.dtype=float32"]
        assert main(["validate", str(job), *(f"--set={s}" for s in settings)]) == 1, family
        err = capsys.readouterr().err
        assert f"pools.rollout and pools.teacher run vLLM: model.path '{folder}' ({folder / 'config.json'}): {expected}" in err, err
        on_transformers = ["pools.rollout.backend=transformers", "pools.teacher.backend=transformers"]
        assert main(["validate", str(job), *(f"--set={s}" for s in settings + on_transformers)]) == 0, capsys.readouterr().err
