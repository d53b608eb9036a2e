"""The soak's rogue generator: a client that joins the job as a generator would (the job's config hash, the public
buffer client) and, at each `hostile` fault, takes a few deals and answers them with groups built to be refused.

Each group is what a broken or malicious generator can send through the real client: it decodes, so the learner's
checks (buffer/plausibility.py, the dealer, the staleness rule), not the decoder, have to catch it. The history
checker then proves none was trained: the rogue's groups carry its own id, which no trained group may
(bench/soak/history.py). The kinds cycle, so every burst of a long soak sends each of them in turn.

Run by bench/soak/run.py as `python -m asyncrl.bench.soak.rogue --config RECIPE overrides...`; a line on stdin
("burst N") sends N groups from the rogue and N from the liar (LIAR_KIND); it prints one JSON line per group (client,
kind, accepted, reason) for the soak's figures.
"""
import argparse
import asyncio
import json
import sys
import time
import uuid

import numpy as np

HOSTILE_KINDS = ("reward_1e300", "nan_logprobs", "future_version", "swapped_prompt", "empty_stopped",
                 "wrong_temperature")
"""What the rogue sends: each must be refused when the learner takes it, so none may ever be trained."""
LIAR_KIND = "made_up_logprobs"
"""What the liar sends: a group that passes every check on its own (its logprobs are plausible numbers, just not
the model's), so the learner can only tell from its own logprobs as it trains: the liar's first groups are trained
until its mismatch over learner.quarantine_window_groups of them quarantines it (learner/trust.py)."""


def hostile_group(kind: str, generator_id: str, deal_id: str, deal_row, sampling, n: int, version: int, vocab: int,
                  rng: np.random.Generator):
    """A group of `n` samples answering the row dealt under `deal_id` (its meta names the deal, as a generator's
    does), broken as `kind` says."""
    from asyncrl.buffer.group import Group, Sample, Sampling

    prompt = np.asarray(deal_row.prompt_ids, dtype=np.int32)
    if kind == "swapped_prompt":  # the deal's id, other prompt tokens
        prompt = rng.integers(2, vocab, max(len(prompt), 1)).astype(np.int32)
    length = 0 if kind == "empty_stopped" else 4
    versions = np.full(length, version + (1000 if kind == "future_version" else 0), np.int32)
    logprobs = np.full(length, np.nan if kind == "nan_logprobs" else -1.0, np.float32)
    if kind == "made_up_logprobs":  # far from what the policy gives these tokens
        logprobs = np.full(length, -1e-6, np.float32)
    samples = [Sample(completion_ids=rng.integers(2, vocab, length).astype(np.int32), logprobs=logprobs.copy(),
                      versions=versions.copy(), reward=1e300 if kind == "reward_1e300" else float(index % 2),
                      finish_reason="stop") for index in range(n)]
    if kind == "wrong_temperature":
        sampling = Sampling(sampling.temperature * 3 + 0.5, sampling.top_p, sampling.top_k, sampling.max_tokens)
    return Group(group_id=uuid.uuid4().hex, prompt_id=deal_row.prompt_id, generator_id=generator_id,
                 prompt_ids=prompt, samples=samples, sampling=sampling, created_at=time.time(),
                 meta={"data_source": deal_row.data_source, "deal": deal_id})


async def burst(client, cfg, kinds: tuple, count: int, sent: int, vocab: int, rng) -> list:
    """`count` hostile groups of `kinds` in turn, one per deal the client is granted; returns one record per group
    (a client the learner quarantined is granted nothing more, so its burst ends early)."""
    from asyncrl.buffer.codec import encode_group
    from asyncrl.buffer.group import Sampling
    from asyncrl.data.prompts import decode_prompt

    rollout = cfg.rollout
    sampling = Sampling(rollout.temperature, rollout.top_p, rollout.top_k, rollout.max_tokens)
    records, waited = [], 0
    while len(records) < count and waited < 60:
        reply = await client.admit(1)
        if not reply.deals:
            waited += 1
            await asyncio.sleep(0.5)
            continue
        deal_id, blob = reply.deals[0]
        kind = kinds[(sent + len(records)) % len(kinds)]
        version = reply.weights.version if reply.weights is not None else 0
        group = hostile_group(kind, client.generator_id, deal_id, decode_prompt(deal_id, blob), sampling, rollout.n,
                              version, vocab, rng)
        answer = await client.send(group.group_id, encode_group(group), deal=deal_id)
        records.append({"client": client.generator_id, "kind": kind, "group": group.group_id,
                        "accepted": answer.accepted, "reason": answer.reason})
    return records


async def serve(cfg, generator_id: str, vocab: int, seed: int) -> None:
    """The rogue (`generator_id`) and the liar (`<generator_id>-liar`), each its own connection; every "burst N" on
    stdin sends N groups from each."""
    from asyncrl.buffer.backends import make_generator_buffer
    from asyncrl.configs.run_config import shared_hash
    from asyncrl.generator.main import wait_for_learner

    clients = [(make_generator_buffer(cfg.buffer, cfg.security, cfg.job.name, name), kinds)
               for name, kinds in ((generator_id, HOSTILE_KINDS), (f"{generator_id}-liar", (LIAR_KIND,)))]
    rng, sent = np.random.default_rng(seed), 0
    try:
        for client, _ in clients:  # as a generator joins: the learner may not be up yet (Redis says so at once)
            await wait_for_learner(client, shared_hash(cfg), 120.0, say=lambda message: None)
        loop = asyncio.get_running_loop()
        while True:
            line = await loop.run_in_executor(None, sys.stdin.readline)
            if not line or line.strip() == "stop":
                break
            count = int(line.split()[1]) if line.startswith("burst") else 0
            for client, kinds in clients:
                for record in await burst(client, cfg, kinds, count, sent, vocab, rng):
                    print(json.dumps(record), flush=True)
            sent += count
    finally:
        for client, _ in clients:
            client.close()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=None)
    parser.add_argument("--id", default="rogue")
    parser.add_argument("--vocab", type=int, required=True, help="the model's vocabulary size")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    from asyncrl.configs import load_config

    asyncio.run(serve(load_config(args.config, args.overrides), args.id, args.vocab, args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
