"""The node bootstrap run locally as two fake EC2 nodes against a moto S3 server.

IMDS is stood in for by the Node facts (private IP, instance id), each node's contract root is
a temp folder, and the node agent is a stub script that reads the contract with
``dtrain.core.contract.read_contract`` (exactly what ``python -m dtrain.runtime`` does first) and
writes a model, output data and a rank log. The nodes start in reverse order to show the S3
rendezvous does not depend on boot order.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

import boto3
import pytest
from dtrain.core import contract
from dtrain.core import s3 as s3_uri
from dtrain.launcher import packaging
from dtrain.launcher.ec2 import placeholders, userdata
from dtrain.launcher.ec2.node import bootstrap as boot
from dtrain.planning.planner import plan
from dtrain.spec.model import JobSpec
from moto.server import ThreadedMotoServer

ROOT = Path(__file__).resolve().parents[2]
BUCKET = "dtrain-example-bucket"
JOB = "pythia-1b-ec2-20250101-000000"
IPS = ["10.0.0.12", "10.0.0.7"]  # rank order; sorting would flip them

STUB_AGENT = """
import json, os, sys
from dtrain.core import contract
c = contract.read_contract(sys.argv[1])
os.makedirs(c.paths.logs_dir, exist_ok=True)
with open(os.path.join(c.paths.logs_dir, f"rank-{c.node_rank}.log"), "w") as f:
    f.write(f"hello from {c.current_host}\\n")
with open(os.path.join(c.paths.model_dir, f"part-{c.current_host}.txt"), "w") as f:
    f.write(json.dumps({"hosts": c.hosts, "entry": c.settings.entry_point,
                        "code": sorted(os.listdir(c.module_dir)),
                        "train": sorted(os.listdir(c.channels["train"])),
                        "lr": c.hyperparameters["lr"], "nccl": os.environ.get("NCCL_DEBUG")}))
os.makedirs(c.paths.checkpoints_dir, exist_ok=True)
with open(os.path.join(c.paths.checkpoints_dir, f"shard-{c.node_rank}.distcp"), "w") as f:
    f.write("weights")
if os.environ.get("STUB_FAILURE"):  # what the node agent writes when it ends badly
    with open(c.paths.failure_file, "w") as f:
        f.write(os.environ["STUB_FAILURE"].format(s3=c.checkpoint_config.get("S3Uri")) + "\\n")
