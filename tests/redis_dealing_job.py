"""A learner's Redis buffer with its dealer and any number of generators on one namespace of a real redis-server,
for the tests of dealing with Redis (the `make_job` fixture of tests/integration/conftest.py builds them)."""
import asyncio
import dataclasses
import time
import uuid

import numpy as np

from asyncrl.buffer.codec import encode_group
from asyncrl.buffer.dealing import PromptDealer
from asyncrl.buffer.group import Group, Sample, Sampling
from asyncrl.buffer.redis.client import RedisBufferClient
from asyncrl.buffer.redis.conn import RedisOptions, connect
from asyncrl.buffer.redis.coordinator import RedisCoordinator
from asyncrl.buffer.redis.dealing import RedisDealer
from asyncrl.buffer.redis.server import RedisBufferServer
from asyncrl.data.prompts import decode_prompt, encode_prompts
from tests.dealt_rows import Row
from tests.messages import run_info

VOCAB = 64



def base_dealer(count: int, epochs=1, timeout_s=60.0) -> PromptDealer:
    rows = [Row(f"f.parquet:{i}", [3, 4 + i % 5], extra_info={"index": i}) for i in range(count)]
    return PromptDealer(encode_prompts(rows), shuffle=True, seed=7, epochs=epochs, timeout_s=timeout_s)


def admitted(client, want: int, version=None):
    """The client's admit reply with its deals decoded, as the generator's admission gate hands them out."""
    reply = asyncio.run(client.admit(want, version=version))
    return dataclasses.replace(reply, deals=[decode_prompt(*deal) for deal in reply.deals])


def group_for(deal, generator_id: str, group_id: str | None = None, prompt_id: str | None = None) -> Group:
    sample = Sample(completion_ids=np.array([1, 2, 3], np.int32), logprobs=np.full(3, -0.5, np.float32),
                    versions=np.zeros(3, np.int32), reward=1.0, finish_reason="stop")
    return Group(group_id=group_id or uuid.uuid4().hex, prompt_id=prompt_id or deal.prompt_id,
                 generator_id=generator_id, prompt_ids=np.array(deal.prompt_ids, np.int32), samples=[sample],
                 sampling=Sampling(temperature=1.0), created_at=time.time(), meta={"deal": deal.deal_id})


class Job:
    """One learner (server + Redis dealer) and any number of generators on one namespace of the real Redis."""

    def __init__(self, url: str, count: int, base: PromptDealer | None = None, ready: int = 4, evals=None):
        self.url, self.job, self.count, self.ready = url, uuid.uuid4().hex[:8], count, ready
        self.generators: list = []
        self.evals = evals
        self.server = self.learner(base)

    def learner(self, base: PromptDealer | None = None) -> RedisBufferServer:
        client = connect(RedisOptions(self.url))
        coordinator = RedisCoordinator(client, self.job, lead=1 << 10, groups_per_step=1)
        coordinator.set_version(0, allow_backwards=True)
        dealer = RedisDealer(client, self.job, base or base_dealer(self.count), self.ready)
        server = RedisBufferServer(client, self.url, self.job, coordinator, vocab_size=VOCAB, config_hash="h",
                                   max_message_bytes=1 << 20, evals=self.evals, dealer=dealer,
                                   run_info=run_info(deals=True, deal_timeout_s=60.0, evals=self.evals is not None))
        server.start()
        return server

    def generator(self, name: str) -> RedisBufferClient:
        client = RedisBufferClient(connect(RedisOptions(self.url)), self.url, self.job, name, lead=1 << 10,
                                   groups_per_step=1, lease_s=60)
        asyncio.run(client.hello("h"))
        self.generators.append(client)
        return client

    def take_all(self, timeout_s=0.3) -> list:
        out = []
        while (group := self.server.take(timeout_s)) is not None:
            out.append(group)
        return out

    def close(self):
        for client in self.generators:
            client.close()
        self.server.close()


def send(client, group) -> object:
    return asyncio.run(client.send(group.group_id, encode_group(group), deal=group.meta["deal"]))
