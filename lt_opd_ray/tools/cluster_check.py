"""Offline checks of cluster configs against a job: Ray cluster-launcher YAML and KubeRay manifests.

Structure: required keys of the launcher config; the RayCluster / RayJob fields
of KubeRay's ray.io/v1 CRDs (unknown keys are errors, as the API server's
strict field validation would report them). Capacity: every pool that pins itself
with `node_resource` finds nodes advertising that resource, with enough units and
GPUs at the groups' maximum size, and the pools together fit the cluster's GPUs and CPUs (at the
sizes a job starts with: autoscaling headroom never refuses a cluster); a node resource named `lt_opd_<pool>` for a pool
that does not exist is an error. Access: the cluster turns Ray's token auth on (every port of a Ray node runs code
on request), KubeRay through `authOptions` (and no container setting RAY_AUTH_MODE itself), the launcher in every
Ray start it runs. The launcher's commands are judged as the launcher will run them: the config merged over the
provider's defaults by Ray's own `fillout_defaults` (a config without start commands gets Ray's, which start the
head without auth), every command list read by a shell parser (lt_opd_ray/tools/shell_commands.py), and a Ray start
accepted only where RAY_AUTH_MODE=token is proven for it; what cannot be read is refused. In every list (setup commands
included) a program the parser cannot read may not be given a word naming Ray, nothing may write a shell start-up file
(the launcher's `bash --login -i` reads them before every later command) or ~/.ray (the token), and no package manager
may install Ray (the image carries the version that supports token auth). Imports Ray's autoscaler
defaults for launcher configs only.
"""

from __future__ import annotations

import copy
import json

from lt_opd_ray.config.schema import JobConfig
from lt_opd_ray.tools.shell_commands import UNKNOWN, UNSET, read_command

POOLS = ("rollout", "teacher", "learner")
POOL_RESOURCE_PREFIX = "lt_opd_"

LAUNCHER_REQUIRED = {"cluster_name", "provider", "available_node_types", "head_node_type"}
LAUNCHER_NODE_REQUIRED = {"resources", "node_config", "max_workers"}

RAYCLUSTER_SPEC = {
    "rayVersion", "enableInTreeAutoscaling", "autoscalerOptions", "headGroupSpec", "workerGroupSpecs",
    "headServiceAnnotations", "suspend", "managedBy", "gcsFaultToleranceOptions", "upgradeStrategy", "authOptions",
}
HEAD_GROUP = {"rayStartParams", "template", "serviceType", "headService", "enableIngress", "suspend", "resources", "labels"}
WORKER_GROUP = {
    "groupName", "replicas", "minReplicas", "maxReplicas", "numOfHosts", "rayStartParams", "template",
    "scaleStrategy", "suspend", "idleTimeoutSeconds", "resources", "labels",
}
RAYJOB_SPEC = {
    "entrypoint", "runtimeEnvYAML", "jobId", "shutdownAfterJobFinishes", "ttlSecondsAfterFinished",
    "activeDeadlineSeconds", "rayClusterSpec", "clusterSelector", "submitterPodTemplate", "submitterConfig",
    "entrypointNumCpus", "entrypointNumGpus", "entrypointResources", "submissionMode", "backoffLimit", "suspend",
    "managedBy", "deletionStrategy", "metadata",
}

Capacity = dict[str, dict[str, float]]  # node group -> total resources at its maximum size


def _unknown(keys, allowed: set[str], where: str) -> list[str]:
    return [f"{where}.{key}: unknown field" for key in sorted(set(keys) - allowed)]


def launcher_capacity(config: dict, source: str) -> tuple[Capacity, list[str]]:
    problems = [f"{source}: missing {key}" for key in sorted(LAUNCHER_REQUIRED - set(config))]
    types = config.get("available_node_types") or {}
    if config.get("head_node_type") not in types:
        problems.append(f"{source}: head_node_type {config.get('head_node_type')!r} is not in available_node_types")
    capacity = {}
    for name, node in types.items():
        problems += [f"{source}: available_node_types.{name}: missing {key}" for key in sorted(LAUNCHER_NODE_REQUIRED - set(node))]
        count = max(int(node.get("max_workers", 0)), 1 if name == config.get("head_node_type") else 0)
        capacity[name] = {r: float(v) * count for r, v in (node.get("resources") or {}).items()}
    problems += launcher_access(config, source)
    return capacity, problems


