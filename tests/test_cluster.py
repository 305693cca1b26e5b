"""A real two-node Ray cluster on 127.0.0.1: ``ray start --head`` and a second ``ray start --address``, each
with its own resource label. ``ppoflow train`` joins it (``ray.address``), places two actor ranks on the
trainer node and the rollout on the other, keeps checkpoints and the step cache on the moto S3 server (the
nodes share no disk), and a second run resumes from the S3 checkpoint with one rank.

The nodes are started without the S3 settings; the driver's environment reaches the workers (the endpoint
and credentials of the S3 server), or they could not write a checkpoint.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import uuid

import boto3
import pytest

from tests.conftest import S3_TEST_BUCKET, free_port, small_run
from tests.preflight_helpers import DEMO_TRAIN

pytestmark = pytest.mark.slow

NODE_START_TIMEOUT_S = 90


def _ray_start(*args: str, env: dict) -> subprocess.Popen:
    """``ray start ... --block``: the node lives as long as this process; terminating it stops the node. Every
    port a node listens on is a free one: the test session's own Ray runs on this machine too, on the defaults."""
    ports = [
        f"--{name}={free_port()}"
        for name in (
            "node-manager-port",
            "object-manager-port",
            "metrics-export-port",
            "runtime-env-agent-port",
            "dashboard-agent-listen-port",
            "dashboard-agent-grpc-port",
        )
    ]
    return subprocess.Popen(
        [
            os.path.join(os.path.dirname(sys.executable), "ray"),
            "start",
            "--block",
            "--node-ip-address=127.0.0.1",
            "--disable-usage-stats",
            *ports,
            *args,
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def _alive_nodes(address: str, env: dict) -> list[dict]:
    """The cluster's live nodes as ``{"id", "resources"}``, asked from a process of its own (this test process
    may hold a connection to another Ray)."""
    script = (
        f"import json, ray; ray.init(address={address!r}, log_to_driver=False); "
        "print(json.dumps([{'id': n['NodeID'], 'resources': n['Resources']} for n in ray.nodes() if n['Alive']]))"
    )
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    return json.loads(result.stdout.strip().splitlines()[-1]) if result.returncode == 0 else []


@pytest.fixture
def two_nodes():
    """A head node labelled ``trainer_node`` (2 CPUs) and a worker node labelled ``rollout_node`` (2 CPUs);
    yields the address and the node id of each label; both stopped at the end."""
    env = {name: value for name, value in os.environ.items() if not name.startswith(("AWS_", "RAY_ADDRESS"))}
    env["RAY_AUTH_MODE"] = "disabled"
    port = free_port()
    address = f"127.0.0.1:{port}"
    nodes = [
        _ray_start(
            "--head",
            f"--port={port}",
            f"--ray-client-server-port={free_port()}",
            "--num-cpus=2",
            '--resources={"trainer_node": 2}',
            "--include-dashboard=false",
            env=env,
        )
    ]
    try:
        deadline = time.monotonic() + NODE_START_TIMEOUT_S
        while socket.socket().connect_ex(("127.0.0.1", port)) and time.monotonic() < deadline:
            time.sleep(0.5)
        nodes.append(_ray_start(f"--address={address}", "--num-cpus=2", '--resources={"rollout_node": 1}', env=env))
        alive: list[dict] = []
        while len(alive) < 2 and time.monotonic() < deadline:
            alive = _alive_nodes(address, env)
        assert len(alive) == 2, "the two-node cluster did not come up"
        node_of = {
            label: next(node["id"] for node in alive if label in node["resources"])
            for label in ("trainer_node", "rollout_node")
        }
        yield address, node_of
    finally:
        for node in nodes:
            node.terminate()
        for node in nodes:
            node.wait(timeout=60)


def test_a_run_spans_two_nodes_with_s3_checkpoints_and_resumes_with_one_rank(
    two_nodes, prefect_server, s3_server, tiny_model, tmp_path
):
    address, node_of = two_nodes
    endpoint, _ = s3_server
    run_dir = f"s3://{S3_TEST_BUCKET}/{uuid.uuid4().hex}"
    words = [word for word in small_run(tiny_model, tmp_path) if not word.startswith("trainer.default_local_dir")] + [
        f"ray.address={address}",
        f"trainer.default_local_dir={run_dir}/run",
        "trainer.save_freq=1",
        "trainer.test_freq=-1",
        "actor_rollout_ref.actor.use_kl_loss=false",
        "actor_rollout_ref.hybrid_engine=false",  # a rollout of its own, on the other node
        "actor_rollout_ref.actor.resources.custom={trainer_node: 1}",
        "actor_rollout_ref.rollout.resources.custom={rollout_node: 1}",
        "skip.rollout.enable=true",
        f"skip.rollout.dump_dir={run_dir}/dump",
        "skip.rollout.steps=[1,2]",
    ]
    # RAY_AUTH_MODE as the nodes have it: the session's own Ray set this process's to "token"
    env = {**os.environ, "PREFECT_API_URL": prefect_server, "AWS_ENDPOINT_URL": endpoint, "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)

    def train(*more: str) -> subprocess.CompletedProcess:
        result = subprocess.run(
            [*DEMO_TRAIN, *words, *more],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert result.returncode == 0, result.stderr[-4000:]
        return result

    first = train("trainer.n_cpu_ranks_per_node=2")
    trainer, rollout = node_of["trainer_node"][:12], node_of["rollout_node"][:12]
    assert f"actor on nodes {trainer}, {trainer}; rollout on node {rollout}" in first.stdout + first.stderr

    s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    prefix = run_dir.removeprefix(f"s3://{S3_TEST_BUCKET}/")
    keys = {
        item["Key"].removeprefix(prefix + "/")
        for item in s3.list_objects_v2(Bucket=S3_TEST_BUCKET, Prefix=prefix)["Contents"]
    }
    assert {
        "run/global_step_1/checkpoint.json",
        "run/global_step_2/checkpoint.json",  # each rank wrote its shards
        "run/global_step_2/actor/shard-00001-model-00001-of-00001.safetensors",
        "run/global_step_2/actor/shard-00002-model-00001-of-00001.safetensors",
    } <= keys
    assert sum(key.startswith("dump/") and key.endswith("/meta.json") for key in keys) == 2  # steps 1 and 2
    # the trained policy is exported whole, under the class FSDP2 wrapped (what loaders such as vLLM look up)
    export = f"{prefix}/run/global_step_2/actor/huggingface"
    config = json.loads(s3.get_object(Bucket=S3_TEST_BUCKET, Key=f"{export}/config.json")["Body"].read())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "run/global_step_2/actor/huggingface/model.safetensors" in keys

    # One rank resumes what two ranks saved, and carries on.
    second = train("trainer.n_cpu_ranks_per_node=1", "trainer.total_training_steps=3")
    assert f"resumed from {run_dir}/run/global_step_2: continuing at step 3" in second.stdout + second.stderr
