"""A buffer over a plain queue (the three methods of a LearnerBuffer that the learner's batch collection uses) and
the scored group it is fed, for tests of collect_batch and what sits on it."""
import queue
import time

import numpy as np

from asyncrl.buffer.group import Group, Sample, Sampling


def make_group(rewards, version=0, baseline=None, length=3):
    samples = [Sample(completion_ids=np.arange(2, 2 + length, dtype=np.int32),
                      logprobs=np.full(length, -0.5, dtype=np.float32),
                      versions=np.full(length, version, dtype=np.int32), reward=r, finish_reason="stop")
               for r in rewards]
    meta = {"data_source": "t"} if baseline is None else {"data_source": "t", "baseline_reward": baseline}
    return Group(group_id=f"g{time.perf_counter_ns()}", prompt_id="p", generator_id="gen", prompt_ids=np.array([5, 6], np.int32),
                 samples=samples, sampling=Sampling(temperature=1.0), created_at=time.time(), meta=meta)


class QueueServer:
    """The methods of a LearnerBuffer that collect_batch uses, over a plain queue; counts give-backs and
    quarantines."""

    def __init__(self, groups):
        self.groups = queue.Queue()
        self.given_back = []
        self.reasons = []
        self.quarantined = []
        for group in groups:
            self.groups.put(group)

    def take(self, timeout):
        try:
            return self.groups.get(timeout=min(timeout, 0.05))
        except queue.Empty:
            return None

    def live_generators(self):
        return ["gen"]

    def metrics(self):
        return {"generator/filtered_groups": 5.0}

    def give_back(self, group, reason="stale"):
        self.given_back.append(group.group_id)
        self.reasons.append(reason)

    def quarantine(self, groups, reason, why=None):
        self.quarantined += [(group.group_id, reason) for group in groups]
