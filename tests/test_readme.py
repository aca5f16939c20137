"""The README runs: every code block is run here (or a rule below says why not and what runs it
instead), against a `kvcore serve` of the default model started by the test where a block needs
a server; and its generated figures are the rendering of docs/readme-figures.json
(tools/readme_figures.py), the planner's and the first curl sample's checked live."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import KVCORE_TEST_HOME

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
sys.path.insert(0, str(ROOT / "tools"))
import readme_figures  # noqa: E402

KVCORE = [sys.executable, "-c", "import sys; from kvcore.cli import main; sys.exit(main())"]
FIGURES = json.loads(readme_figures.FIGURES.read_text())


def blocks() -> list[tuple[str, str]]:
    """(language, text) of every fenced block of the README."""
    return [(m[1], m[2]) for m in re.finditer(r"^```(\w*)\n(.*?)^```", README, re.S | re.M)]


def commands(text: str) -> list[str]:
    """The commands of a shell block: continuation lines and quoted newlines joined, comment
    lines and trailing comments dropped."""
    out, pending = [], ""
    for line in text.splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        pending += line + "\n"
        if line.rstrip().endswith("\\"):
            pending = pending.rstrip()[:-1] + " "
            continue
        try:
            words = shlex.split(pending, comments=True)
        except ValueError:  # an open quote: the command goes on
            continue
        out.append(shlex.join(words))
        pending = ""
    return out


# Commands not run here, each with what runs it instead (a rule for every command the README
# shows: test_every_block_is_covered fails on one that neither runs nor has a reason).
NOT_RUN = {
    r"make (serve|test)": "make test is this suite; make serve runs `kvcore serve`, which runs",
    r"pip install -e '\.\[cluster\]'": "changes the environment: the dev extra installs it",
    r"kvcore serve --replicas": "Ray Serve replicas: tests/test_cluster_live.py serves the default "
                                "model through 2 replicas and the prefix router, "
                                "tests/test_cluster_autoscale.py min/max replicas, "
                                "tests/test_cluster_cli.py these flags' checks",
    r"kvcore serve --kv-offload-size \S+ --kv-tier-dir /var/":
        "a disk tier under /var: tests/test_tier_service.py serves with host and disk tiers "
        "(flags, metrics, a restart), tests/test_readme.py's server has a host tier",
    r"(python3 -c 'import secrets|export RAY_|ray |kvcore serve /models/)":
        "the multi-node steps: tests/test_cluster_two_nodes.py runs them on one machine",
}


def _not_run(command: str) -> str | None:
    return next((why for pattern, why in NOT_RUN.items() if re.match(pattern, command)), None)


def _env() -> dict[str, str]:
    return {**os.environ, "KVCORE_HOME": str(KVCORE_TEST_HOME)}


class Server:
    """A `kvcore serve` process (the README's command line, on a free port)."""

    def __init__(self, command: str, model_dir: Path) -> None:
        argv = shlex.split(command.replace("/path/to/hf-model", str(model_dir)))
        argv = [a for a in argv if a != "kvcore"]
        if "--port" in argv:
            argv[argv.index("--port") + 1] = "0"
        else:
            argv += ["--port", "0"]
        self.proc = subprocess.Popen([*KVCORE, *argv, "--device", "cpu"], env=_env(),
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        assert self.proc.stderr is not None
        self.url = ""
        for line in self.proc.stderr:
            if line.startswith("{") and json.loads(line)["event"] == "serving":
                self.url = json.loads(line)["url"]
                break
        assert self.url, f"{command!r} exited with {self.proc.wait()}"
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5):
                    return
            except OSError:
                time.sleep(0.1)
        raise TimeoutError(f"{command!r} never became healthy")

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=120)


@pytest.fixture(scope="module")
def server(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """`kvcore serve` as the README's first serve command line runs it: the default model, with
    small host and disk KV tiers so that the /debug/kv sample's tier fields are live too
    (answers are the same with tiers on or off)."""
    tier_dir = tmp_path_factory.mktemp("kv-tiers")
    live = Server(f"kvcore serve --kv-offload-size 64MiB --kv-tier-dir {tier_dir} "
                  "--kv-tier-disk-size 64MiB", default_model_dir)
    yield live
    assert live.stop() == 0


def _localize(text: str, server: Server, default_model_dir: Path) -> str:
    """A block as run here: its server is the test's, its placeholder paths real ones."""
    host = server.url.removeprefix("http://")
    for address in ("127.0.0.1:8000", "localhost:8000"):
        text = text.replace(address, host)
    return text.replace("path/to/hf-model", str(default_model_dir))


def _run(argv: list[str], timeout: float = 600) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=_env(),
                          cwd=ROOT)
    assert done.returncode == 0, (argv, done.stdout[-2000:], done.stderr[-2000:])
    return done


def test_generated_figures_are_their_json_rendered() -> None:
    """The eval table, the capacity paragraph, the first curl sample and the start-up times:
    README.md holds exactly what tools/readme_figures.py renders from the stored JSON."""
    regions = readme_figures.readme_regions(README)
    assert set(regions) == set(readme_figures.RENDER)
    assert readme_figures.rendered(README, FIGURES) == README


def test_capacity_figures_are_the_planner_s(default_model_dir: Path) -> None:
    """Live: `kvcore plan --json` on the default model gives the stored figures."""
    for dtype, plans in FIGURES["plan"].items():
        for memory, stored in plans.items():
            assert readme_figures.plan_json(str(default_model_dir), dtype, memory) == stored


