"""Which model directory a generator starts its tokenizer and engine from (generator.model_source).

The learner names its model directory in the run info. A generator on the learner's host, or one with a shared
filesystem, reads it there. One that shares nothing asks the learner's catch-up server for the model's non-weight
files (config, tokenizer) and the newest weights, checks both (the archive's digest, every bucket's checksum), and
writes an ordinary model directory under generator.model_cache_dir (weightsync/model_files.py): every engine then
starts as usual, and weight sync carries on from that version.
"""
import asyncio
import logging
import os

from asyncrl.buffer.interface import LearnerUnavailable
from asyncrl.weightsync.buckets import FlatBuckets
from asyncrl.weightsync.catchup import fetch, fetch_files
from asyncrl.weightsync.layout import layout_of
from asyncrl.weightsync.model_files import ModelFilesError, materialize
from asyncrl.weightsync.receiver import verify

log = logging.getLogger(__name__)
WEIGHTS_POLL_S = 0.5
HELLO_TIMEOUT_S = 10.0
"""Each repeated hello's own limit: a learner that went away is noticed in seconds, not after the whole wait."""


def uses_local(source: str, learner_path: str) -> bool:
    """Whether the learner's own directory is to be used (pure: the caller says what exists)."""
    return source == "local" or (source == "auto" and os.path.isfile(os.path.join(learner_path, "config.json")))


async def first_weights(client, config_hash: str, hello, timeout_s: float):
    """The newest weights announcement with a catch-up address: in the hello reply, or in a later one once the learner
    has published (it publishes before it admits anyone, but a generator may say hello first)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    reply = hello
    while reply.weights is None or not reply.weights.catchup:
        if loop.time() > deadline:
            raise LearnerUnavailable(f"the learner at {client.endpoint} announced no weights with a catch-up address "
                                     f"within {timeout_s:.0f} s, and this generator has no model of its own")
        await asyncio.sleep(WEIGHTS_POLL_S)
        reply = await client.hello(config_hash, timeout_s=min(HELLO_TIMEOUT_S, timeout_s))
    return reply.weights


def fetch_model(weights, files_digest: str, cache_dir: str, name: str, timeout_s: float, keys=None) -> tuple:
    """(model directory, version) built from the learner's model files and its newest weights (blocking)."""
    address = weights.catchup
    if weights.lora is not None:
        raise ModelFilesError("the learner trains a LoRA adapter and publishes only the adapter: a generator needs "
                              "the base model on its own host (generator.model_source=local)")
    blob, digest = fetch_files(address, timeout_s, keys=keys)
    if digest != files_digest:
        raise ModelFilesError(f"the catch-up server {address} sent model files {digest[:12]}, the learner announced "
                              f"{files_digest[:12]}")
    got = fetch(address, -1, lambda m: FlatBuckets(layout_of(m)), timeout_s, keys=keys)
    bad = verify(got.buckets, got.announcement)
    if bad:
        raise ModelFilesError(f"weights v{got.announcement.version} from {address} fail the checksums of buckets "
                              f"{bad[:5]}")
    return (materialize(blob, digest, got.buckets.tensors(), os.path.expanduser(cache_dir), name),
            got.announcement.version)


async def resolve_model(gen, fetch_timeout_s: float, client, hello, config_hash: str, generator_id: str, keys,
                        say) -> str:
    """The directory this generator loads its tokenizer and engine from (`gen`: the generator section;
    `fetch_timeout_s`: weightsync.timeout_s)."""
    info = hello.run_info
    if uses_local(gen.model_source, info.model_path):
        return info.model_path
    if not info.model_files:
        raise ModelFilesError(f"the learner serves no model files, and {info.model_path} is not on this host: "
                              f"give this host the model at that path (generator.model_source=local)")
    weights = await first_weights(client, config_hash, hello, gen.connect_timeout_s)
    path, version = await asyncio.to_thread(fetch_model, weights, info.model_files, gen.model_cache_dir,
                                            generator_id, fetch_timeout_s, keys)
    say(f"generator {generator_id}: model files and weights v{version} from the learner ({weights.catchup}), "
        f"in {path}")
    return path