sys.exit(int(os.environ.get("STUB_EXIT", "0")))
"""


@pytest.fixture(scope="module")
def s3_server():
    server = ThreadedMotoServer(port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def s3(s3_server, tmp_path, monkeypatch):
    monkeypatch.setenv("DTRAIN_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    client = boto3.client("s3", region_name="us-east-1", endpoint_url=s3_server)
    if BUCKET in [b["Name"] for b in client.list_buckets()["Buckets"]]:
        for item in client.list_objects_v2(Bucket=BUCKET).get("Contents", []):
            client.delete_object(Bucket=BUCKET, Key=item["Key"])
    else:
        client.create_bucket(Bucket=BUCKET)
    return client


def job_config(token: str) -> dict:
    spec = JobSpec.from_file(ROOT / "examples" / "ec2-p4d.yaml",
                             overrides=["ec2.subnet_id=subnet-1"])
    text = userdata.render(spec, plan(spec), job_name=JOB)
    body = text.split("<<'DTRAIN_JOB_JSON'\n", 1)[1].split("\nDTRAIN_JOB_JSON\n", 1)[0]
    return json.loads(placeholders.fill(body, {"launch_token": token}))


def upload_artifacts(s3, config: dict) -> None:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        data = b"print('train')\n"
        info = tarfile.TarInfo("train.py")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    bucket, key = s3_uri.split(config["source"])
    s3.put_object(Bucket=bucket, Key=key, Body=buffer.getvalue())
    bucket, key = s3_uri.split(config["channels"]["train"])
    s3.put_object(Bucket=bucket, Key=f"{key}/shard-0.jsonl", Body=b"{}\n")


def run_two_nodes(s3, tmp_path, config, monkeypatch, exit_code=0) -> list[int]:
    stub = tmp_path / "agent.py"
    stub.write_text(STUB_AGENT)
    monkeypatch.setenv("STUB_EXIT", str(exit_code))
    codes = [None, None]

    def node(rank):
        n = boot.Node(rank=rank, private_ip=IPS[rank], instance_id=f"i-{rank}",
                      root=str(tmp_path / f"node{rank}" / "ml"),
                      work_dir=str(tmp_path / f"node{rank}" / "work"))
        codes[rank] = boot.run_node(s3, config, n, command=[sys.executable, str(stub), n.root],
                                    rendezvous_timeout_s=60, poll_s=0.2)

    threads = [threading.Thread(target=node, args=(rank,)) for rank in (1, 0)]
    threads[0].start()
    time.sleep(0.5)  # node 1 boots first and waits for node 0
    threads[1].start()
    for t in threads:
        t.join(timeout=120)
    return codes


def read_json(s3, key):
    return json.loads(s3.get_object(Bucket=BUCKET, Key=key)["Body"].read())


def test_two_nodes_rendezvous_write_a_contract_the_agent_reads_and_upload_results(
        s3, tmp_path, monkeypatch):
    config = job_config("tok1")
    upload_artifacts(s3, config)
    assert run_two_nodes(s3, tmp_path, config, monkeypatch) == [0, 0]
    prefix = f"dtrain/{JOB}"
    for rank, ip in enumerate(IPS):
        status = read_json(s3, f"{prefix}/status/{ip}.json")
        assert (status["state"], status["rank"], status["exit_code"]) == ("completed", rank, 0)
        seen = read_json(s3, f"{prefix}/model/part-{ip}.txt")
        assert seen["hosts"] == sorted(IPS) and seen["entry"] == "train.py"
        assert seen["code"] == ["train.py"] and seen["train"] == ["shard-0.jsonl"]
        assert seen["lr"] == 0.0003 and seen["nccl"] == "WARN"
        log = s3.get_object(Bucket=BUCKET, Key=f"{prefix}/logs/{ip}/rank-{rank}.log")
        assert log["Body"].read() == f"hello from {ip}\n".encode()
        written = contract.read_contract(str(tmp_path / f"node{rank}" / "ml"), num_gpus=8)
        assert written.current_host == ip and written.settings.processes_per_host == 8
        assert written.checkpoint_config["S3Uri"] == f"s3://{BUCKET}/{prefix}/checkpoints"


def test_a_failing_agent_is_reported_failed_in_the_status_objects(s3, tmp_path, monkeypatch):
    config = job_config("tok2")
    upload_artifacts(s3, config)
    assert run_two_nodes(s3, tmp_path, config, monkeypatch, exit_code=3) == [3, 3]
    from dtrain.launcher.ec2.nodes import job_state, read_status_objects

    nodes = read_status_objects(s3, f"s3://{BUCKET}/dtrain/{JOB}")
    assert [n["state"] for n in nodes] == ["failed", "failed"]
    state = job_state({}, nodes, 2)
    assert state["status"] == "Failed" and "code 3" in state["failure_reason"]


def test_an_interrupted_agent_stops_the_job_with_its_line_instead_of_failing_it(
        s3, tmp_path, monkeypatch):
    config = job_config("tok4")
    upload_artifacts(s3, config)
    monkeypatch.setenv("STUB_FAILURE", "interrupted: training stopped at step 12 after a "
                       "checkpoint because a host received SIGTERM; resubmit to resume from {s3}")
    # 143: the node was SIGTERMed, or its workers stopped after a checkpoint because one was.
    assert run_two_nodes(s3, tmp_path, config, monkeypatch, exit_code=143) == [143, 143]
    from dtrain.launcher.ec2.nodes import job_state, read_status_objects

    nodes = read_status_objects(s3, f"s3://{BUCKET}/dtrain/{JOB}")
    assert [n["state"] for n in nodes] == ["stopped", "stopped"]
    state = job_state({"i-0": "terminated", "i-1": "terminated"}, nodes, 2)
    assert state["status"] == "Stopped"
    assert state["failure_reason"] == (
        "interrupted: training stopped at step 12 after a checkpoint because a host received "
        f"SIGTERM; resubmit to resume from s3://{BUCKET}/dtrain/{JOB}/checkpoints")


def test_max_run_stops_the_job_with_the_agents_line_as_on_the_other_targets(
        s3, tmp_path, monkeypatch):
    config = job_config("tok6")
    upload_artifacts(s3, config)
    monkeypatch.setenv("STUB_FAILURE", "max_run of 60 s reached on 10.0.0.12; workers were stopped")
    assert run_two_nodes(s3, tmp_path, config, monkeypatch,
                         exit_code=contract.MAX_RUN_EXIT_CODE) == [124, 124]
    from dtrain.launcher.ec2.nodes import job_state, read_status_objects

    nodes = read_status_objects(s3, f"s3://{BUCKET}/dtrain/{JOB}")
    assert [n["state"] for n in nodes] == ["stopped", "stopped"]
    state = job_state({"i-0": "terminated", "i-1": "terminated"}, nodes, 2)
    assert state["status"] == "Stopped"
    assert state["failure_reason"] == "max_run of 60 s reached on 10.0.0.12; workers were stopped"


def test_checkpoints_go_where_the_interruption_line_says_even_without_a_checkpoint_uri(
        s3, tmp_path, monkeypatch):
    config = job_config("tok5")
    del config["checkpoint_uri"]  # a job.json that names no checkpoint location
    upload_artifacts(s3, config)
    assert run_two_nodes(s3, tmp_path, config, monkeypatch) == [0, 0]
    where = f"s3://{BUCKET}/dtrain/{JOB}/checkpoints"
    for rank in range(2):
        written = contract.read_contract(str(tmp_path / f"node{rank}" / "ml"), num_gpus=8)
        assert written.checkpoint_config["S3Uri"] == where  # what the runtime tells the user
    keys = {o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET, Prefix=f"dtrain/{JOB}/checkpoints/")
            .get("Contents", [])}
    assert keys == {f"dtrain/{JOB}/checkpoints/shard-0.distcp",
                    f"dtrain/{JOB}/checkpoints/shard-1.distcp"}


def test_rendezvous_gives_up_with_a_failed_status_when_a_node_never_arrives(s3, tmp_path):
    config = job_config("tok3")
    node = boot.Node(rank=0, private_ip=IPS[0], instance_id="i-0",
                     root=str(tmp_path / "ml"), work_dir=str(tmp_path / "work"))
    code = boot.run_node(s3, config, node, command=["false"], rendezvous_timeout_s=0.5,
                         poll_s=0.1)
    status = read_json(s3, f"dtrain/{JOB}/status/{IPS[0]}.json")
    assert code == 1 and status["state"] == "failed"
    assert "1 of 2 nodes checked in" in status["reason"]


SPOT_AGENT = """
import os, signal, sys, time
from dtrain.core import contract
c = contract.read_contract(sys.argv[1])

