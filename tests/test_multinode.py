"""Several nodes for real: two hosts of their own (network and UTS namespaces, tests/two_nodes.py) joined by a bridge,
one rank each, the run folder on the file system both see; the launches docs/training.md shows, as written (node
names and paths adapted), each to the weights of a one-node run of the same global batch and samples.

    torchrun --nnodes 2 (static rendezvous)      the same weights as one node's two ranks, tensor for tensor;
                                                 each host's line, progress from global rank 0 only
    torchrun --nnodes 1:2 (elastic, c10d)        node 2 crashes mid-stage: node 1's rank exits 9 within
                                                 run.lost_rank_timeout_s, its agent restarts it on node 1 alone
                                                 (resumed at one process); stopped, node 2 back, launched again: on
                                                 at two; the weights of the undisturbed run within float tolerance

The trainers (and torchrun's agents) are forked from the suite's warm interpreter in place of the fresh processes
the launchers start (warm_python.stand_in_env): each joins its node's namespaces, so it is on that node as the fresh
one would be. Needs root; skips without it.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import warm_python
from train_fixtures import REPO_ROOT, ranks_cmd, run_env, run_job, tiny_config, write_config
from two_nodes import two_node_cluster

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]

STEPS = 20
STAGE = {"name": "s", "image_size": 16, "context_length": 8, "samples": 8 * STEPS, "global_batch": 8, "lr": 2e-3,
         "warmup_steps": 1}
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
LOST_AFTER_S = 5


def _config(root: Path, data: Path, name: str, **data_keys) -> Path:
    cfg = tiny_config(root / name, data, precision="fp32", stages=[STAGE], every_steps=2, evals=False,
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


@pytest.fixture(scope="module")
def one_node(tmp_path_factory, tiny_fmnist):
    """The undisturbed run: one node, two ranks (forked), the same global batch and samples."""
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
    got = _weights(root / "static")
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[k], expected[k]) for k in got), "two nodes trained other weights than one node"
    # each host says what its own loaders hold, once; only global rank 0 reports the run
    for node, out in zip(made.nodes, text):
        lines = [line for line in out.splitlines() if line.startswith("[host ")]
        assert len(lines) == 1 and lines[0].startswith(f"[host {node.name}] stage 0 (s): 1 rank(s) reading 1 of 2"), out
        assert "shuffle buffer 200 samples a stream" in lines[0]
    assert "exported the final weights" in text[0] and "exported the final weights" not in text[1]
    assert not re.search(r"^(step|stage) ", text[1], re.M), text[1]


def test_elastic_torchrun_survives_a_node_crash_and_takes_the_node_back(one_node, tiny_fmnist, cluster):
    (root, expected), (made, env) = one_node, cluster
    n1, n2 = made.nodes
    # the first launch's 2 hosts, one stream each: 200 a stream, as the one-node run's explicit buffer
    config = _config(root, tiny_fmnist, "elastic", host_shuffle_buffer=200)
    run_dir = root / "elastic"

    def torchrun(node, out):
        cmd = [TORCHRUN, "--nnodes", "1:2", "--nproc_per_node", "1", "--max-restarts", "3",
               "--rdzv_backend", "c10d", "--rdzv_endpoint", f"{n1.name}:29500", "--rdzv_id", "crate-mn",
               "-m", "crate_clip.train.cli", "--config", config, "--resume", "auto"]
        return _launch(made, node, cmd, env, out)

    out1, out2, out2b = (root / f"elastic-{x}.out" for x in ("n1", "n2", "n2-back"))
    agent1, agent2 = torchrun(n1, out1), torchrun(n2, out2)
    _wait_for(lambda: _saved_steps(run_dir) and max(_saved_steps(run_dir)) >= 4, agent1, out1)
    holder = json.loads((root / "elastic.lock").read_text())
    assert holder["host"] == n1.name   # the run lock names the host that holds it (rank 0's)
    lost_at = time.monotonic()
    made.kill_node(n2)
    assert agent2.wait(timeout=30) == -signal.SIGKILL
    # node 1's rank hears no more of rank 1: it ends with 9 (no 30-minute collective timeout) and its agent
    # restarts it, alone: it resumes from the last checkpoint at one process
    _wait_for(lambda: "has not been heard from" in out1.read_text(), agent1, out1)
    said = time.monotonic() - lost_at
    assert said < LOST_AFTER_S + 15, f"the lost rank was noticed after {said:.0f} s"
    lost_line = next(line for line in out1.read_text().splitlines() if "has not been heard from" in line)
    assert f"rank 1 (host {n2.name})" in lost_line and "(exit 9)" in lost_line
    resumed_alone = max(_saved_steps(run_dir))
    _wait_for(lambda: max(_saved_steps(run_dir)) > resumed_alone, agent1, out1)   # steps of its own, alone
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
    got = _weights(run_dir)
    # a segment at one process sums the gradients in another order: float rounding, which AdamW's normalisation
    # carries into the weights (measured: at most 4.8e-6 absolute); another sample order would move them ~1e-3
    worst = max(float((got[k] - expected[k]).abs().max()) for k in got)
    assert worst < 5e-5, f"the weights differ from the undisturbed run's by up to {worst:.2e}"


def _saved_steps(run_dir: Path) -> list[int]:
    return [int(p.name.rsplit("step", 1)[1]) for p in (run_dir / "checkpoints").glob("stage0-step*")
            if (p / "crate_clip.json").is_file()]


def _wait_for(condition, proc, out: Path, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"not reached (launcher {proc.returncode}):\n{out.read_text()[-4000:]}")
        time.sleep(0.2)
