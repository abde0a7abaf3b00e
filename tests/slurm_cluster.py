"""Tests only: a real one-node Slurm cluster on localhost (Debian's slurm-wlm: munged, slurmctld, slurmd), in a
temporary folder of its own, for the tests of what a Slurm job does to a training run (signals, requeue, exit codes).

    with slurm_cluster() as cluster:            # skips the test, with the reason, where Slurm cannot run
        job = cluster.sbatch(["configs/slurm/train.sbatch", "run.yaml"], env=..., cwd=...)
        cluster.wait_state(job, {"COMPLETED", "FAILED"})
        cluster.job(job)["ExitCode"]            # '8:0': the job's own exit code (no accounting needed)

Nothing of the machine's own Slurm or munge is used or changed: the daemons run in the foreground as children of
the test (ended by their PIDs), on free ports, with their key, sockets, state and spool in the folder, and the
client commands find the cluster through SLURM_CONF. About 1 s to come up.
"""
from __future__ import annotations

import contextlib
import math
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Iterator, Optional

import pytest

from crate_clip.train.stage_setup.engine import _free_port

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "scontrol", "scancel", "sinfo")
INSTALL = "make system-data installs it as root (apt-get install slurm-wlm)"


def _which(name: str) -> Optional[str]:
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")


def slurm_conf(folder: Path, munge_socket: Path, nodes=None) -> str:
    """A one-node cluster: localhost with 2 CPUs, tasks tracked as the processes below slurmstepd (no cgroups, no
    systemd), no accounting (scontrol keeps a finished job's state and exit code for MinJobAge seconds). With
    `nodes` (a two_nodes.TwoNodeCluster): its two nodes, slurmctld on the bridge's address (the head), a node that
    does not answer for 10 s is down."""
    names = [n.name for n in nodes.nodes] if nodes else ["localhost"]
    node_lines = ([f"NodeName={n.name} NodeAddr={n.addr} CPUs=2 RealMemory=1000 State=UNKNOWN" for n in nodes.nodes]
                  if nodes else ["NodeName=localhost CPUs=2 RealMemory=1000 State=UNKNOWN"])
    return "\n".join([
        f"ClusterName=crate{os.getpid()}",
        f"SlurmctldHost=localhost({nodes.head})" if nodes else "SlurmctldHost=localhost",
        f"SlurmctldPort={_free_port()}", f"SlurmdPort={_free_port()}",
        "SlurmUser=root", "SlurmdUser=root", "AuthType=auth/munge", "CredType=cred/munge",
        f"AuthInfo=socket={munge_socket}", "MpiDefault=none",
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
        "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core", "SchedulerType=sched/backfill",
        "SlurmdParameters=config_overrides",   # CPUs=2 whatever the machine has
        f"StateSaveLocation={folder / 'state'}", f"SlurmdSpoolDir={folder / 'spool' / '%n'}",
        f"SlurmctldPidFile={folder / 'slurmctld.pid'}", f"SlurmdPidFile={folder / 'slurmd-%n.pid'}",
        f"SlurmctldLogFile={folder / 'slurmctld.log'}", f"SlurmdLogFile={folder / 'slurmd-%n.log'}",
        "ReturnToService=2", "JobCompType=jobcomp/none", "AccountingStorageType=accounting_storage/none",
        "JobAcctGatherType=jobacct_gather/none", "MinJobAge=600", "KillWait=30",
        *(["SlurmdTimeout=10", "MessageTimeout=5"] if nodes else []),
        *node_lines,
        f"PartitionName=debug Nodes={','.join(names)} Default=YES MaxTime=INFINITE State=UP", ""])


