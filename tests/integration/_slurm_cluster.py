"""A real two-node Slurm cluster on this machine, for the Slurm target's tests.

``SlurmCluster(folder).start()`` runs munged and slurmctld here (the login node, where dtrain
runs) and one slurmd per node, each in network, UTS, mount and PID namespaces of its own: nodes
``n1`` and ``n2`` on a bridge whose address is the controller's, each with its own address, host
name and ``/etc/hosts`` (bind-mounted inside its mount namespace only). A job's processes on a
node see that node alone, as on a real cluster.

``stop()`` stops the daemons, ends whatever still runs on a node (the first process of a PID
namespace takes every other one with it when it exits) and removes the namespaces, links and
bridge. The tests' fixture calls it even when a test fails; ``start`` first removes what a
killed earlier run left behind. Needs root and Debian's ``slurm-wlm`` and ``munge``.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

# what each command comes from, by the command that installs it
INSTALL = {
    "apt-get install -y slurm-wlm munge": ("munged", "slurmctld", "slurmd", "sbatch", "srun",
                                           "squeue", "scancel", "scontrol", "sinfo"),
    "apt-get install -y iproute2 util-linux": ("ip", "nsenter", "unshare"),
}
NODES = ("n1", "n2")
PREFIX = "dtrs"  # names of our namespaces and links: dtrs<pid>...
OWNER_ENV = "DTRAIN_TEST_SLURM_OWNER"  # in every daemon's environment: the pid that started it
KILL_WAIT_S = 30  # Slurm's default: scancel's SIGKILL comes this long after its SIGTERM

# The first process of a node's PID namespace: starts slurmd and reaps every orphan (slurmstepd
# and job processes end up here); when slurmd is gone it exits, and the kernel kills whatever
# is left on the node.
_NODE_INIT = """
import os, signal, subprocess, sys
slurmd = subprocess.Popen(sys.argv[1:])
signal.signal(signal.SIGTERM, lambda *_: slurmd.terminate())
while True:
    try:
        pid, _ = os.waitpid(-1, 0)
    except ChildProcessError:
        break
    if pid == slurmd.pid:
        break
