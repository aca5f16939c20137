"""A request that can never run is refused once, before admission, as a 400 naming the field;
no error message carries an id the server made up (request, sequence or call ids)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from engine_helpers import make_engine
from kvcore.config import ParamError
from kvcore.request import Sequence
from kvcore.sampling import BeamSearchParams, SamplingParams
from service_fixtures import tiny_app, wait_pool_idle

ROOT = Path(__file__).parent.parent
INTERNAL_ID = re.compile(r"(cmpl|chatcmpl)-[0-9a-f]{8}|#n\d|#b\d")


@pytest.mark.asyncio
@pytest.mark.parametrize("max_waiting", [0, None])
async def test_more_choices_than_max_num_seqs_is_a_400_naming_n(
        aiohttp_client, tiny_model_dir: Path, max_waiting: int | None) -> None:
    """The defect: with --max-num-seqs 4 --max-waiting 0, n=8 answered 429 (retry later)
    although it can never run; without --max-waiting it was a 400 naming `cmpl-...-0`."""
    app = tiny_app(tiny_model_dir, {"max_num_seqs": 4}, max_waiting=max_waiting)
    client = await aiohttp_client(app)
    for path, body in (("/v1/completions", {"prompt": "hi", "n": 8, "max_tokens": 2}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                 "n": 8, "max_tokens": 2, "stream": True}),
                       ("/v1/completions", {"prompt": "hi", "n": 8, "max_tokens": 2,
                                            "use_beam_search": True})):
        resp = await client.post(path, json=body)
        error = (await resp.json())["error"]
        assert resp.status == 400, error
        assert error["param"] == "n" and "max_num_seqs=4" in error["message"]
        assert not INTERNAL_ID.search(error["message"]), error["message"]
    ok = await client.post("/v1/completions", json={"prompt": "hi", "n": 4, "max_tokens": 2})
    # n = 4 fits: answered (--max-waiting 0 turns every call away while it would wait: 429)
    assert ok.status == (200 if max_waiting is None else 429)
    await wait_pool_idle(app)


@pytest.mark.asyncio
async def test_a_prompt_bigger_than_the_pool_is_a_400_without_ids(
        aiohttp_client, tiny_model_dir: Path) -> None:
    app = tiny_app(tiny_model_dir, {"num_blocks": 8}, max_waiting=0)  # 8 blocks of 4 tokens
    client = await aiohttp_client(app)
    for body, param in (({"prompt": [5] * 20, "max_tokens": 20}, "max_tokens"),
                        ({"prompt": [5] * 4, "max_tokens": 8, "n": 3}, "n")):
        resp = await client.post("/v1/completions", json=body)
        error = (await resp.json())["error"]
        assert resp.status == 400 and error["param"] == param, error
        assert "whole pool" in error["message"] and not INTERNAL_ID.search(error["message"])


def test_check_request_builds_the_sequence_the_engine_adds(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir, max_model_len=64)
    seq = engine.check_request("r", [5, 6, 7], SamplingParams(n=3, max_tokens=None,
                                                              stop_token_ids=(9,)),
                               prompt_text="abc")
    assert isinstance(seq, Sequence) and not engine.has_unfinished_requests()  # nothing queued
    assert (seq.max_tokens, seq.num_pending_forks, seq.prompt) == (61, 2, "abc")
    assert 9 in seq.stop_token_ids and not seq.host_decides
    beam = engine.check_request("b", [5], BeamSearchParams(beam_width=2, max_tokens=None))
    assert beam.host_decides and beam.max_tokens == 63 and not beam.stop_token_ids
    with pytest.raises(ParamError) as err:
        engine.check_request("x", [5], SamplingParams(n=engine.scheduler.max_num_seqs + 1))
    assert err.value.param == "n"
    engine.add(seq)
    with pytest.raises(ParamError, match="already in use") as err:
        engine.add(engine.check_request("r", [5], SamplingParams()))
    assert err.value.param == "request_id" and "'r'" not in str(err.value)


def _messages_of_raises(path: Path) -> list[tuple[int, str]]:
    """The f-strings and strings of every `raise X(...)` and error constructor in a module."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
            call = node.exc
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("bad_request", "APIError", "ParamError", "RequestFailed")):
            call = node
        else:
            continue
        for arg in call.args:
            found.append((node.lineno, ast.unparse(arg)))
    return found


def test_no_error_message_names_an_internal_id() -> None:
    """Error messages that reach a client never interpolate a request, sequence or call id:
    those are the server's own (`cmpl-...-0`, `...#n1`) and mean nothing to the caller."""
    names = re.compile(r"\{[^}]*\b(request_id|seq_id|call_id|seq\.request_id|"
                       r"parent_id|child_id)\b[^}]*\}")
    offenders = []
    files = [*sorted((ROOT / "service").glob("*.py")), ROOT / "src/kvcore/scheduler.py",
             ROOT / "src/kvcore/request.py", *sorted((ROOT / "src/kvcore/engine").glob("*.py"))]
    for path in files:
        for line, text in _messages_of_raises(path):
            if names.search(text):
                offenders.append(f"{path.relative_to(ROOT)}:{line}: {text}")
    assert not offenders, "\n".join(offenders)


@pytest.mark.asyncio
async def test_token_ids_with_a_constraint_not_compiled_yet_are_checked_after_prepare(
        tiny_model_dir: Path) -> None:
    """AsyncEngine.generate never compiles on the event loop: token ids whose constraint is
    not cached are checked on the first __anext__, after `prepare` compiled it off the loop;
    a refusal still names its field, and nothing is left queued or allocated."""
    from kvcore.engine import AsyncEngine, Engine
    from kvcore.sampling.constraints import Constraint
    from service_fixtures import tiny_config

    engine = Engine(tiny_config(tiny_model_dir, max_num_seqs=4))
    compiler = engine.constraints
    async with AsyncEngine(engine) as async_engine:
        choice = Constraint.choice(["yes", "no"])
        stream = async_engine.generate([5, 6], SamplingParams(n=8, constraint=choice))
        assert compiler.lookup(choice) is None  # not compiled by generate itself
        with pytest.raises(ParamError) as err:
            await anext(stream)
        assert err.value.param == "n" and compiler.lookup(choice) is not None
        bad = Constraint("grammar", "start: start", "structured_outputs.grammar")
        with pytest.raises(ParamError) as err:
            await anext(async_engine.generate([5, 6], SamplingParams(constraint=bad)))
        assert err.value.param == "structured_outputs.grammar"
        regex = Constraint("regex", "(ab)+")
        outputs = [out async for out in async_engine.generate(
            [5, 6], SamplingParams(max_tokens=4, temperature=0.0, constraint=regex))]
        assert outputs[-1].finished and not engine.has_unfinished_requests()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