class SlurmCluster:
    """The running cluster: its SLURM_CONF and the client commands."""

    def __init__(self, folder: Path, nodes=None):
        self.folder, self.conf, self.nodes = folder, folder / "slurm.conf", nodes
        self._daemons: list[subprocess.Popen] = []

    def env(self, base: Optional[dict] = None) -> dict:
        """`base` (default: this process's environment) with SLURM_CONF pointing at this cluster."""
        return dict(os.environ if base is None else base, SLURM_CONF=str(self.conf))

    def command(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        """A Slurm client command against this cluster (its output captured)."""
        done = subprocess.run(list(args), env=self.env(), capture_output=True, text=True, timeout=60)
        if check and done.returncode != 0:
            raise AssertionError(f"{' '.join(args)}: exit {done.returncode}: {done.stderr.strip()}")
        return done

    def sbatch(self, args: list[str], env: dict, cwd: Path) -> str:
        """Submit a batch script (sbatch ARGS) in `env` from `cwd`; returns the job id."""
        done = subprocess.run(["sbatch", "--parsable", *args], env=self.env(env), cwd=cwd, capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip().split(";")[0]

    def job(self, job: str) -> dict:
        """`scontrol show job -o JOB` as a dict (JobState, ExitCode 'code:signal', Restarts, ...)."""
        out = self.command("scontrol", "show", "job", "-o", job).stdout
        return dict(field.split("=", 1) for field in out.split() if "=" in field)

    def wait_state(self, job: str, states: set[str], timeout: float = 240.0) -> dict:
        """Until the job's JobState is one of `states`; returns its record."""
        deadline = time.time() + timeout
        while True:
            record = self.job(job)
            if record.get("JobState") in states:
                return record
            if time.time() > deadline:
                raise AssertionError(f"job {job} still {record.get('JobState')} after {timeout:.0f} s, not "
                                     f"{sorted(states)}: {record}")
            time.sleep(0.1)

    def start_now(self, job: str, timeout: float = 60.0) -> None:
        """A requeued job waits (BeginTime, about 2 minutes); let it start now, but only once the node is idle again
        and the clock has left the second it went idle in. At the kill, slurmd revokes the job's credential and
        refuses every credential of that job issued up to the same whole second, so an attempt started sooner fails
        at once ("Killing non-startable batch JobId=N: Job credential revoked", exit code 1:0, nothing in its
        output): the race Slurm's own delay avoids, which a loaded machine hit here."""
        deadline = time.time() + timeout
        while not self._node_idle():
            assert time.time() < deadline, f"the node not idle {timeout:.0f} s after job {job} was requeued"
            time.sleep(0.05)
        time.sleep(math.floor(time.time()) + 1.1 - time.time())
        self.command("scontrol", "update", f"JobId={job}", "StartTime=now")

    def _start(self) -> None:
        folder = self.folder
        for sub in ("state", "spool", "munge"):
            (folder / sub).mkdir()
        (folder / "munge").chmod(0o700)
        key = folder / "munge" / "munge.key"
        key.write_bytes(os.urandom(128))
        key.chmod(0o600)
        sock = folder / "munge" / "socket"
        self.conf.write_text(slurm_conf(folder, sock, self.nodes))
        self._spawn(["munged", "-F", "-f", f"--socket={sock}", f"--key-file={key}",
                     f"--log-file={folder / 'munge' / 'log'}", f"--pid-file={folder / 'munge' / 'pid'}",
                     f"--seed-file={folder / 'munge' / 'seed'}"], until=sock.exists)
        self._spawn(["slurmctld", "-D", "-c"])
        if self.nodes is None:
            self._spawn(["slurmd", "-D", "-N", "localhost"], until=self._node_idle)
            return
        for node in self.nodes.nodes:   # one slurmd on each node, in its namespaces
            self.start_slurmd(node, wait=node is self.nodes.nodes[-1])

    def start_slurmd(self, node, wait: bool = True) -> None:
        """The slurmd of `node` (two-node cluster), as its own host: it and the jobs it starts are on that node."""
        (self.folder / "spool" / node.name).mkdir(parents=True, exist_ok=True)
        self._spawn(self.nodes.command(node, ["sh", "-c", f'{_cgroup_mounts()} && exec "$@"', "slurmd",
                                              _which("slurmd"), "-D", "-N", node.name]),
                    until=self._node_idle if wait else None)

    def _spawn(self, cmd: list[str], until=None, timeout: float = 20.0) -> None:
        """Start a daemon in the foreground; wait until `until()` (it died, or timed out: skip with its log)."""
        name = Path(cmd[-1] if cmd[0] == "ip" else cmd[0]).name   # a node's slurmd: named after the node
        log = open(self.folder / f"{name}-{len(self._daemons)}.out", "w")
        self._daemons.append(subprocess.Popen([_which(cmd[0]), *cmd[1:]], env=self.env(), stdout=log,
                                              stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
        log.close()
        deadline = time.time() + timeout
        while until is not None and not until():
            if self._daemons[-1].poll() is not None or time.time() > deadline:
                code = self._daemons[-1].poll()
                said = "\n".join(self._logs()[-15:])
                why = "timeout" if code is None else f"exit {code}"
                raise _CannotStart(f"{cmd[0]} did not come up ({why}): {said}")
            time.sleep(0.05)

    def _node_idle(self) -> bool:
        """Every node that is not drained is idle."""
        done = subprocess.run(["sinfo", "-h", "-o", "%T"], env=self.env(), capture_output=True, text=True)
        states = {s.rstrip("*~#") for s in done.stdout.split()} - {"drained", "down", "drain"}
        return states == {"idle"}

    def _logs(self) -> list[str]:
        lines = []
        for path in sorted(self.folder.glob("*.log")) + sorted(self.folder.glob("*.out")):
            lines += [f"{path.name}: {line}" for line in path.read_text(errors="replace").splitlines()]
        return lines

    def stop(self) -> None:
        """Cancel what still runs, then end the daemons (by their PIDs), slurmd first."""
        with contextlib.suppress(Exception):
            subprocess.run(["scancel", "--full", "--user", "root"], env=self.env(), capture_output=True, timeout=30)
            deadline = time.time() + 15
            while time.time() < deadline and subprocess.run(["squeue", "-h", "-t", "R,CG"], env=self.env(),
                                                            capture_output=True, text=True).stdout.strip():
                time.sleep(0.1)
        for proc in reversed(self._daemons):
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _cgroup_mounts() -> str:
    """Shell commands that mount the machine's cgroup hierarchies again under /sys/fs/cgroup: `ip netns exec` gives
    a node a sysfs of its own, without them, and slurmd 22.05 will not start without (proctrack/linuxproc still
    tracks the jobs' processes, not the cgroups)."""
    mounts = [line.split() for line in Path("/proc/mounts").read_text().splitlines()]
    if any(m[1] == "/sys/fs/cgroup" and m[2] == "cgroup2" for m in mounts):
        return "mount -t cgroup2 none /sys/fs/cgroup"
    steps = ["mount -t tmpfs none /sys/fs/cgroup"]
    for m in mounts:   # cgroup v1: one hierarchy a controller (cpu, memory, ..., name=systemd)
        if m[2] == "cgroup" and m[1].startswith("/sys/fs/cgroup/"):
            options = ",".join(o for o in m[3].split(",") if o not in ("rw", "ro", "relatime", "nosuid", "nodev",
                                                                         "noexec"))
            steps.append(f"mkdir -p {m[1]} && mount -t cgroup -o {options} cgroup {m[1]}")
    return " && ".join(steps)


class _CannotStart(RuntimeError):
    pass


@contextlib.contextmanager
def slurm_cluster(nodes=None) -> Iterator[SlurmCluster]:
    """A started one-node cluster for the body (or one of `nodes`, a two_nodes.TwoNodeCluster that is up); skips the
    test, saying why, where Slurm cannot run here."""
    missing = [name for name in DAEMONS + CLIENTS if not _which(name)]
    if missing:
        pytest.skip(f"Slurm is not installed (missing {', '.join(missing)}); {INSTALL}")
    if os.geteuid() != 0:
        pytest.skip("the local Slurm cluster runs its daemons as root (SlurmUser=root); run the test as root")
    # a short path: munged's socket path must fit a sockaddr_un (108 bytes)
    folder = Path(tempfile.mkdtemp(prefix="slurm-"))
    cluster = SlurmCluster(folder, nodes)
    try:
        try:
            cluster._start()
        except (_CannotStart, OSError) as exc:
            pytest.skip(f"the local Slurm cluster could not start: {exc}")
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(folder, ignore_errors=True)
