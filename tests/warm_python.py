"""Tests only: the suite's `python -m crate_clip...` and `python tests/<script>.py` commands forked from one warm
interpreter (a "zygote" per pytest process) that has imported torch, DeepSpeed, open_clip and the training code,
instead of each paying that import again in a fresh interpreter (~9 s of CPU each on the 2-core machine; the suite
launches a few hundred).

    proc = warm_python.Popen([sys.executable, "-m", "crate_clip.train.cli", ...], env=..., cwd=..., stdout=PIPE)
    done = warm_python.run(cmd, env=..., cwd=..., capture_output=True, text=True, timeout=600)

They take the subprocess arguments the suite uses (env, cwd, the three streams, text, start_new_session; run:
capture_output, timeout) and give subprocess's objects: `pid` is the command's own process (a test may stop, kill
or look it up by that PID), `returncode` is its exit code, or -N when signal N ended it; the output goes to the
caller's pipes or files; `max_rss_kb` (run's result, a WarmProcess once ended) is its peak RSS, which counts the
zygote's pages it shares (None for a command run in a fresh interpreter). The command runs as `python CMD` would
(its arguments, environment and working folder, `__main__`, the exit at the end: threads joined, atexit functions
run) and its CPU is added to the test's (cpu_cost.py). What a fresh interpreter decides at start-up is redone after
the fork where the project reads it (core.errors.STARTED_BY_LAUNCHER, the temporary folder, faulthandler, SIGINT).

A command runs in a fresh interpreter instead (subprocess itself) when the warm one could differ from it: interpreter
options (`python -X ...`), a variable read when a library loads (OMP_*, MALLOC_*, LD_*, PYTHONPATH, ...) set
differently from the zygote's, or other Popen arguments (preexec_fn, pass_fds, ...). The zygote is started at
the first command and ends with the pytest process (the kernel ends it: PR_SET_PDEATHSIG). A command whose point is
to import the project itself (a documentation snippet, the order of the imports) names a lighter zygote,
`base="libraries"` or `base="torch"` (BASES), which still saves it the imports of the libraries.
"""
from __future__ import annotations

import atexit
import ctypes
import gc
import importlib
import json
import os
import resource
import runpy
import select
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

PIPE, STDOUT, DEVNULL, TimeoutExpired = subprocess.PIPE, subprocess.STDOUT, subprocess.DEVNULL, subprocess.TimeoutExpired
# What every training rank imports first (fork_ranks.py preloads these). None starts a thread at import (the ranks
# create their process groups and pools themselves). Not DeepSpeed's muon module: the ranks import it themselves, as
# the product does, with its compile deferred (stage_setup/deepspeed_imports.py), at no cost worth preloading.
# matplotlib.pyplot: rank 0's training curve at the end (~0.4 s; the backend is chosen when the curve is drawn).
RANK_PRELOAD = ("torch", "deepspeed", "deepspeed.ops", "open_clip", "matplotlib.pyplot",
                "crate_clip.train.loop.stage_loop")
# What the commands import first: a rank's modules and the CLIs'.
PRELOAD = RANK_PRELOAD + ("crate_clip.train.cli", "crate_clip.cli", "crate_clip.eval.cli", "crate_clip.export.cli")
# What a command finds imported, by the warm interpreter ("base") it is forked from: "project", the default, as above;
# "libraries", the libraries alone and none of the project, for a command whose point is to import the project itself
# (a documentation snippet); "torch" alone, for a command whose
# point is the order of the other imports (crate_clip's, timm's, open_clip's) or a variable they read as they load
# (huggingface_hub's HF_HUB_OFFLINE). One interpreter per base and pytest process, each started at its first command.
BASES = {"project": PRELOAD, "libraries": ("torch", "torchvision", "timm", "open_clip", "transformers"),
         "torch": ("torch",)}
