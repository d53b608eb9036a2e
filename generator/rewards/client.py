"""A generator's side of the reward server: one blocking call per sample, made in a reward worker process
(generator/rewards/scorer.py), so it never blocks the generator's event loop, and a wait for the server at start.

A server that is away (not started yet, restarting) or full (503) is retried with backoff until the call's deadline
(reward.timeout_s, less a margin so the pool does not kill the worker first); then the sample scores 0 and is
counted like any failed reward. A 4xx or 5xx answer other than 503 fails the call at once, with the server's reason.
"""
import asyncio
import math
import time

from asyncrl.generator.rewards.errors import RewardError

DEADLINE_MARGIN = 0.9
"""The share of reward.timeout_s a call may spend before it gives up on its own."""
_clients: dict = {}  # url -> httpx.Client, one per worker process (kept alive between calls)


def _client(url: str):
    import httpx

    if url not in _clients:
        _clients[url] = httpx.Client(base_url=url, timeout=None)
    return _clients[url]


def score_remote(url: str, prompt, response: str, data_source: str, ground_truth, timeout_s: float) \
        -> tuple[float, dict]:
    """The server's score of one sample; raises RewardError when it cannot be had within `timeout_s`."""
    import httpx

    deadline = time.monotonic() + timeout_s * DEADLINE_MARGIN
    item = {"prompt": prompt if prompt is not None else "", "response": response, "data_source": data_source,
            "ground_truth": ground_truth if isinstance(ground_truth, (str, int, float, list, dict)) else None}
    backoff, last = 0.05, "no answer"
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise RewardError(f"reward server {url}: not scored within {timeout_s * DEADLINE_MARGIN:.1f} s ({last})")
        try:
            reply = _client(url).post("/v1/score", json={"items": [item]}, timeout=remaining)
        except httpx.TransportError as err:  # away: not started yet, restarting, or the call's time ran out
            last = f"{type(err).__name__}"
        else:
            if reply.status_code == 200:
                return read_reply(url, reply.json())
            if reply.status_code != 503:
                raise RewardError(f"reward server {url}: HTTP {reply.status_code}: {error_of(reply)}")
            last = f"busy: {error_of(reply)}"
        time.sleep(min(backoff, max(0.0, deadline - time.monotonic())))
        backoff = min(backoff * 2, 1.0)


def error_of(reply) -> str:
    try:
        return str(reply.json().get("error", reply.text))[:300]
    except ValueError:
        return reply.text[:300]


def read_reply(url: str, body) -> tuple[float, dict]:
    """The first (only) score and its info; anything else is the server's fault, said as such."""
    try:
        score = float(body["scores"][0])
        info = {str(k): float(v) for k, v in (body.get("info") or [{}])[0].items()}
    except (KeyError, IndexError, TypeError, ValueError, AttributeError):
        raise RewardError(f"reward server {url}: a reply that is not {{scores, info}}") from None
    if not math.isfinite(score) or not all(math.isfinite(v) for v in info.values()):
        raise RewardError(f"reward server {url}: a non-finite score")
    return score, info


async def wait_for_server(url: str, timeout_s: float, say) -> dict:
    """Poll GET /health until the server answers (it may start after the generator); its description."""
    import httpx

    deadline = time.monotonic() + timeout_s
    announced = False
    async with httpx.AsyncClient(base_url=url, timeout=2.0) as client:
        while True:
            try:
                reply = await client.get("/health")
                if reply.status_code == 200:
                    return reply.json()
            except httpx.TransportError:  # not listening yet: ask again below
                pass
            if time.monotonic() > deadline:
                raise RewardError(f"no reward server answered at {url} within {timeout_s:.0f} s (start it with "
                                  f"`asyncrl reward-server --config ...`)")
            if not announced:
                say(f"waiting for the reward server at {url} ...")
                announced = True
            await asyncio.sleep(0.5)
