"""A real two-node Ray cluster on this machine: a head (`ray start --head`) and a second node (`ray start
--address`), each a raylet of its own with its own custom resource (learner_host on the head, generator_host on
the other), so a job's placement can be checked. Each `ray start --block` is our child: SIGTERM to its PID stops
the processes it started (Ray's own stop command finds processes by name, which would stop any other Ray on
the machine). Every port is a free one; the session files live in a short /tmp directory (Ray's unix sockets must fit
108 bytes)."""
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from tests.conftest import free_port

START_TIMEOUT_S = 90


@dataclass
class RayCluster:
    address: str
    temp_dir: str
    nodes: list


def ray_bin() -> str:
    return os.path.join(os.path.dirname(sys.executable), "ray")


def node_ports() -> list:
    """The ports a node would otherwise take at fixed numbers (two clusters, or another test, would collide)."""
    return ["--min-worker-port=0", "--max-worker-port=0", f"--ray-client-server-port={free_port()}",
            f"--dashboard-agent-listen-port={free_port()}", f"--dashboard-agent-grpc-port={free_port()}",
            f"--metrics-export-port={free_port()}", f"--runtime-env-agent-port={free_port()}",
            f"--node-manager-port={free_port()}", f"--object-manager-port={free_port()}"]


def start_node(args: list, log_path: str) -> subprocess.Popen:
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    return subprocess.Popen([ray_bin(), "start", "--block", "--disable-usage-stats", "--node-ip-address=127.0.0.1",
                             "--object-store-memory=100000000", *node_ports(), *args],
                            stdout=open(log_path, "ab"), stderr=subprocess.STDOUT, env=env)


def wait_for_nodes(address: str, count: int, nodes: list, log_dir: str) -> None:
    """Until `ray status` lists `count` active nodes (or a node process exited: its log says why)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    while True:
        for proc in nodes:
            assert proc.poll() is None, open(os.path.join(log_dir, "head.log")).read()[-3000:]
        out = subprocess.run([ray_bin(), "status", f"--address={address}"], capture_output=True, text=True,
                             env=env, timeout=60)
        active = out.stdout.split("Active:", 1)[-1].split("Pending:", 1)[0]
        if out.returncode == 0 and active.count(" node_") >= count:
            return
        assert time.monotonic() < deadline, out.stdout + out.stderr
        time.sleep(1)


def start_cluster(cpus_head: int = 2, cpus_worker: int = 4) -> RayCluster:
    temp_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")
    port = free_port()
    address = f"127.0.0.1:{port}"
    nodes = []
    try:
        nodes.append(start_node(["--head", f"--port={port}", f"--num-cpus={cpus_head}", "--num-gpus=0",
                                 '--resources={"learner_host": 4}', "--include-dashboard=false",
                                 f"--dashboard-port={free_port()}", f"--temp-dir={temp_dir}"],
                                os.path.join(temp_dir, "head.log")))
        wait_for_nodes(address, 1, nodes, temp_dir)
        nodes.append(start_node([f"--address={address}", f"--num-cpus={cpus_worker}", "--num-gpus=0",
                                 '--resources={"generator_host": 4}'], os.path.join(temp_dir, "worker.log")))
        wait_for_nodes(address, 2, nodes, temp_dir)
    except BaseException:
        stop_cluster(RayCluster(address, temp_dir, nodes))
        raise
    return RayCluster(address, temp_dir, nodes)


def stop_process(proc: subprocess.Popen, sig: int, timeout_s: float = 60) -> None:
    """`sig` to a process we started, then SIGKILL if it is still there after `timeout_s`."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def stop_cluster(cluster: RayCluster) -> None:
    """The second node first, then the head; each `ray start --block` stops what it started on SIGTERM."""
    for proc in reversed(cluster.nodes):
        stop_process(proc, signal.SIGTERM)
    shutil.rmtree(cluster.temp_dir, ignore_errors=True)
