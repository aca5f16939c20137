"""The README's figures that a command produces, generated from that command's JSON.

docs/readme-figures.json holds what the commands printed: `kvcore eval --json` on the default
model (and how long it took), `kvcore plan --json` for each KV dtype, the SSE events of the first
curl sample against `kvcore serve`, and `tools/bench_startup.py --json`. This script renders the
README's generated regions (between `<!-- figures:NAME -->` and `<!-- /figures -->`) from that
file; tests/test_readme.py fails when they differ, and checks the commands' JSON against it live
where that is cheap (the planner, the curl sample).

    .venv/bin/python tools/readme_figures.py capture [--eval] [--plan] [--sample] [--startup]
    .venv/bin/python tools/readme_figures.py write      # render the regions into README.md
    .venv/bin/python tools/readme_figures.py check      # exit 1 when README.md differs

`capture` reruns the commands (the eval takes minutes; the startup bench two server starts).
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
FIGURES = ROOT / "docs" / "readme-figures.json"
KVCORE = [sys.executable, "-c", "import sys; from kvcore.cli import main; sys.exit(main())"]
REGION = re.compile(r"(<!-- figures:(?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /figures -->)",
                    re.DOTALL)
DTYPES = ("fp32", "fp16", "bf16", "fp8", "int4")
CONTEXT = 8192  # the capacity table's sequence length
INT4_SEQS = 15  # int4's window pool is sized for the running sequences: plan it for these
# the first curl sample: what it asks (the README shows this body in the curl command)
SAMPLE_BODY = {"messages": [{"role": "user", "content": "What is the capital of France?"}],
               "max_tokens": 12, "temperature": 0, "stream": True,
               "stream_options": {"include_usage": True}}
LABELS = {"fp16": "fp16 (the default)", "fp8": "fp8 (e4m3, per-layer scale 1.0)"}


# --- capture: run the commands ---------------------------------------------------------------

def plan_json(model_dir: str, dtype: str, memory: str) -> dict[str, Any]:
    extra = ["--max-num-seqs", str(INT4_SEQS)] if dtype == "int4" and memory == "1GiB" else []
    out = subprocess.run([*KVCORE, "plan", "--model", model_dir, "--dtype", dtype, "--memory",
                          memory, "--context", str(CONTEXT), "--json", *extra],
                         check=True, capture_output=True, text=True).stdout
    result: dict[str, Any] = json.loads(out)
    del result["model"]  # where the model lives on this machine
    return result


def capture_plans(model_dir: str) -> dict[str, Any]:
    return {dtype: {memory: plan_json(model_dir, dtype, memory) for memory in ("1GiB", "16GiB")}
            for dtype in DTYPES}


def capture_eval() -> dict[str, Any]:
    out = ROOT / ".cache" / "readme-eval.json"
    out.parent.mkdir(exist_ok=True)
    start = time.perf_counter()
    subprocess.run([*KVCORE, "eval", "--json", str(out), "--no-progress"], check=True,
                   stdout=subprocess.DEVNULL)
    result: dict[str, Any] = json.loads(out.read_text())
    result["wall_s"] = round(time.perf_counter() - start, 1)
    result["model"] = "SmolLM2-135M-Instruct"
    return result


def sse_events(url: str, body: dict[str, Any]) -> list[Any]:
    """The data of each SSE event of a streamed call (the last is "[DONE]")."""
    request = urllib.request.Request(url, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as resp:
        raw = resp.read().decode()
    data = [e[len("data: "):] for e in raw.split("\n\n") if e.startswith("data: ")]
    return [d if d == "[DONE]" else json.loads(d) for d in data]


def capture_sample() -> list[Any]:
    proc = subprocess.Popen([*KVCORE, "serve", "--port", "0", "--device", "cpu"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        url = next(json.loads(line)["url"] for line in proc.stderr
                   if line.startswith("{") and json.loads(line)["event"] == "serving")
        for _ in range(6000):
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5):
                    break
            except OSError:
                time.sleep(0.1)
        return sse_events(f"{url}/v1/chat/completions", SAMPLE_BODY)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


def capture_startup() -> dict[str, Any]:
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_startup.py"), "--json"],
                         check=True, capture_output=True, text=True).stdout
    result: dict[str, Any] = json.loads(out)
    return result


# --- render ---------------------------------------------------------------------------------

def _pct(value: float) -> str:
    return "100%" if value == 1 else f"{value:.2%}"


def render_eval(figures: dict[str, Any]) -> str:
    evaluation, plans = figures["eval"], figures["plan"]
    lines = ["| KV dtype | bytes / token | sequences of 8,192 tokens per GiB | perplexity | "
             "vs fp32 | mean KL | top-1 agreement | greedy agreement |",
             "|---|---|---|---|---|---|---|---|"]
    for i, row in enumerate(evaluation["rows"]):
        dtype = row["cache_dtype"]
        label = LABELS.get(dtype, dtype)
        plan = plans[dtype]["1GiB"]
        per_token = f"{plan['bytes_per_token']:,}"
        if row["int4"]:
            label = (f"int4 (values in groups of {row['int4']['group']}, "
                     f"{row['int4']['window']}-token fp16 window)")
            per_token += " + window"
        vs_base = "-" if i == 0 else f"{row['perplexity_vs_baseline']:+.2%}"
        kl = "0" if i == 0 else f"{row['mean_kl']:.5f}"
        lines.append(
            f"| {label} | {per_token} | {plan['max_concurrent_sequences']} | "
            f"{row['perplexity']:.4f} | {vs_base} | {kl} | {_pct(row['top1_agreement'])} | "
            f"{_pct(row['greedy_agreement'])} |")
    minutes = evaluation["wall_s"] / 60
    head = (f"`kvcore eval` with no flags on the default model ({evaluation['model']}; "
            f"{evaluation['tokens']:,} tokens of {evaluation['text']}, the model and numba's "
            f"kernels already on disk) took {minutes:.0f} minutes on this repository's busy "
            "2-core test machine; docs/benchmarks.md has a longer run and the group-size / "
            "window measurements:")
    return (textwrap.fill(head, width=100, break_on_hyphens=False) + "\n\n"
            + "\n".join(lines) + "\n")


def render_capacity(figures: dict[str, Any]) -> str:
    plans = figures["plan"]
    int4 = plans["int4"]["1GiB"]
    counts = " / ".join(str(plans[d]["16GiB"]["max_concurrent_sequences"]) for d in DTYPES)
    return (f"Sequences per GiB come from the planner (`kvcore plan --model DIR --dtype D "
            f"--memory 1GiB --context {CONTEXT}`; for int4 with `--max-num-seqs {INT4_SEQS}`, "
            f"since the fp16 window pool is sized for the running sequences: {INT4_SEQS} "
            f"sequences' windows and one step's tokens take "
            f"{int4['window_bytes'] / 2**20:.0f} MiB of the GiB); at 16 GiB the counts are "
            f"{counts} ({', '.join(DTYPES)}). int4's {int4['bytes_per_token']:,} bytes per "
            "token are kvcore.cache.int4's sealed rows: keys quantized per channel over a block "
            "(2,304 bytes per block and layer with their fp16 scales and zero points), values per "
            "token in groups of 32 channels (1,920 bytes), and the block's 4-byte window-slot "
            "entry. So: fp16 when memory is not the limit; int4 for about 3x fp16's sequences at "
            "a quality loss that is smaller here than fp8's (fp8 without calibrated scales has 3 "
            "mantissa bits for every value, int4 a scale per channel or per group); run `kvcore "
            "eval` on your model and text before you commit to either.\n")


def _abridged(event: Any) -> str:
    """An SSE event as the sample shows it: the envelope elided, the choice kept."""
    if event == "[DONE]":
        return "# data: [DONE]"
    if event["choices"]:
        choice = {k: v for k, v in event["choices"][0].items() if v is not None}
        return "# data: {...,\"choices\":[" + json.dumps(choice, separators=(",", ":")) + "]}"
    usage = json.dumps(event["usage"], separators=(",", ":"))
    return "# data: {...,\"choices\":[],\"usage\":" + usage + "}"


def render_sample(figures: dict[str, Any]) -> str:
    events = figures["chat_sample"]
    messages = json.dumps(SAMPLE_BODY["messages"])
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events
                   if e != "[DONE]" and e["choices"])
    return ("```sh\n"
            'curl -N http://127.0.0.1:8000/v1/chat/completions -H "Content-Type: '
            'application/json" \\\n'
            f"  -d '{{\"messages\": {messages},\n"
            '       "max_tokens": 12, "temperature": 0, "stream": true,\n'
            "       \"stream_options\": {\"include_usage\": true}}'\n"
            + "\n".join(_abridged(e) for e in events)
            + f"\n# (the answer, joined: {text!r})\n```\n")


def render_startup(figures: dict[str, Any]) -> str:
    s = figures["startup"]
    later = ", ".join(f"{x:g}" for x in s["later_starts_s"])
    return (f"Measured with `tools/bench_startup.py` on this repository's busy 2-core test "
            f"machine ({s['cpu']}, load average {s['load_average_before']:g}): `kvcore serve` "
            f"of the default model answered /health after {s['first_start_s']:g} s on an "
            f"empty numba cache (the first start compiles) and after {later} s on the next "
            "start(s), which load the compiled kernels.\n")


def _prose(render: Any) -> Any:
    """A render whose text is a paragraph, wrapped as the README's are."""
    def wrapped(figures: dict[str, Any]) -> str:
        return textwrap.fill(render(figures).strip(), width=100, break_on_hyphens=False) + "\n"
    return wrapped