# Variables a library reads as it loads (or the interpreter as it starts): a command that sets one differently from
# the zygote runs in a fresh interpreter.
LOAD_TIME_VARS = ("OMP_", "MKL_", "KMP_", "GOMP_", "MALLOC_", "LD_", "PYTHONPATH", "PYTHONHASHSEED", "PYTHONHOME",
                  "PYTHONWARNINGS", "PYTHONDONTWRITEBYTECODE", "PYTHONUNBUFFERED", "PYTORCH_", "TORCH_", "DS_", "HF_",
                  "TRANSFORMERS_", "CUDA_", "NCCL_")
PR_SET_PDEATHSIG = 1
_CHILD_CPU = [0.0]   # user + system s of the finished warm commands of this process (read by cpu_cost.py)
_zygotes: dict[str, dict] = {base: {} for base in BASES}
_zygote = _zygotes["project"]   # the one stand-ins, attach() and socket_path() mean
# the load-time variables a base's imports do not read: a command may set them otherwise and still be forked
NOT_READ_BY = {"torch": ("DS_", "HF_", "TRANSFORMERS_")}


def launched_cpu_s() -> float:
    """CPU seconds of the warm commands that ended in this process so far."""
    return _CHILD_CPU[0]


def count_launched_cpu(seconds: float) -> None:
    """Add the CPU of commands this process had started through another program (cpu_cost.py counts it)."""
    _CHILD_CPU[0] += seconds


def socket_path() -> str | None:
    """Where this process's warm interpreter listens (None before its first command), for attach()."""
    return _zygote.get("socket")


def attach(path: str) -> None:
    """Fork this process's commands from the warm interpreter listening at `path`, another process's: how a
    program the suite launches, which starts commands in turn, reaches the pytest process's interpreter
    (test_slurm_preemption.py's `crate-clip` stand-in, run by Slurm's job script)."""
    _zygote["socket"] = path


# ------------------------------------------------------------------------------------- a stand-in for a trainer
# Set in the environment of what a test launches (torchrun, srun, deepspeed's ssh/pdsh runner): a training entry point
# started anywhere below it, `python [-u] -m crate_clip.train.cli ...`, is forked from the suite's warm interpreter
# instead (tests/warm_site/sitecustomize.py). STAND_IN_PATH is the folder to put first on PYTHONPATH for that.
STAND_IN_ENV = "WARM_PYTHON_STAND_IN"
STAND_IN_PATH = str(Path(__file__).resolve().parent / "warm_site")
TRAINING_ENTRIES = (["-m", "crate_clip.train.cli"], ["-m", "crate_clip.cli", "train"])


def stand_in_env(env: dict) -> dict:
    """`env` for a launcher whose training processes should be warm: this process's zygote (started if need be), the
    stand-in's folder first on PYTHONPATH, and the file their CPU is added to (count_stand_in_cpu)."""
    if not socket_path():
        run([sys.executable, "-c", "pass"], env=env)   # the zygote, started in this environment
    cpu_file = tempfile.NamedTemporaryFile(prefix="warm-cpu-", delete=False)
    cpu_file.close()
    path = os.pathsep.join(p for p in (STAND_IN_PATH, env.get("PYTHONPATH")) if p)
    return dict(env, PYTHONPATH=path, **{STAND_IN_ENV: socket_path(), "WARM_CPU_FILE": cpu_file.name})


def count_stand_in_cpu(env: dict) -> None:
    """Add the CPU of the stand-ins' warm commands (written to env's WARM_CPU_FILE) to this test's."""
    path = Path(env.get("WARM_CPU_FILE", ""))
    if path.is_file():
        count_launched_cpu(sum(float(x) for x in path.read_text().split()))
        path.unlink()


# warm too; the trainers they start are stood in for again
LAUNCHER_ENTRIES = (["-m", "torch.distributed.run"], ["-m", "deepspeed.launcher.runner"],
                    ["-m", "deepspeed.launcher.launch"])
SCRIPTS = {"torchrun": ["-m", "torch.distributed.run"], "crate-clip": ["-m", "crate_clip.cli"],
           "deepspeed": ["-m", "deepspeed.launcher.runner"]}   # console scripts, as the modules they run


