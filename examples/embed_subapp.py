"""Mount kvcore's OpenAI-compatible app under /llm inside your own aiohttp application.

    python examples/embed_subapp.py [MODEL_DIR]     # default: SmolLM2-135M-Instruct
"""

from __future__ import annotations

import asyncio
import sys

from aiohttp import ClientSession, web

from kvcore import AsyncEngine, EngineConfig, SchedulerConfig
from kvcore.model.hub import resolve_model
from kvcore.service import make_app


async def index(request: web.Request) -> web.Response:
    return web.Response(text="my application")


async def main(model: str | None) -> None:
    config = EngineConfig(model=str(resolve_model(model)),
                          scheduler=SchedulerConfig(max_model_len=1024, max_num_seqs=8))
    engine = AsyncEngine.from_config(config)
    root = web.Application()
    root.router.add_get("/", index)
    # the sub-app's cleanup_ctx starts the engine with the root app and stops it at cleanup
    root.add_subapp("/llm", make_app(engine, served_model_name="my-model",
                                     api_keys={"secret-key": "team-a"}))
    runner = web.AppRunner(root)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        async with ClientSession(f"http://127.0.0.1:{port}") as http:
            async with http.get("/") as resp:
                print(await resp.text())
            async with http.post("/llm/v1/chat/completions", json={
                    "model": "my-model", "max_tokens": 24, "temperature": 0,
                    "messages": [{"role": "user", "content": "Name a colour."}]},
                    headers={"Authorization": "Bearer secret-key"}) as resp:
                answer = await resp.json()
                print(answer["choices"][0]["message"]["content"])
                print(answer["usage"])
    finally:
        await runner.cleanup()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1] if len(sys.argv) > 1 else None))