START_FIELDS = ("head_start_ray_commands", "worker_start_ray_commands")
SETUP_FIELDS = ("initialization_commands", "setup_commands", "head_setup_commands", "worker_setup_commands")
NODE_TYPE_FIELDS = ("initialization_commands", "worker_setup_commands")  # a node type's own lists replace the config's
TOKEN_FILE = "~/.ray/auth_token"
FIX = "start it as RAY_AUTH_MODE=token ray start ..."


def launcher_as_run(config: dict) -> dict:
    """The config Ray's cluster launcher runs: the user's keys over the provider's defaults (`ray up` merges them so)."""
    from ray.autoscaler._private.util import fillout_defaults

    return fillout_defaults(copy.deepcopy(config))


def _start_problem(start, token_mounted: set[str]) -> str | None:
    """Why one Ray start is not proven token-authenticated (None: it is)."""
    if start.under_sudo:
        return "under sudo, whose policy (env_reset, the target user's home), not the command, decides its RAY_AUTH_MODE and token file"
    if start.system_config_auth:
        return "with an auth setting (or an unreadable value) in --system-config, which RAY_AUTH_MODE alone must decide"
    if start.auth_mode != "token":
        mode = {UNKNOWN: "not set to token in the command itself", UNSET: "unset"}.get(start.auth_mode, repr(start.auth_mode))
        return f"without token auth (RAY_AUTH_MODE is {mode})"
    if start.token == UNSET and start.token_path not in (UNKNOWN, UNSET) and start.token_path not in token_mounted:
        return f"with RAY_AUTH_TOKEN_PATH={start.token_path}, a file the config's file_mounts do not put on the node"
    return None


def launcher_access(config: dict, source: str) -> list[str]:
    """Every Ray start of every command list the launcher runs is proven to use token auth; what cannot be read is refused."""
    try:
        merged = launcher_as_run(config)
    except ImportError as exc:
        return [f"{source}: Ray's cluster launcher is not importable here ({exc}), so check-cluster cannot merge its defaults and tell what the nodes run"]
    except Exception as exc:  # noqa: BLE001 - whatever Ray's merge raises, the launcher would refuse the config too
        return [f"{source}: provider: Ray's cluster launcher cannot fill in its defaults ({type(exc).__name__}: {exc}), so check-cluster cannot tell what the nodes run"]
    provider = (merged.get("provider") or {}).get("type")
    mounts = merged.get("file_mounts") or {}
    token_mounted = {str(target) for target in mounts} if isinstance(mounts, dict) else set()
    lists = [(key, merged.get(key), key in config) for key in (*SETUP_FIELDS, *START_FIELDS)]
    for name, node in (merged.get("available_node_types") or {}).items():
        lists += [(f"available_node_types.{name}.{key}", node.get(key), True) for key in NODE_TYPE_FIELDS if isinstance(node, dict) and key in node]
    problems, proven = [], []
    for field, commands, own in lists:
        where = field if own else f"{field} (Ray's {provider} defaults: the config sets none)"
        if commands is None:
            continue
        if not isinstance(commands, list) or not all(isinstance(c, str) for c in commands):
            problems.append(f"{source}: {where}: not a list of shell commands, so check-cluster cannot tell what the nodes run")
            continue
        for command in commands:
            reading = read_command(command, strict=field in START_FIELDS)
            why = next((w for start in reading.starts if (w := _start_problem(start, token_mounted))), None)
            host = next((s.dashboard_host for s in reading.starts if s.head and s.dashboard_host not in (None, "127.0.0.1", "localhost")), None)
            if reading.unreadable:
                problems.append(f"{source}: {where}: {command!r} {reading.unreadable[0]}, so check-cluster cannot prove that Ray starts there "
                                f"with token auth; {reading.fixes[0] or FIX}")
            elif why:
                exposed = f" (its dashboard on {host})" if host else ""
                problems.append(f"{source}: {where}: {command!r} starts Ray {why}, so anyone who reaches the node{exposed} can run a job on it; {FIX}")
            else:
                proven += reading.starts
    if proven and TOKEN_FILE not in token_mounted and any(s.token in (UNKNOWN, UNSET) and s.token_path in (UNKNOWN, UNSET) for s in proven):
        problems.append(f"{source}: file_mounts: no {TOKEN_FILE}, so the nodes' `RAY_AUTH_MODE=token ray start` finds no token; "
                        f"mount the one `ray get-auth-token --generate` wrote: file_mounts: {{\"{TOKEN_FILE}\": \"{TOKEN_FILE}\"}}")
    return problems