def test_eval_json_renders(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Live on the tiny model (the default model's eval takes minutes): the renderer reads
    `kvcore eval --json` as the command writes it today."""
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    out = tmp_path / "eval.json"
    _run([*KVCORE, "eval", str(tiny_model_dir), "--text", str(text), "--context", "64",
          "--kv-dtypes", "fp32,fp16,bf16,fp8,int4-g16-r8", "--greedy-tokens", "4",  # head_dim 16
          "--json", str(out), "--no-progress"])
    evaluation = json.loads(out.read_text()) | {"wall_s": 60.0, "model": "tiny"}
    plans = {d: {"1GiB": readme_figures.plan_json(str(tiny_model_dir), d, "1GiB")}
             for d in readme_figures.DTYPES}
    table = readme_figures.render_eval({"eval": evaluation, "plan": plans})
    assert table.count("\n| ") == 1 + len(readme_figures.DTYPES)  # header, then one per dtype


def test_every_block_is_covered() -> None:
    """Each block is run by a test below, or each of its commands names why it is not."""
    for language, text in blocks():
        if language == "sh":
            for command in commands(text):
                assert (_not_run(command) is not None or command.startswith(
                    ("kvcore ", "curl "))), f"README command with no test: {command!r}"
        else:
            assert language in ("python", ""), language


def test_shell_blocks(server: Server, default_model_dir: Path, tmp_path: Path) -> None:
    """Every command of the README's shell blocks that is not in NOT_RUN: `kvcore plan`,
    `kvcore pull` and `convert`, `kvcore generate`; `kvcore serve` lines are started (health,
    the names they serve, SIGTERM exits 0); curl commands run against the test's server (the
    first is the generated sample, compared with its stored events)."""
    from tiny_gguf import make_tiny_gguf

    gguf = tmp_path / "model.Q4_K_M.gguf"
    make_tiny_gguf(gguf)
    sample = None
    for language, text in blocks():
        if language != "sh":
            continue
        for command in commands(text):
            if _not_run(command) is not None or command == "kvcore serve":
                continue  # ("kvcore serve" itself: the test's server)
            if command.startswith("kvcore serve"):
                started = Server(command, default_model_dir)
                key = re.search(r"--api-key (\S+)", command)
                headers = {"Authorization": f"Bearer {key[1]}"} if key else {}
                try:
                    with urllib.request.urlopen(urllib.request.Request(
                            f"{started.url}/v1/models", headers=headers), timeout=30) as resp:
                        names = [m["id"] for m in json.load(resp)["data"]]
                    expected = re.search(r"--served-model-name (\S+)", command)
                    assert names == [expected[1] if expected else default_model_dir.name]
                finally:
                    assert started.stop() == 0
                continue
            command = _localize(command, server, default_model_dir)
            command = command.replace("model.Q4_K_M.gguf", str(gguf)).replace(
                "./my-model", str(tmp_path / "my-model"))
            argv = shlex.split(command)
            if argv[0] == "kvcore":
                argv = [*KVCORE, *argv[1:]]
            done = _run(argv)
            if argv[0] == "curl" and "-N" in argv:  # the streamed sample
                sample = [e if e == "[DONE]" else json.loads(e)
                          for e in re.findall(r"^data: (.*)$", done.stdout, re.M)]
    assert sample is not None
    assert _content(sample) == _content(FIGURES["chat_sample"])  # live = the stored sample


def _content(events: list[Any]) -> list[Any]:
    """The events less what differs between runs (id, created)."""
    return [e if e == "[DONE]" else {k: v for k, v in e.items() if k not in ("id", "created")}
            for e in events]


def test_python_blocks(server: Server, default_model_dir: Path, tmp_path: Path) -> None:
    """Every python block as a program: the client ones against the test's server, the
    library ones on the default model."""
    for i, (language, text) in enumerate(blocks()):
        if language != "python":
            continue
        program = tmp_path / f"block{i}.py"
        program.write_text(_localize(text, server, default_model_dir))
        _run([sys.executable, str(program)])


def test_the_debug_kv_sample_names_the_answer_s_fields(server: Server) -> None:
    """The README's /debug/kv sample (a commented JSON) lists the fields a live answer has, a
    request in flight included."""
    (sample,) = [text for language, text in blocks() if language == ""]
    documented = set(re.findall(r'"(\w+)":', sample))
    body = json.dumps({"prompt": "Count: one, two, three,", "max_tokens": 512,
                       "ignore_eos": True}).encode()
    running = threading.Thread(target=lambda: urllib.request.urlopen(urllib.request.Request(
        f"{server.url}/v1/completions", body, {"Content-Type": "application/json"}),
        timeout=600).read())
    running.start()
    answer: dict[str, Any] = {"requests": []}
    deadline = time.monotonic() + 120
    while not answer["requests"] and time.monotonic() < deadline:  # polled: it publishes
        with urllib.request.urlopen(f"{server.url}/debug/kv", timeout=60) as resp:
            answer = json.load(resp) or answer
        time.sleep(0.2)
    running.join()
    fields = set(answer) | set(answer["planner"]) | set(answer["totals"]) | set(
        answer["series"]) | set(answer["counts"])
    fields |= {k for request in answer["requests"] for k in request}
    tiers = answer["tiers"]  # the host tier's keys (the disk tier's are the same)
    fields |= set(tiers) | set(tiers["tiers"]) | set(tiers["tiers"]["host"])
    assert documented - {"replica", "replicas"} <= fields | {"tenants"}, documented - fields