def training_entry(orig_argv: list[str]) -> list[str] | None:
    """The `python` arguments of a training entry point or of a launcher (interpreter options dropped; a console
    script as the module it runs), or None for another command."""
    args = [a for a in orig_argv[1:] if a not in ("-u", "-B")]
    if args and os.path.basename(args[0]) in SCRIPTS:
        args = [*SCRIPTS[os.path.basename(args[0])], *args[1:]]
    return args if any(args[:len(e)] == e for e in TRAINING_ENTRIES + LAUNCHER_ENTRIES) else None


def stand_in(argv: list[str]) -> None:
    """In a fresh interpreter started for `python ARGV` (a training entry point): have the zygote fork ARGV in this
    process's place (its namespaces, environment, folder, standard streams), pass every signal this process gets on
    to it, and end as it ends (its code, or its signal). Never returns."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)   # gone with its launcher
    env = dict(os.environ)
    attach(env[STAND_IN_ENV])
    if not any(argv[:len(e)] == e for e in LAUNCHER_ENTRIES):   # a trainer: its environment as the user's
        env.pop(STAND_IN_ENV)
        path = [p for p in env.pop("PYTHONPATH", "").split(os.pathsep) if p and p != STAND_IN_PATH]
        if path:
            env["PYTHONPATH"] = os.pathsep.join(path)
    proc = WarmProcess([sys.executable, *argv], env, os.getcwd(), None, None, None, False, False,
                       stand_in_for=os.getpid())
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(signum, lambda s, f: proc.send_signal(s))
    while True:
        try:
            code = proc.wait()
            break
        except InterruptedError:
            continue
    if env.get("WARM_CPU_FILE"):
        with open(env["WARM_CPU_FILE"], "a") as f:
            f.write(f"{launched_cpu_s()}\n")
    sys.stdout.flush()
    if code < 0:   # ended by a signal: so does this process, as the launcher expects to see it
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code)


# ----------------------------------------------------------------------------------------------- the caller's side
def run(cmd, *, capture_output=False, timeout=None, **kwargs) -> subprocess.CompletedProcess:
    """subprocess.run for the suite's Python commands: warm when it can be (see the module docstring)."""
    if capture_output:
        kwargs.update(stdout=PIPE, stderr=PIPE)
    with Popen(cmd, **kwargs) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
    done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    done.max_rss_kb = getattr(proc, "max_rss_kb", None)   # None: it ran in a fresh interpreter
    return done


def Popen(cmd, *, env=None, cwd=None, stdin=None, stdout=None, stderr=None, text=False, start_new_session=False,
          base="project", **others):
    """subprocess.Popen for the suite's Python commands: a WarmProcess when it can be, else a subprocess.Popen.
    `base`: the warm interpreter it is forked from (BASES)."""
    env = dict(os.environ if env is None else env)
    if others or not _forkable(list(map(str, cmd)), env, base):
        return subprocess.Popen(cmd, env=env, cwd=cwd, stdin=stdin, stdout=stdout, stderr=stderr, text=text,
                                start_new_session=start_new_session, **others)
    return WarmProcess(list(map(str, cmd)), env, cwd, stdin, stdout, stderr, text, start_new_session, base=base)


def _forkable(cmd: list[str], env: dict, base: str = "project") -> bool:
    """A `python -m MODULE`, `python -c CODE` or `python SCRIPT.py` command whose load-time variables are the
    zygote's (its environment is the first such command's)."""
    if len(cmd) < 2 or cmd[0] != sys.executable or (cmd[1].startswith("-") and cmd[1] not in ("-m", "-c")):
        return False
    if cmd[1] in ("-m", "-c") and len(cmd) < 3:
        return False
    zygote_env, unread = _zygotes[base].get("env", env), NOT_READ_BY.get(base, ())
    return all(env.get(k) == zygote_env.get(k) for k in set(env) | set(zygote_env)
               if k.startswith(LOAD_TIME_VARS) and not k.startswith(unread))