def checkpoint(step):
    path = os.path.join(c.checkpoint_dir, f"step-{step:06d}")
    os.makedirs(path + ".tmp", exist_ok=True)
    with open(os.path.join(path + ".tmp", "shard.distcp"), "w") as f:
        f.write(f"weights of step {step}")
    open(os.path.join(path + ".tmp", "COMPLETE"), "w").close()
    os.rename(path + ".tmp", path)

def on_term(*_):  # what the trainer does on SIGTERM: one more checkpoint, then exit 143
    checkpoint(2)
    sys.exit(143)

signal.signal(signal.SIGTERM, on_term)
checkpoint(1)
os.makedirs(os.path.join(c.checkpoint_dir, "step-000002.tmp"), exist_ok=True)  # half written
while True:
    time.sleep(0.05)
"""


FACTS = {"local-ipv4": IPS[0], "instance-id": "i-0", "placement/region": "us-east-1",
         "ami-launch-index": "0"}


class FakeImds:
    """A double of EC2's instance metadata service: IMDSv2 token, the node's ``FACTS``, and the
    spot notice path, 404 until ``interrupt()``."""

    def __init__(self):
        import http.server

        notice = self.notice = {}

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_PUT(self):
                self._answer(200, b"token") if self.path == "/latest/api/token" else \
                    self._answer(404, b"")

            def do_GET(self):
                fact = FACTS.get(self.path.removeprefix("/latest/meta-data/"))
                if self.path == "/latest/meta-data/spot/instance-action" and notice:
                    self._answer(200, json.dumps(notice).encode())
                elif fact is not None:
                    self._answer(200, fact.encode())
                else:
                    self._answer(404, b"")

            def _answer(self, code, body):
                self.send_response(code)
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_port}"

    def interrupt(self):
        self.notice.update(action="terminate", time="2026-11-24T03:00:00Z")


def start_one_node(s3, tmp_path, config: dict) -> tuple[threading.Thread, dict]:
    """A one-node job whose agent checkpoints each step and once more on SIGTERM, run by the
    bootstrap in a thread; ``result["code"]`` is its exit code once the thread ends."""
    upload_artifacts(s3, config)
    stub = tmp_path / "agent.py"
    stub.write_text(SPOT_AGENT)
    node = boot.Node(rank=0, private_ip=IPS[0], instance_id="i-0",
                     root=str(tmp_path / "node" / "ml"), work_dir=str(tmp_path / "node" / "work"))
    result: dict = {}
    runner = threading.Thread(target=lambda: result.update(code=boot.run_node(
        s3, config, node, command=[sys.executable, str(stub), node.root],
        rendezvous_timeout_s=30, poll_s=0.2)))
    runner.start()
    return runner, result


def test_a_spot_notice_checkpoints_at_once_and_every_complete_checkpoint_is_already_in_s3(
        s3, tmp_path, monkeypatch):
    imds = FakeImds()
    monkeypatch.setenv(boot.IMDS_ENDPOINT_ENV, imds.url)
    monkeypatch.setattr(boot, "LOG_SYNC_S", 0.2)
    monkeypatch.setattr(boot, "SPOT_POLL_S", 0.2)
    config = {**job_config("t-spot"), "num_nodes": 1}
    runner, result = start_one_node(s3, tmp_path, config)
    bucket, prefix = s3_uri.split(boot.checkpoint_uri(config))

    def keys() -> list[str]:
        return sorted(o["Key"][len(prefix) + 1:] for o in
                      s3.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", []))

    deadline = time.monotonic() + 60
    while "step-000001/COMPLETE" not in keys():  # synced while the job still runs
        assert runner.is_alive() and time.monotonic() < deadline
        time.sleep(0.1)
    assert not [k for k in keys() if ".tmp" in k]  # never a checkpoint being written
    imds.interrupt()
    runner.join(timeout=60)
    assert result["code"] == 143
    assert {"step-000001/COMPLETE", "step-000002/COMPLETE", "step-000002/shard.distcp"} <= \
        set(keys())
    report = json.loads(s3.get_object(Bucket=BUCKET, Key=s3_uri.split(
        f"{config['prefix']}/status/{IPS[0]}.json")[1])["Body"].read())
    assert report["state"] == "stopped"
    imds.server.shutdown()


STOPPING = ("is stopping (a spot interruption notice, max_run or a stop): stopping this node's "
            "workers after a checkpoint too")


@pytest.mark.parametrize("peer_state,said", [
    ("failed", "reported a failure: stopping this node's workers now"),
    ("interrupting", STOPPING), ("stopped", STOPPING)])
def test_a_peers_failure_or_spot_notice_stops_this_nodes_workers_at_once(
        s3, tmp_path, monkeypatch, capfd, peer_state, said):
    """Without it, this node's workers would wait in collectives with the failed (or departing)
    node until the process-group timeout (30 min of idle p4d time). A report of an earlier
    launch of the same job name is not this launch's peer."""
    monkeypatch.setattr(boot, "PEER_POLL_S", 0.2)
    config = {**job_config("t-peer"), "num_nodes": 1}
    peer = boot.Node(rank=1, private_ip=IPS[1], instance_id="i-1", root="", work_dir="")
    boot.write_status(s3, {**config, "launch_token": "earlier"}, peer, "failed", exit_code=1)
    runner, result = start_one_node(s3, tmp_path, config)
    time.sleep(3)
    assert runner.is_alive(), "the agent runs until told otherwise"
    boot.write_status(s3, config, peer, peer_state, exit_code=1, reason="rank 1 exited")
    runner.join(timeout=30)
    assert not runner.is_alive() and result["code"] == 143  # its workers checkpointed and stopped
    assert f"node {IPS[1]} {said}" in capfd.readouterr().err
    report = read_json(s3, s3_uri.split(f"{config['prefix']}/status/{IPS[0]}.json")[1])
    assert report["state"] == "stopped"


