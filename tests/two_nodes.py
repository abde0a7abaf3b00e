"""Tests only: a cluster of two nodes on one machine, each a Linux network namespace with a UTS namespace of its own
(its own hostname and address), joined by a bridge; the file system is shared, as a cluster's run folder is.

    with two_node_cluster() as cluster:           # skips the test, saying why, where it cannot be made (no root)
        cluster.nodes                              # [Node("crate-n1", "10.97.K.2"), Node("crate-n2", "10.97.K.3")]
        cluster.popen(node, cmd, env=..., ...)     # subprocess.Popen of CMD run on NODE
        cluster.kill_node(node)                    # a crash: its link down, SIGKILL to every process on it

It is also a script, for trying a multi-node launch by hand (docs/training.md#several-nodes-on-one-machine):

    python tests/two_nodes.py up                   # prints the nodes; stays until `down`
    python tests/two_nodes.py run crate-n1 -- hostname
    python tests/two_nodes.py down

Layout: a bridge in the machine's own namespace holds the address .1 (the "head": slurmctld, a test's servers), each
node a veth pair to it (its end named eth0) and .2, .3. A node's processes resolve both node names through
/etc/netns/<node>/hosts, which `ip netns exec` mounts over /etc/hosts for them (and a resolv.conf that fails at once:
no DNS server is reachable from a node). A command runs on a node as `ip netns exec NODE nsenter --uts=UTS_FILE --
CMD`; killing a node is what a crash does: its link goes down, so the other node's connections to it hear nothing
more (no FIN, no RST), and every process whose network namespace is the node's (`ip netns pids`) gets SIGKILL.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

STATE = Path("/run/crate-clip-two-nodes")
TOOLS = ("ip", "nsenter", "unshare")


@dataclass(frozen=True)
class Node:
    name: str   # its hostname and network namespace
    addr: str   # its address on the bridge


class TwoNodeCluster:
    """The two nodes of one cluster (made by `up`, removed by `down`)."""

    def __init__(self, tag: str, subnet: int):
        self.tag, self.subnet = tag, subnet
        self.head = f"10.97.{subnet}.1"   # the bridge's address: the machine itself, seen from the nodes
        self.nodes = [Node(f"crate-{tag}-n{i}", f"10.97.{subnet}.{i + 1}") for i in (1, 2)]
        self.bridge = f"cb{tag}"
        self.folder = STATE / tag

    # ------------------------------------------------------------------ running things on a node
    def command(self, node: Node, cmd: list[str]) -> list[str]:
        """`cmd` as run on `node`: its network namespace (and hosts file), its hostname."""
        return ["ip", "netns", "exec", node.name, "nsenter", f"--uts={self.folder / node.name}", "--", *cmd]

    def popen(self, node: Node, cmd: list[str], **kwargs) -> subprocess.Popen:
        return subprocess.Popen(self.command(node, list(map(str, cmd))), **kwargs)

    def run(self, node: Node, cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(node, list(map(str, cmd))), **kwargs)

    def pids(self, node: Node) -> list[int]:
        """Every process on `node` (its network namespace): a launcher's workers forked elsewhere and joined to it
        included."""
        out = subprocess.run(["ip", "netns", "pids", node.name], capture_output=True, text=True).stdout
        return [int(p) for p in out.split()]

    def kill_node(self, node: Node) -> list[int]:
        """A node crash: its link down (so that no FIN or RST of its dying processes reaches the other node), then
        SIGKILL to each of its processes until none is left. The PIDs killed."""
        _ip("link", "set", self._root_end(node), "down")
        killed: list[int] = []
        for _ in range(50):
            pids = self.pids(node)
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            time.sleep(0.05)
        return sorted(set(killed))

    def revive(self, node: Node) -> None:
        """The node back on the network (its processes are not: start them again)."""
        _ip("link", "set", self._root_end(node), "up")

    def start_sshd(self) -> list[subprocess.Popen]:
        """Passwordless ssh between the nodes, as a cluster has it: each node an sshd (Debian's openssh-server) and an
        /etc/ssh of its own (/etc/netns/<node>/ssh, mounted over /etc/ssh on the node), with a key made here that
        every node's root accepts and uses. The sshds, to stop after use (down() kills them with the nodes)."""
        key = self.folder / "id_ed25519"
        if not key.exists():
            _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)])
        Path("/run/sshd").mkdir(exist_ok=True)   # sshd's privilege-separation folder
        daemons = []
        for node in self.nodes:
            etc = Path("/etc/netns") / node.name / "ssh"
            etc.mkdir(parents=True, exist_ok=True)
            shutil.copy(key, etc / "id_ed25519")
            (etc / "authorized_keys").write_text(Path(f"{key}.pub").read_text())
            if not (etc / "ssh_host_ed25519_key").exists():
                _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(etc / "ssh_host_ed25519_key")])
            (etc / "sshd_config").write_text(
                f"ListenAddress {node.addr}\nHostKey /etc/ssh/ssh_host_ed25519_key\nPermitRootLogin prohibit-password\n"
                "AuthorizedKeysFile /etc/ssh/authorized_keys\nUsePAM no\nStrictModes no\nPidFile none\n"
                "AcceptEnv none\n")
            (etc / "ssh_config").write_text(
                "Host *\n  IdentityFile /etc/ssh/id_ed25519\n  StrictHostKeyChecking no\n"
                "  UserKnownHostsFile /dev/null\n  LogLevel ERROR\n  BatchMode yes\n")
            daemons.append(self.popen(node, [shutil.which("sshd", path="/usr/sbin:/sbin:/usr/bin"), "-D", "-e"],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        return daemons

    # ------------------------------------------------------------------ making and removing it
    def up(self) -> "TwoNodeCluster":
        self.folder.mkdir(parents=True, exist_ok=True)
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.head}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        hosts = "".join(f"{n.addr} {n.name}\n" for n in self.nodes) + f"{self.head} crate-{self.tag}-head\n" \
            "127.0.0.1 localhost\n"
        for i, node in enumerate(self.nodes, 1):
            _ip("netns", "add", node.name)
            root_end, node_end = self._root_end(node), f"cn{self.tag}x{i}"
            _ip("link", "add", root_end, "type", "veth", "peer", "name", node_end)
            _ip("link", "set", node_end, "netns", node.name)
            _ip("link", "set", root_end, "master", self.bridge)
            _ip("link", "set", root_end, "up")
            inside = ["ip", "netns", "exec", node.name, "ip"]
            _run([*inside, "link", "set", node_end, "name", "eth0"])
            _run([*inside, "addr", "add", f"{node.addr}/24", "dev", "eth0"])
            _run([*inside, "link", "set", "eth0", "up"])
            _run([*inside, "link", "set", "lo", "up"])
            _run([*inside, "route", "add", "default", "via", self.head])
            etc = Path("/etc/netns") / node.name
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(hosts)
            # no DNS server is reachable from a node: a lookup the hosts file cannot answer (torch's store names
            # each client by a reverse lookup of its v4-mapped address) fails at once instead of after timeouts
            (etc / "resolv.conf").write_text("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")
            uts = self.folder / node.name
            uts.touch()
            _run(["unshare", f"--uts={uts}", "hostname", node.name])   # a UTS namespace kept by its bind mount
        (self.folder / "cluster.json").write_text(json.dumps({"tag": self.tag, "subnet": self.subnet}))
        return self

    def down(self) -> None:
        """Remove what `up` made, also half of it; the processes still on the nodes are killed first."""
        for node in self.nodes:
            with contextlib.suppress(Exception):
                self.kill_node(node)
            subprocess.run(["ip", "netns", "del", node.name], capture_output=True)
            subprocess.run(["ip", "link", "del", self._root_end(node)], capture_output=True)
            with contextlib.suppress(OSError):
                subprocess.run(["umount", str(self.folder / node.name)], capture_output=True)
            shutil.rmtree(Path("/etc/netns") / node.name, ignore_errors=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
        shutil.rmtree(self.folder, ignore_errors=True)

    def _root_end(self, node: Node) -> str:
        return f"cr{self.tag}x{self.nodes.index(node) + 1}"


def cannot_run() -> Optional[str]:
    """Why a cluster cannot be made here, or None."""
    if os.geteuid() != 0:
        return "two network namespaces need root (ip netns, unshare); run the test as root"
    missing = [t for t in TOOLS if not (shutil.which(t) or shutil.which(t, path="/usr/sbin:/sbin"))]
    if missing:
        return f"{', '.join(missing)} not installed (Debian: iproute2, util-linux)"
    probe = subprocess.run(["ip", "netns", "add", "crate-probe"], capture_output=True, text=True)
    subprocess.run(["ip", "netns", "del", "crate-probe"], capture_output=True)
    if probe.returncode != 0:
        return f"network namespaces cannot be made here: {probe.stderr.strip()}"
    return None


@contextlib.contextmanager
def two_node_cluster() -> Iterator[TwoNodeCluster]:
    """A cluster made for the body and removed after it; skips the test (pytest) where it cannot be made."""
    import pytest

    why = cannot_run()
    if why:
        pytest.skip(why)
    tag = f"{os.getpid() % 10000:04d}"
    cluster = TwoNodeCluster(tag, 20 + os.getpid() % 200)
    try:
        cluster.up()
        yield cluster
    finally:
        cluster.down()


def _ip(*args: str) -> None:
    _run(["ip", *args])


def _run(cmd: list[str]) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {done.stderr.strip()}")


def _saved() -> Optional[TwoNodeCluster]:
    state = next(STATE.glob("*/cluster.json"), None) if STATE.is_dir() else None
    if state is None:
        return None
    record = json.loads(state.read_text())
    return TwoNodeCluster(record["tag"], record["subnet"])


def main(argv: list[str]) -> int:
    """`up`, `run NODE -- CMD...`, `down` (the cluster's state under /run/crate-clip-two-nodes)."""
    if argv[:1] == ["up"]:
        why = cannot_run()
        if why:
            print(why, file=sys.stderr)
            return 2
        cluster = _saved() or TwoNodeCluster("0000", 97).up()
        for node in cluster.nodes:
            print(f"{node.name} {node.addr}")
        return 0
    cluster = _saved()
    if cluster is None:
        print("no cluster is up: python tests/two_nodes.py up", file=sys.stderr)
        return 2
    if argv[:1] == ["down"]:
        cluster.down()
        return 0
    if argv[:1] == ["run"] and len(argv) > 3 and argv[2] == "--":
        node = next((n for n in cluster.nodes if n.name == argv[1]), None)
        if node is None:
            print(f"no node {argv[1]!r}: {[n.name for n in cluster.nodes]}", file=sys.stderr)
            return 2
        return cluster.run(node, argv[3:]).returncode
    print(__doc__.split("\n\n")[2], file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
