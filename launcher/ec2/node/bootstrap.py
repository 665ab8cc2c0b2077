"""The Python half of an EC2 node's bootstrap (``ec2_bootstrap.sh`` installs dtrain, then runs it).

``python -m dtrain.launcher.ec2.node.bootstrap --config job.json --rank N``:

1. rendezvous through S3: every node writes ``{prefix}/rendezvous/{token}/{rank}.json`` with its
   private IP and waits until all ``num_nodes`` objects exist, so nodes may boot in any order and
   the host list is the launch order (rank 0 first);
2. downloads the job's source archive and input channels, writes the container contract
   (``dtrain.core.contract.write_host_contract``) under ``--root`` (``/opt/ml``);
3. runs the node agent (``python -m dtrain.runtime``, or inside ``image_uri`` with docker),
   uploading its logs every ``LOG_SYNC_S`` seconds for ``dtrain logs --follow``;
4. uploads ``model/`` and ``checkpoints/`` (merged across hosts), ``output/`` per host, and writes
   ``{prefix}/status/{host}.json`` at each step; the shell half then powers the node off.

Instance facts come from IMDSv2 unless given as arguments (the tests stand in for IMDS that way).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import subprocess
import sys
import tarfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

from dtrain.core import checkpoint_layout, contract, logformat, s3, states
from dtrain.launcher.agents import default_interface
from dtrain.launcher.ec2 import layout

# The instance metadata service; AWS's SDKs read the same variable to point elsewhere.
IMDS_ENDPOINT_ENV = "AWS_EC2_METADATA_SERVICE_ENDPOINT"
IMDS = "http://169.254.169.254"
LOG_SYNC_S = 30  # logs and newly completed checkpoints go to S3 this often while the job runs
SPOT_POLL_S = 5  # EC2 gives two minutes' notice; the checkpoint needs most of them
PEER_POLL_S = 10  # how often a node looks for a peer's failure report, to stop at once
RENDEZVOUS_TIMEOUT_S = 1800
RENDEZVOUS_POLL_S = 5


@dataclass(frozen=True)
class Node:
    rank: int
    private_ip: str
    instance_id: str
    root: str
    work_dir: str


def imds(path: str) -> str:
    """One IMDSv2 value (token first: the instances require it)."""
    base = os.environ.get(IMDS_ENDPOINT_ENV, IMDS).rstrip("/") + "/latest"
    put = urllib.request.Request(f"{base}/api/token", method="PUT",
                                 headers={"X-aws-ec2-metadata-token-ttl-seconds": "300"})
    token = urllib.request.urlopen(put, timeout=2).read().decode()
    get = urllib.request.Request(f"{base}/meta-data/{path}",
                                 headers={"X-aws-ec2-metadata-token": token})
    return urllib.request.urlopen(get, timeout=2).read().decode()


def spot_notice() -> dict | None:
    """EC2's interruption notice for this instance (``{"action": "terminate", "time": ...}``),
    or None while there is none (the path answers 404 then)."""
    try:
        return json.loads(imds("spot/instance-action"))
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return None
        raise


# ---------------------------------------------------------------- S3 helpers

def download_prefix(client, uri: str, folder: str) -> None:
    bucket, prefix = s3.split(uri)
    for key in layout.list_keys(client, uri):
        target = os.path.join(folder, key[len(prefix):].lstrip("/"))
        if key.endswith("/"):
            continue
        os.makedirs(os.path.dirname(target), exist_ok=True)
        client.download_file(bucket, key, target)


def upload_dir(client, folder: str, uri: str) -> int:
    """Upload ``folder``'s files under ``uri``; a checkpoint's ``COMPLETE`` marker last, so a
    copy in S3 is never marked complete before its shards are there."""
    paths = [os.path.join(base, name) for base, _dirs, files in os.walk(folder) for name in files]
    for path in sorted(paths, key=lambda p: (os.path.basename(p) == checkpoint_layout.COMPLETE, p)):
        bucket, key = s3.split(s3.join(uri, os.path.relpath(path, folder).replace(os.sep, "/")))
        client.upload_file(path, bucket, key)
    return len(paths)


# ---------------------------------------------------------------- steps

def write_status(client, config: dict, node: Node, state: str, **extra: Any) -> None:
    layout.put_json(client, layout.status_uri(config["prefix"], node.private_ip), {
        "host": node.private_ip, "rank": node.rank, "instance_id": node.instance_id,
        "launch": config["launch_token"], "state": state, "updated": time.time(), **extra,
    })


def rendezvous(client, config: dict, node: Node, *, timeout_s: float,
               poll_s: float) -> list[str]:
    """Private IPs of every node in rank order, once all of them have checked in."""
    folder = layout.rendezvous_folder(config["prefix"], config["launch_token"])
    layout.put_json(client, s3.join(folder, f"{node.rank}.json"),
                    {"rank": node.rank, "ip": node.private_ip, "instance_id": node.instance_id})
    deadline = time.monotonic() + timeout_s
    want = config["num_nodes"]
    while True:
        keys = [k for k in layout.list_keys(client, folder) if k.endswith(".json")]
        if len(keys) >= want:
            bucket, _ = s3.split(folder)
            peers = [layout.read_json(client, bucket, k) for k in keys]
            return [p["ip"] for p in sorted(peers, key=lambda p: p["rank"])][:want]
        reports: list[tuple[str, str]] = []
        _quietly(peer_states, client, config, node, reports)  # S3 busy: look again
        failed = [host for host, state in reports if state == "failed"]
        if failed:  # e.g. its wheel never installed: it will never check in
            raise RuntimeError(f"rendezvous: node {failed[0]} failed before every node checked "
                               "in; its reason is in its status")
        if time.monotonic() > deadline:
            raise TimeoutError(f"rendezvous: {len(keys)} of {want} nodes checked in within "
                               f"{timeout_s:.0f} s")
        time.sleep(poll_s)


def checkpoint_uri(config: dict) -> str:
    """Where the job's checkpoints live in S3 (the contract's ``S3Uri`` too, which the
    runtime's interruption line tells the user to resume from)."""
    return layout.checkpoint_uri(config["prefix"], config.get("checkpoint_uri"))


