"""One attempt at reading a remote shard's bytes, with every failure sorted into transient or permanent.

A transport is opened once per attempt; remote_retry.py retries the transient failures. How each source is read:
- http(s)://: Python's own HTTP client (urllib), so the status code and the kind of network error are known;
- hf://: the https URL of the file on the Hugging Face hub (`HF_ENDPOINT`, the token `huggingface-cli login`
  stored), read as http;
- pipe:<command>: the command in a shell, its standard output read (webdataset's convention);
- gs://, ais://, sftp://: the command webdataset runs for them (`gsutil cat`, `ais get`, `curl`), read as pipe:.
A transfer that sends no byte for `stall_s` seconds is broken off (a transient failure). A transfer re-opened
mid-shard asks an HTTP server for the rest only (`Range`); a server that ignores it, and a command, start over.
"""
from __future__ import annotations

import http.client
import os
import re
import select
import shlex
import signal
import socket
import subprocess
import tempfile
import urllib.error
import urllib.parse
import urllib.request

from crate_clip.core.shard_sources import PIPE

# HTTP answers that may go away by themselves: throttling, timeouts and server-side errors.
TRANSIENT_STATUS = frozenset({408, 425, 429}) | frozenset(range(500, 600))
# What a command's standard error says when the object is missing or not ours (aws, gsutil, curl, cat, sh): a
# retry would get the same answer, so the shard is a counted skip. Any other non-zero exit is retried.
PERMANENT_MARKERS = re.compile(r"\b40[34]\b|NoSuchKey|NoSuchBucket|AccessDenied|Forbidden|not found|"
                               r"does not exist|no such file|No URLs matched|matched no objects", re.IGNORECASE)
# What a redirect to another host does not take along (_SameHostCredentials).
CREDENTIAL_HEADERS = ("Authorization", "Cookie")
# Schemes webdataset reads through a command, and that command (the URL appended, shell-quoted).
COMMAND_SCHEMES = {"gs://": "gsutil cat {}", "ais://": "ais get {} -", "sftp://": "curl -fsS -L {}"}
_EXIT_WAIT_S = 5.0   # after a command's standard output ends, how long its exit status is waited for


class TransientSourceError(OSError):
    """A failure the source may recover from (network, server error, throttling, stall): worth retrying."""


class PermanentSourceError(OSError):
    """The source answered that the shard is missing or not readable by us (404, 403, no such object)."""


def shown_source(url: str) -> str:
    """A source as it may be printed: a password in the URL is hidden."""
    return re.sub(r"//([^/@:\s]+):[^/@\s]*@", r"//\1:***@", url)


def open_transport(url: str, stall_s: float, start: int = 0):
    """An open transfer of the remote shard `url` from byte `start` where the source can (HTTP Range): an object with
    readinto(buffer), close() and `position` (the byte it starts at: `start` or 0), whose failures are
    TransientSourceError or PermanentSourceError."""
    if url.startswith(PIPE):
        return CommandOutput(url[len(PIPE):], stall_s)
    if url.startswith("hf://"):
        http_url, headers = hf_http_url(url)
        return HttpBody(http_url, stall_s, headers, start)
    if url.startswith(("http://", "https://")):
        return HttpBody(url, stall_s, start=start)
    for scheme, command in COMMAND_SCHEMES.items():
        if url.startswith(scheme):
            return CommandOutput(command.format(shlex.quote(url)), stall_s)
    raise PermanentSourceError(f"{url}: no reader for this kind of URL")


def hf_http_url(url: str) -> tuple[str, dict]:
    """The https URL of an `hf://[datasets/|spaces/]owner/name[@revision]/path` file and the headers to read it
    (the stored token, if any); no network access."""
    from huggingface_hub import get_token, hf_hub_url

    parts = url[len("hf://"):].split("/")
    repo_type = parts.pop(0)[:-1] if parts and parts[0] in ("datasets", "spaces") else None
    if len(parts) < 3:
        raise PermanentSourceError(f"{url}: expected hf://[datasets/]owner/name[@revision]/path")
    name, _, revision = parts[1].partition("@")
    http_url = hf_hub_url(f"{parts[0]}/{name}", "/".join(parts[2:]), repo_type=repo_type, revision=revision or None,
                          endpoint=os.environ.get("HF_ENDPOINT") or None)
    token = get_token()
    return http_url, ({"Authorization": f"Bearer {token}"} if token else {})


def _network_error(exn: BaseException) -> str:
    """A short description of a network failure: refused, reset, DNS, timeout..."""
    reason = getattr(exn, "reason", exn)   # urllib wraps the socket error in URLError.reason
    if isinstance(reason, socket.gaierror):
        return f"DNS lookup failed ({reason.strerror or reason})"
    if isinstance(reason, (socket.timeout, TimeoutError)):
        return "timed out"
    if isinstance(reason, ConnectionRefusedError):
        return "connection refused"
    if isinstance(reason, ConnectionResetError):
        return "connection reset"
    return f"{type(reason).__name__}: {reason}" if str(reason) else type(reason).__name__


