"""Several nodes for real: two hosts of their own (network and UTS namespaces, tests/two_nodes.py) joined by a bridge,
one rank each, the run folder on the file system both see; the launches docs/training.md shows, as written (node
names and paths adapted), each to the weights of a one-node run of the same global batch and samples.

    torchrun --nnodes 2 (static rendezvous)      the same weights as one node's two ranks, tensor for tensor;
                                                 each host's line, progress from global rank 0 only
    deepspeed --hostfile (pdsh, ssh)             the same weights, tensor for tensor
    torchrun --nnodes 1:2 (elastic, c10d)        node 2 crashes mid-stage: node 1's rank exits 9 within
                                                 run.lost_rank_timeout_s, its agent restarts it on node 1 alone
                                                 (resumed at one process); stopped, node 2 back, launched again: on
                                                 at two; the weights of the undisturbed run within float tolerance
    Slurm, two slurmds (sbatch --nodes=2)        a requeue saves both ranks' parts, exit 8, resumed bit for bit;
                                                 node 2 crashes: exit 9 and a requeue, node 2 drained, finished
                                                 on node 1
    Slurm, srun torchrun (the docs' 2 scripts)   the same weights, tensor for tensor

The trainers (and torchrun's agents) are forked from the suite's warm interpreter in place of the fresh processes
the launchers start (warm_python.stand_in_env): each joins its node's namespaces, so it is on that node as the fresh
one would be. Needs root; skips without it.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import warm_python
from slurm_cluster import slurm_cluster
from train_fixtures import REPO_ROOT, ranks_cmd, read_jsonl, run_env, run_job, tiny_config, write_config
from two_nodes import cannot_run, two_node_cluster

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]

STEPS = 20
STAGE = {"name": "s", "image_size": 16, "context_length": 8, "samples": 8 * STEPS, "global_batch": 8, "lr": 2e-3,
         "warmup_steps": 1}
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
LOST_AFTER_S = 5


def _config(root: Path, data: Path, name: str, every_steps: int = 0, **data_keys) -> Path:
    """The run config of `name`; `every_steps` for the runs that resume (the others save at the stage's end only:
    a save changes nothing the run trains, which the preempted runs' bit-exact comparison with one_node shows)."""
    cfg = tiny_config(root / name, data, precision="fp32", stages=[STAGE], every_steps=every_steps, evals=False,
                      logging={"every_steps": 1, "progress": False, "tensorboard": False, "plot": False},
                      run={"name": name, "output_dir": str(root / name), "seed": 3,
                           "lost_rank_timeout_s": LOST_AFTER_S})
    cfg["data"].update(data_keys)
    if "host_shuffle_buffer" in data_keys:
        cfg["data"].pop("shuffle_buffer")
    return write_config(cfg, root / f"{name}.yaml")


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(run_dir / "export" / "open_clip_model.safetensors")


def _identical(got: dict, expected: dict) -> bool:
    """The same tensors under the same names, bit for bit."""
    return got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in got)


def _worst_difference(got: dict, expected: dict) -> float:
    """The largest absolute difference of any weight (the same names in both)."""
    assert got.keys() == expected.keys()
    return max(float((got[k] - expected[k]).abs().max()) for k in got)