def prepare_contract(client, config: dict, node: Node, hosts: list[str]) -> contract.Paths:
    paths = contract.Paths(os.path.abspath(node.root))
    if config.get("source"):
        archive = os.path.join(node.work_dir, "sourcedir.tar.gz")
        bucket, key = s3.split(config["source"])
        client.download_file(bucket, key, archive)
        os.makedirs(paths.code_dir, exist_ok=True)
        with tarfile.open(archive) as tar:
            tar.extractall(paths.code_dir, filter="data")
    for channel, uri in config["channels"].items():
        download_prefix(client, uri, paths.channel_dir(channel))
    download_prefix(client, checkpoint_uri(config), paths.checkpoints_dir)  # resume, if any
    settings = contract.Settings(**config["settings"])
    return contract.write_host_contract(
        node.root, current_host=node.private_ip, hosts=hosts, settings=settings,
        hyperparameters=config["hyperparameters"], channels=list(config["channels"]),
        checkpoint_s3_uri=checkpoint_uri(config),
        network_interface_name=default_interface(),
    )


def agent_command(config: dict, node: Node) -> list[str]:
    """The node agent on the AMI's Python, or in ``image_uri`` with the GPUs and EFA devices."""
    if not config.get("image_uri"):
        return [sys.executable, "-m", "dtrain.runtime", "--root", node.root]
    env_flags = [f"--env={k}" for k in (*config.get("environment", {}), logformat.STAMP_ENV)]
    return [
        "docker", "run", "--rm", "--gpus", "all", "--network", "host", "--ipc", "host",
        "--ulimit", "memlock=-1", "--device", "/dev/infiniband",
        "-v", f"{node.root}:{node.root}", "-v", f"{node.work_dir}:/opt/dtrain:ro", *env_flags,
        config["image_uri"], "bash", "-c",
        # --no-deps: the image has the runtime's dependencies; the wheel adds only dtrain.
        ("python -m pip install --quiet --no-deps /opt/dtrain/*.whl && "
         f"exec python -m dtrain.runtime --root {node.root}"),
    ]


