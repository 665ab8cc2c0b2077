"""The node agent: SageMaker-style scripts run unchanged; failures, stop, no orphans.

Failures, max_run and max_restarts are covered through the local target (tests/integration/test_local.py).

Each test writes a real contract and runs ``python -m dtrain.runtime`` as a real process.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from dtrain.core import contract as c

pytestmark = pytest.mark.slow

SAGEMAKER_SCRIPT = """
import argparse, json, os
import torch.distributed as dist
parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, required=True)
parser.add_argument("--model-dir", default=os.environ["SM_MODEL_DIR"])
parser.add_argument("--train", default=os.environ["SM_CHANNEL_TRAIN"])
args, _ = parser.parse_known_args()
hps = json.loads(os.environ["SM_HPS"])
assert hps == {"epochs": 2}, hps
dist.init_process_group("gloo")
with open(os.path.join(args.train, "data.txt")) as f:
    words = f.read().split()
rank = dist.get_rank()
if rank == 0:
    with open(os.path.join(args.model_dir, "model.json"), "w") as f:
        json.dump({"epochs": args.epochs, "words": len(words), "world": dist.get_world_size(),
                   "hosts": json.loads(os.environ["SM_HOSTS"])}, f)
dist.barrier()
dist.destroy_process_group()
"""


def make_job(tmp_path, script: str, *, hosts=("algo-1",), hyperparameters=None,
             channels=(), **settings):
    code = tmp_path / "code"
    code.mkdir(exist_ok=True)
    (code / "train.py").write_text(textwrap.dedent(script))
    settings.setdefault("processes_per_host", 1)
    roots = []
    for host in hosts:
        root = tmp_path / host
        c.write_host_contract(str(root), current_host=host, hosts=list(hosts),
                              settings=c.Settings(entry_point="train.py", source_dir=str(code),
                                                  job_name="t", **settings),
                              hyperparameters=hyperparameters or {}, channels=list(channels))
        roots.append(root)
    return roots


def start_agent(root, *, port=None, grace=None, path=None):
    env = dict(os.environ, DTRAIN_MASTER_ADDR="127.0.0.1")
    if port:
        env["DTRAIN_MASTER_PORT"] = str(port)
    if path:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(path), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "dtrain.runtime", "--root", str(root)]
    if grace is not None:
        cmd += ["--grace-period", str(grace)]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_host_sagemaker_job(tmp_path) -> list[Path]:
    roots = make_job(tmp_path, SAGEMAKER_SCRIPT, hosts=("algo-1", "algo-2"),
                     hyperparameters={"epochs": 2}, channels=["train"])
    for root in roots:
        (root / "input/data/train/data.txt").write_text("one two three")
    return roots


def test_sagemaker_toolkit_script_runs_unchanged_on_two_hosts(tmp_path):
    roots = two_host_sagemaker_job(tmp_path)
    port = free_port()
    agents = [start_agent(root, port=port) for root in roots]
    outputs = [a.communicate(timeout=90)[0] for a in agents]
    assert [a.returncode for a in agents] == [0, 0], outputs
    model = json.loads((roots[0] / "model/model.json").read_text())
    assert model == {"epochs": 2, "words": 3, "world": 2, "hosts": ["algo-1", "algo-2"]}
    assert (roots[1] / "output/logs/rank-1.stdout.log").exists()


# Loaded by the second host's agent only (PYTHONPATH): its rendezvous shutdown starts 2 s late,
# as on a slower node, while host 0's agent, whose process holds the rendezvous store, is done.
LATE_SHUTDOWN = """
import time
from torch.distributed.elastic.rendezvous import dynamic_rendezvous
shutdown = dynamic_rendezvous.DynamicRendezvousHandler.shutdown
def late(self):
    time.sleep(2)
    return shutdown(self)
