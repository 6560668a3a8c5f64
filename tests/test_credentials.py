"""Credentials given in URIs never leave the process: the run's files, its trackers' stores and every line a command
prints show `***` where a URI's userinfo or secret query values were (docs/operating.md, "Security")."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import job_for
from test_tracking import logs

from lt_opd_ray.cli.main import main
from lt_opd_ray.core.redact import redact
from lt_opd_ray.core.storage import RunStorage
from lt_opd_ray.runtime.checkpoint import CheckpointStore
from lt_opd_ray.runtime.tracking import Trackers, _credentials_to_environment

REPO = Path(__file__).resolve().parents[1]
SECRETS = ("AKIALEAKEDKEY", "s3-SeCrEt", "mlflow-pw-leak", "lt-user")
STORE = "s3://AKIALEAKEDKEY:s3-SeCrEt%2Fleak@bucket/runs/t?endpoint_override=127.0.0.1:9&scheme=http&region=us-east-1"
TRACKER = "https://lt-user:mlflow-pw-leak@mlflow.internal:5000"


FORMS = [  # (given, shown): userinfo in any spelling, every query and fragment value but the few known safe keys'
    (STORE, "s3://***@bucket/runs/t?endpoint_override=127.0.0.1:9&scheme=http&region=us-east-1"),
    (TRACKER, "https://***@mlflow.internal:5000"),
    ("https://ghp_token@host/repo", "https://***@host/repo"),
    ("gs://bucket/run?access_key=AK&secret_key=SK&region=eu", "gs://bucket/run?access_key=***&secret_key=***&region=eu"),
    (f"cannot open '{STORE}': denied", "cannot open 's3://***@bucket/runs/t?endpoint_override=127.0.0.1:9&scheme=http&region=us-east-1': denied"),
    ("https://u:p@ss@mlflow:5000/x", "https://***@mlflow:5000/x"),  # an "@" in the password: split at the last
    ("s3://KEY:wJal/rXU@bucket/run", "s3://***@bucket/run"),  # a raw "/" in the secret (pyarrow then refuses the URI, quoting it)
    ("abfs://c@acct.dfs.core.windows.net/p?client_id=app&client_secret=S3CR3T&tenant_id=t",
     "abfs://***@acct.dfs.core.windows.net/p?client_id=***&client_secret=***&tenant_id=***"),
    ("https://b.s3.amazonaws.com/o?X-Amz-Credential=AK%2F1&X-Amz-Signature=abc&X-Amz-Expires=60&X-Amz-Security-Token=tok",
     "https://b.s3.amazonaws.com/o?X-Amz-Credential=***&X-Amz-Signature=***&X-Amz-Expires=60&X-Amz-Security-Token=***"),
    ("gs://bucket/runs/model@v2", "gs://bucket/runs/model@v2"),  # an "@" in a path is not userinfo
    ("/data/rows@2x.png and mailto:me@example.org", "/data/rows@2x.png and mailto:me@example.org"),
    ("https://alice:s3'cr3t@host/x", "https://***@host/x"),  # a quote in the secret
    ('s3://AKIAXX:wJalr"SECRET@bucket/p', "s3://***@bucket/p"),
    ("https://h/x?pwd=hunter2", "https://h/x?pwd=***"),
    ("https://h/x?pass=hunter2&user=me", "https://h/x?pass=***&user=***"),
    ("https://h/cb#access_token=abc&expires_in=60", "https://h/cb#access_token=***&expires_in=***"),
    ("https://h/cb#tok123", "https://h/cb#***"),  # a bare fragment
    ("s3://a:b@x/y,s3://c:d@z/w", "s3://***@x/y,s3://***@z/w"),  # two URIs joined
    ("s3://a:b@x/y;gs://c:d@z/w", "s3://***@x/y;gs://***@z/w"),
    ("s3://a:b@x/y|https://c:d@z/w", "s3://***@x/y|https://***@z/w"),
    ('{"uri": "s3://k:s@b/x"}', '{"uri": "s3://***@b/x"}'),
    ("dir: 'https://u:p@h/x'", "dir: 'https://***@h/x'"),
    ("https://u%40x:p%2F@h/run", "https://***@h/run"),  # percent-encoded userinfo
    ("ftp://anonymous@ftp.host/x", "ftp://***@ftp.host/x"),
    ("postgresql://u:p@db:5432/x?sslmode=require", "postgresql://***@db:5432/x?sslmode=***"),
    ("jdbc:mysql://u:p@h/db", "jdbc:mysql://***@h/db"),
    ("HTTPS://U:P@H/X", "HTTPS://***@H/X"),
    ("https://h/x?a=1;sig=2", "https://h/x?a=***;sig=***"),
    ("(see https://u:p@h/x)", "(see https://***@h/x)"),
    ("redis://:password@host:6379/0", "redis://***@host:6379/0"),
    ("s3://a:b@c/run\nnext line s3://bucket/ok", "s3://***@c/run\nnext line s3://bucket/ok"),
    ("wss://h/socket?token=abc", "wss://h/socket?token=***"),
    ("https://acct.blob.core.windows.net/c/b?sv=2024&sig=abc%3D", "https://acct.blob.core.windows.net/c/b?sv=***&sig=***"),
    ("step 3 loss 0.5, budget 5.00%", "step 3 loss 0.5, budget 5.00%"),
    ("s3://AKIA:pa://ss@b/x", "s3://***@b/x"),  # a "://" inside the secret starts no URI
    ("s3://AKIA:p@ss://x@b/y", "s3://***@b/y"),
]


@pytest.mark.parametrize("given, shown", FORMS)
def test_a_uris_userinfo_and_secret_query_values_are_hidden_and_nothing_else(given, shown):
    assert redact(given) == shown


def test_the_command_lines_output_and_argv_are_redacted_line_by_line_however_they_are_written(capsys):
    """Every line the command line prints, written in pieces that split a URI, and the `sys.argv` Ray and W&B record
    while it runs, show no credential; the parsed arguments keep them, and everything is restored after."""
    import sys

    from lt_opd_ray.core.redact import redacted_process

    argv = sys.argv
    sys.argv = ["lt-opd", "train", "job.yaml", "--set", f"checkpoint.dir={STORE}"]
    try:
        with redacted_process():
            assert sys.argv[-1] == "checkpoint.dir=s3://***@bucket/runs/t?endpoint_override=127.0.0.1:9&scheme=http&region=us-east-1"
            sys.stdout.write("cannot open s3://AKIALEAKEDKEY:s3-Se")
            sys.stdout.write("CrEt@bucket/x\nnext ")
            print(" line", TRACKER, file=sys.stderr)
            print("https://h/o?X-Amz-Signature=mlflow-pw-leak")
    finally:
        sys.argv = argv
    out, err = capsys.readouterr()
    assert out == "cannot open s3://***@bucket/x\nnext https://h/o?X-Amz-Signature=***\n", out
    assert err == " line https://***@mlflow.internal:5000\n", err
    assert sys.argv is argv


def test_an_mlflow_servers_credentials_go_to_mlflows_variables_not_its_uri(monkeypatch):
    for name in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
        monkeypatch.setenv(name, "")  # restored (removed) after the test, whatever the function set
    assert _credentials_to_environment("https://lt-user:pw%40leak@mlflow.internal:5000/x") == "https://mlflow.internal:5000/x"
    assert os.environ["MLFLOW_TRACKING_USERNAME"] == "lt-user" and os.environ["MLFLOW_TRACKING_PASSWORD"] == "pw@leak"
    assert _credentials_to_environment("sqlite:///runs/t/mlflow.db") == "sqlite:///runs/t/mlflow.db"


def test_no_credential_of_a_job_is_written_or_printed(tmp_path, capfd):
    """A job whose checkpoint.dir and MLflow server carry credentials: `validate --print`, the run folder's job.yaml,
    every tracker's store of the job, and `train` against a store that does not answer (its error line, and nothing
    written to its staging folder) show none of them."""
    tracking = f'tracking: {{backends: [tensorboard, mlflow, wandb], project: tests, dir: "{tmp_path / "tracking"}", mlflow_uri: "{TRACKER}"}}\n'
    (tmp_path / "job.yaml").write_text((REPO / "jobs" / "train_tiny.yaml").read_text() + tracking)
    assert main(["validate", str(tmp_path / "job.yaml"), "--print", "--schema-only", "--set", f"checkpoint.dir={STORE}"]) == 0
    validated = capfd.readouterr()
    assert "dir: s3://***@bucket/runs/t" in validated.out
    # Ray keeps a submitted job's entrypoint and working directory for every token holder to read: refused before any upload
    assert main(["submit", str(tmp_path / "job.yaml"), "--address", "http://127.0.0.1:9"]) == 2
    assert main(["submit", "jobs/train_tiny.yaml", "--address", "http://127.0.0.1:9", "--set", f"checkpoint.dir={STORE}"]) == 2
    submitted = capfd.readouterr()
    assert submitted.err.count("carries credentials in a URI; Ray keeps a job's entrypoint") == 2

    job = job_for("tiny:qwen3_5", tmp_path / "run", extra=f'tracking: {{mlflow_uri: "{TRACKER}"}}\n')
    CheckpointStore(job)
    assert "mlflow_uri: https://***@mlflow.internal:5000" in (tmp_path / "run" / "job.yaml").read_text()
    # every tracker keeps the job; MLflow on its own store here (no MLflow server on this machine), the two URIs in
    # fields each store copies
    stored = job.model_copy(update={
        "data": job.data.model_copy(update={"path": STORE}), "model": job.model.model_copy(update={"path": TRACKER}),
        "tracking": job.tracking.model_copy(update={"backends": ["tensorboard", "mlflow", "wandb"], "dir": str(tmp_path / "tracking"), "mlflow_uri": None}),
    })
    trackers = Trackers(stored, RunStorage(str(tmp_path / "run")))
    for log in logs():
        trackers.step(log)
    trackers.close()
    assert any(b"***@bucket" in path.read_bytes() for path in (tmp_path / "tracking").rglob("*") if path.is_file())

    train = subprocess.run([str(Path(sys.executable).parent / "lt-opd"), "train", str(tmp_path / "job.yaml"), "--set", f"checkpoint.dir={STORE}",
                            "--set", f"checkpoint.staging_dir={tmp_path / 'stage'}"], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert train.returncode == 2 and train.stderr.startswith("error: s3://***@bucket/runs/t?endpoint_override=127.0.0.1:9"), train.stderr
    assert "not reachable" in train.stderr and not (tmp_path / "stage").exists()

    printed = capfd.readouterr()
    shown = "".join([validated.out, validated.err, submitted.out, submitted.err, printed.out, printed.err, train.stdout, train.stderr])
    leaks = [(str(path), secret) for path in tmp_path.rglob("*") if path.is_file() for secret in SECRETS if secret.encode() in path.read_bytes()
             and path != tmp_path / "job.yaml"]  # the job as the user wrote it
    assert not leaks and not [secret for secret in SECRETS if secret in shown], (leaks, shown[-3000:])