def run_agent(client, config: dict, node: Node, paths: contract.Paths,
              command: list[str]) -> int:
    """Run the node agent; meanwhile sync its logs and each checkpoint it completes to S3, and
    pass EC2's spot interruption notice on as SIGTERM, so it checkpoints at once, and a peer's
    failure report too: its workers would otherwise wait in collectives with the failed node
    until the process-group timeout."""
    env = {**os.environ, **config.get("environment", {}), logformat.STAMP_ENV: "1"}
    logs_uri = layout.logs_folder(config["prefix"], node.private_ip)
    stop = threading.Event()
    agent = subprocess.Popen(command, env=env)
    synced: set[str] = set()

    def sync() -> None:
        while not stop.wait(LOG_SYNC_S):
            _quietly(upload_dir, client, paths.logs_dir, logs_uri)
            _quietly(upload_bootstrap_log, client, config, node)
            _quietly(sync_checkpoints, client, paths.checkpoints_dir, checkpoint_uri(config),
                     synced)

    def watch_peers() -> None:
        while not stop.wait(PEER_POLL_S):
            found: list[tuple[str, str]] = []
            _quietly(peer_states, client, config, node, found)  # S3 busy: look again
            why = {state: host for host, state in found}
            if "failed" in why:
                print(f"dtrain: node {why['failed']} reported a failure: stopping this node's "
                      "workers now instead of waiting for their collectives to time out",
                      file=sys.stderr, flush=True)
            elif "interrupting" in why or "stopped" in why:
                # a spot notice, max_run or a stop: its workers stop after a checkpoint, so do
                # these (a quick one may write `stopped` before a poll sees `interrupting`)
                host = why.get("interrupting") or why["stopped"]
                print(f"dtrain: node {host} is stopping (a spot interruption notice, max_run or "
                      "a stop): stopping this node's workers after a checkpoint too",
                      file=sys.stderr, flush=True)
            else:
                continue
            agent.send_signal(signal.SIGTERM)
            return

    def watch_spot() -> None:
        while not stop.wait(SPOT_POLL_S):
            try:
                notice = spot_notice()
            except OSError:
                continue  # not on EC2, or IMDS busy: ask again
            if notice:
                print(f"dtrain: spot interruption notice {notice}: stopping the workers after "
                      "a checkpoint", file=sys.stderr, flush=True)
                _quietly(functools.partial(write_status, notice=notice), client, config, node,
                         "interrupting")
                agent.send_signal(signal.SIGTERM)
                return

    threads = [threading.Thread(target=t, daemon=True) for t in (sync, watch_spot, watch_peers)]
    for thread in threads:
        thread.start()
    try:
        return agent.wait()
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=5)


def peer_states(client, config: dict, node: Node, found: list[tuple[str, str]]) -> None:
    """Add to ``found`` (host, state) of the other nodes' status objects written by this
    launch (a job name used again keeps an earlier launch's objects)."""
    bucket, _ = s3.split(config["prefix"])
    reports = [layout.read_json(client, bucket, key)
               for key in layout.list_keys(client, layout.status_folder(config["prefix"]))
               if key.endswith(".json")]
    found.extend((r.get("host"), r.get("state")) for r in reports
                 if r.get("launch") == config["launch_token"] and r.get("host") != node.private_ip)


def sync_checkpoints(client, folder: str, uri: str, synced: set[str]) -> None:
    """Upload each complete checkpoint not uploaded yet (as SageMaker syncs its checkpoint
    folder), so an interrupted node's shards are in S3 even if it goes down before its job
    ends. A checkpoint still being written (``step-N.tmp``) is never uploaded."""
    for _step, path in checkpoint_layout.complete_checkpoints(folder):
        if path.name not in synced:
            upload_dir(client, str(path), s3.join(uri, path.name))
            synced.add(path.name)


