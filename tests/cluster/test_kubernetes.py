"""The Kubernetes manifests in examples/kubernetes/, run as two local "pods": each pod is a process started with
the manifest's own command and env, plus what Kubernetes (and Kubeflow's operator) adds to a pod's env; nothing
else tells `workbench launch` how many nodes there are or which one it is."""

import sys
from pathlib import Path

import pytest
import yaml

from .helpers import finish, free_port, start, summary

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "kubernetes"
FAST = ["training.max_steps=3", "training.threads=1", "output.eval_every=null", "data.eval=null",
        "output.save_every=null", "output.log_every=1"]


def container_of(pod_template: dict) -> dict:
    (container,) = pod_template["spec"]["containers"]
    return container


def command_of(container: dict, run_dir) -> list[str]:
    command = list(container["command"])
    assert command[0] == "workbench"
    return [sys.executable, "-m", "workbench", *command[1:], f"output.dir={run_dir}", *FAST]


def run_pods(pods: list[tuple[list[str], dict]], run_dir) -> dict:
    processes = [start(command, env) for command, env in pods]
    results = [finish(p, timeout=240) for p in processes]
    for code, out in results:
        assert code == 0, out[-3000:]
    assert "# defaults from" in results[0][1]
    s = summary(run_dir)
    assert s["status"] == "completed" and s["world_size"] == 2 and s["distributed_type"] == "MULTI_CPU", s
    assert len(set(s["trainable_checksum_per_rank"])) == 1  # one run, synchronised, not two alone
    return s


def test_pytorchjob_manifest_runs_as_two_pods(tmp_path):
    job = yaml.safe_load((EXAMPLES / "pytorchjob.yaml").read_text())
    specs = job["spec"]["pytorchReplicaSpecs"]
    replicas = [(name, i) for name in ("Master", "Worker") for i in range(specs[name]["replicas"])]
    port = str(free_port())
    pods = []
    for node_rank, (name, _) in enumerate(replicas):
        container = container_of(specs[name]["template"])
        env = {e["name"]: e["value"] for e in container.get("env", [])}
        # what the operator sets in each pod (MASTER_ADDR: the master's Service, here this machine)
        env.update(PET_NNODES=str(len(replicas)), PET_NODE_RANK=str(node_rank),
                   PET_NPROC_PER_NODE=str(job["spec"]["nprocPerNode"]), MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                   WORLD_SIZE=str(len(replicas)), RANK=str(node_rank))
        pods.append((command_of(container, tmp_path / "run"), env))
    run_pods(pods, tmp_path / "run")


def test_indexed_job_manifest_gives_each_pod_its_node_rank(tmp_path):
    """The Indexed Job's pods as far as the command each would run (the run itself: the PyTorchJob test above)."""
    docs = list(yaml.safe_load_all((EXAMPLES / "indexed-job.yaml").read_text()))
    job = next(d for d in docs if d["kind"] == "Job")
    container = container_of(job["spec"]["template"])
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["MASTER_ADDR"].startswith(job["metadata"]["name"] + "-0.")  # pod 0 through the headless Service
    for index in range(job["spec"]["completions"]):
        code, out = finish(start(command_of(container, tmp_path / "run") + ["--dry-run"],
                                 {**env, "JOB_COMPLETION_INDEX": str(index)}))
        assert code == 0, out
        assert "defaults from PET_NNODES, PET_NPROC_PER_NODE, JOB_COMPLETION_INDEX, MASTER_ADDR, MASTER_PORT" in out
        assert (f"--num_processes 2 --num_machines 2 --machine_rank {index} --main_process_ip "
                f"{env['MASTER_ADDR']} --main_process_port {env['MASTER_PORT']}") in out, out
