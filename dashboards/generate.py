"""Generate the Grafana dashboard for an LT-OPD run and its kube-prometheus-stack ConfigMap.

    python dashboards/generate.py        # rewrites lt_opd.json and kube-prometheus-stack-configmap.yaml

Panels read the `ray_lt_opd_*` series the actors export (lt_opd_ray/runtime/metrics.py)
and Ray's own node metrics. Variables: the Prometheus datasource, the Ray session
(`SessionName`, every Ray metric carries it) and the run (the job's name). A test checks that
the committed files equal this script's output and that every query returns data
from a real Prometheus scraping a real run.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
RUN = 'run=~"$run", SessionName=~"$session"'

# (title, unit, [(expr, legend)])
POOLS = ("rollout", "teacher", "learner")  # each pool's node type advertises lt_opd_<pool> (pools.<pool>.node_resource)


def on_pool_nodes(metric: str, pool: str) -> str:
    """`metric` (a Ray node metric, labelled by `ip`) averaged over the nodes whose raylet reports resource
    lt_opd_<pool> (`ray_resources`, labelled by `NodeAddress`)."""
    nodes = f'(count by (SessionName, NodeAddress) (ray_resources{{SessionName=~"$session", Name="lt_opd_{pool}"}}) > bool 0)'
    node_metric = f'label_replace({metric}{{SessionName=~"$session"}}, "NodeAddress", "$1", "ip", "(.*)")'
    return f"avg({node_metric} * on (SessionName, NodeAddress) group_left() {nodes})"


PANELS = [
    ("Rollout tokens/s per worker", "short", [(f"ray_lt_opd_rollout_tokens_per_second{{{RUN}}}", "{{actor}}"),
                                              (f"sum(ray_lt_opd_rollout_tokens_per_second{{{RUN}}})", "pool total")]),
    ("Teacher tokens/s per replica", "short", [(f"ray_lt_opd_teacher_tokens_per_second{{{RUN}}}", "{{actor}}"),
                                               (f"sum(ray_lt_opd_teacher_tokens_per_second{{{RUN}}})", "pool total")]),
    ("Learner samples/s", "short", [(f"rate(ray_lt_opd_learner_samples_total{{{RUN}}}[$__rate_interval])", "samples/s")]),
    ("Step-time split", "s", [(f'ray_lt_opd_phase_seconds{{{RUN}, phase!="step"}}', "{{phase}}")]),
    ("Step seconds", "s", [(f'ray_lt_opd_phase_seconds{{{RUN}, phase="step"}}', "step")]),
    ("Pool busy fraction", "percentunit", [(f"ray_lt_opd_pool_busy_fraction{{{RUN}}}", "{{pool}}")]),
    ("Rollout staleness (weight versions)", "short", [(f"ray_lt_opd_staleness{{{RUN}}}", "staleness")]),
    ("Weight-sync seconds", "s", [(f"ray_lt_opd_weight_sync_seconds{{{RUN}}}", "{{actor}}")]),
    ("Weight-sync bytes/s", "Bps", [(f"rate(ray_lt_opd_weight_sync_bytes_total{{{RUN}}}[$__rate_interval])", "{{actor}}")]),
    ("Visual budget (curriculum)", "percent", [(f"ray_lt_opd_budget_bps{{{RUN}, actor=\"driver\"}} / 100", "budget %")]),
    ("Optimizer steps", "short", [(f"ray_lt_opd_step{{{RUN}}}", "step")]),
    ("Loss and divergence", "short", [(f"ray_lt_opd_loss{{{RUN}}}", "loss {{actor}}"), (f"ray_lt_opd_divergence{{{RUN}}}", "divergence {{actor}}")]),
    ("Reward of the update's responses (jobs with a reward)", "short", [(f"ray_lt_opd_reward_mean{{{RUN}}}", "mean"),
                                                                         (f"ray_lt_opd_reward_std{{{RUN}}}", "standard deviation")]),
    ("Groups whose rewards were all equal (dynamic sampling; jobs with a reward)", "short",
     [(f"ray_lt_opd_resampled_groups{{{RUN}}}", "given to drawn rows"), (f"ray_lt_opd_flat_groups{{{RUN}}}", "kept flat after the last round")]),
    ("Held-out accuracy at the evaluation budget", "percentunit",
     [(f"ray_lt_opd_eval_accuracy{{{RUN}}}", "{{selector}} at {{budget_bps}} bps")]),
    ("Importance weight", "short", [(f"ray_lt_opd_importance_weight{{{RUN}}}", "{{actor}}")]),
    ("Importance weights clipped (RL baselines: ratios the clip stops), responses cut at max_new_tokens", "percentunit",
     [(f"ray_lt_opd_importance_clipped_share{{{RUN}}}", "clipped {{actor}}"), (f"ray_lt_opd_truncated_share{{{RUN}}}", "cut {{actor}}")]),
    ("Rollout/learner log-prob gap of the sampled tokens", "short", [(f"ray_lt_opd_logprob_gap{{{RUN}}}", "{{actor}}")]),
    ("Response length (tokens)", "short", [(f"ray_lt_opd_response_tokens{{{RUN}}}", "{{stat}} {{actor}}")]),
    ("Student/teacher top-k overlap", "percentunit", [(f"ray_lt_opd_topk_overlap{{{RUN}}}", "{{actor}}")]),
    ("Teacher payload bytes/token", "bytes", [(f"ray_lt_opd_teacher_payload_bytes_per_token{{{RUN}}}", "{{actor}}")]),
    ("Benchmark scores at the evaluation budget", "short", [(f"ray_lt_opd_eval_score{{{RUN}}}", "{{benchmark}} {{selector}} at {{budget_bps}} bps")]),
    ("Teacher requests at replicas and queued (the autoscaler's input)", "short",
     [('sum(ray_serve_num_ongoing_requests_at_replicas{SessionName=~"$session", application=~"$run-teacher"})', "ongoing at replicas"),
      ('sum(ray_serve_deployment_queued_queries{SessionName=~"$session", application=~"$run-teacher"})', "queued at handles")]),
    ("Object store memory", "bytes", [('ray_object_store_memory{SessionName=~"$session"}', "{{Location}} {{instance}}")]),
    ("GPU memory per node (each pool runs on its own node type)", "decmbytes",
     [('ray_node_gram_used{SessionName=~"$session"}', "GPU {{GpuIndex}} {{instance}}")]),
    ("Actors per pool", "short", [(f"ray_lt_opd_pool_actors{{{RUN}}}", "{{pool}}")]),
    ("Actor restarts per pool", "short", [(f"ray_lt_opd_actor_restarts{{{RUN}}}", "{{pool}}")]),
    ("Node utilisation (Ray node metrics)", "percent", [('ray_node_gpus_utilization{SessionName=~"$session"}', "GPU {{GpuIndex}} {{instance}}"),
                                                        ('ray_node_cpu_utilization{SessionName=~"$session"}', "CPU {{instance}}")]),
    ("CPU utilisation by pool (mean over the nodes advertising its node_resource)", "percent",
     [(on_pool_nodes("ray_node_cpu_utilization", pool), pool) for pool in POOLS]),
    ("GPU utilisation by pool (mean over the nodes advertising its node_resource)", "percent",
     [(on_pool_nodes("ray_node_gpus_utilization", pool), pool) for pool in POOLS]),
]

# Series that exist only where the hardware does (no GPU, no GPU series); the test accepts an empty answer for these.
HARDWARE_DEPENDENT = {"ray_node_gpus_utilization", "ray_node_gram_used"}


def panel(index: int, title: str, unit: str, targets: list[tuple[str, str]]) -> dict:
    return {
        "id": index + 1,
        "type": "timeseries",
        "title": title,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "gridPos": {"h": 8, "w": 12, "x": 12 * (index % 2), "y": 8 * (index // 2)},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi"}},
        "targets": [
            {"refId": chr(ord("A") + i), "expr": expr, "legendFormat": legend, "datasource": {"type": "prometheus", "uid": "${datasource}"}}
            for i, (expr, legend) in enumerate(targets)
        ],
    }


def variable(name: str, label: str, query: str) -> dict:
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "query": {"query": query, "refId": name},
        "definition": query,
        "refresh": 2,
        "includeAll": True,
        "multi": True,
        "allValue": ".*",
        "current": {"selected": True, "text": "All", "value": "$__all"},
    }


def dashboard() -> dict:
    return {
        "uid": "lt-opd-run",
        "title": "LT-OPD run",
        "tags": ["lt-opd", "ray"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {
            "list": [
                {"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus", "current": {}},
                variable("session", "Ray session", "label_values(ray_lt_opd_step, SessionName)"),
                variable("run", "Run (job name)", 'label_values(ray_lt_opd_step{SessionName=~"$session"}, run)'),
            ]
        },
        "panels": [panel(i, *spec) for i, spec in enumerate(PANELS)],
    }


def configmap(dashboard_json: str) -> dict:
    """For kube-prometheus-stack: its Grafana sidecar loads ConfigMaps labelled grafana_dashboard=1."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "lt-opd-dashboard", "labels": {"grafana_dashboard": "1"}},
        "data": {"lt-opd.json": dashboard_json},
    }


class _BlockStrings(yaml.SafeDumper):
    """Dumps multi-line strings as literal blocks, so the embedded dashboard stays readable."""


_BlockStrings.add_representer(
    str, lambda dumper, value: dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)
)


def render() -> dict[str, str]:
    text = json.dumps(dashboard(), indent=2) + "\n"
    return {
        "lt_opd.json": text,
        "kube-prometheus-stack-configmap.yaml": "# Generated by dashboards/generate.py; do not edit.\n"
        + yaml.dump(configmap(text), Dumper=_BlockStrings, sort_keys=False, width=4096),
    }


if __name__ == "__main__":
    for name, text in render().items():
        (HERE / name).write_text(text)
        print(f"wrote {HERE / name}")
