"""A kvstate-serve process for tests: started on a free loopback port, stopped at the end,
and raw HTTP helpers (http.client: the bytes exactly as the server sends them)."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """`python -m kvstate.serve` with `args`, as a child process; `url` is its /v1 base."""

    def __init__(self, *args: str, startup_s: float = 60.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        command = [sys.executable, "-m", "kvstate.serve", "--port", str(self.port), *args]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        # A file, not a pipe: a pipe nobody reads fills up and stalls the server's logging.
        self.log = tempfile.TemporaryFile("w+")  # noqa: SIM115 (closed in stop)
        self.process = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT, text=True
        )
        deadline = time.monotonic() + startup_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"kvstate-serve exited: {self.output()}")
            with contextlib.suppress(OSError):
                if get(self.port, "/health")[0] == 200:
                    return
            time.sleep(0.2)
        self.stop()
        raise RuntimeError("kvstate-serve did not answer /health in time")

    def output(self) -> str:
        """What the server printed so far (its log)."""
        self.log.seek(0)
        return self.log.read()

    def stop(self) -> str:
        """Stop the server; its log."""
        self.process.terminate()
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        text = self.output()
        self.log.close()
        return text


def connection(port: int, timeout: float = 60.0) -> http.client.HTTPConnection:
    return http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)


def get(port: int, path: str) -> tuple[int, Any]:
    conn = connection(port, 10)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        body = response.read()
        kind = response.getheader("content-type", "")
        return response.status, json.loads(body) if "json" in kind else body.decode()
    finally:
        conn.close()


def post(port: int, path: str, body: bytes | dict[str, Any]) -> tuple[int, Any]:
    """(status, JSON body) of a POST; `body` a dict (sent as JSON) or raw bytes."""
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn = connection(port)
    try:
        conn.request("POST", path, raw, {"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def sse_events(response: http.client.HTTPResponse) -> Iterator[bytes]:
    """The raw events of a server-sent-event stream, each `data: ...` without its blank
    line, as they arrive."""
    buffer = b""
    while True:
        line = response.readline()
        if not line:
            return
        buffer += line
        if buffer.endswith(b"\n\n"):
            yield buffer[:-2]
            buffer = b""


def stream(port: int, path: str, body: dict[str, Any]) -> tuple[http.client.HTTPResponse, Any]:
    """A streaming POST's response (headers read) and its connection (close it)."""
    conn = connection(port)
    conn.request("POST", path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    return conn.getresponse(), conn


def wait_until(condition: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting until {what}")
        time.sleep(0.05)
