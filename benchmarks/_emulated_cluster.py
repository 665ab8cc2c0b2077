"""The emulated 2-host cluster: two network namespaces joined by a veth pair whose bandwidth
``tc tbf`` limits, and the node agents started in them (one per namespace, each reading its own
container contract). Used by ``mics_emulated_cluster.py``; needs root.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HOSTS = ("dtrain_mics_h0", "dtrain_mics_h1")  # network namespaces; also the cleanup key
DEVS = ("dtmics0", "dtmics1")
ADDRS = ("10.213.77.1", "10.213.77.2")  # only inside the namespaces above
PER_HOST = 2
TMP_PREFIX = "dtrain_mics_"
ENTRY_POINT = Path(__file__).resolve().parent / "mics_emulated_cluster.py"  # the workers
# DeepSpeed compiles a C++ op on its first launch (minutes): keep it between runs
EXTENSIONS_DIR = Path.home() / ".cache" / "dtrain-bench" / "torch_extensions"
# (label, implementation, sharding_degree, hierarchical all-gather)
def sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=check, capture_output=True, text=True)


# ---------------------------------------------------------------- the emulated cluster


def create_cluster() -> None:
    for ns in HOSTS:
        sh("ip", "netns", "add", ns)
        sh("ip", "-n", ns, "link", "set", "lo", "up")
    sh("ip", "link", "add", DEVS[0], "netns", HOSTS[0], "type", "veth",
       "peer", "name", DEVS[1], "netns", HOSTS[1])
    for ns, dev, addr in zip(HOSTS, DEVS, ADDRS):
        sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
        sh("ip", "-n", ns, "link", "set", dev, "up")


def limit_link(rate_bytes_per_s: float) -> None:
    """tbf on both veth ends: each shapes its egress, so each direction gets ``rate``."""
    rate_bits = int(rate_bytes_per_s * 8)
    burst = max(int(rate_bytes_per_s / 100), 65536)
    for ns, dev in zip(HOSTS, DEVS):
        sh("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf",
           "rate", f"{rate_bits}bit", "burst", str(burst), "latency", "200ms")


def destroy_cluster() -> None:
    """Kill what runs in our namespaces, delete them (veth and qdiscs go too), drop temp dirs."""
    existing = sh("ip", "netns", "list", check=False).stdout.split()
    for ns in HOSTS:
        if ns not in existing:
            continue
        for _ in range(3):  # bounded: agents may still be reaping workers
            pids = [int(p) for p in sh("ip", "netns", "pids", ns, check=False).stdout.split()]
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.5)
        sh("ip", "netns", "del", ns, check=False)
    for path in glob.glob(os.path.join(tempfile.gettempdir(), TMP_PREFIX + "*")):
        shutil.rmtree(path, ignore_errors=True)


# ---------------------------------------------------------------- launching through the agent


def write_contracts(job_dir: Path, name: str, *, hosts: list[str], devs: list[str],
                    hyperparameters: dict, distribution: dict | None = None,
                    per_host: int = PER_HOST) -> list[str]:
    """One container-contract tree per host (as the local launcher writes them)."""
    from dtrain.core import contract

    settings = contract.Settings(
        entry_point=ENTRY_POINT.name, job_name=name, instance_type="local",
        source_dir=str(ENTRY_POINT.parent), distribution=distribution or {},
        processes_per_host=per_host)
    roots = []
    for host, dev in zip(hosts, devs):
        root = job_dir / name / host
        contract.write_host_contract(str(root), current_host=host, hosts=hosts,
                                     settings=settings, hyperparameters=hyperparameters,
                                     network_interface_name=dev)
        roots.append(str(root))
    return roots


def run_agents(roots: list[str], *, namespaces: tuple[str, ...], devs: list[str], port: int,
               timeout: float) -> None:
    """``python -m dtrain.runtime --root ROOT`` in each namespace; wait; stop all on failure."""
    procs = []
    try:
        for root, ns, dev in zip(roots, namespaces, devs):
            env = {**os.environ, "GLOO_SOCKET_IFNAME": dev, "OMP_NUM_THREADS": "1",
                   "DTRAIN_MASTER_PORT": str(port), "DTRAIN_STOP_GRACE_PERIOD": "5",
                   "DS_ACCELERATOR": "cpu",
                   "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR",
                                                          str(EXTENSIONS_DIR))}
            log = open(os.path.join(root, "agent.log"), "w")  # noqa: SIM115 -- closed by exit
            procs.append(subprocess.Popen(
                ["ip", "netns", "exec", ns, sys.executable, "-m", "dtrain.runtime",
                 "--root", root], env=env, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True))
        wait_all(procs, roots, timeout=timeout)
    finally:
        stop_processes(procs)


def wait_all(procs: list[subprocess.Popen], roots: list[str], *, timeout: float) -> None:
    """Wait until every agent has exited 0; the first that fails raises at once (its peers would
    otherwise sit in torch elastic's exit barrier for 5 minutes, waiting for the failed host)."""
    deadline = time.monotonic() + timeout
    while True:
        codes = [proc.poll() for proc in procs]
        failed = [root for code, root in zip(codes, roots) if code]
        if failed:
            # the host that says why (its failure file) first: a peer fails after it
            root = min(failed, key=lambda r: not os.path.exists(_failure_file(r)))
            raise RuntimeError(f"node agent for {root} exited {codes[roots.index(root)]}:\n"
                               f"{_why(root)}")
        if all(code == 0 for code in codes):
            return
        if time.monotonic() > deadline:
            running = [root for code, root in zip(codes, roots) if code is None]
            raise RuntimeError(f"no result after {timeout:.0f} s (--timeout); still running:\n"
                               + "\n".join(f"{root}:\n{_why(root)}" for root in running))
        time.sleep(0.2)


def _failure_file(root: str) -> str:
    from dtrain.core import contract

    return contract.Paths(root).failure_file


def _why(root: str) -> str:
    """The end of a host's failure file, else of its agent's log."""
    failure = _failure_file(root)
    path = failure if os.path.exists(failure) else os.path.join(root, "agent.log")
    return Path(path).read_text()[-3000:]


def stop_processes(procs: list[subprocess.Popen]) -> None:
    """SIGTERM each agent's session (it stops its workers), then SIGKILL what is left."""
    alive = [p for p in procs if p.poll() is None]
    for proc in alive:
        _signal_group(proc, signal.SIGTERM)
    for proc in alive:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            _signal_group(proc, signal.SIGKILL)
            proc.wait()


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


class Launcher:
    """Runs one benchmark role on the emulated hosts and returns rank 0's JSON result."""

    def __init__(self, args: argparse.Namespace, job_dir: Path) -> None:
        self.args, self.job_dir, self.port, self.count = args, job_dir, 29611, 0

    def run(self, role: str, *, hosts: int = 2, per_host: int = PER_HOST,
            distribution: dict | None = None, **params) -> dict:
        self.count += 1
        self.port += 1
        name = f"{self.count:02d}-{role}"
        out = self.job_dir / f"{name}.json"
        loopback = hosts == 1 and role == "loopback"
        addrs = [ADDRS[0]] if hosts == 1 else list(ADDRS)
        devs = ["lo"] if loopback else list(DEVS[:hosts])
        hps = {"role": role, "out": str(out), **params}
        roots = write_contracts(self.job_dir, name, hosts=addrs, devs=devs, hyperparameters=hps,
                                distribution=distribution, per_host=per_host)
        run_agents(roots, namespaces=HOSTS[:hosts], devs=devs, port=self.port,
                   timeout=self.args.timeout)
        return json.loads(out.read_text())