def test_rendezvous_gives_up_at_once_when_a_peer_reports_it_failed(s3, tmp_path):
    config = job_config("tok-peer-failed")
    peer = boot.Node(rank=1, private_ip=IPS[1], instance_id="i-1", root="", work_dir="")
    boot.write_status(s3, config, peer, "failed", exit_code=1, reason="no wheel")
    node = boot.Node(rank=0, private_ip=IPS[0], instance_id="i-0",
                     root=str(tmp_path / "ml"), work_dir=str(tmp_path / "work"))
    started = time.monotonic()
    code = boot.run_node(s3, config, node, command=["false"], rendezvous_timeout_s=60,
                         poll_s=0.1)
    assert code == 1 and time.monotonic() - started < 30  # not the rendezvous timeout
    status = read_json(s3, f"dtrain/{JOB}/status/{IPS[0]}.json")
    assert status["state"] == "failed" and f"node {IPS[1]} failed before every node" in \
        status["reason"]


AWS_CLI = """#!{python}
# A double of the AWS CLI's `aws s3 cp SRC DST` (what the bootstrap's shell half runs), on the
# moto server of the test
import os, sys
import boto3
args = [a for a in sys.argv[1:] if a != "--only-show-errors"]
assert args[:2] == ["s3", "cp"], args
src, dst = args[2:4]
client = boto3.client("s3", region_name="us-east-1", endpoint_url=os.environ["STUB_S3"])
def split(uri):
    bucket, _, key = uri[len("s3://"):].partition("/")
    return bucket, key
try:
    if src == "-":
        client.put_object(Bucket=split(dst)[0], Key=split(dst)[1], Body=sys.stdin.buffer.read())
    elif src.startswith("s3://"):
        target = os.path.join(dst, src.rsplit("/", 1)[1]) if os.path.isdir(dst) else dst
        client.download_file(*split(src), target)
    else:
        client.upload_file(src, *split(dst))
except Exception as exc:
    print(f"fatal error: {{exc}}", file=sys.stderr)
    sys.exit(1)
"""

