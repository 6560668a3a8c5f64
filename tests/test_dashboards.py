"""The Grafana dashboard against a real Prometheus scraping a real local tiny run."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "dashboards"))
import generate  # noqa: E402

JOB_NAME = "dash"


def metric_names(expr: str) -> set[str]:
    """Metric names an expression reads (identifiers followed by a label selector or a range)."""
    return set(re.findall(r"\b(ray_[a-z0-9_]+)\s*[{\[]", expr))


def panel_queries(dashboard: dict, job: str, session: str = ".*", rate_interval: str = "30s"):
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            expr = target["expr"].replace("$run", job).replace("$session", session).replace("$__rate_interval", rate_interval)
            yield panel["title"], expr


def test_committed_dashboard_files_equal_the_generator():
    for name, text in generate.render().items():
        assert (REPO / "dashboards" / name).read_text() == text, f"dashboards/{name} is stale: run python dashboards/generate.py"
    configmap = yaml.safe_load((REPO / "dashboards" / "kube-prometheus-stack-configmap.yaml").read_text())
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(configmap["data"]["lt-opd.json"]) == json.loads((REPO / "dashboards" / "lt_opd.json").read_text())


def test_dashboard_has_datasource_and_session_variables_and_every_panel_uses_them():
    board = json.loads((REPO / "dashboards" / "lt_opd.json").read_text())
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert "SessionName" in variables["session"]["query"]["query"]
    for panel in board["panels"]:
        assert panel["datasource"]["uid"] == "${datasource}"
        for target in panel["targets"]:
            assert '$session' in target["expr"], panel["title"]


def test_provisioning_files_parse():
    datasources = yaml.safe_load((REPO / "dashboards/provisioning/datasources/prometheus.yaml").read_text())
    assert datasources["datasources"][0]["type"] == "prometheus"
    providers = yaml.safe_load((REPO / "dashboards/provisioning/dashboards/lt-opd.yaml").read_text())
    assert providers["providers"][0]["type"] == "file"


def prometheus_query(port: int, expr: str) -> list:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    answer = json.loads(urllib.request.urlopen(url, timeout=10).read())
    assert answer["status"] == "success", answer
    return answer["data"]["result"]


@pytest.fixture(scope="module")
def scraped_run(cluster, metrics_port, tmp_path_factory, tiny_dirs):
    """A tiny distributed run on the shared cluster (one node advertising every pool's node_resource), its Ray
    metrics scraped every second by a real Prometheus."""
    from conftest import job_for
    from test_benchmarks import fixture

    from lt_opd_ray.runtime.driver import Driver
    from lt_opd_ray.runtime.learner_group import free_port

    binary = shutil.which("prometheus")
    assert binary, "prometheus is not installed: scripts/setup.sh installs Debian's package"
    tmp = tmp_path_factory.mktemp("prom")
    prom_port = free_port()
    config = {"global": {"scrape_interval": "1s"}, "scrape_configs": [{"job_name": "ray", "static_configs": [{"targets": [f"127.0.0.1:{metrics_port}"]}]}]}
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    server = subprocess.Popen(
        [binary, f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'data'}", f"--web.listen-address=127.0.0.1:{prom_port}"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    pope, _, _ = fixture("pope", tmp)
    evaluation = f'eval: {{data: "synthetic:2", every_steps: 1, benchmarks: {{pope: "{pope}"}}}}\nreward: {{name: format}}\n'
    driver = Driver(job_for(tiny_dirs["qwen3_5"], tmp / "ckpt", ranks=1, name=JOB_NAME, extra=evaluation))
    try:
        for _ in range(3):
            driver.run_step()
        # each actor reports to the node's agent on its own schedule: wait until every panel's query, rate() windows
        # included, returns data (what the test then checks)
        board = json.loads((REPO / "dashboards" / "lt_opd.json").read_text())
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                if not panels_without_data(prom_port, board):
                    break
            except OSError:
                pass
            time.sleep(2)
        yield prom_port
    finally:
        driver.shutdown()
        server.terminate()
        server.wait(timeout=30)


def panels_without_data(port: int, board: dict) -> list[str]:
    return [
        f"{title}: {expr}"
        for title, expr in panel_queries(board, JOB_NAME)
        if not prometheus_query(port, expr) and not metric_names(expr) & generate.HARDWARE_DEPENDENT
    ]


def test_every_query_of_every_panel_returns_data(scraped_run):
    board = json.loads((REPO / "dashboards" / "lt_opd.json").read_text())
    empty = panels_without_data(scraped_run, board)
    assert not empty, "panels without data:\n" + "\n".join(empty)
    # the variables' own queries resolve to this run
    sessions = {r["metric"].get("SessionName") for r in prometheus_query(scraped_run, "ray_lt_opd_step")}
    assert sessions and None not in sessions


def test_a_panel_on_a_metric_that_no_longer_exists_fails_the_check(scraped_run):
    board = json.loads((REPO / "dashboards" / "lt_opd.json").read_text())
    board["panels"][0]["targets"][0]["expr"] = board["panels"][0]["targets"][0]["expr"].replace("rollout_tokens_per_second", "rollout_tokens_per_sec")
    title, expr = next(panel_queries(board, JOB_NAME))
    assert prometheus_query(scraped_run, expr) == [], f"{title} should have no data"


def test_hardware_dependent_series_are_still_exported_by_ray():
    """Series with no data on this machine (no GPU) must at least still be among Ray's node metrics."""
    from ray.dashboard.modules.reporter.reporter_agent import METRICS_GAUGES

    for name in generate.HARDWARE_DEPENDENT:
        assert name.removeprefix("ray_") in METRICS_GAUGES, name