def _connect(env: dict, base: str = "project") -> socket.socket:
    """A connection to this process's zygote of `base`, started at its first command with that command's
    environment."""
    zygote = _zygotes[base]
    if "socket" not in zygote:
        folder = tempfile.mkdtemp(prefix="warm-python-")
        path = os.path.join(folder, "socket")
        proc = subprocess.Popen([sys.executable, __file__, path, base], env=env, cwd=folder, stdin=DEVNULL,
                                stdout=PIPE, text=True)
        said = []   # what the imports print (DeepSpeed's accelerator line), then "ready CPU_SECONDS"
        while not said or not (said[-1].startswith("ready ") or said[-1] == ""):
            said.append(proc.stdout.readline())
        proc.stdout.close()
        if not said[-1].startswith("ready "):
            raise RuntimeError(f"the warm Python did not start (exit code {proc.wait()}): {''.join(said)[-3000:]}")
        zygote.update(socket=path, proc=proc, folder=folder,
                      env={k: v for k, v in env.items() if k.startswith(LOAD_TIME_VARS)})
        atexit.register(_stop_zygote, zygote)
        if base != "project":   # a lighter base's imports count for the test that started it (the project's for
            count_launched_cpu(float(said[-1].split()[1]))   # none: tests/README.md, "Warm interpreters")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.connect(zygote["socket"])
    return sock


def _stop_zygote(zygote: dict) -> None:
    proc = zygote.get("proc")
    if proc and proc.poll() is None:
        proc.terminate()
        proc.wait()
    shutil.rmtree(zygote.get("folder", ""), ignore_errors=True)


class WarmProcess:
    """A command forked by the zygote, with the parts of subprocess.Popen's interface the tests use."""

    def __init__(self, args, env, cwd, stdin, stdout, stderr, text, start_new_session, stand_in_for=None,
                 base="project"):
        self.args, self.returncode, self._text = args, None, text
        self.max_rss_kb = None   # the command's peak RSS once it ended (its pages shared with the zygote included)
        self.stdin = self.stdout = self.stderr = None
        self._read: dict = {}
        self._readers: list[threading.Thread] = []
        ends, theirs = self._streams(stdin, stdout, stderr)
        request = {"argv": args[1:], "env": env, "cwd": str(cwd or os.getcwd()), "new_session": start_new_session,
                   "sigint_ignored": signal.getsignal(signal.SIGINT) == signal.SIG_IGN, "stand_in": stand_in_for}
        self._conn = _connect(env, base)
        try:
            socket.send_fds(self._conn, [json.dumps(request).encode()], theirs)
            reply = json.loads(self._conn.recv(4096) or b"{}")
        finally:
            for fd in ends:
                os.close(fd)
        if "pid" not in reply:
            raise RuntimeError(f"the warm Python did not start {args}: {reply}")
        self.pid = reply["pid"]

    def _streams(self, stdin, stdout, stderr) -> tuple[list[int], list[int]]:
        """(the descriptors to close here once sent, the command's stdin, stdout and stderr descriptors)."""
        ends: list[int] = []

        def target(spec, fd: int, writing: bool, name: str) -> int:
            if spec is None:
                return fd
            if spec == DEVNULL:
                ends.append(os.open(os.devnull, os.O_WRONLY if writing else os.O_RDONLY))
                return ends[-1]
            if spec == PIPE:
                r, w = os.pipe()
                mine, theirs = (r, w) if writing else (w, r)
                ends.append(theirs)
                mode = ("r" if writing else "w") + ("" if self._text else "b")
                setattr(self, name, open(mine, mode, **({"encoding": "utf-8", "errors": "strict"} if self._text else
                                                         {})))
                return theirs
            return spec if isinstance(spec, int) else spec.fileno()

        fds = [target(stdin, 0, False, "stdin"), target(stdout, 1, True, "stdout")]
        fds.append(fds[1] if stderr == STDOUT else target(stderr, 2, True, "stderr"))
        return ends, fds

    # waiting
    def poll(self):
        if self.returncode is None and select.select([self._conn], [], [], 0)[0]:
            self._ended()
        return self.returncode

    def wait(self, timeout=None):
        if self.returncode is None:
            if not select.select([self._conn], [], [], timeout)[0]:
                raise TimeoutExpired(self.args, timeout)
            self._ended()
        return self.returncode

    def _ended(self) -> None:
        reply = json.loads(self._conn.recv(4096) or b'{"code": null}')
        if reply.get("code") is None:
            raise RuntimeError(f"the warm Python ended while running {self.args}")
        self.returncode = reply["code"]
        self.max_rss_kb = reply.get("max_rss_kb")
        _CHILD_CPU[0] += reply.get("cpu_s", 0.0)
        self._conn.close()

    def communicate(self, timeout=None):
        """Both outputs read to their end (by threads, as subprocess does on a timeout: a later call goes on)."""
        if self.stdin and not self.stdin.closed:
            self.stdin.close()
        if not self._readers:
            for name in ("stdout", "stderr"):
                stream = getattr(self, name)
                if stream is not None:
                    self._read[name] = []
                    self._readers.append(threading.Thread(target=lambda s=stream, n=name: self._read[n].append(
                        s.read()), daemon=True))
                    self._readers[-1].start()
        deadline = None if timeout is None else time.monotonic() + timeout
        for reader in self._readers:
            reader.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if reader.is_alive():
                raise TimeoutExpired(self.args, timeout)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        outputs = []
        for name in ("stdout", "stderr"):
            stream = getattr(self, name)
            outputs.append(self._read[name][0] if stream is not None else None)
            if stream is not None:
                stream.close()
        return tuple(outputs)

    # signals
    def send_signal(self, sig) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        for stream in (self.stdin, self.stdout, self.stderr):
            if stream is not None and not stream.closed:
                stream.close()
        self.wait()


