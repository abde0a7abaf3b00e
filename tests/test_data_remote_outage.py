"""Remote shards ride out outages (issue 38 B), against real servers on 127.0.0.1: `python -m http.server` stopped
mid-read and restarted, an http.server that answers 503 / 429 and cuts a body mid-way, a server that accepts and
then sends nothing, `pipe:` commands, and S3 through moto's own server read with `pipe:aws s3 cp`."""
from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

from crate_clip.core.errors import EXIT_SOURCE_UNAVAILABLE, report_error
from crate_clip.core.shard_sources import ShardListError, expand_source
from crate_clip.data.remote_retry import RetryPolicy, ShardSourceUnavailable
from crate_clip.data.shard_reader import iter_shard_samples

import warm_python
from data_fixtures import write_numbered_shards
from processes import children
from remote_servers import FaultyHttpServer, HttpServerProcess, MotoS3, SilentServer
from train_fixtures import REPO_ROOT, read_jsonl

FAST = RetryPolicy(total_s=30, stall_s=5, backoff_base_s=0.2, backoff_max_s=1.0)


@pytest.fixture(scope="module")
def shards(tmp_path_factory, fashion_mnist_dir) -> list[Path]:
    """6 real shards of 8 numbered Fashion-MNIST samples each."""
    out = tmp_path_factory.mktemp("remote_shards")
    write_numbered_shards(out, 48, 8, fashion_mnist_dir)
    return sorted(out.glob("*.tar"))


def read_keys(urls: list[str], retry: RetryPolicy = FAST) -> tuple[list[str], Counter]:
    """The sample keys of the shards in order, and the skips counted."""
    skips: Counter = Counter()
    return [s["__key__"] for url in urls for s in iter_shard_samples(url, skips, retry=retry)], skips


def backoff_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "next attempt in" in r.getMessage()]


def test_http_server_stopped_mid_read_yields_the_undisturbed_batches(shards, caplog):
    from crate_clip.data.train_stream import StreamConfig, build_train_stream

    server = HttpServerProcess(shards[0].parent).start()
    try:
        source = f"{server.url}/{{00000000..00000005}}.tar"

        def stream(outage_after: int | None) -> tuple[list[list[str]], dict]:
            cfg = StreamConfig(sources=[source], num_workers=0, shuffle_buffer=8, seed=5,
                               remote_retry_total_s=60, remote_backoff_base_s=0.2, remote_backoff_max_s=1.0)
            s = build_train_stream(cfg, image_size=16, context_length=8, text_mask="truncate", batch_size=8)
            batches = []
            for i, _ in enumerate(itertools.islice(s, 8)):
                batches.append(list(s.batch_keys))
                if i == outage_after:   # the next shard group is opened while the server is down
                    back = server.outage(3.0)
            if outage_after is not None:
                back.join()
            return batches, s.skip_counts()

        undisturbed, _ = stream(None)
        caplog.clear()
        gets_before = server.gets
        disturbed, skips = stream(outage_after=1)
    finally:
        server.stop()
    assert disturbed == undisturbed and len(undisturbed) == 8
    assert sum(skips.values()) == 0
    lines = backoff_lines(caplog)
    assert lines and all(server.url in line and "connection refused" in line for line in lines)
    assert server.gets > gets_before   # the restarted server served the rest


