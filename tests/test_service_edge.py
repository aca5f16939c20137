"""The HTTP edge of `kvcore serve` (D5, D6): header timeouts, JSON answers to aiohttp's parser
errors, the connection cap, and a log of JSON lines that never holds request bytes or a key."""

from __future__ import annotations

import json
import socket
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from test_service_cli import SERVE

KEY = "sk-edge-secret-key"


class _Server:
    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self.lines: list[str] = []
        self.port = 0
        self._ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        assert self._ready.wait(120), self.lines

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)
            if '"event": "serving"' in line:
                self.port = json.loads(line)["port"]
            if '"event": "engine ready"' in line:
                self._ready.set()

    def connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=10)

    def raw(self, data: bytes) -> bytes:
        """Send raw bytes; the whole answer up to the server's close."""
        with self.connect() as sock:
            sock.sendall(data)
            chunks = []
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        return b"".join(chunks)


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[_Server]:
    proc = subprocess.Popen(
        [*SERVE, str(tiny_model_dir), "--port", "0", "--api-key", KEY, "--block-size", "4",
         "--num-blocks", "64", "--max-model-len", "128", "--device", "cpu",
         "--max-connections", "4", "--header-timeout", "1", "--body-timeout", "1",
         "--drain-timeout", "1"],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    try:
        yield _Server(proc)
    finally:
        proc.terminate()
        proc.wait(30)


def _status_and_body(answer: bytes) -> tuple[int, dict]:
    head, _, body = answer.partition(b"\r\n\r\n")
    assert b"content-type: application/json" in head.lower(), answer[:300]
    return int(head.split(b" ", 2)[1]), json.loads(body)


@pytest.mark.parametrize("request_bytes", [
    b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",  # request line too long
    b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"b" * 100_000 + b"\r\n\r\n",  # huge header
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: ten\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    b"GET / HTTP/1.1\nHost: x\n\n",  # bare LF
    b"BREW /coffee HTCPCP/1.0\r\n\r\n",
    f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\x00\r\n"
    f"Content-Length: 2\r\n\r\n{{}}".encode(),
], ids=["long-url", "huge-header", "bad-length", "length-and-chunked", "bad-chunk", "bare-lf",
        "bad-method", "nul-in-key"])
def test_parser_errors_answer_json_and_log_no_request_bytes(server: _Server,
                                                            request_bytes: bytes) -> None:
    status, body = _status_and_body(server.raw(request_bytes))
    assert 400 <= status < 500
    assert set(body["error"]) == {"message", "type", "param", "code"}
    time.sleep(0.1)
    log = "".join(server.lines)
    assert KEY not in log and "aaaaaaaa" not in log and "bbbbbbbb" not in log


def test_an_unsupported_http_version_is_505(server: _Server) -> None:
    """The HTTP/1 socket answers an `HTTP/2.0` request line with 505 in HTTP/1.1 (aiohttp alone
    answered `HTTP/2.0 200 OK`; its parser refuses other versions, `HTTP/1.2` or `HTTP/3.0`,
    with a 400), and closes the connection; the server goes on."""
    answer = server.raw(b"GET /health HTTP/2.0\r\nHost: x\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 505 "), answer[:100]
    status, body = _status_and_body(answer)
    assert status == 505 and body["error"]["type"] == "HTTPVersionNotSupportedError"
    assert server.raw(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
                      ).startswith(b"HTTP/1.1 200 ")


def test_slow_headers_are_closed_with_408(server: _Server) -> None:
    with server.connect() as sock:
        start = time.monotonic()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\n")
        answer = b""
        for byte in b"Host: 127.0.0.1\r\nContent-Type: application/json\r\n":
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                break
            time.sleep(0.1)
            sock.settimeout(0.01)
            try:
                answer += sock.recv(65536)
            except TimeoutError:
                continue
            if answer:
                break
    assert answer.startswith(b"HTTP/1.1 408")
    assert time.monotonic() - start < 5


def test_a_short_body_is_408(server: _Server) -> None:
    answer = server.raw(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                        b"application/json\r\nAuthorization: Bearer " + KEY.encode() +
                        b"\r\nContent-Length: 50\r\n\r\n{\"prompt\":")
    assert _status_and_body(answer)[0] == 408


def test_connections_beyond_the_cap_get_503(server: _Server) -> None:
    idle = [server.connect() for _ in range(4)]
    try:
        time.sleep(0.2)
        status, body = _status_and_body(server.raw(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"))
        assert status == 503 and "connections" in body["error"]["message"]
    finally:
        for sock in idle:
            sock.close()
    time.sleep(0.3)
    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/health", timeout=10) as resp:
        assert resp.status == 200


def test_every_log_line_is_json(server: _Server) -> None:
    server.raw(b"GET / HTTP/1.1\nHost: x\n\n")
    time.sleep(0.1)
    for line in server.lines:
        json.loads(line)


def test_silent_sockets_are_closed_after_the_header_timeout(server: _Server) -> None:
    """N3: connections that never send a byte fill --max-connections 4 only until the header
    timeout (1 s here, counted from the connection's opening), then close without an answer."""
    silent = [server.connect() for _ in range(4)]
    try:
        time.sleep(0.2)
        status, _ = _status_and_body(server.raw(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"))
        assert status == 503  # the four silent sockets hold every slot
        start = time.monotonic()
        for sock in silent:
            sock.settimeout(10)
            assert sock.recv(65536) == b""  # closed by the server, nothing written
        assert time.monotonic() - start < 3
    finally:
        for sock in silent:
            sock.close()
    time.sleep(0.1)
    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/health", timeout=10) as resp:
        assert resp.status == 200
    assert any('"idle_timeout"' in line for line in server.lines)