RENDER = {"kv-dtypes": render_eval, "capacity": _prose(render_capacity),
          "chat-sample": render_sample, "startup": _prose(render_startup)}


def readme_regions(text: str) -> dict[str, str]:
    return {m["name"]: m["body"] for m in REGION.finditer(text)}


def rendered(text: str, figures: dict[str, Any]) -> str:
    """README text with each generated region rendered from `figures`."""
    def fill(m: re.Match[str]) -> str:
        return m.group(1) + RENDER[m["name"]](figures) + m.group(4)
    return REGION.sub(fill, text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=("capture", "write", "check"))
    for name in ("eval", "plan", "sample", "startup"):
        parser.add_argument(f"--{name}", action="store_true", help=f"capture: the {name} only")
    args = parser.parse_args(argv)
    figures = json.loads(FIGURES.read_text()) if FIGURES.exists() else {}
    if args.action == "capture":
        from kvcore.model.hub import resolve_model

        every = not (args.eval or args.plan or args.sample or args.startup)
        if every or args.plan:
            figures["plan"] = capture_plans(str(resolve_model(None)))
        if every or args.sample:
            figures["chat_sample"] = capture_sample()
        if every or args.startup:
            figures["startup"] = capture_startup()
        if every or args.eval:
            figures["eval"] = capture_eval()
        FIGURES.write_text(json.dumps(figures, indent=1) + "\n")
        return 0
    text = README.read_text()
    new = rendered(text, figures)
    if args.action == "write":
        README.write_text(new)
        return 0
    if new != text:
        print("README.md's generated figures differ from docs/readme-figures.json: run "
              "tools/readme_figures.py write", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