def upload_results(client, config: dict, node: Node, paths: contract.Paths) -> None:
    prefix = config["prefix"]
    upload_dir(client, paths.model_dir, layout.model_folder(prefix))
    upload_dir(client, paths.output_dir, layout.output_folder(prefix, node.private_ip))
    upload_dir(client, paths.logs_dir, layout.logs_folder(prefix, node.private_ip))
    upload_dir(client, paths.checkpoints_dir, checkpoint_uri(config))
    upload_bootstrap_log(client, config, node)


def upload_bootstrap_log(client, config: dict, node: Node) -> None:
    """The node's own log (the bootstrap's lines and the agent's, workers' echoed), which
    ``dtrain logs`` reads."""
    bootstrap_log = os.path.join(node.work_dir, layout.BOOTSTRAP_LOG)
    if os.path.isfile(bootstrap_log):
        bucket, key = s3.split(layout.bootstrap_log_uri(config["prefix"], node.private_ip))
        client.upload_file(bootstrap_log, bucket, key)


def _quietly(func, *args) -> None:
    try:
        func(*args)
    except Exception as exc:  # noqa: BLE001 - a failed upload must not kill the node's job
        name = getattr(func, "__name__", None) or getattr(func, "func", func).__name__
        print(f"dtrain: {name} failed: {exc}", file=sys.stderr)


def _failure_reason(paths: contract.Paths, code: int) -> str:
    try:
        with open(paths.failure_file) as fh:
            return fh.readline().strip() or f"node agent exited with code {code}"
    except OSError:
        return f"node agent exited with code {code}"


def run_node(client, config: dict, node: Node, *, command: list[str] | None = None,
             rendezvous_timeout_s: float = RENDEZVOUS_TIMEOUT_S,
             poll_s: float = RENDEZVOUS_POLL_S) -> int:
    """Every step of one node's life; returns the node agent's exit code (1 if it never ran)."""
    paths = contract.Paths(os.path.abspath(node.root))
    os.makedirs(node.work_dir, exist_ok=True)
    write_status(client, config, node, "starting")
    code, reason = 1, ""
    try:
        hosts = rendezvous(client, config, node, timeout_s=rendezvous_timeout_s, poll_s=poll_s)
        paths = prepare_contract(client, config, node, hosts)
        write_status(client, config, node, "running", hosts=hosts)
        code = run_agent(client, config, node, paths, command or agent_command(config, node))
        reason = "" if code == 0 else _failure_reason(paths, code)
    except Exception as exc:  # noqa: BLE001 - reported in the status object, then shutdown
        reason = f"bootstrap failed on {node.private_ip}: {type(exc).__name__}: {exc}"
        print(f"dtrain: {reason}", file=sys.stderr)
    _quietly(upload_results, client, config, node, paths)
    # 143: this node was SIGTERMed, or its workers stopped after a checkpoint because another
    # node was; 124: max_run was reached. Either way the job is stopped (resubmit to resume), not
    # failed, as on SageMaker and the local target (docs/concepts/container-contract.md).
    state = states.outcome([code]).lower()
    write_status(client, config, node, state, exit_code=code, reason=reason)
    with open(os.path.join(node.work_dir, layout.REPORTED), "w"):
        pass
    return code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dtrain.launcher.ec2.node.bootstrap")
    parser.add_argument("--config", required=True, help="job.json written by the user data")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--work-dir", default="/opt/dtrain")
    parser.add_argument("--root", default=contract.DEFAULT_ROOT, help="contract root")
    parser.add_argument("--private-ip", default=None, help="default: IMDS local-ipv4")
    parser.add_argument("--instance-id", default=None, help="default: IMDS instance-id")
    args = parser.parse_args(argv)
    with open(args.config) as fh:
        config = json.load(fh)
    node = Node(rank=args.rank, private_ip=args.private_ip or imds("local-ipv4"),
                instance_id=args.instance_id or imds("instance-id"), root=args.root,
                work_dir=args.work_dir)
    import boto3
    from botocore.config import Config

    client = boto3.client("s3", region_name=config.get("region"),
                          config=Config(retries={"mode": "adaptive"}))
    return run_node(client, config, node)


if __name__ == "__main__":
    sys.exit(main())
