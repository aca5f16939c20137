"""AsyncEngine embedded in an asyncio program: streaming, a free event loop, abort on cancel."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest

from engine_helpers import assert_pool_empty, make_engine, run_all
from kvcore.config import ParamError
from kvcore.engine import AsyncEngine
from kvcore.request import RequestOutput, merge_outputs
from kvcore.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = ["The cat", "A long time ago in a galaxy", "def main():", "1 2 3 4"]


def test_embedding_example_streams_the_same_tokens_and_never_blocks_the_loop(
        tiny_model_dir: Path) -> None:
    expected = run_all(make_engine(tiny_model_dir), PROMPTS, GREEDY)

    async def main() -> tuple[list[tuple[str, list[int], str]], int]:
        ticks = 0
        stop_ticking = asyncio.Event()

        async def ticker() -> None:  # another coroutine of the host program
            nonlocal ticks
            while not stop_ticking.is_set():
                ticks += 1
                await asyncio.sleep(0)

        async def consume(engine: AsyncEngine, prompt: str) -> tuple[str, list[int], str]:
            outputs = [out async for out in engine.generate(prompt, GREEDY)]
            assert outputs[-1].finished and all(not o.finished for o in outputs[:-1])
            whole = merge_outputs(outputs).outputs[0]
            return "".join(o.outputs[0].text for o in outputs), whole.token_ids, whole.text

        async with AsyncEngine(make_engine(tiny_model_dir)) as engine:
            tick_task = asyncio.create_task(ticker())
            results = await asyncio.gather(*(consume(engine, p) for p in PROMPTS))
            stop_ticking.set()
            await tick_task
            assert_pool_empty(engine.engine)
        return results, ticks

    results, ticks = asyncio.run(main())
    for (streamed, token_ids, text), ref in zip(results, expected, strict=True):
        assert token_ids == ref.outputs[0].token_ids
        assert streamed == text == ref.outputs[0].text
    assert ticks > 10  # the loop kept running other tasks while steps computed


def test_cancelling_or_closing_the_consumer_aborts_the_request(tiny_model_dir: Path) -> None:
    async def main() -> None:
        async with AsyncEngine(make_engine(tiny_model_dir)) as engine:
            first = asyncio.Event()

            async def consume() -> None:
                async for _ in engine.generate("hello", SamplingParams(max_tokens=500,
                                                                        ignore_eos=True),
                                               request_id="cancelled"):
                    first.set()

            task = asyncio.create_task(consume())
            await first.wait()
            assert engine.engine.kv.usage() > 0
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            stream = engine.generate("hello", SamplingParams(max_tokens=500, ignore_eos=True),
                                     request_id="closed")
            await stream.__anext__()
            await stream.aclose()  # type: ignore[attr-defined]
            for _ in range(100):  # aborts apply between steps, within one step
                if not engine.engine.has_unfinished_requests():
                    break
                await asyncio.sleep(0.01)
            assert_pool_empty(engine.engine)

    asyncio.run(main())


def test_abort_and_stop_end_streams_with_reason_abort(tiny_model_dir: Path) -> None:
    async def main() -> tuple[RequestOutput, RequestOutput]:
        engine = AsyncEngine(make_engine(tiny_model_dir))
        await engine.start()
        long = SamplingParams(max_tokens=500, ignore_eos=True)

        async def last_of(request_id: str, started: asyncio.Event) -> RequestOutput:
            outputs = []
            async for out in engine.generate("abc", long, request_id=request_id):
                started.set()
                outputs.append(out)
            return merge_outputs(outputs)

        a_started, b_started = asyncio.Event(), asyncio.Event()
        a = asyncio.create_task(last_of("a", a_started))
        b = asyncio.create_task(last_of("b", b_started))
        await a_started.wait()
        await b_started.wait()
        await engine.abort("a")
        out_a = await a
        await engine.stop()
        out_b = await b
        assert_pool_empty(engine.engine)
        return out_a, out_b

    out_a, out_b = asyncio.run(main())
    for out in (out_a, out_b):
        assert out.finished and out.outputs[0].finish_reason == "abort"
        assert 0 < len(out.outputs[0].token_ids) < 500


@pytest.mark.parametrize(("prompt", "params", "param"), [
    ([], GREEDY, "prompt"),
    ([5] * 32, GREEDY, "prompt"),
    ([10**6], GREEDY, "prompt"),
    ([5] * 4, SamplingParams(max_tokens=40), "max_tokens"),
    ([5] * 4, SamplingParams(max_tokens=4, stop_token_ids=(10**6,)), "stop_token_ids"),
    ([5] * 4, SamplingParams(max_tokens=4, logit_bias={10**6: 1.0}), "logit_bias"),
])
def test_token_ids_are_checked_once_as_generate_is_called(
        tiny_model_dir: Path, prompt: list[int], params: SamplingParams, param: str) -> None:
    """A request that can never run raises from generate() itself, before anything is queued
    (a server refuses it before its own queue limit), naming the parameter."""
    async def main() -> None:
        async with AsyncEngine(make_engine(tiny_model_dir, max_model_len=32)) as engine:
            with pytest.raises(ParamError) as info:
                engine.generate(prompt, params)
            assert info.value.param == param
            assert engine.num_waiting == 0 and not engine.engine.has_unfinished_requests()

    asyncio.run(main())


def test_validation_errors_raise_on_first_anext(tiny_model_dir: Path) -> None:
    async def main() -> None:
        async with AsyncEngine(make_engine(tiny_model_dir, max_model_len=32)) as engine:
            with pytest.raises(ValueError, match="empty"):
                await engine.generate([], GREEDY).__anext__()
            with pytest.raises(ValueError, match="max_model_len"):
                await engine.generate([5] * 30, GREEDY).__anext__()
            ok = [o async for o in engine.generate([5] * 4, GREEDY, request_id="x")]
            assert ok[-1].finished and ok[-1].prompt_token_ids == [5] * 4
        with pytest.raises(RuntimeError, match="not started"):
            await engine.generate("hi", GREEDY).__anext__()

    asyncio.run(main())