@pytest.fixture(scope="module")
def one_node(tmp_path_factory, tiny_fmnist):
    """The undisturbed run: one node, two ranks (forked), the same global batch and samples."""
    why = cannot_run()
    if why:   # before the run: the tests that compare with it would skip
        pytest.skip(why)
    root = tmp_path_factory.mktemp("multinode")
    config = _config(root, tiny_fmnist, "one_node", shuffle_buffer=200)
    proc = run_job(ranks_cmd(2, "--config", str(config), module="crate_clip.train.cli"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root, _weights(root / "one_node")


@pytest.fixture
def cluster():
    with two_node_cluster() as made:
        env = warm_python.stand_in_env(run_env())
        yield made, env
        warm_python.count_stand_in_cpu(env)


def _launch(cluster, node, cmd, env, out: Path) -> subprocess.Popen:
    return cluster.popen(node, cmd, env=env, cwd=REPO_ROOT, stdout=out.open("w"), stderr=subprocess.STDOUT)


def test_torchrun_two_static_nodes_train_what_one_node_trains(one_node, tiny_fmnist, cluster):
    (root, expected), (made, env) = one_node, cluster
    n1, n2 = made.nodes
    config = _config(root, tiny_fmnist, "static", shuffle_buffer=200)
    outs = [root / f"static-{n.name}.out" for n in made.nodes]
    procs = [_launch(made, node, [TORCHRUN, "--nnodes", "2", "--node_rank", rank, "--nproc_per_node", "1",
                                  "--master_addr", n1.name, "--master_port", "29500",
                                  "-m", "crate_clip.cli", "train", "--config", config], env, out)
             for rank, node, out in zip("01", made.nodes, outs)]
    codes = [p.wait(timeout=300) for p in procs]
    text = [o.read_text() for o in outs]
    assert codes == [0, 0], text
    assert _identical(_weights(root / "static"), expected), "two nodes trained other weights than one node"
    # each host says what its own loaders hold, once; only global rank 0 reports the run
    for node, out in zip(made.nodes, text):
        lines = [line for line in out.splitlines() if line.startswith("[host ")]
        assert len(lines) == 1 and lines[0].startswith(f"[host {node.name}] stage 0 (s): 1 rank(s) reading 1 of 2"), out
        assert "shuffle buffer 200 samples a stream" in lines[0]
    assert "exported the final weights" in text[0] and "exported the final weights" not in text[1]
    assert not re.search(r"^(step|stage) ", text[1], re.M), text[1]


def test_deepspeed_hostfile_launch_over_ssh_trains_what_one_node_trains(one_node, tiny_fmnist, cluster):
    """`deepspeed --hostfile` as docs/training.md shows it: its pdsh runner ssh-es to each node (an sshd from Debian on
    each, a key made for the test) and starts DeepSpeed's launch.py there; the same weights as one node's two ranks.
    The variables the trainers need reach them as a user's would: a DS_ENV_FILE (DeepSpeed's .deepspeed_env)."""
    missing = [tool for tool in ("sshd", "ssh", "pdsh") if not shutil.which(tool, path="/usr/sbin:/usr/bin:/sbin")]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed (make system-data: apt-get install openssh-server pdsh)")
    (root, expected), (made, env) = one_node, cluster
    n1, n2 = made.nodes
    made.start_sshd()
    config = _config(root, tiny_fmnist, "deepspeed", shuffle_buffer=200)
    hostfile = root / "hostfile"
    hostfile.write_text(f"{n1.name} slots=1\n{n2.name} slots=1\n")
    env_file = root / "deepspeed_env"
    env_file.write_text("".join(f"{k}={env[k]}\n" for k in env if k.startswith(("WARM_", "OMP_"))))
    cmd = [str(Path(sys.executable).with_name("deepspeed")), "--hostfile", hostfile, "--num_nodes", "2",
           "--num_gpus", "1", "--master_addr", n1.name, "--module", "crate_clip.train.cli", "--config", config]
    done = made.run(n1, cmd, env=dict(env, DS_ENV_FILE=str(env_file)), cwd=REPO_ROOT, capture_output=True,
                    text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert _identical(_weights(root / "deepspeed"), expected), "the hostfile launch trained other weights"
    # launch.py says a host's processes in LOCAL_SIZE: each host's line counts its own rank
    for node in made.nodes:
        assert f"{node.name}: [host {node.name}] stage 0 (s): 1 rank(s) reading 1 of 2" in done.stdout, done.stdout


def test_elastic_torchrun_survives_a_node_crash_and_takes_the_node_back(one_node, tiny_fmnist, cluster):
    (root, expected), (made, env) = one_node, cluster
    n1, n2 = made.nodes
    # the first launch's 2 hosts, one stream each: 200 a stream, as the one-node run's explicit buffer
    config = _config(root, tiny_fmnist, "elastic", every_steps=2, host_shuffle_buffer=200)
    run_dir = root / "elastic"

    def torchrun(node, out):
        cmd = [TORCHRUN, "--nnodes", "1:2", "--nproc_per_node", "1", "--max-restarts", "3",
               "--rdzv_backend", "c10d", "--rdzv_endpoint", f"{n1.name}:29500", "--rdzv_id", "crate-mn",
               "-m", "crate_clip.train.cli", "--config", config, "--resume", "auto"]
        return _launch(made, node, cmd, env, out)

    out1, out2, out2b = (root / f"elastic-{x}.out" for x in ("n1", "n2", "n2-back"))
    agent1, agent2 = torchrun(n1, out1), torchrun(n2, out2)
    _wait_for(lambda: _saved_steps(run_dir) and max(_saved_steps(run_dir)) >= 4, _launcher_ended(agent1), out1)
    holder = json.loads((root / "elastic.lock").read_text())
    assert holder["host"] == n1.name   # the run lock names the host that holds it (rank 0's)
    lost_at = time.monotonic()
    made.kill_node(n2)
    assert agent2.wait(timeout=30) == -signal.SIGKILL
    # node 1's rank hears no more of rank 1: it ends with 9 (no 30-minute collective timeout) and its agent
    # restarts it, alone: it resumes from the last checkpoint at one process
    _wait_for(lambda: "has not been heard from" in out1.read_text(), _launcher_ended(agent1), out1)
    said = time.monotonic() - lost_at
    assert said < LOST_AFTER_S + 15, f"the lost rank was noticed after {said:.0f} s"
    lost_line = next(line for line in out1.read_text().splitlines() if "has not been heard from" in line)
    assert f"rank 1 (host {n2.name})" in lost_line and "(exit 9)" in lost_line
    resumed_alone = max(_saved_steps(run_dir))
    # steps of its own, alone
    _wait_for(lambda: max(_saved_steps(run_dir)) > resumed_alone, _launcher_ended(agent1), out1)
    # the job is stopped (a preemption: SIGTERM to torchrun, which passes it on: a save, exit 8) and launched again
    # once node 2 is back: both nodes resume at two processes
    os.kill(agent1.pid, signal.SIGTERM)
    assert agent1.wait(timeout=120) != 0
    assert "stopped by SIGTERM" in out1.read_text(), out1.read_text()[-3000:]
    made.revive(n2)
    out1b = root / "elastic-n1-back.out"
    agents = [torchrun(n1, out1b), torchrun(n2, out2b)]
    codes = [a.wait(timeout=300) for a in agents]
    assert codes == [0, 0], (out1b.read_text()[-3000:], out2b.read_text()[-3000:])
    assert "resuming from" in out1b.read_text()
    assert "resuming from" in out1.read_text()   # on node 1 alone
    # a segment at one process sums the gradients in another order: float rounding, which AdamW's normalisation
    # carries into the weights (measured: at most 4.8e-6 absolute); another sample order would move them ~1e-3
    worst = _worst_difference(_weights(run_dir), expected)
    assert worst < 5e-5, f"the weights differ from the undisturbed run's by up to {worst:.2e}"


def test_slurm_two_nodes_preempted_then_a_node_lost(one_node, tiny_fmnist, cluster):
    """configs/slurm/train.sbatch on two slurmds (one a node) under one slurmctld, `sbatch --nodes=2`: `scontrol
    requeue` saves one checkpoint of every rank's part at the step in progress, exit 8, and the second attempt
    resumes on both nodes bit for bit (its losses are the one-node run's); then node 2 crashes: node 1's rank exits 9
    and requeues the job, node 2 is drained, the job's node count set to 1, and the third attempt
    finishes on node 1 alone."""
    (root, expected), (made, env) = one_node, cluster
    n1, n2 = made.nodes
    config = _config(root, tiny_fmnist, "slurm", every_steps=2, shuffle_buffer=200)
    run_dir = root / "slurm"
    env = dict(env, PATH=f"{Path(sys.executable).parent}:{env['PATH']}")   # `crate-clip`, as an installed one
    with slurm_cluster(made) as slurm:
        job = slurm.sbatch(["--nodes=2", f"--output={root}/slurm-%j.out", "configs/slurm/train.sbatch",
                            str(config)], env=env, cwd=REPO_ROOT)
        out = root / f"slurm-{job}.out"
        attempt = slurm.wait_state(job, {"RUNNING"})
        assert attempt["NumNodes"] == "2", attempt
        _wait_for(lambda: _saved_steps(run_dir) and max(_saved_steps(run_dir)) >= 2, _job_ended(slurm, job), out)
        slurm.command("scontrol", "requeue", job)   # SIGTERM to every process of the job, on both nodes
        slurm.wait_state(job, {"PENDING"})
        preempted = out.read_text()
        assert "stopped by SIGTERM" in preempted, preempted[-3000:]
        tag = max(_saved_steps(run_dir))
        parts = sorted(p.name for p in (run_dir / "checkpoints").glob(f"stage0-step{tag:08d}/*optim_states.pt"))
        assert len(parts) == 2, parts   # one checkpoint holds both ranks' optimizer partitions
        slurm.start_now(job)
        slurm.wait_state(job, {"RUNNING"})
        _wait_for(lambda: max(_saved_steps(run_dir)) >= tag + 4, _job_ended(slurm, job), out)
        lost_at = time.monotonic()
        made.kill_node(n2)   # node 2 crashes: rank 0 (node 1) ends the job (9) and requeues it
        slurm.wait_state(job, {"PENDING"}, timeout=120)
        noticed = time.monotonic() - lost_at
        slurm.command("scontrol", "update", f"NodeName={n2.name}", "State=DRAIN", "Reason=crashed")
        slurm.command("scontrol", "update", f"JobId={job}", "NumNodes=1", "NumTasks=1")   # on what is left
        slurm.start_now(job)
        last = slurm.wait_state(job, {"COMPLETED", "FAILED"}, timeout=300)
        text = out.read_text()
        assert last["JobState"] == "COMPLETED" and last["NumNodes"] == "1" and last["NodeList"] == n1.name, \
            (last, text[-4000:])
    lost = [line for line in text.splitlines() if "has not been heard from" in line or "has not answered" in line]
    assert lost and "(exit 9)" in lost[0] and "requeueing Slurm job" in text, text[-4000:]
    # the lost rank is noticed within LOST_AFTER_S + a beat; Slurm then waits KillWait (30 s) for the crashed node's
    # task before the job is requeued: a bound, not the process group's 30 minutes (measured: 36 s)
    assert noticed < LOST_AFTER_S + 60, f"the requeue came {noticed:.0f} s after the crash"
    third = text[text.rindex("resuming from"):]
    assert "[host " not in third   # the third attempt's ranks all on node 1: one host, LOCAL_WORLD_SIZE its tasks
    # the attempt after the preemption trained what the undisturbed run trained, step for step, bit for bit
    ours = {r["global_step"]: r["loss"] for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r}
    theirs = {r["global_step"]: r["loss"] for r in read_jsonl(root / "one_node" / "metrics.jsonl") if "loss" in r}
    assert all(ours[s] == theirs[s] for s in range(tag + 1, tag + 5)), (ours, theirs)
    worst = _worst_difference(_weights(run_dir), expected)
    assert worst < 5e-5, f"the weights differ from the undisturbed run's by up to {worst:.2e}"


def test_slurm_torchrun_scripts_of_the_docs_on_two_nodes(one_node, tiny_fmnist, cluster):
    """docs/training.md's two batch scripts that run torchrun under srun (one agent a node, its c10d rendezvous at
    the job's first node): as written, but for the GPUs, 2 nodes of 1 rank and our config; each ends with the weights
    of one node's two ranks, tensor for tensor."""
    (root, expected), (made, env) = one_node, cluster
    env = dict(env, PATH=f"{Path(sys.executable).parent}:{env['PATH']}")   # `torchrun`, as an installed one
    docs = (REPO_ROOT / "docs" / "training.md").read_text()
    scripts = re.findall(r"```bash\n(#!/bin/bash\n#SBATCH --job-name=crate-b16\n.*?)```", docs, re.S)
    assert len(scripts) == 2
    with slurm_cluster(made) as slurm:
        for i, script in enumerate(scripts):
            name = f"srun_torchrun{i}"
            config = _config(root, tiny_fmnist, name, shuffle_buffer=200)
            for old, new in (("--gpus-per-node=8 ", ""), ("--cpus-per-task=64", "--cpus-per-task=1"),
                             ("--nodes=4", "--nodes=2"), ("--nproc_per_node 8", "--nproc_per_node 1"),
                             ("configs/datacomp/crate_alpha_clipa_b-16.yaml", str(config)),
                             ("runs/b16/slurm-%j.out", f"{root}/{name}-%j.out")):
                assert old in script
                script = script.replace(old, new)
            path = root / f"{name}.sbatch"
            path.write_text(script)
            job = slurm.sbatch([str(path)], env=env, cwd=REPO_ROOT)
            done = slurm.wait_state(job, {"COMPLETED", "FAILED", "CANCELLED"}, timeout=300)
            out = (root / f"{name}-{job}.out").read_text()
            assert done["JobState"] == "COMPLETED" and done["NumNodes"] == "2", (done, out[-4000:])
            assert all(f"[host {node.name}] stage 0 (s): 1 rank(s)" in out for node in made.nodes), out[-4000:]
            assert _identical(_weights(root / name), expected), f"{name}: other weights"


def test_the_two_node_script_makes_runs_on_and_removes_a_cluster(capsys):
    """`python tests/two_nodes.py up | run NODE -- CMD | down`, as docs/training.md shows it (called in-process)."""
    import two_nodes

    why = cannot_run()
    if why:
        pytest.skip(why)
    if two_nodes.STATE.is_dir() and any(two_nodes.STATE.glob("*/cluster.json")):
        pytest.skip("a cluster made by hand is up (python tests/two_nodes.py down removes it)")
    try:
        assert two_nodes.main(["up"]) == 0
        assert capsys.readouterr().out.split() == ["crate-0000-n1", "10.97.97.2", "crate-0000-n2", "10.97.97.3"]
        cluster = two_nodes._saved()
        done = cluster.run(cluster.nodes[0], ["hostname"], capture_output=True, text=True)
        assert done.stdout.strip() == "crate-0000-n1"
        assert two_nodes.main(["run", "crate-0000-n2", "--", "sh", "-c", "exit 3"]) == 3
    finally:
        assert two_nodes.main(["down"]) == 0
    assert not any(two_nodes.STATE.glob("*/cluster.json")) and not Path("/etc/netns/crate-0000-n1").exists()


def _saved_steps(run_dir: Path) -> list[int]:
    return [int(p.name.rsplit("step", 1)[1]) for p in (run_dir / "checkpoints").glob("stage0-step*")
            if (p / "crate_clip.json").is_file()]


def _wait_for(condition, ended, out: Path, timeout: float = 240) -> None:
    """Until `condition()`; fails with the output's tail once `ended()` says what stopped (or the timeout)."""
    deadline = time.monotonic() + timeout
    while not condition():
        why = ended() or ("a timeout" if time.monotonic() > deadline else None)
        if why:
            text = out.read_text() if out.exists() else ""
            raise AssertionError(f"not reached ({why}):\n{text[-4000:]}")
        time.sleep(0.2)


def _launcher_ended(proc: subprocess.Popen):
    return lambda: None if proc.poll() is None else f"launcher {proc.returncode}"


def _job_ended(slurm, job: str):
    def ended():
        state = slurm.job(job).get("JobState")
        return None if state in ("RUNNING", "PENDING", "CONFIGURING") else f"job {state}"
    return ended
