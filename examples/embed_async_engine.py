"""Use AsyncEngine directly from an asyncio program: stream one request, then run three at once.

    python examples/embed_async_engine.py [MODEL_DIR]     # default: SmolLM2-135M-Instruct
"""

from __future__ import annotations

import asyncio
import sys

from kvcore import AsyncEngine, EngineConfig, SamplingParams, SchedulerConfig
from kvcore.model.hub import resolve_model


async def complete(engine: AsyncEngine, prompt: str, params: SamplingParams) -> str:
    # each output carries what is new: the answer is their text joined
    return "".join([output.outputs[0].text async for output in engine.generate(prompt, params)])


async def main(model: str | None) -> None:
    config = EngineConfig(model=str(resolve_model(model)),
                          scheduler=SchedulerConfig(max_model_len=1024, max_num_seqs=8))
    async with AsyncEngine.from_config(config) as engine:
        tokenizer = engine.tokenizer
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": "What is the capital of France?"}])
        params = SamplingParams(max_tokens=24, temperature=0)
        # deltas as the engine produces them (the driver batches this with any other request)
        async for output in engine.generate(prompt, params):
            print(output.outputs[0].text, end="", flush=True)
        print()
        # concurrent requests share the continuous batch
        questions = ["Name a fruit.", "Name a river.", "Name a planet."]
        answers = await asyncio.gather(*(
            complete(engine, tokenizer.apply_chat_template([{"role": "user", "content": q}]),
                     params) for q in questions))
        for question, answer in zip(questions, answers, strict=True):
            print(f"{question} -> {answer!r}")


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1] if len(sys.argv) > 1 else None))
