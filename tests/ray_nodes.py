"""A Ray cluster of several nodes on this machine, started as README.md's cluster section says:
`ray start --head` and `ray start --address=HEAD`, token authentication on, the token in a file
every node (and the ingress) reads through RAY_AUTH_TOKEN_PATH.

Each node is one `ray start --block` process in a session of its own (start_new_session): its
raylet, agents and workers all stay in that session, so a node is killed (a lost machine) or
stopped by the ids of exactly its processes. `ray stop` is not used: it stops every Ray process
on the machine, other programs' included. Every port is a free one picked here and the temp dir
is private, so the cluster shares the machine with any other Ray instance.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RAY = str(Path(sys.executable).with_name("ray"))
HOST = "127.0.0.1"  # Ray registers a node by the machine's reachable address instead


def free_port(taken: set[int]) -> int:
    """A port free now and not in `taken` (added to it): each Ray component needs its own."""
    while True:
        with socket.socket() as s:
            s.bind((HOST, 0))
            port = int(s.getsockname()[1])
        if port not in taken:
            taken.add(port)
            return port


def session_pids(sid: int) -> list[int]:
    """The processes of one session (a node's), read from /proc."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # it exited meanwhile
            continue
        if int(fields[3]) == sid and fields[0] != "Z":  # field 6 of stat: the session id
            pids.append(int(entry.name))
    return pids


def _kill(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


@dataclass
class Node:
    name: str
    process: subprocess.Popen[bytes]
    log: Path

    @property
    def sid(self) -> int:
        return self.process.pid  # start_new_session: the session leader

    def pids(self) -> list[int]:
        return session_pids(self.sid)

    def kill(self) -> None:
        """The machine is gone: SIGKILL to every process of the node at once."""
        _kill(self.pids(), signal.SIGKILL)
        self.process.wait(30)

    def stop(self, timeout: float = 40.0) -> None:
        """`ray start --block` drains and stops its processes on SIGTERM; SIGKILL what is left."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout)
        deadline = time.monotonic() + 10
        while (left := self.pids()) and time.monotonic() < deadline:
            _kill(left, signal.SIGKILL)
            time.sleep(0.2)
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)


class RayNodes:
    """A head node and worker nodes on this machine, token authentication on."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.token_path = root / "ray-token"
        # any secret string works; `ray get-auth-token --generate` makes one for ~/.ray
        self.token_path.write_text(secrets.token_hex(32))
        self.token_path.chmod(0o600)
        # short: Ray's socket paths under it must fit AF_UNIX's 107 bytes
        self.temp_dir = Path(tempfile.mkdtemp(prefix="kvcore-ray-"))
        self._ports: set[int] = set()
        self.port = free_port(self._ports)
        self.nodes: list[Node] = []

    @property
    def address(self) -> str:
        return f"{HOST}:{self.port}"

    def env(self, **extra: str) -> dict[str, str]:
        """The environment of every node and of the ingress: token mode and the token's file
        (a private HOME, so neither ~/.ray/auth_token nor the user's Ray state is read)."""
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("RAY_") or k == "RAY_USAGE_STATS_ENABLED"}
        env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(self.token_path),
                   RAY_USAGE_STATS_ENABLED="0", HOME=str(self.root), **extra)
        return env

    def start(self, name: str, resources: dict[str, float], cwd: Path,
              num_cpus: int = 1) -> Node:
        """`ray start --head` for the first node, `ray start --address=HEAD` after it."""
        port = lambda: free_port(self._ports)  # noqa: E731
        # the head's dashboard (on 127.0.0.1) serves Ray's state API: `ray list ...`
        args = ([RAY, "start", "--head", f"--port={self.port}", "--include-dashboard=true",
                 f"--dashboard-port={port()}", f"--ray-client-server-port={port()}"]
                if not self.nodes else [RAY, "start", f"--address={self.address}"])
        args += [f"--node-ip-address={HOST}", f"--num-cpus={num_cpus}",
                 f"--resources={json.dumps(resources)}", "--block",
                 f"--temp-dir={self.temp_dir}", f"--object-store-memory={100 << 20}",
                 "--disable-usage-stats", "--min-worker-port=0", "--max-worker-port=0"]
        for flag in ("node-manager", "object-manager", "dashboard-agent-listen",
                     "dashboard-agent-grpc", "runtime-env-agent", "metrics-export"):
            args.append(f"--{flag}-port={port()}")
        log = self.root / f"{name}.log"
        with log.open("wb") as out:
            process = subprocess.Popen(args, cwd=cwd, env=self.env(), stdout=out,
                                       stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                       start_new_session=True)
        node = Node(name, process, log)
        self.nodes.append(node)
        self.wait_for_nodes(len(self.nodes), node)
        return node

    def ray(self, *args: str, timeout: float = 60.0) -> str:
        """A `ray` CLI command against this cluster (ray status, ray list ...); its stdout."""
        done = subprocess.run([RAY, *args], env=self.env(), capture_output=True, text=True,
                              timeout=timeout, cwd=self.root)
        if done.returncode != 0:
            raise RuntimeError(f"ray {' '.join(args)} failed: {done.stderr[-2000:]}")
        return done.stdout

    def list_state(self, kind: str, *filters: str) -> list[dict[str, Any]]:
        """Ray's state API (`ray list nodes|actors --detail --format json`)."""
        args = ["list", kind, f"--address={self.address}", "--detail", "--format=json",
                "--limit=1000"]
        for f in filters:
            args += ["--filter", f]
        out = self.ray(*args)
        return [] if out.startswith("No resource in the cluster") else list(json.loads(out))

    def wait_for_nodes(self, count: int, node: Node, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if node.process.poll() is not None:
                raise RuntimeError(f"ray start ({node.name}) exited: "
                                   f"{node.log.read_text()[-3000:]}")
            if "Ray runtime started" in node.log.read_text(errors="replace"):
                alive = self.list_state("nodes", "state=ALIVE")
                if len(alive) >= count:
                    return
            time.sleep(1)
        raise RuntimeError(f"{count} Ray nodes did not come up: {node.log.read_text()[-3000:]}")

    def stop(self) -> list[int]:
        """Stop every node (workers first); the pids left in their sessions (none, normally)."""
        for node in reversed(self.nodes):
            node.stop()
        left = [pid for node in self.nodes for pid in node.pids()]
        if not left:
            shutil.copytree(self.temp_dir, self.root / "ray", symlinks=True,
                            ignore_dangling_symlinks=True, dirs_exist_ok=True,
                            ignore=shutil.ignore_patterns("sockets"))
            shutil.rmtree(self.temp_dir, ignore_errors=True)
        return left
