"""Helpers shared by the integration tests: the tiny model's vocabulary, the sampling a job's generators use,
least-privilege Redis users, and waiting for a learner to register its job in Redis."""
import math
import time
import uuid

from asyncrl.buffer.group import Sampling
from asyncrl.buffer.redis.acl import acl_rules


VOCAB = 64
HONEST_LOGPROB = -math.log(VOCAB)
"""What an engine of the tiny model (`tiny_model_dir`: initial weights, logits near 0) gives every token: a scripted
generator's logprobs must stay near the learner's, or learner/trust.py quarantines it (-1.0 is 3 nats off)."""


def recipe_sampling(cfg) -> Sampling:
    """What a generator of this job samples with: the learner rejects anything else (buffer/plausibility.py)."""
    rollout = cfg.rollout
    return Sampling(rollout.temperature, rollout.top_p, rollout.top_k, rollout.max_tokens)


def create_job_user(admin, namespace: str) -> tuple:
    """(user, password) created with the job's rules; the caller deletes it."""
    user, password = f"job{uuid.uuid4().hex[:6]}", uuid.uuid4().hex
    admin.execute_command("ACL", "SETUSER", user, *acl_rules(namespace, password))
    return user, password


def user_url(redis_server, user: str, password: str) -> str:
    return f"redis://{user}:{password}@127.0.0.1:{redis_server.port}/0"


def denials(admin, user: str) -> list:
    """What Redis refused `user` since the log was reset: (reason, command or key)."""
    return [(entry["reason"], entry["object"]) for entry in admin.acl_log() if entry["username"] == user]


def wait_for_the_learner(client, stream) -> None:
    """Until the learner has registered the job in Redis (its config hash in the stream's meta), for 120 s at most:
    a hand-written generator writes the job's keys only after that."""
    deadline = time.monotonic() + 120
    while not client.hget(stream.keys["meta"], "config_hash"):  # the learner is starting
        assert time.monotonic() < deadline, "the learner never registered the job"
        time.sleep(0.05)