def _group_capacity(group: dict, where: str) -> tuple[dict[str, float], list[str]]:
    params = group.get("rayStartParams") or {}
    resources: dict[str, float] = {}
    problems = []
    if "resources" in params:
        try:
            # KubeRay passes the value verbatim to `ray start --resources`, so it is a quoted JSON object
            resources = {k: float(v) for k, v in json.loads(json.loads(params["resources"])).items()}
        except (ValueError, TypeError, AttributeError):
            problems.append(f"{where}.rayStartParams.resources: not a quoted JSON object: {params['resources']!r}")
    gpus = cpus = 0.0
    for container in group.get("template", {}).get("spec", {}).get("containers", []):
        limits = container.get("resources", {}).get("limits") or {}
        gpus += float(limits.get("nvidia.com/gpu", 0))
        cpu = str(limits.get("cpu", 0))
        cpus += float(cpu[:-1]) / 1000 if cpu.endswith("m") else float(cpu)  # Kubernetes quantities: "40" or "500m"
    resources["GPU"] = float(params.get("num-gpus", gpus))
    resources["CPU"] = float(params.get("num-cpus", cpus))  # what `ray start` advertises: the container's CPU limit
    count = int(group.get("maxReplicas", group.get("replicas", 1))) * int(group.get("numOfHosts", 1))
    return {r: v * count for r, v in resources.items()}, problems


AUTH_ENV = {"RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"}


def _pod_auth(group: dict, where: str) -> list[str]:
    """KubeRay's authOptions sets the Ray containers' auth variables; a container that sets one itself may override it."""
    problems = []
    params = group.get("rayStartParams") or {}
    if "system-config" in params and "auth" in str(params["system-config"]).lower():
        problems.append(f"{where}.rayStartParams.system-config: names an auth setting, which authOptions alone must decide")
    return problems + _template_auth(group.get("template") or {}, f"{where}.template")


def _template_auth(template: dict, where: str) -> list[str]:
    problems = []
    pod = template.get("spec") or {}
    for kind in ("initContainers", "containers"):
        for i, container in enumerate(pod.get(kind) or []):
            for var in container.get("env") or []:
                if isinstance(var, dict) and var.get("name") in AUTH_ENV:
                    problems.append(f"{where}.spec.{kind}[{i}].env: sets {var['name']}, which KubeRay's authOptions sets; remove it so token auth cannot be overridden")
            if container.get("envFrom"):
                problems.append(f"{where}.spec.{kind}[{i}].envFrom: may set RAY_AUTH_MODE, which KubeRay's authOptions sets; name the variables one by one in env")
    return problems


def raycluster_capacity(spec: dict, where: str) -> tuple[Capacity, list[str]]:
    problems = _unknown(spec, RAYCLUSTER_SPEC, where)
    if (spec.get("authOptions") or {}).get("mode") != "token":
        problems.append(f"{where}.authOptions: token auth is off, so anyone who reaches the head can run a job on the cluster; set authOptions: {{mode: token}} (KubeRay >= 1.5.1)")
    if "headGroupSpec" not in spec:
        problems.append(f"{where}.headGroupSpec: missing")
    else:
        problems += _unknown(spec["headGroupSpec"], HEAD_GROUP, f"{where}.headGroupSpec")
        problems += _pod_auth(spec["headGroupSpec"], f"{where}.headGroupSpec")
    capacity = {}
    for i, group in enumerate(spec.get("workerGroupSpecs") or []):
        at = f"{where}.workerGroupSpecs[{i}]"
        problems += _unknown(group, WORKER_GROUP, at)
        if "groupName" not in group or "template" not in group:
            problems.append(f"{at}: groupName and template are required")
        if int(group.get("minReplicas", 0)) > int(group.get("maxReplicas", 2**31)):
            problems.append(f"{at}: minReplicas exceeds maxReplicas")
        problems += _pod_auth(group, at)
        group_capacity, group_problems = _group_capacity(group, at)
        capacity[group.get("groupName", at)] = group_capacity
        problems += group_problems
    return capacity, problems