"""


def require_slurm(path: str | None = None) -> None:
    """Fail (never skip) with one line naming the install command when Slurm is missing."""
    import pytest

    missing = {install: [c for c in commands if shutil.which(c, path=path) is None]
               for install, commands in INSTALL.items()}
    missing = {install: commands for install, commands in missing.items() if commands}
    if missing:
        found = ", ".join(c for commands in missing.values() for c in commands)
        pytest.fail(f"Slurm is not installed ({found} not found): {'; '.join(missing)}",
                    pytrace=False)
    if os.geteuid() != 0:
        pytest.fail("the Slurm tests start daemons in network namespaces: run them as root",
                    pytrace=False)


def _sh(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, check=check, timeout=60)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _free_subnet() -> str:
    """``10.213.N`` not used by any address here (another run's bridge)."""
    used = _sh("ip", "-o", "-4", "addr").stdout
    for n in range(os.getpid() % 200, os.getpid() % 200 + 250):
        prefix = f"10.213.{n % 250}"
        if f" {prefix}." not in used:
            return prefix
    raise RuntimeError("no free 10.213.x.0/24 subnet for the test cluster")


def remove_leftovers() -> None:
    """Daemons, namespaces and links of earlier runs whose process is gone (a killed pytest).

    A daemon is known by ``OWNER_ENV`` in its environment; killing a node's init ends every
    process of that node with it."""
    marker = re.compile(rf"(?:^|\0){OWNER_ENV}=(\d+)\0".encode())
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            owner = marker.search(Path(f"/proc/{pid}/environ").read_bytes())
        except OSError:
            continue
        if owner and not Path(f"/proc/{owner[1].decode()}").exists():
            _signal(int(pid), signal.SIGKILL)

    def stale(name: str) -> bool:
        match = re.match(rf"^{PREFIX}(\d+)", name)
        return bool(match) and not Path(f"/proc/{match[1]}").exists()

    for line in _sh("ip", "netns", "list").stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        if stale(name):
            _sh("ip", "netns", "del", name, check=False)
    for line in _sh("ip", "-o", "link").stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        if stale(name):
            _sh("ip", "link", "del", name, check=False)


class SlurmCluster:
    def __init__(self, folder: Path):
        self.folder = folder
        self.tag = f"{PREFIX}{os.getpid()}"
        self.subnet = _free_subnet()
        self.conf = folder / "slurm.conf"
        self.daemons: dict[str, subprocess.Popen] = {}

    @property
    def env(self) -> dict[str, str]:
        """What a login-node shell sets to use this cluster."""
        return {"SLURM_CONF": str(self.conf)}

    def address(self, index: int) -> str:
        return f"{self.subnet}.{index}"  # .1 the controller (bridge), .2 n1, .3 n2

    # ---------------------------------------------------------------- start

    def start(self) -> SlurmCluster:
        remove_leftovers()
        for sub in ("state", "spool", "log"):
            (self.folder / sub).mkdir(parents=True, exist_ok=True)
        self._network()
        self._munge()
        self._write_conf()
        self.daemons["slurmctld"] = self._daemon("slurmctld",
                                                 ["slurmctld", "-D", "-f", str(self.conf)])
        for i, node in enumerate(NODES):
            self._node(i + 1, node)
        self.wait_idle()
        return self

    def _network(self) -> None:
        bridge = self.tag
        _sh("ip", "link", "add", "name", bridge, "type", "bridge")
        _sh("ip", "addr", "add", f"{self.address(1)}/24", "dev", bridge)
        _sh("ip", "link", "set", bridge, "up")
        for i, node in enumerate(NODES, start=1):
            ns, outer, inner = f"{self.tag}-{node}", f"{self.tag}v{i}", f"{self.tag}p{i}"
            _sh("ip", "netns", "add", ns)
            _sh("ip", "link", "add", outer, "type", "veth", "peer", "name", inner)
            _sh("ip", "link", "set", outer, "master", bridge)
            _sh("ip", "link", "set", outer, "up")
            _sh("ip", "link", "set", inner, "netns", ns)
            for command in (("link", "set", inner, "name", "eth0"),
                            ("addr", "add", f"{self.address(i + 1)}/24", "dev", "eth0"),
                            ("link", "set", "eth0", "up"), ("link", "set", "lo", "up"),
                            ("route", "add", "default", "via", self.address(1))):
                _sh("ip", "-n", ns, *command)
            hosts = ["127.0.0.1 localhost", f"{self.address(1)} {socket.gethostname()}"]
            hosts += [f"{self.address(j + 2)} {name}" for j, name in enumerate(NODES)]
            (self.folder / f"hosts-{node}").write_text("\n".join(hosts) + "\n")
        # No name server inside the nodes' networks: an empty resolv.conf makes a lookup that
        # /etc/hosts cannot answer fail at once instead of waiting for an unreachable one.
        (self.folder / "resolv.conf").write_text("")

    def _munge(self) -> None:
        key = self.folder / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self.munge_socket = self.folder / "munge.sock"
        self.daemons["munged"] = self._daemon("munged", [
            "munged", "--foreground", "--force", f"--socket={self.munge_socket}",
            f"--key-file={key}", f"--pid-file={self.folder / 'munged.pid'}",
            f"--log-file={self.folder / 'log' / 'munged.log'}",
            f"--seed-file={self.folder / 'munged.seed'}"])
        self._wait(lambda: self.munge_socket.exists(), "munged to create its socket")

    def _write_conf(self) -> None:
        f = self.folder
        nodes = "\n".join(f"NodeName={node} NodeAddr={self.address(i + 2)} CPUs={os.cpu_count()} "
                          "State=UNKNOWN" for i, node in enumerate(NODES))
        self.conf.write_text(f"""\
ClusterName=dtraintest
SlurmctldHost={socket.gethostname().split('.')[0]}({self.address(1)})
SlurmctldPort={_free_port()}
SlurmdPort=6818
AuthType=auth/munge
AuthInfo=socket={self.munge_socket}
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={f / 'state'}
SlurmdSpoolDir={f / 'spool'}/%n
SlurmctldPidFile={f / 'slurmctld.pid'}
SlurmdPidFile={f / 'spool'}/slurmd-%n.pid
SlurmctldLogFile={f / 'log' / 'slurmctld.log'}
SlurmdLogFile={f / 'log'}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
KillWait={KILL_WAIT_S}
SlurmctldTimeout=30
SlurmdTimeout=60
InactiveLimit=0
{nodes}
PartitionName=debug Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE State=UP
""")

    def _daemon(self, name: str, argv: list[str]) -> subprocess.Popen:
        log = open(self.folder / "log" / f"{name}.stdout", "ab")  # noqa: SIM115 - the daemon's
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT,
                                env={**os.environ, **self.env, OWNER_ENV: str(os.getpid())})

    def _node(self, index: int, node: str) -> None:
        (self.folder / "spool" / node).mkdir(parents=True, exist_ok=True)
        setup = (f"hostname {node} && mount --bind {self.folder / f'hosts-{node}'} /etc/hosts && "
                 f"mount --bind {self.folder / 'resolv.conf'} /etc/resolv.conf && "
                 f"exec {sys.executable} -c \"$0\" slurmd -D -N {node} -f {self.conf}")
        self.daemons[node] = self._daemon(node, [
            "nsenter", f"--net=/run/netns/{self.tag}-{node}", "unshare", "--uts", "--mount",
            "--pid", "--fork", "--mount-proc", "sh", "-c", setup, _NODE_INIT])

    def wait_idle(self, timeout_s: float = 60) -> None:
        def idle() -> bool:
            out = _sh("sinfo", "--noheader", "--format=%T", check=False).stdout
            return out.split() == ["idle"]

        self._wait(idle, "both Slurm nodes to be idle", timeout_s=timeout_s)

    def _wait(self, ready, what: str, *, timeout_s: float = 30) -> None:
        os.environ.update(self.env)  # the Slurm commands the checks run read it
        deadline = time.monotonic() + timeout_s
        while not ready():
            for name, daemon in self.daemons.items():
                if daemon.poll() is not None:
                    raise RuntimeError(f"{name} exited with {daemon.returncode} while waiting for "
                                       f"{what}; see {self.folder / 'log'}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out waiting for {what}; see {self.folder / 'log'}")
            time.sleep(0.5)

    # ---------------------------------------------------------------- inspect and stop

    def node_processes(self, *, settle_s: float = 10.0) -> list[str]:
        """Command lines of whatever runs on the nodes besides their init and slurmd, once
        ``settle_s`` has passed or nothing does (processes that are exiting get that long)."""
        deadline = time.monotonic() + settle_s
        while True:
            found = self._job_processes()
            if not found or time.monotonic() > deadline:
                return found
            time.sleep(0.2)

    def _job_processes(self) -> list[str]:
        inits = {node: self._init_pid(node) for node in NODES}
        namespaces = {_pid_namespace(pid) for pid in inits.values()} - {None}
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            if int(pid) in inits.values() or _is_zombie(pid) or \
                    _pid_namespace(int(pid)) not in namespaces:
                continue
            cmd = _cmdline(pid)
            if not cmd.startswith("slurmd -D -N "):
                found.append(cmd)
        return found

    def _init_pid(self, node: str) -> int | None:
        """The first process of ``node``'s PID namespace (the child of ``unshare --fork``)."""
        unshare = self.daemons.get(node)
        if unshare is None or unshare.poll() is not None:
            return None
        try:
            children = Path(f"/proc/{unshare.pid}/task/{unshare.pid}/children").read_text()
        except OSError:
            return None
        return int(children.split()[0]) if children.split() else None

    def stop(self) -> None:
        for name in (*NODES, "slurmctld", "munged"):  # the nodes' inits forward it to slurmd
            daemon = self.daemons.get(name)
            if daemon is None:
                continue
            init = self._init_pid(name) if name in NODES else daemon.pid
            if init:
                _signal(init, signal.SIGTERM)
            try:
                daemon.wait(timeout=15)
            except subprocess.TimeoutExpired:
                if init:
                    _signal(init, signal.SIGKILL)  # takes the node's processes with it
                daemon.kill()
                daemon.wait()
        for i, node in enumerate(NODES, start=1):
            _sh("ip", "netns", "del", f"{self.tag}-{node}", check=False)
            _sh("ip", "link", "del", f"{self.tag}v{i}", check=False)  # not always gone with it
        _sh("ip", "link", "del", self.tag, check=False)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _pid_namespace(pid: int | None) -> int | None:
    try:
        return os.stat(f"/proc/{pid}/ns/pid").st_ino if pid else None
    except OSError:
        return None


def _cmdline(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return ""


def _is_zombie(pid: str) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


if __name__ == "__main__":  # a cluster to try things by hand: python _slurm_cluster.py FOLDER
    cluster = SlurmCluster(Path(sys.argv[1]).resolve())
    cluster.folder.mkdir(parents=True, exist_ok=True)
    require_slurm()
    cluster.start()
    print(f"export SLURM_CONF={cluster.conf}  # Ctrl-C stops the cluster", flush=True)
    try:
        signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        cluster.stop()