# ----------------------------------------------------------------------------------------------- the zygote's side
def preload(modules) -> None:
    """Import `modules` once, so that the processes forked from this one start with them."""
    for name in modules:
        importlib.import_module(name)


def frozen_heap() -> None:
    """The heap as it is now left out of every later cycle collection, here and in the processes forked from here
    (gc.freeze, as Python's docs advise before fork without exec): a forked command's full collection would otherwise
    walk the ~10^6 objects of the preloaded imports (~0.25 s of CPU each time) and write to every page holding them
    (copy-on-write: the command's own copy of pages it could have shared). What the command itself makes is still
    collected; the imports' own garbage is collected once, now."""
    gc.collect()
    gc.freeze()


def serve(path: str, base: str = "project") -> None:
    """Preload `base`'s modules, then fork each requested command; send its PID, then its exit code and CPU time when
    it ends."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    preload(BASES[base])
    frozen_heap()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(64)
    mine = selectors.DefaultSelector()
    mine.register(listener, selectors.EVENT_READ)
    running: dict[int, tuple[int, socket.socket]] = {}   # pidfd -> (pid, connection)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    print(f"ready {usage.ru_utime + usage.ru_stime}", flush=True)   # what the imports cost
    os.dup2(2, 1)   # the caller stopped reading this pipe
    while True:
        for key, _ in mine.select():
            if key.fileobj is listener:
                conn, _ = listener.accept()
                try:
                    started = _fork(conn, listener, mine, running)
                except OSError:
                    conn.close()
                    continue
                if started:
                    pid, pidfd = started
                    running[pidfd] = (pid, conn)
                    mine.register(pidfd, selectors.EVENT_READ)
            else:
                pid, conn = running.pop(key.fd)
                mine.unregister(key.fd)
                os.close(key.fd)
                _, status, usage = os.wait4(pid, 0)
                try:
                    conn.send(json.dumps({"code": os.waitstatus_to_exitcode(status),
                                          "cpu_s": usage.ru_utime + usage.ru_stime,
                                          "max_rss_kb": usage.ru_maxrss}).encode())
                except OSError:
                    pass   # the caller is gone
                conn.close()


def _fork(conn: socket.socket, listener, mine, running) -> tuple[int, int] | None:
    """Fork the command `conn` asks for; (its PID, a pidfd that becomes readable when it ends)."""
    data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
    request = json.loads(data)
    threads = len(os.listdir("/proc/self/task"))
    if threads != 1:   # forking with another thread running could copy a held lock: refuse, loudly
        conn.send(json.dumps({"error": f"the zygote runs {threads} threads"}).encode())
        for fd in fds:
            os.close(fd)
        conn.close()
        return None
    pid = os.fork()
    if pid == 0:
        for fd in [listener.fileno(), mine.fileno(), *running, *(c.fileno() for _, c in running.values())]:
            os.close(fd)
        _become(request, fds, conn)
    for fd in fds:
        os.close(fd)
    conn.send(json.dumps({"pid": pid}).encode())
    return pid, os.pidfd_open(pid)


def _become(request: dict, fds: list[int], conn: socket.socket) -> None:
    """In the forked child: become `python ARGV` in its environment and folder; never returns."""
    conn.close()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, 0)   # the command outlives the zygote, as a process
    if request.get("stand_in"):
        _take_the_place_of(request["stand_in"])
    if request["new_session"]:
        os.setsid()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in set(fds) - {0, 1, 2}:
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    _as_at_start(request["sigint_ignored"])
    exit_as_the_interpreter(run_as_main(request["argv"], request["cwd"]))


def _take_the_place_of(pid: int) -> None:
    """In the forked child: join the namespaces of stand-in `pid` (its node: network, hostname, mounts), and die with
    it (SIGKILL), as the process it stands for would with its launcher."""
    setns = ctypes.CDLL(None, use_errno=True).setns
    for kind in ("net", "uts", "mnt"):
        fd = os.open(f"/proc/{pid}/ns/{kind}", os.O_RDONLY)
        try:
            if setns(fd, 0) != 0:
                raise OSError(ctypes.get_errno(), f"setns {kind} of {pid}")
        finally:
            os.close(fd)

    def watch() -> None:
        while True:
            time.sleep(0.2)
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="stand-in-watch", daemon=True).start()


def run_as_main(argv: list[str], cwd: str) -> int:
    """Run `python ARGV` (-m MODULE ..., -c CODE ..., SCRIPT ...) in this process as the interpreter would start
    it: sys.argv, sys.path[0] and __main__ as it sets them. Returns the exit code it would end with (tests/
    fork_ranks.py runs its ranks with it too)."""
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            sys.path[0] = cwd
            sys.modules.pop(argv[1], None)   # preloaded: run afresh as __main__, as `python -m` finds it
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        elif argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            sys.path[0] = ""
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
        else:
            sys.argv = list(argv)
            sys.path[0] = str(Path(argv[0]).resolve().parent)
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exc:
        return _exit_code(exc.code)
    except BaseException:   # noqa: BLE001 - as the interpreter: the traceback, exit code 1
        import traceback
        traceback.print_exc()
        return 1
    return 0


def _exit_code(value) -> int:
    if value is None or isinstance(value, int):
        return value or 0
    print(value, file=sys.stderr)   # sys.exit("message"): said on stderr, exit code 1
    return 1


def exit_as_the_interpreter(code: int) -> None:
    """What the interpreter does at its end, in its order (os._exit skips it): join the non-daemon threads, run the
    atexit functions, flush the outputs."""
    try:
        threading._shutdown()
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)


def _as_at_start(sigint_ignored: bool) -> None:
    """Redo what a fresh interpreter or the project decides at start-up from the environment."""
    import faulthandler
    import crate_clip.core.errors as errors

    errors.STARTED_BY_LAUNCHER = any(k in os.environ for k in errors.LAUNCHER_ENV)
    tempfile.tempdir = None   # TMPDIR may differ
    if os.environ.get("PYTHONFAULTHANDLER"):
        faulthandler.enable()
    elif faulthandler.is_enabled():
        faulthandler.disable()
    # a fresh interpreter keeps an ignored SIGINT ignored (an xdist worker's children) and else installs its own
    signal.signal(signal.SIGINT, signal.SIG_IGN if sigint_ignored else signal.default_int_handler)


if __name__ == "__main__":
    serve(*sys.argv[1:3])
