"""`asyncrl reward-server`: a reward model served to the generators over HTTP (docs/rewards.md, "Reward models").

    POST /v1/score   {"items": [{"prompt": str | [{role, content}], "response": str, "data_source"?, "ground_truth"?}]}
                  -> {"scores": [float], "info": [{str: float}]}
                     400 a malformed request; 413 a body over 16 MiB; 503 + Retry-After: the queue is full (back
                     off and ask again);
                     504 not scored within reward_server.request_timeout_s; 500 the model failed on the batch
    GET  /health  -> {"ok": true, "kind", "model"}       (generators wait for it at start)
    GET  /metrics -> items, batches, mean batch size, queue, refusals, timeouts, unparsed verdicts

It may be started before or after the generators: a generator whose reward names a server waits for /health when it
starts, and its calls retry a server that is away or full until reward.timeout_s (generator/rewards/client.py).
Items of concurrent requests are scored together (batcher.py).
"""
import asyncio
import json
import logging
import os
import socket

from asyncrl.generator.reward_server.batcher import Batcher, QueueFull, ScoreTimeout
from asyncrl.generator.reward_server.items import BadItem, parse_items

log = logging.getLogger(__name__)
RETRY_AFTER_S = "1"
MAX_BODY_BYTES = 16 << 20
"""Largest request body read (413 past it): a caller cannot make the server hold more than this per request."""


async def read_body(request, limit: int) -> bytes | None:
    """The body, or None once it passes `limit` bytes (read in chunks: a lying Content-Length changes nothing)."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


def build_app(batcher: Batcher, describe: dict, extra_stats=lambda: {}):
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse

    app = FastAPI(title="asyncrl reward server", docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/health")
    async def health():
        return {"ok": True, **describe}

    @app.get("/metrics")
    async def metrics():
        return {**batcher.stats(), **extra_stats()}

    @app.post("/v1/score")
    async def score(request: Request):
        body = await read_body(request, MAX_BODY_BYTES)
        if body is None:
            return JSONResponse({"error": f"the body is larger than {MAX_BODY_BYTES} bytes"}, 413)
        try:
            items = parse_items(json.loads(body), batcher.max_queue)
        except (json.JSONDecodeError, UnicodeDecodeError):
            return JSONResponse({"error": "the body is not JSON"}, 400)
        except BadItem as err:
            return JSONResponse({"error": str(err)}, 400)
        try:
            results = await batcher.score(items)
        except QueueFull as err:
            return JSONResponse({"error": f"busy: {err}"}, 503, headers={"Retry-After": RETRY_AFTER_S})
        except ScoreTimeout as err:
            return JSONResponse({"error": str(err)}, 504)
        except Exception as err:
            return JSONResponse({"error": f"scoring failed: {err}"}, 500)
        return {"scores": [score for score, _ in results], "info": [info for _, info in results]}

    return app


async def build_scorer(cfg, say):
    """(score_batch coroutine, what /health says, extra /metrics, what to close) for reward_server.kind."""
    if cfg.model_path is None:
        raise ValueError("reward_server.model_path is not set: the reward model or judge to serve")
    if not os.path.isdir(cfg.model_path):
        raise ValueError(f"reward_server.model_path: {cfg.model_path} is not a directory (models are loaded from "
                         f"local directories)")
    if cfg.kind == "classifier":
        from asyncrl.generator.reward_server.classifier import ClassifierScorer

        scorer = ClassifierScorer(cfg.model_path, cfg.max_length, cfg.dtype)
        return (lambda items: asyncio.to_thread(scorer.score, items)), lambda: {}, None
    from transformers import AutoTokenizer

    from asyncrl.generator.engines.base import EngineOptions
    from asyncrl.generator.engines.factory import make_engine
    from asyncrl.generator.reward_server.judge import JudgeScorer

    engine = make_engine(cfg.engine, EngineOptions(cfg.model_path, cfg.dtype, max_model_len=cfg.max_model_len,
                                                   kv_cache_gib=cfg.kv_cache_gib, seed=0))
    await engine.start()
    judge = JudgeScorer(engine, AutoTokenizer.from_pretrained(cfg.model_path), cfg)
    say(f"reward server: judge on the {cfg.engine} engine")
    return judge.score_batch, lambda: {"judge/unparsed": judge.unparsed}, engine


async def serve(cfg, say=print, ready=None) -> None:
    """Serve until cancelled. `ready(url)` is called once the socket listens."""
    import uvicorn

    score_batch, extra_stats, engine = await build_scorer(cfg, say)
    batcher = Batcher(score_batch, cfg.max_batch, cfg.batch_wait_s, cfg.max_queue, cfg.request_timeout_s)
    batcher.start()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((cfg.host, cfg.port))
    except OSError as err:
        sock.close()
        raise OSError(f"reward server cannot bind {cfg.host}:{cfg.port}: {err}") from None
    url = f"http://{cfg.host}:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(build_app(batcher, {"kind": cfg.kind, "model": cfg.model_path},
                                                     extra_stats), log_level="warning", lifespan="off",
                                           access_log=False))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            if task.done():
                task.result()
            await asyncio.sleep(0.01)
        say(f"reward server: {cfg.kind} {cfg.model_path} at {url}")
        if ready is not None:
            ready(url)
        await task
    finally:
        server.should_exit = True
        await asyncio.gather(task, return_exceptions=True)
        await batcher.close()
        if engine is not None:
            await engine.close()