class _SameHostCredentials(urllib.request.HTTPRedirectHandler):
    """Redirects followed as urllib does, but a credential (Authorization, Cookie) goes on only to the host it was
    given for: the hub redirects a file to a CDN, which must not see the user's token (requests does the same)."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        if new is not None and _origin(newurl) != _origin(req.full_url):
            for name in CREDENTIAL_HEADERS:
                new.remove_header(name)
        return new


def _origin(url: str) -> tuple:
    parts = urllib.parse.urlsplit(url)
    return parts.scheme.lower(), (parts.hostname or "").lower(), parts.port


_OPENER = urllib.request.build_opener(_SameHostCredentials)


class HttpBody:
    """The body of one HTTP GET from byte `start`; every socket operation waits at most `stall_s` seconds.
    `position`: the byte of the file it starts at; `total`: the file's size, where the answer says it."""

    def __init__(self, url: str, stall_s: float, headers: dict | None = None, start: int = 0):
        self.stall_s, self.position, self.total = stall_s, 0, None
        headers = dict(headers or {}, **({"Range": f"bytes={start}-"} if start else {}))
        try:
            self._response = _OPENER.open(urllib.request.Request(url, headers=headers), timeout=stall_s)
        except urllib.error.HTTPError as exn:
            exn.close()
            kind = TransientSourceError if exn.code in TRANSIENT_STATUS else PermanentSourceError
            raise kind(f"HTTP {exn.code} {exn.reason}") from None
        except (OSError, http.client.HTTPException) as exn:   # URLError is an OSError
            raise TransientSourceError(self._failure(exn)) from None
        self._place(start)

    def _place(self, start: int) -> None:
        """Where the body's bytes lie in the file (a server that ignores Range answers 200 with the whole body)."""
        answer = self._response
        self.content_type = answer.headers.get("Content-Type", "")
        if answer.status != 206:
            self.total = answer.length
            return
        ranged = re.match(r"bytes (\d+)-\d+/(\d+|\*)", answer.headers.get("Content-Range", "").strip())
        if not ranged:   # its bytes start somewhere in the file; reading them as the rest would lose samples
            self.close()
            raise PermanentSourceError(f"a Range request from byte {start:,} was answered 206 Partial Content with "
                                       f"no valid Content-Range ({answer.headers.get('Content-Range')!r}): where "
                                       "its bytes lie in the shard is unknown")
        self.position = int(ranged.group(1))
        self.total = None if ranged.group(2) == "*" else int(ranged.group(2))

    def _failure(self, exn: BaseException) -> str:
        text = _network_error(exn)
        return f"no byte for {self.stall_s:g} s" if text == "timed out" else text

    def readinto(self, buffer) -> int:
        # read1: what one receive brings (readinto would wait until the buffer is full, so that a server dripping
        # bytes would hold it for hours and the throughput floor of remote_retry.py could never look)
        try:
            data = self._response.read1(len(buffer))
        except (OSError, http.client.HTTPException) as exn:  # IncompleteRead (chunked), reset, socket timeout
            raise TransientSourceError(self._failure(exn)) from None
        n = len(data)
        buffer[:n] = data
        left = self._response.length
        if n == 0 and len(buffer) and left:   # http.client ends a short body quietly: the connection broke
            raise TransientSourceError(f"connection closed with {left:,} bytes of the body unsent")
        return n

    def close(self) -> None:
        self._response.close()


class CommandOutput:
    """The standard output of one run of a shell command (its own process group, so that closing it ends
    every process it started); its standard error is kept for the failure's message."""

    def __init__(self, command: str, stall_s: float):
        self.stall_s, self.position, self.total, self.content_type = stall_s, 0, None, ""
        self._stderr = tempfile.TemporaryFile()
        # no pipe for stderr: a chatty command could fill it and block while we wait for its stdout
        self._proc = subprocess.Popen(command, shell=True, stdout=subprocess.PIPE, stderr=self._stderr,
                                      stdin=subprocess.DEVNULL, bufsize=0, start_new_session=True)

    def readinto(self, buffer) -> int:
        ready, _, _ = select.select([self._proc.stdout], [], [], self.stall_s)
        if not ready:
            self._kill()
            raise TransientSourceError(f"no byte for {self.stall_s:g} s")
        n = self._proc.stdout.readinto(buffer)
        if n == 0 and len(buffer):
            self._check_exit()
        return n

    def _check_exit(self) -> None:
        """At the end of the output: a non-zero exit is a failure, permanent when stderr says so."""
        try:
            code = self._proc.wait(timeout=_EXIT_WAIT_S)
        except subprocess.TimeoutExpired:
            self._kill()
            raise TransientSourceError("the command closed its output but did not exit") from None
        if code == 0:
            return
        said = self._last_stderr_line()
        detail = f"exit code {code}" + (f": {said}" if said else "")
        raise (PermanentSourceError if PERMANENT_MARKERS.search(said) else TransientSourceError)(detail)

    def _last_stderr_line(self) -> str:
        self._stderr.seek(0)
        lines = [ln.strip() for ln in self._stderr.read()[-4096:].decode("utf-8", "replace").splitlines()]
        return next((ln for ln in reversed(lines) if ln), "")

    def _kill(self) -> None:
        if self._proc.poll() is None:
            try:
                os.killpg(self._proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self._proc.wait()

    def close(self) -> None:
        # A reader that stops early (the step budget reached mid-shard) must not leave the command running.
        self._kill()
        self._proc.stdout.close()
        self._stderr.close()