dynamic_rendezvous.DynamicRendezvousHandler.shutdown = late
"""


def test_a_host_that_shuts_the_rendezvous_down_late_still_ends_without_a_traceback(tmp_path):
    roots = two_host_sagemaker_job(tmp_path)
    late = tmp_path / "late"
    late.mkdir()
    (late / "sitecustomize.py").write_text(LATE_SHUTDOWN)
    port = free_port()
    agents = [start_agent(roots[0], port=port), start_agent(roots[1], port=port, path=late)]
    outputs = [a.communicate(timeout=90)[0] for a in agents]
    assert [a.returncode for a in agents] == [0, 0], outputs
    # before host 0 waited for it, the late agent's store had gone: "sendBytes failed ...
    # Broken pipe", a C++ stack and "failed to shutdown the rendezvous"
    assert "TCPStore" not in outputs[1] and "failed to shutdown" not in outputs[1], outputs[1]


def test_sigterm_stops_workers_within_the_grace_period(tmp_path, live_processes):
    script = """
    import signal, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a worker that ignores the polite stop
    print("started", flush=True)
    time.sleep(120)
    """
    (root,) = make_job(tmp_path, script, processes_per_host=2)
    agent = start_agent(root, grace=2)
    _wait_for(lambda: (root / "output/logs/rank-1.stdout.log").exists()
              and "started" in (root / "output/logs/rank-1.stdout.log").read_text())
    agent.send_signal(signal.SIGTERM)
    started = time.monotonic()
    agent.communicate(timeout=30)
    assert agent.returncode == 128 + signal.SIGTERM
    assert time.monotonic() - started < 10
    assert live_processes(str(tmp_path)) == []


@pytest.mark.parametrize("noted", [True, False])
def test_workers_that_exit_0_on_sigterm_are_a_stop_when_the_trainer_noted_one(tmp_path, noted):
    # a script that returns after Trainer.fit stopped on the signal, without exit 143 (the
    # Trainer notes the stop in SM_OUTPUT_DIR), against workers that finished as it came
    script = f"""
    import os, pathlib, signal, sys, time
    def leave(*_):
        if {noted}:
            (pathlib.Path(os.environ["SM_OUTPUT_DIR"]) / "stopped_early.json").write_text("{{}}")
        sys.exit(0)
    signal.signal(signal.SIGTERM, leave)
    print("started", flush=True)
    time.sleep(120)
    """
    (root,) = make_job(tmp_path, script)
    agent = start_agent(root)
    _wait_for(lambda: (root / "output/logs/rank-0.stdout.log").exists()
              and "started" in (root / "output/logs/rank-0.stdout.log").read_text())
    agent.send_signal(signal.SIGTERM)
    output = agent.communicate(timeout=60)[0]
    failure = Path(c.Paths(str(root)).failure_file)
    if noted:
        assert agent.returncode == 128 + signal.SIGTERM, output
        assert failure.read_text().startswith("interrupted: the workers on algo-1 stopped early")
    else:
        assert agent.returncode == 0, output
        assert not failure.exists()


def test_killed_agent_takes_its_workers_with_it(tmp_path, live_processes):
    (root,) = make_job(tmp_path, "print('up', flush=True)\nimport time\ntime.sleep(120)\n")
    agent = start_agent(root)
    _wait_for(lambda: live_processes(str(tmp_path / "code"), settle_s=0) != [])
    agent.kill()
    agent.wait()
    assert live_processes(str(tmp_path)) == []


def test_an_interruption_whose_checkpoint_cannot_be_read_is_still_reported_as_one(tmp_path):
    # The workers stop after a checkpoint, but its trainer.json is garbage and the checkpoint
    # config's S3Uri is not a string: the report says what it can, and the agent neither crashes
    # nor loses the interruption's exit code.
    script = """
    import os, pathlib
    checkpoint = pathlib.Path(os.environ["DTRAIN_CHECKPOINT_DIR"]) / "step-000004"
    checkpoint.mkdir(parents=True)
    (checkpoint / "trainer.json").write_text("{not json")
    (checkpoint / "COMPLETE").write_text("{}")
    raise SystemExit(143)
    """
    (root,) = make_job(tmp_path, script)
    paths = c.Paths(str(root))
    Path(paths.checkpoint_config_file).write_text(
        json.dumps({"LocalPath": paths.checkpoints_dir, "S3Uri": 7}))
    agent = start_agent(root)
    output = agent.communicate(timeout=90)[0]
    assert agent.returncode == c.PREEMPTED_EXIT_CODE, output
    assert "Traceback" not in output
    details = json.loads(Path(paths.failure_details_file).read_text())
    assert (details["reason"], details["step"], details["rank"]) == ("interrupted", 4, None)
    assert Path(paths.failure_file).read_text() == (
        "interrupted: training stopped at step 4 after a checkpoint because a host received "
        f"SIGTERM; resubmit to resume from {paths.checkpoints_dir}/step-000004\n")


def test_recipe_entry_points_resolve_to_runtime_modules_or_fail_clearly(tmp_path):
    from dtrain.runtime.agent.workers import build_worker_command

    (root,) = make_job(tmp_path, "")
    c.write_host_contract(str(root), current_host="algo-1", hosts=["algo-1"],
                          settings=c.Settings(entry_point="recipe:no_such_recipe"))
    with pytest.raises(ValueError, match="no recipe module dtrain.runtime.recipes.no_such_recipe"):
        build_worker_command(c.read_contract(str(root), num_gpus=0))


def _wait_for(predicate, *, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.1)


def test_bad_recipe_input_fails_the_agent_before_any_worker_starts(tmp_path):
    # The spec named no model, so validation could not know seq_len 512 is beyond the 256
    # positions of the recipe's default model; and the channel holds binary, not text.
    root = tmp_path / "algo-1"
    c.write_host_contract(str(root), current_host="algo-1", hosts=["algo-1"],
                          settings=c.Settings(entry_point="recipe:causal_lm", job_name="t"),
                          hyperparameters={"seq_len": 512}, channels=["train"])
    garbage = root / "input/data/train/notes.txt"
    garbage.write_bytes(bytes(range(256)) * 16)
    agent = start_agent(root)
    output = agent.communicate(timeout=60)[0]
    assert agent.returncode == 2, output
    assert list((root / "output/logs").iterdir()) == []  # no worker started, trained or failed
    assert Path(c.Paths(str(root)).failure_file).read_text() == (
        "node agent could not start: hyperparameters.seq_len: 512 is more than the 256 positions "
        "of model 'gpt-neox-tiny'; lower seq_len to at most 256 or use a model with more "
        f"positions; inputs.train: {garbage} is binary, not text; give text files or a token "
        "channel (`python -m dtrain.runtime.train.tokenize`)\n")


def test_a_failure_whose_stderr_is_its_one_line_is_not_said_twice(tmp_path):
    from dtrain.runtime.agent.reports import write_failure

    paths = c.Paths(str(tmp_path))
    summary = "rank 1 on algo-2 exited with code 3: boom"
    write_failure(paths, {"summary": summary, "tail": ["boom", ""]})
    assert Path(paths.failure_file).read_text() == summary + "\n"  # 'boom\n\nboom' before
    traceback = ["Traceback (most recent call last):", '  File "train.py", line 1', "boom"]
    write_failure(paths, {"summary": summary, "tail": traceback})
    assert Path(paths.failure_file).read_text() == summary + "\n\n" + "\n".join(traceback) + "\n"