def manifest_capacity(doc: dict, source: str) -> tuple[Capacity, list[str]]:
    if doc.get("apiVersion") != "ray.io/v1":
        return {}, [f"{source}: apiVersion must be ray.io/v1, got {doc.get('apiVersion')!r}"]
    kind, spec = doc.get("kind"), doc.get("spec") or {}
    if kind == "RayCluster":
        return raycluster_capacity(spec, f"{source}: spec")
    if kind == "RayJob":
        problems = _unknown(spec, RAYJOB_SPEC, f"{source}: spec")
        if not spec.get("entrypoint"):
            problems.append(f"{source}: spec.entrypoint: missing")
        problems += _template_auth(spec.get("submitterPodTemplate") or {}, f"{source}: spec.submitterPodTemplate")
        capacity, more = raycluster_capacity(spec.get("rayClusterSpec") or {}, f"{source}: spec.rayClusterSpec")
        return capacity, problems + more
    return {}, [f"{source}: kind must be RayCluster or RayJob, got {kind!r}"]


def check_capacity(capacity: Capacity, job: JobConfig, source: str) -> list[str]:
    from lt_opd_ray.runtime.resources import pool_sizes

    problems = []
    for group, resources in capacity.items():
        for resource in resources:
            if resource.startswith(POOL_RESOURCE_PREFIX) and resource[len(POOL_RESOURCE_PREFIX) :] not in POOLS:
                problems.append(f"{source}: {group} advertises {resource}, a resource of unknown pool {resource[len(POOL_RESOURCE_PREFIX):]!r} (pools: {', '.join(POOLS)})")
    for pool, size in pool_sizes(job).items():
        spec = getattr(job.pools, pool)
        if not spec.node_resource or size == 0:  # no teacher where the objective reads no teacher scores
            continue
        groups = {g: r for g, r in capacity.items() if spec.node_resource in r}
        if not groups:
            problems.append(f"{source}: pool {pool} requests {spec.node_resource}, which no node group advertises")
            continue
        units = sum(r[spec.node_resource] for r in groups.values())
        gpus = sum(r.get("GPU", 0.0) for r in groups.values())
        if units < size:
            problems.append(f"{source}: pool {pool} needs {size} x {spec.node_resource}, the groups {sorted(groups)} offer {units:g}")
        if gpus < size * spec.gpus:
            problems.append(f"{source}: pool {pool} needs {size * spec.gpus:g} GPUs on {sorted(groups)}, which have {gpus:g}")
    for resource in ("GPU", "CPU"):  # every pool, pinned or not, somewhere in the cluster
        need = sum(size * getattr(getattr(job.pools, pool), resource.lower() + "s") for pool, size in pool_sizes(job).items())
        have = sum(r.get(resource, 0.0) for r in capacity.values())
        if resource in {r for c in capacity.values() for r in c} and need > have + 1e-9:
            problems.append(f"{source}: the pools need {need:g} {resource}s in all, the node groups offer {have:g} at their largest")
    return problems


def check_cluster_file(doc: dict, job: JobConfig, source: str) -> list[str]:
    """All problems of one cluster YAML (launcher config or KubeRay manifest) for `job`."""
    if not isinstance(doc, dict):
        return [f"{source}: not a mapping of a launcher config or a KubeRay manifest"]
    if "available_node_types" in doc or "provider" in doc:  # a launcher config, even one that leaves its node types to Ray's defaults
        capacity, problems = launcher_capacity(doc, source)
    else:
        capacity, problems = manifest_capacity(doc, source)
    return problems + check_capacity(capacity, job, source)
