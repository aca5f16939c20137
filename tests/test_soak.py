"""tools/soak.py: its stream and log checks catch what they must, and a short soak of a live
`kvcore serve` (the tiny model) passes every check."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent / "tools"))
import soak  # noqa: E402


def _sse(*events: dict | str) -> bytes:
    return b"".join(b"data: " + (e.encode() if isinstance(e, str) else json.dumps(e).encode())
                    + b"\n\n" for e in events)


def _chunk(index: int, text: str, finish: str | None = None) -> dict:
    return {"choices": [{"index": index, "text": text, "finish_reason": finish}]}


ERROR = {"error": {"message": "generation failed", "type": "InternalServerError", "param": None,
                   "code": 500}}


def test_check_sse_accepts_well_formed_streams() -> None:
    ok = soak.check_sse(_sse(_chunk(0, "a"), _chunk(1, "b", "length"), _chunk(0, "c", "stop"),
                             {"choices": [], "usage": {}}, "[DONE]"), 2, chat=False)
    assert ok.problem is None and ok.texts == {0: "ac", 1: "b"}
    assert ok.finish == {0: "stop", 1: "length"}
    failed = soak.check_sse(_sse(_chunk(0, "a"), ERROR, "[DONE]"), 1, chat=False)
    assert failed.problem is None and failed.error == ERROR["error"]  # well-formed, yet an error
    chat = {"choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": "abort"}]}
    assert soak.check_sse(_sse(chat, "[DONE]"), 1, chat=True).finish == {0: "abort"}


def test_check_sse_flags_malformed_streams() -> None:
    bad = {
        "no [DONE]": _sse(_chunk(0, "a", "stop")),
        "truncated": _sse(_chunk(0, "a", "stop"), "[DONE]")[:-1],
        "two errors": _sse(ERROR, ERROR, "[DONE]"),
        "error not last": _sse(ERROR, _chunk(0, "a", "stop"), "[DONE]"),
        "error not in shape": _sse({"error": "boom"}, "[DONE]"),
        "choice never finished": _sse(_chunk(0, "a", "stop"), _chunk(1, "b"), "[DONE]"),
        "finished twice": _sse(_chunk(0, "a", "stop"), _chunk(0, "", "stop"), "[DONE]"),
        "[DONE] twice": _sse(_chunk(0, "a", "stop"), "[DONE]", "[DONE]"),
        "not JSON": _sse(_chunk(0, "a", "stop"), "{oops", "[DONE]"),
        "a second HTTP response": _sse(_chunk(0, "a")) + b"HTTP/1.1 500 Internal Server Error"
                                 + b"\r\n\r\n" + _sse("[DONE]"),
    }
    for name, raw in bad.items():
        assert soak.check_sse(raw, 2 if name == "choice never finished" else 1,
                              chat=False).problem, name


def test_error_problem_checks_shape_and_param() -> None:
    body = json.dumps({"error": {"message": "m", "type": "BadRequestError", "param": "top_p",
                                 "code": 400}}).encode()
    assert soak.error_problem(body, "top_p") is None and soak.error_problem(body) is None
    assert soak.error_problem(body, "temperature")
    assert soak.error_problem(b"400: Bad Request")
    assert soak.error_problem(b'{"detail": "bad"}')


def test_check_log_counts_non_json_tracebacks_and_the_key() -> None:
    lines = [json.dumps({"event": "request", "outcome": "ok"}),
             json.dumps({"event": "request", "outcome": "error 500 IndexError"}),
             json.dumps({"event": "stream failed", "exception": "Traceback ...\nIndexError"}),
             "Traceback (most recent call last):",
             json.dumps({"event": "bad http request", "header": "Bearer sk-secret"})]
    log = soak.check_log(lines, "sk-secret")
    assert log["non_json_lines"] == 1 and log["tracebacks"] == 2 and log["api_key_lines"] == 1
    assert log["request_outcomes"] == {"ok": 1, "error 500 IndexError": 1}
    assert log["error_5xx_outcomes"] == 1


def test_soak_tiny_server_passes(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    summary = soak.main([
        "--model", str(tiny_model_dir), "--server-args",
        "--device cpu --block-size 4 --num-blocks 1024 --max-model-len 1024",
        "--requests", "110", "--concurrency", "6", "--max-tokens", "8", "--bursts", "2",
        "--burst", "40", "--burst-tokens", "400", "--max-waiting", "4", "--header-timeout", "1",
        "--body-timeout", "1",
        "--drain-timeout", "0", "--request-timeout", "20", "--duration", "60",
        "--constraint-grammars", "1", "--unique-schemas", "8",
        "--log", str(tmp_path / "serve.log"),
        "--json", str(out)])
    assert json.loads(out.read_text()) == summary
    assert summary["failures"] == [] and summary["log_examples"] == []
    assert all(summary["checks"].values()), summary["checks"]
    assert summary["cases_run"] == 110 and summary["server_errors_5xx"] == 0
    streams = summary["streams"]
    assert streams["malformed"] == 0 and streams["hung"] == 0 and streams["ok"] > 0
    assert summary["leaked_blocks"] == 0 and summary["metrics_after"]["num_free_blocks"] == 1024
    log = summary["log"]
    assert log["non_json_lines"] == 0 and log["tracebacks"] == 0 and log["api_key_lines"] == 0
    # every kind of traffic met the server, and each limit answered as it should
    status = summary["status"]
    assert {"200", "400", "401", "404", "408", "413", "415", "429"} <= set(status)
    assert summary["burst_429"] > 0
    # a burst of n=2 calls admits at most --max-waiting 4 + --max-num-seqs 8 sequences
    assert len(summary["admission_bursts_admitted_seqs"]) == 1
    assert 0 < summary["admission_bursts_admitted_seqs"][0] <= 12
    # 64 silent sockets fill --max-connections, and are closed unanswered after 1 s
    idle = summary["idle_sockets"]
    assert idle["status_while_full"] == 503 and idle["still_open"] == idle["answered"] == 0
    # /health answered all along (a stalled event loop would show as a slow answer)
    assert summary["health_probe"]["count"] > 10 and summary["health_probe"]["max_s"] < 30
    # --max-connections holds for connections opened one at a time and all at once
    assert summary["connection_cap_503"].keys() == {"one at a time", "all at once"}
    assert all(refused > 0 for refused in summary["connection_cap_503"].values())
    assert summary["drain_finish_reasons"] == {"abort": 3} and summary["server_exit_code"] == 0
    # the constraint phase: every crash and error shape a 400 naming its field (answered
    # after each: checked by `failures`), large grammars compiled off the stream's path, and
    # the RSS of unique large schemas flat
    constraints = summary["constraints"]
    assert set(constraints["statuses"].values()) == {400} and len(constraints["statuses"]) == 9
    assert constraints["stall"]["grammar_statuses"] == [200] * 5
    assert constraints["memory"]["statuses"] == {"200": 8}
    assert summary["checks"]["constraint_stall_bounded"] is True
    assert summary["checks"]["constraint_rss_flat"] is True
    assert "505" in status  # the HTTP/2.0 request line
    assert (tmp_path / "serve.log").read_text().count('"event": "request"') > 0
