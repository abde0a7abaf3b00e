"""Real servers on 127.0.0.1 for the remote-shard tests: `python -m http.server` (stopped and restarted on its
port), an http.server that fails chosen transfers (a status code, a body cut mid-way), a socket server that
accepts and never answers, and moto's own S3 server."""
from __future__ import annotations

import http.server
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path


DRIP_S = 0.5   # a dripping transfer's pace: a byte every DRIP_S seconds


def free_port() -> int:
    """A TCP port nobody listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_listening(port: int, timeout: float = 30.0) -> None:
    """Return once something accepts connections on 127.0.0.1:port."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout} s")


class HttpServerProcess:
    """`python -m http.server` serving `folder` on 127.0.0.1; `stop()` ends it, `start()` brings it back on the same
    port; `gets` counts the GET requests it logged (its log is read on a thread)."""

    def __init__(self, folder: Path, port: int | None = None):
        self.folder, self.port, self.proc, self.gets = folder, port or free_port(), None, 0
        self.url = f"http://127.0.0.1:{self.port}"

    def start(self) -> "HttpServerProcess":
        self.proc = subprocess.Popen([sys.executable, "-m", "http.server", str(self.port), "--bind", "127.0.0.1",
                                      "--directory", str(self.folder)], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True)
        threading.Thread(target=self._count_gets, args=(self.proc,), daemon=True).start()
        wait_listening(self.port)
        return self

    def _count_gets(self, proc) -> None:
        for line in proc.stderr:
            self.gets += '"GET ' in line

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)

    def outage(self, seconds: float) -> threading.Thread:
        """Stop the server now and start it again after `seconds` (on a thread, returned)."""
        self.stop()
        back = threading.Timer(seconds, self.start)
        back.start()
        return back


class FaultyHandler(http.server.SimpleHTTPRequestHandler):
    """Serves the server's folder; `server.faults[path]` lists what the next requests of that path get instead:
    an HTTP status code, "cut" (the headers promise the whole body, half of it comes, the connection closes) or
    "drip" (the headers and half the body at once, then a byte every DRIP_S seconds until the client goes away; a
    Range request drips from its first byte; with `server.drip_all` set, every request drips), "html" (200 with an
    HTML error page), "206 without Content-Range" (the rest of a Range request, not saying where it starts) or
    "redirect" (302 to `server.redirect_to` + the path). `server.seen` lists (path, headers) of every request.
    A `Range: bytes=N-` request gets the rest of the file (206), except for the paths in `server.no_range`
    (answered 200 with the whole file, as `python -m http.server` does); `server.ranges` records (path, N)."""

    def do_GET(self):
        faults = self.server.faults.get(self.path)
        fault = faults.pop(0) if faults else ("drip" if self.server.drip_all else None)
        body = None
        if not isinstance(fault, int) and (Path(self.directory) / self.path.lstrip("/")).is_file():
            body = (Path(self.directory) / self.path.lstrip("/")).read_bytes()
        start = re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range", ""))
        self.server.seen.append((self.path, dict(self.headers)))
        if isinstance(fault, int) or body is None:
            self.send_error(fault or 404)
            return
        if fault in ("html", "206 without Content-Range", "redirect"):
            self._misanswer(fault, body, start)
            return
        if start and self.path not in self.server.no_range:
            self.server.ranges.append((self.path, int(start.group(1))))
            part = body[int(start.group(1)):]
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {int(start.group(1))}-{len(body) - 1}/{len(body)}")
        else:
            part = body
            self.send_response(200)
        self.send_header("Content-Length", str(len(part)))
        self.end_headers()
        if fault == "drip":
            self._drip(part, burst=not start)
            return
        self.wfile.write(part[: len(part) // 2] if fault == "cut" else part)
        self.close_connection = fault == "cut"

    def _misanswer(self, fault: str, body: bytes, start) -> None:
        """A proxy's error page answered 200; the rest of a Range request answered 206 without saying where it starts;
        or a redirect to `server.redirect_to` + the path."""
        if fault == "redirect":
            self.send_response(302)
            self.send_header("Location", self.server.redirect_to + self.path)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        page = b"<html><body>upstream unavailable, try again later</body></html>"
        part = page if fault == "html" else body[int(start.group(1)) if start else 0:]
        self.send_response(200 if fault == "html" else 206)
        self.send_header("Content-Type", "text/html" if fault == "html" else "application/x-tar")
        self.send_header("Content-Length", str(len(part)))
        self.end_headers()
        self.wfile.write(part)

    def _drip(self, part: bytes, burst: bool) -> None:
        """Half of `part` at once (`burst`), then byte by byte; a Range request (a retry) drips from its start."""
        self.server.drips += 1
        self.close_connection = True
        head = len(part) // 2 if burst else 0
        self.wfile.write(part[:head])
        for byte in part[head:]:
            time.sleep(DRIP_S)
            if self.server.closing:
                return
            try:
                self.wfile.write(bytes([byte]))
                self.wfile.flush()
            except OSError:   # the client broke the transfer off (its stall watchdog, a stop)
                return

    def log_message(self, *args) -> None:
        pass


class FaultyHttpServer:
    """An in-process http.server (threads) on 127.0.0.1 that fails the transfers listed in `faults`."""

    def __init__(self, folder: Path, faults: dict[str, list], no_range: tuple = ()):
        handler = lambda *a, **kw: FaultyHandler(*a, directory=str(folder), **kw)  # noqa: E731
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.server.faults, self.server.no_range, self.server.ranges = faults, set(no_range), []
        self.server.drip_all, self.server.drips, self.server.closing = False, 0, False
        self.server.seen, self.server.redirect_to = [], ""   # (path, headers) of every request; a redirect's target
        self.server.block_on_close = False   # a dripping transfer would hold close() for hours
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def close(self) -> None:
        self.server.closing = True
        self.server.shutdown()
        self.server.server_close()


class SilentServer:
    """Accepts TCP connections on 127.0.0.1 and never sends a byte (a hung load balancer, a wedged server)."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url, self.held, self.accepted = f"http://127.0.0.1:{self.sock.getsockname()[1]}", [], 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.held.append(conn)
            self.accepted += 1

    def close(self) -> None:
        self.sock.close()
        for conn in self.held:
            conn.close()


class MotoS3:
    """moto's own S3 server (`python -m moto.server`) on 127.0.0.1, with dummy credentials in `env`."""

    def __init__(self):
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                    "AWS_DEFAULT_REGION": "us-east-1", "AWS_CONFIG_FILE": os.devnull,
                    "AWS_SHARED_CREDENTIALS_FILE": os.devnull}
        self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     env=dict(os.environ, **self.env))
        wait_listening(self.port)

    def upload(self, bucket: str, files: list[Path]) -> None:
        """Create `bucket` and put the files in it under their names."""
        import boto3

        s3 = boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1", aws_access_key_id="testing",
                          aws_secret_access_key="testing")
        s3.create_bucket(Bucket=bucket)
        for f in files:
            s3.upload_file(str(f), bucket, f.name)

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)