# The Deep Learning AMI's Python, where pip works and the bootstrap's Python half dies on import
BROKEN_PYTHON = """#!/bin/bash
if [ "$2" = pip ]; then exit 0; fi
echo "ImportError: cannot import name 'x' from 'torch'" >&2
exit 1
"""


@pytest.mark.parametrize("case", ["no wheel", "python half dies"])
def test_a_shell_half_failure_is_reported_in_the_status_object_with_the_nodes_log(
        s3, s3_server, tmp_path, case):
    """Before this report the other nodes waited out the 30-minute rendezvous, and `dtrain
    status` had nothing to say; the node powers off either way."""
    spec = JobSpec.from_file(ROOT / "examples" / "ec2-p4d.yaml", overrides=["ec2.subnet_id=s-1"])
    script = placeholders.fill(userdata.render(spec, plan(spec), job_name=JOB),
                               {"launch_token": "t-shell"})
    stubs = tmp_path / "bin"
    stubs.mkdir()
    (stubs / "aws").write_text(AWS_CLI.format(python=sys.executable))
    (stubs / "shutdown").write_text(f"#!/bin/bash\necho \"$*\" >> {tmp_path}/shutdown.calls\n")
    (stubs / "python").write_text(BROKEN_PYTHON)
    for stub in stubs.iterdir():
        stub.chmod(0o755)
    config = job_config("t-shell")
    if case == "python half dies":  # the wheel is there; what runs it is not
        bucket, key = s3_uri.split(config["prefix"])
        s3.put_object(Bucket=bucket, Key=f"{key}/source/{packaging.wheel_name()}", Body=b"w")
    imds = FakeImds()
    env = {"PATH": f"{stubs}:/usr/bin:/bin", "STUB_S3": s3_server,
           "AWS_EC2_METADATA_SERVICE_ENDPOINT": imds.url, "DTRAIN_PYTHON": str(stubs / "python"),
           "DTRAIN_BOOTSTRAP_DIR": str(tmp_path / "work"), "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "HOME": str(tmp_path)}
    done = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True,
                          timeout=120, check=False)
    imds.server.shutdown()
    assert done.returncode == 1, done.stdout + done.stderr
    status = read_json(s3, f"dtrain/{JOB}/status/{IPS[0]}.json")
    assert (status["state"], status["launch"], status["rank"]) == ("failed", "t-shell", 0)
    expected = ("could not download dtrain's wheel" if case == "no wheel" else
                "dtrain.launcher.ec2.node.bootstrap exited with code 1 before reporting")
    assert status["reason"].startswith(f"bootstrap failed on {IPS[0]}: ") and \
        expected in status["reason"]
    log = s3.get_object(Bucket=BUCKET, Key=f"dtrain/{JOB}/logs/{IPS[0]}/bootstrap.log")
    assert b"dtrain: node 0 installing" in log["Body"].read()
    assert "-h now" in (tmp_path / "shutdown.calls").read_text()  # powered off at the end


def test_a_checkpoints_complete_marker_is_uploaded_after_its_shards(tmp_path, monkeypatch):
    from dtrain.core.checkpoint_layout import COMPLETE

    folder = tmp_path / "step-000004"
    (folder / "rng").mkdir(parents=True)
    for name in (COMPLETE, "__0_0.distcp", ".metadata", "trainer.json", "rng/rank-00000.pt"):
        (folder / name).write_text("x")
    keys = []
    uploader = type("Client", (), {"upload_file": lambda self, path, bucket, key: keys.append(key)})
    walk = boot.os.walk  # the marker first, as a directory listing may give it

    def marker_first(top):
        for base, dirs, files in walk(top):
            yield base, dirs, sorted(files, key=lambda name: name != COMPLETE)

    monkeypatch.setattr(boot.os, "walk", marker_first)
    assert boot.upload_dir(uploader(), str(folder), "s3://b/ckpt/step-000004") == 5
    assert keys[-1] == f"ckpt/step-000004/{COMPLETE}" and len(set(keys)) == 5
