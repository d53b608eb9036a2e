"""`asyncrl reward-server` for real: a tiny sequence-classification reward model built locally, served by the real
process over HTTP, called by concurrent requests (batched), by a client that starts before it (retries), under
back-pressure (503 + Retry-After, then scored), and from a generator's reward worker pool as a reward.functions
component; and an LLM judge on the generators' hf engine (the demo model, which answers digits)."""
import asyncio
import os
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch

from asyncrl.configs import load_config
from asyncrl.generator.rewards.client import score_remote, wait_for_server
from tests.conftest import free_port


@pytest.fixture(scope="module")
def reward_model(demo_assets, tmp_path_factory):
    """A 2-layer Qwen2 with a one-label head, on the demo's tokenizer."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForSequenceClassification

    model_dir, _ = demo_assets
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128, num_labels=1,
                         pad_token_id=tokenizer.pad_token_id)
    path = str(tmp_path_factory.mktemp("reward-model"))
    Qwen2ForSequenceClassification(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def start_server(model_dir, port, tmp_path, *overrides):
    log = open(tmp_path / f"reward-server-{port}.log", "ab")
    return subprocess.Popen([sys.executable, "-m", "asyncrl.launch.cli", "reward-server", f"reward_server.port={port}",
                             f"reward_server.model_path={model_dir}", "reward_server.max_length=64", *overrides],
                            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"})


def stop(proc):
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def direct_scores(model_dir, pairs):
    """The reward model's logits for (prompt, response) pairs, one at a time, without the server."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    out = []
    for prompt, response in pairs:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt},
                                              {"role": "assistant", "content": response}], tokenize=False)
        with torch.no_grad():
            out.append(float(model(**tokenizer(text, return_tensors="pt", add_special_tokens=False)).logits[0, 0]))
    return out


def test_the_reward_server_batches_backs_off_and_can_start_after_its_clients(reward_model, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    early = {}

    def call_before_the_server_is_up():  # a reward worker's call: it retries until the server answers
        early["score"] = score_remote(url, [{"role": "user", "content": "sort:321="}], "123", "s", "123", 120)

    caller = threading.Thread(target=call_before_the_server_is_up)
    caller.start()
    time.sleep(0.5)
    proc = start_server(reward_model, port, tmp_path, "reward_server.max_batch=8", "reward_server.max_queue=8",
                        "reward_server.batch_wait_s=0.05")
    try:
        asyncio.run(wait_for_server(url, 120, say=lambda message: None))
        caller.join(timeout=120)
        pairs = [(f"sort:{i}{i + 1}=", f"{i}{i + 1}") for i in range(8)]

        async def concurrent():
            async with httpx.AsyncClient(base_url=url, timeout=60) as client:
                replies = await asyncio.gather(*(client.post("/v1/score", json={"items": [
                    {"prompt": prompt, "response": response}]}) for prompt, response in pairs))
                flood = await asyncio.gather(*(client.post("/v1/score", json={"items": [
                    {"prompt": "sort:1=", "response": "1"}] * 4}) for _ in range(12)))
                bad = await client.post("/v1/score", json={"items": [{"prompt": 1}]})
                huge = await client.post("/v1/score", content=b"[" + b" " * (17 << 20) + b"]")
                return replies, flood, bad, huge, (await client.get("/metrics")).json()

        replies, flood, bad, huge, metrics = asyncio.run(concurrent())
    finally:
        stop(proc)
    assert early["score"][0] == pytest.approx(direct_scores(reward_model, [("sort:321=", "123")])[0], abs=1e-5)
    scores = [reply.json()["scores"][0] for reply in replies]
    assert scores == pytest.approx(direct_scores(reward_model, pairs), abs=1e-5)  # batched = one at a time
    assert metrics["mean_batch"] > 1  # concurrent requests shared forward passes
    codes = sorted(reply.status_code for reply in flood)
    assert codes.count(503) >= 1 and codes.count(200) >= 1, codes  # back-pressure, not an unbounded queue
    assert all(r.headers.get("retry-after") == "1" for r in flood if r.status_code == 503)
    assert bad.status_code == 400 and "prompt" in bad.json()["error"]
    assert huge.status_code == 413  # never read whole
    assert proc.returncode == 143  # SIGTERM ends it as it ends every asyncrl command
    assert "Traceback" not in (tmp_path / f"reward-server-{port}.log").read_text()


def test_a_generators_reward_worker_pool_scores_through_the_server(reward_model, tmp_path):
    """reward.functions mixes a built-in scorer and the reward server; the server component gets the prompt."""
    from asyncrl.generator.rewards.scorer import RewardScorer

    port = free_port()
    proc = start_server(reward_model, port, tmp_path)
    cfg = load_config(None, [f"reward.functions=[{{name: exact}}, {{name: rm, weight: 0.5, "
                             f"server: 'http://127.0.0.1:{port}'}}]"])

    async def scenario():
        scorer = RewardScorer(None, "compute_score", 2, 60.0, functions=cfg.reward.functions)
        await scorer.start()
        try:
            for url in scorer.servers:
                await wait_for_server(url, 120, say=lambda message: None)
            return await scorer.score("asyncrl/sort_digits", "123", "123", {},
                                      prompt=[{"role": "user", "content": "sort:321="}])
        finally:
            await scorer.close()

    try:
        reward, info = asyncio.run(scenario())
    finally:
        stop(proc)
    expected_rm = direct_scores(reward_model, [("sort:321=", "123")])[0]
    assert info["reward/exact"] == 1.0 and info["reward/rm"] == pytest.approx(expected_rm, abs=1e-5)
    assert reward == pytest.approx(1.0 + 0.5 * expected_rm, abs=1e-5)


def test_an_llm_judge_on_the_generators_engine_scores_by_its_verdict(demo_assets):
    """The demo model sorts digits: asked `sort:<response>=`, its first digit, times 0.1, is the score. A pattern its
    verdict never matches scores unparsed_score and is counted."""
    from asyncrl.generator.reward_server.app import serve

    model_dir, _ = demo_assets
    results = {}

    async def scenario(pattern):
        cfg = load_config(None, [f"reward_server.model_path={model_dir}", "reward_server.kind=judge",
                                 "reward_server.port=0", "reward_server.template=sort:{response}=",
                                 f"reward_server.score_pattern={pattern}", "reward_server.max_model_len=128",
                                 "reward_server.unparsed_score=-1"]).reward_server
        ready = asyncio.get_running_loop().create_future()
        server = asyncio.create_task(serve(cfg, say=lambda message: None, ready=ready.set_result))
        url = await ready
        try:
            async with httpx.AsyncClient(base_url=url, timeout=60) as client:
                reply = await client.post("/v1/score", json={"items": [{"prompt": "q", "response": r}
                                                                       for r in ("31", "5021", "9")]})
                return reply.json(), (await client.get("/metrics")).json()
        finally:
            server.cancel()
            await asyncio.gather(server, return_exceptions=True)

    parsed, parsed_metrics = asyncio.run(scenario("'(\\d)'"))
    unparsed, unparsed_metrics = asyncio.run(scenario("'score=(\\d)'"))
    assert [info["judge_parsed"] for info in parsed["info"]] == [1.0, 1.0, 1.0]
    assert all(0.0 <= score <= 0.9 for score in parsed["scores"]) and parsed_metrics["judge/unparsed"] == 0
    assert parsed_metrics["batches"] == 1  # the three verdicts were sampled together
    assert unparsed["scores"] == [-1.0, -1.0, -1.0] and unparsed_metrics["judge/unparsed"] == 3