def test_503_429_and_a_body_cut_mid_way_are_retried_404_403_are_counted_skips(shards, caplog):
    names = [p.name for p in shards]
    faults = {f"/{names[1]}": [503, "cut"], f"/{names[2]}": [429], f"/{names[4]}": ["cut", "cut"],
              "/forbidden.tar": [403]}
    # shard 1 is read on with a Range request; shard 4's server ignores Range: the bytes already read are dropped
    server = FaultyHttpServer(shards[0].parent, faults, no_range=(f"/{names[4]}",))
    try:
        urls = [f"{server.url}/{n}" for n in names]
        keys, skips = read_keys(urls[:3] + [f"{server.url}/missing.tar"] + urls[3:] + [f"{server.url}/forbidden.tar"])
    finally:
        server.close()
    local, _ = read_keys([str(p) for p in shards])
    assert keys == local and len(local) == 48   # no sample twice, none lost, same order
    assert skips == Counter(unreadable_shard=2)  # 404 and 403: not retried
    lines = backoff_lines(caplog)
    assert len(lines) == 5
    assert sum("HTTP 503" in ln for ln in lines) == 1 and sum("HTTP 429" in ln for ln in lines) == 1
    assert sum("bytes of the body unsent" in ln for ln in lines) == 3
    assert server.server.ranges == [(f"/{names[1]}", shards[1].stat().st_size // 2)]
    assert not any("missing.tar" in ln or "forbidden.tar" in ln for ln in lines)


def test_hf_urls_read_from_the_hub_endpoint_with_the_same_retries(shards, tmp_path, monkeypatch, caplog):
    repo = tmp_path / "datasets" / "owner" / "name" / "resolve" / "main"   # the hub's file URLs: resolve/<revision>
    repo.mkdir(parents=True)
    for p in shards[:2]:
        (repo / p.name).write_bytes(p.read_bytes())
    server = FaultyHttpServer(tmp_path, {"/datasets/owner/name/resolve/main/00000001.tar": [502]})
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    try:
        keys, skips = read_keys(expand_source("hf://datasets/owner/name/{00000000..00000001}.tar"))
    finally:
        server.close()
    assert keys == read_keys([str(p) for p in shards[:2]])[0] and not skips
    assert [ln.split(": ", 1)[1].split(";")[0] for ln in backoff_lines(caplog)] == ["HTTP 502 Bad Gateway"]


def test_a_retry_answered_with_other_bytes_is_a_counted_skip_with_a_line(shards, caplog):
    """A transfer cut mid-way is read on with a Range request; a 206 that does not say where its bytes start, or a
    proxy's HTML error page answered 200, would be read on as the rest of the shard (samples lost without a word):
    each is the shard's end, counted as truncated_tar, with one line naming the shard and why."""
    names = [p.name for p in shards]
    faults = {f"/{names[1]}": ["cut", "206 without Content-Range"], f"/{names[2]}": ["cut", "html"]}
    server = FaultyHttpServer(shards[0].parent, faults)
    try:
        keys, skips = read_keys([f"{server.url}/{n}" for n in names[:3]])
    finally:
        server.close()
    local, _ = read_keys([str(p) for p in shards[:3]])
    assert skips == Counter(truncated_tar=2) and keys == [k for k in local if k in keys] and len(keys) < len(local)
    said = [r.getMessage() for r in caplog.records if "the rest of the shard is skipped" in r.getMessage()]
    assert len(said) == 2 and names[1] in said[0] and "206 Partial Content with no valid Content-Range" in said[0]
    assert names[2] in said[1] and "not the same file" in said[1] and "(text/html)" in said[1], said


def test_the_hub_token_goes_to_the_hub_host_only(shards, tmp_path, monkeypatch):
    """An hf:// file read with the stored token (HF_TOKEN): a redirect within the hub's host keeps it, one to another
    host (a CDN) does not get it."""
    repo = tmp_path / "datasets" / "owner" / "name" / "resolve" / "main"
    repo.mkdir(parents=True)
    for p in shards[:2]:
        (repo / p.name).write_bytes(p.read_bytes())
    path = "/datasets/owner/name/resolve/main/"
    hub, cdn = FaultyHttpServer(tmp_path, {path + shards[0].name: ["redirect"], path + shards[1].name: ["redirect"]}), \
        FaultyHttpServer(tmp_path, {})
    hub.server.redirect_to = hub.url   # shard 0: to the same host (and port); shard 1 below: to another host
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    try:
        first, _ = read_keys([f"hf://datasets/owner/name/{shards[0].name}"])
        hub.server.redirect_to = cdn.url.replace("127.0.0.1", "localhost")
        second, _ = read_keys([f"hf://datasets/owner/name/{shards[1].name}"])
    finally:
        hub.close()
        cdn.close()
    assert first + second == read_keys([str(p) for p in shards[:2]])[0]
    tokens = [(path_, headers.get("Authorization")) for path_, headers in hub.server.seen + cdn.server.seen]
    assert tokens == [(path + shards[0].name, "Bearer hf_secret")] * 2 + [(path + shards[1].name, "Bearer hf_secret"),
                                                                        (path + shards[1].name, None)], tokens


class _ShardSamples(torch.utils.data.IterableDataset):
    def __init__(self, url: str, retry: RetryPolicy):
        self.url, self.retry = url, retry

    def __iter__(self):
        return (s["__key__"] for s in iter_shard_samples(self.url, Counter(), retry=self.retry))


def test_a_server_that_never_answers_ends_in_one_line_and_exit_code_7(capsys):
    server = SilentServer()
    url = f"{server.url}/00000000.tar"
    policy = RetryPolicy(total_s=1.5, stall_s=0.3, backoff_base_s=0.1, backoff_max_s=0.3)
    start = time.monotonic()
    try:
        # read by a DataLoader worker, as in training: the error crosses the process boundary as PyTorch re-raises it
        with pytest.raises(ShardSourceUnavailable) as err:
            list(torch.utils.data.DataLoader(_ShardSamples(url, policy), batch_size=None, num_workers=1))
    finally:
        server.close()
    assert time.monotonic() - start < 60   # no hang (for ever): the stall timeout broke every silent transfer off
    assert server.accepted >= 3            # retried before giving up
    line = str(err.value)
    assert "\n" not in line and url in line and "no byte for 0.3 s" in line and "--resume latest" in line
    assert err.value.checkpoint_before_exit is True and err.value.exit_code == EXIT_SOURCE_UNAVAILABLE == 7
    assert report_error("crate-clip train", err.value) == 7
    assert capsys.readouterr().err == f"crate-clip train: {line}\n"


def test_a_transfer_below_the_throughput_floor_is_a_stall_and_the_outage_budget_runs_out(shards, caplog):
    """A server that sends half a shard, then a byte every 0.5 s (never silent for a whole stall timeout): below
    data.remote_min_bytes_per_s over remote_stall_timeout_s it is broken off and retried, and since no attempt brings
    the source back, the outage's budget runs out (exit code 7) instead of the read taking hours."""
    server = FaultyHttpServer(shards[0].parent, {})
    server.server.drip_all = True
    # a stall timeout of 4 drips: on a loaded machine a drip came over a second late once (a 1 s timeout)
    policy = RetryPolicy(total_s=4.0, stall_s=2.0, backoff_base_s=0.1, backoff_max_s=0.2, min_bytes_per_s=1024)
    start = time.monotonic()
    try:
        with pytest.raises(ShardSourceUnavailable,
                           match=r"still unreachable after 4 s .* (below 1024 B/s|no byte for 2 s)") as err:
            read_keys([f"{server.url}/{shards[0].name}"], policy)
    finally:
        server.close()
    assert time.monotonic() - start < 30 and server.server.drips >= 2   # retried, then given up: no hang
    lines = backoff_lines(caplog)   # a retry drips from its first byte: on a loaded machine, silent for a while
    assert any("below 1024 B/s (data.remote_min_bytes_per_s)" in ln for ln in lines), lines
    assert all("below 1024 B/s" in ln or "no byte for 2 s" in ln for ln in lines), lines
    assert err.value.exit_code == EXIT_SOURCE_UNAVAILABLE


def test_a_size_probe_of_a_silent_server_is_unknown_not_a_hang(shards):
    from crate_clip.data.shard_census import remote_shard_size

    server, files = SilentServer(), FaultyHttpServer(shards[0].parent, {})
    try:
        start = time.monotonic()
        silent = remote_shard_size(f"{server.url}/00000000.tar", timeout=0.3)
        waited = time.monotonic() - start
        # a ceiling, not a speed check: on a loaded CI machine this answer once came after 5 s
        served = remote_shard_size(f"{files.url}/{shards[0].name}", timeout=60)
    finally:
        server.close()
        files.close()
    # a hang would never return: the bound only tells "gave up after its timeout" from "waited for ever", with room
    # for a loaded machine (not a speed check)
    assert silent is None and waited < 30, waited
    assert served == 8   # the shard's _stats.json, read through the same transport


def test_pipe_commands_retried_on_failure_and_stall_skipped_when_the_object_is_missing(shards, tmp_path, caplog):
    flag, cut = tmp_path / "failed-once", tmp_path / "cut-once"
    flaky = f"pipe:test -e {flag} && cat {shards[0]} || {{ touch {flag}; echo 'network is down' >&2; exit 1; }}"
    # the first run sends half the shard, then fails: the second run's first half is dropped, no sample comes twice
    broken = f"pipe:test -e {cut} && cat {shards[2]} || {{ touch {cut}; head -c 7000 {shards[2]}; exit 56; }}"
    keys, skips = read_keys([flaky, f"pipe:cat {tmp_path}/missing.tar", f"pipe:cat {shards[1]}", broken])
    local, _ = read_keys([str(p) for p in shards[:3]])
    assert keys == local and skips == Counter(unreadable_shard=1)
    lines = backoff_lines(caplog)
    assert len(lines) == 2 and "exit code 1: network is down" in lines[0] and "exit code 56" in lines[1]

    stalled = RetryPolicy(total_s=1.0, stall_s=0.3, backoff_base_s=0.1, backoff_max_s=0.2)
    start = time.monotonic()
    with pytest.raises(ShardSourceUnavailable, match=r"pipe:sleep 30 still unreachable .* no byte for 0.3 s"):
        read_keys(["pipe:sleep 30"], stalled)
    assert time.monotonic() - start < 25   # broken off at the stall timeout, not after the command's 30 s


def test_s3_urls_are_refused_with_the_pipe_form_to_use():
    from crate_clip.core.errors import ConfigError
    from crate_clip.train.run.run_config import config_from_dict

    source = "s3://bucket/shards/{00000000..00000009}.tar"
    with pytest.raises(ShardListError) as err:
        expand_source(source)
    assert f"'pipe:aws s3 cp {source} -'" in str(err.value)
    stage = {"name": "s", "image_size": 16, "context_length": 16, "samples": 64, "global_batch": 8, "lr": 1e-3}
    with pytest.raises(ConfigError) as err:   # what `crate-clip train` says, before any work (exit code 2)
        config_from_dict({"data": {"sources": [source]}, "stages": [stage]})
    assert f"data.sources.0: '{source}': s3:// is read through the aws CLI" in str(err.value)
    assert f"fix: 'pipe:aws s3 cp {source} -'" in str(err.value)


def test_s3_through_moto_server_read_with_pipe_aws_s3_cp(shards, monkeypatch):
    pytest.importorskip("moto.server", reason="moto[server] is not installed (pip install 'moto[server]')")
    pytest.importorskip("boto3", reason="boto3 (a dependency of moto[server]) is not installed")
    venv_bin = Path(sys.executable).parent
    if not (venv_bin / "aws").exists() and shutil.which("aws") is None:
        pytest.skip("the aws CLI is not installed (pip install awscli)")
    s3 = MotoS3()
    try:
        s3.upload("shards", shards[:2])
        for key, value in s3.env.items():
            monkeypatch.setenv(key, value)
        monkeypatch.setenv("PATH", f"{venv_bin}{os.pathsep}{os.environ['PATH']}")
        source = f"pipe:aws s3 cp --endpoint-url {s3.endpoint} s3://shards/{{00000000..00000002}}.tar -"
        keys, skips = read_keys(expand_source(source))   # the third object does not exist
    finally:
        s3.close()
    local, _ = read_keys([str(p) for p in shards[:2]])
    assert keys == local and len(keys) == 16
    assert skips == Counter(unreadable_shard=1)   # aws says 404: a counted skip, not retried



def _losses(run_dir: Path) -> list[float]:
    from train_fixtures import read_jsonl

    return [r["loss"] for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r]


class TinyRuns:
    """Tiny one-stage training runs (8 steps of 16) that read 12 shards of 8 samples from `python -m http.server`:
    a shard group is one batch, so the run opens shards from its first step to its last."""

    STAGE = {"name": "s", "image_size": 16, "context_length": 16, "samples": 128, "global_batch": 16, "lr": 2e-3,
             "warmup_steps": 1}

    def __init__(self, root: Path, fashion_mnist_dir: Path):
        self.root = root
        write_numbered_shards(root / "shards", 96, 8, fashion_mnist_dir)
        self.server = HttpServerProcess(root / "shards").start()

    def command(self, name: str, *extra: str, url: str | None = None, **data) -> list[str]:
        """The command of run `name` (1 rank, 1 loader worker) reading the shards from `url` (default: the server)."""
        from train_fixtures import ranks_cmd, tiny_config, write_config

        cfg = tiny_config(self.root / name, self.root, precision="fp32", stages=[self.STAGE], evals=False,
                          logging={"every_steps": 1, "progress": False, "tensorboard": False, "plot": False})
        cfg["data"] = {"sources": [f"{url or self.server.url}/{{00000000..00000011}}.tar"], "num_workers": 1,
                       "shuffle_buffer": 16, "remote_backoff_base_s": 0.5, "remote_backoff_max_s": 2, **data}
        return ranks_cmd(1, "--config", str(write_config(cfg, self.root / f"{name}.yaml")), *extra,
                         module="crate_clip.train.cli")

    def start(self, name: str, *extra: str, url: str | None = None, **data) -> subprocess.Popen:
        """Run `name` in the background, its stderr in <root>/<name>.err."""
        from train_fixtures import run_env

        with open(self.root / f"{name}.err", "w") as err:
            return warm_python.Popen(self.command(name, *extra, url=url, **data), env=run_env(), cwd=REPO_ROOT,
                                     stdout=subprocess.DEVNULL, stderr=err, text=True)

    def train(self, name: str, outage_s: float | None = None, *extra: str, url: str | None = None, **data):
        """Run `name` to its end; with `outage_s`, the server stops once the run has opened its first two shards and
        comes back after outage_s seconds (never, for inf)."""
        from train_fixtures import run_job

        gets, state = self.server.gets, {"done": False, "back": None}

        def stop_after_first_group():
            while self.server.gets < gets + 2 and not state["done"]:
                time.sleep(0.01)
            if not state["done"]:
                state["back"] = self.server.stop() if outage_s == float("inf") else self.server.outage(outage_s)

        if outage_s is not None:
            threading.Thread(target=stop_after_first_group, daemon=True).start()
        proc = run_job(self.command(name, *extra, url=url, **data), timeout=300)
        state["done"] = True
        if state["back"] is not None:
            state["back"].join()
        return proc


@pytest.fixture(scope="module")
def tiny_runs(tmp_path_factory, fashion_mnist_dir):
    """The shards, their server and the undisturbed run's losses (the reference of both outage tests)."""
    runs = TinyRuns(tmp_path_factory.mktemp("outage_runs"), fashion_mnist_dir)
    proc = runs.train("undisturbed")
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs.reference = _losses(runs.root / "undisturbed")
    assert len(runs.reference) == 8
    yield runs
    runs.server.stop()


@pytest.mark.slow
def test_a_run_that_rides_out_a_server_outage_ends_with_the_undisturbed_loss(tiny_runs):
    """The server stopped for 5 s mid-run: every step's loss is the undisturbed run's (BENCHMARKS.md, issue 38)."""
    proc = tiny_runs.train("outage", 5.0)
    assert proc.returncode == 0, proc.stderr[-3000:]
    retries = [ln for ln in proc.stderr.splitlines() if "next attempt in" in ln]
    assert retries and all("connection refused" in ln for ln in retries), proc.stderr[-3000:]
    assert _losses(tiny_runs.root / "outage") == tiny_runs.reference
    print(f"final loss: undisturbed {tiny_runs.reference[-1]!r}, 5 s outage {_losses(tiny_runs.root / 'outage')[-1]!r}")


@pytest.mark.slow
def test_a_source_that_stays_away_saves_exits_7_and_resume_latest_ends_with_the_undisturbed_loss(tiny_runs):
    """The server stopped for longer than data.remote_retry_total_s: a checkpoint of the last completed step, one
    line naming the source, the error and --resume latest, exit code 7; the resume, with the server back, trains on
    to the undisturbed run's losses."""
    pytest.importorskip("crate_clip.train.loop.stop_requests",
                        reason="the trainer's stop-save-exit (task 38D) is not in")
    proc = tiny_runs.train("gave_up", float("inf"), remote_retry_total_s=2)
    assert proc.returncode == EXIT_SOURCE_UNAVAILABLE, proc.stderr[-3000:]
    said = [ln for ln in proc.stderr.splitlines() if "still unreachable after 2 s" in ln]
    assert said and tiny_runs.server.url in said[-1] and "connection refused" in said[-1], proc.stderr[-3000:]
    assert "--resume latest" in said[-1] and "Traceback" not in proc.stderr
    run_dir = tiny_runs.root / "gave_up"
    stopped_at = len(_losses(run_dir))
    assert 0 < stopped_at < 8 and (run_dir / "checkpoints" / "latest").is_file()
    tiny_runs.server.start()
    resumed = tiny_runs.train("gave_up", None, "--resume", "latest", remote_retry_total_s=2)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _losses(run_dir) == tiny_runs.reference


@pytest.mark.slow
def test_a_source_away_from_the_start_exits_7_saying_resume_auto_which_then_trains_the_undisturbed_run(tiny_runs):
    """No step trained, so nothing saved: the line says --resume auto (--resume latest would find no checkpoint and
    exit 4), and that resume, with the server back, trains the undisturbed run."""
    tiny_runs.server.stop()
    try:
        proc = tiny_runs.train("away", None, remote_retry_total_s=1)
    finally:
        tiny_runs.server.start()
    said = [ln for ln in proc.stderr.splitlines() if ln.startswith("crate-clip train:")]
    assert proc.returncode == EXIT_SOURCE_UNAVAILABLE and len(said) == 1, proc.stderr[-3000:]
    assert "no step trained yet, so nothing is saved" in said[0] and "start it again with --resume auto" in said[0]
    assert "--resume latest" not in said[0] and not (tiny_runs.root / "away" / "checkpoints" / "latest").exists()
    resumed = tiny_runs.train("away", None, "--resume", "auto", remote_retry_total_s=1)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _losses(tiny_runs.root / "away") == tiny_runs.reference


def _wait_for(condition, what: str, proc: subprocess.Popen, err: Path, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None and time.monotonic() < deadline, f"{what}: {err.read_text()[-3000:]}"
        time.sleep(0.05)


def _ended_within(proc: subprocess.Popen, err: Path, seconds: float) -> str:
    """The run's stderr once it has ended, at most `seconds` after the stop signal (a bound, not a speed check: a
    retried outage or a drip would hold it for the 20 minutes of data.remote_retry_total_s)."""
    signalled = time.monotonic()
    try:
        proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"not ended {seconds:g} s after the stop signal: {err.read_text()[-3000:]}") from None
    print(f"{err.stem}: ended {time.monotonic() - signalled:.1f} s after the stop signal")   # BENCHMARKS.md
    return err.read_text()


def _stopped_and_saved(run_dir: Path, proc: subprocess.Popen, out: str) -> int:
    """Exit 8 with rank 0's one line, a checkpoint of the last step logged, the lock released: the last step."""
    lines = [ln for ln in out.splitlines() if ln.startswith("crate-clip train:")]
    assert proc.returncode == 8, out[-3000:]
    assert len(lines) == 1 and lines[0].startswith("crate-clip train: stopped by SIGTERM"), out[-3000:]
    assert "--resume latest" in lines[0] and "Traceback" not in out and "killed by signal" not in out, out[-3000:]
    steps = [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"stage0-step{steps[-1]:08d}", out[-3000:]
    assert not run_dir.with_suffix(".lock").exists()
    return steps[-1]


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_stop_signal_during_a_retried_outage_or_a_drip_saves_and_exits_8_within_seconds(tiny_runs):
    """The default retry budget (20 minutes) and a loader worker, as users run: a SIGTERM to the loader worker alone
    while the server is gone, and to the rank alone and then to every process (twice) while the server drips a byte
    every 0.5 s, each end the run with the last step saved and exit 8 within seconds; resumed with the source back,
    the run ends with the undisturbed run's losses (docs/data.md#remote-shards-outages)."""
    root = tiny_runs.root
    # 1. the server gone for good while the run reads: the loader worker retries it; SIGTERM to that worker alone
    proc = tiny_runs.start("gone")
    _wait_for(lambda: (root / "gone" / "metrics.jsonl").is_file(), "the first step", proc, root / "gone.err")
    tiny_runs.server.stop()
    _wait_for(lambda: "next attempt in" in (root / "gone.err").read_text(), "a retry", proc, root / "gone.err")
    rank = children(proc.pid)[0]
    os.kill(children(rank)[0], signal.SIGTERM)
    _stopped_and_saved(root / "gone", proc, _ended_within(proc, root / "gone.err", 30))
    tiny_runs.server.start()

    # 2. a server that drips: SIGTERM to the rank alone, then to the rank and its loader worker
    dripping = FaultyHttpServer(root / "shards", {})
    try:
        proc = tiny_runs.start("drip", url=dripping.url)
        _wait_for(lambda: (root / "drip" / "metrics.jsonl").is_file(), "the first step", proc, root / "drip.err")
        dripping.server.drip_all = True
        _wait_for(lambda: dripping.server.drips > 0, "a dripping transfer", proc, root / "drip.err")
        time.sleep(1.0)
        rank = children(proc.pid)[0]
        processes = [rank, *children(rank)]
        os.kill(rank, signal.SIGTERM)
        time.sleep(0.3)
        for pid in processes:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        _stopped_and_saved(root / "drip", proc, _ended_within(proc, root / "drip.err", 30))
        dripping.server.drip_all = False
        resumed = tiny_runs.train("drip", None, "--resume", "latest", url=dripping.url)
    finally:
        dripping.close()
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _losses(root / "drip") == tiny_runs.reference
