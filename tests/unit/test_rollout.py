"""The generator's scoring of a group (ReMax's greedy baseline, DAPO's overlong shaping) and its reaction to failed
weight loads (logic only; the real engines are covered by tests/integration and the e2e runs)."""
import asyncio

import pytest

from asyncrl.buffer.interface import AdmitReply, HelloReply, LearnerUnavailable, Rejections, SendReply, Status
from asyncrl.configs.sections import RewardConfig
from asyncrl.generator.config import RolloutConfig
from asyncrl.data.prompts import PromptRow
from asyncrl.generator.engines.base import Completion, EngineBroken, WeightLoadError
from asyncrl.generator.rewards.functions import score
from asyncrl.generator.rollout import RolloutLoop
from tests.messages import announcement, run_info


class ScriptedEngine:
    """Sampled completions have 1..n tokens of id 7; the greedy one (temperature 0) is a single token 9."""

    version = 3
    resumed_requests = 0

    def __init__(self):
        self.requests = []

    async def sample(self, prompt_ids, sampling, n):
        self.requests.append((sampling.temperature, n))
        if sampling.temperature == 0:
            return [Completion(token_ids=[9], logprobs=[0.0], versions=[3], finish_reason="stop")]
        return [Completion(token_ids=[7] * (i + 1), logprobs=[-0.1] * (i + 1), versions=[3] * (i + 1),
                           finish_reason="stop") for i in range(n)]


class DigitTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(str(i) for i in ids)


def reward_is_nine(data_source, solution_str, ground_truth, extra_info=None):
    return float(solution_str == "9")


class InlineScorer:
    """RewardScorer's interface, calling the function in place (the real worker pool: tests/unit/test_scoring.py)."""

    seconds, calls = 0.0, 0

    def __init__(self, fn):
        self.fn = fn

    def error_counts(self):
        return {}

    async def score(self, data_source, text, ground_truth, extra_info, prompt_id="?", prompt=None):
        return score(self.fn, data_source, text, ground_truth, extra_info)


def sample_group(rollout, reward_cfg):
    engine = ScriptedEngine()
    loop = RolloutLoop(client=None, engine=engine, prompts=iter([]), scorer=InlineScorer(reward_is_nine),
                       tokenizer=DigitTokenizer(), rollout_cfg=rollout, max_inflight_groups=1, generator_id="g",
                       reward_shaping=reward_cfg)
    row = PromptRow(prompt_id="p", prompt_ids=[1, 2], data_source="t", ground_truth="9", extra_info={})
    return asyncio.run(loop.sampler.sample(row)), engine


def test_greedy_baseline_is_scored_and_sent_only_when_asked():
    group, engine = sample_group(RolloutConfig(n=3, max_tokens=4, greedy_baseline=True), RewardConfig())
    assert group.meta["baseline_reward"] == 1.0 and sorted(engine.requests) == [(0.0, 1), (1.0, 3)]
    assert [s.reward for s in group.samples] == [0.0, 0.0, 0.0]
    group, engine = sample_group(RolloutConfig(n=3, max_tokens=4), RewardConfig())
    assert "baseline_reward" not in group.meta and engine.requests == [(1.0, 3)]


def test_overlong_shaping_is_added_to_the_reward_and_reported():
    group, _ = sample_group(RolloutConfig(n=4, max_tokens=4), RewardConfig(overlong_buffer_len=2,
                                                                          overlong_penalty_factor=1.0))
    # lengths 1..4 with max 4 and a buffer of 2: 0, 0, -0.5, -1
    assert [s.reward for s in group.samples] == [0.0, 0.0, -0.5, -1.0]
    assert [s.reward_info["overlong_penalty"] for s in group.samples] == [0.0, 0.0, -0.5, -1.0]


class FakeStage:
    """WeightStage's interface for the loop: every announced version stages fine; loads are recorded."""

    good = None

    def __init__(self):
        self.ended = []

    def stage(self, message):
        return message.version

    def end_load(self, staged, ok):
        self.ended.append((staged, ok))


class FailingEngine(ScriptedEngine):
    def __init__(self, error):
        super().__init__()
        self.error = error

    async def load_weights(self, staged, fallback):
        raise self.error


def loop_with(engine, stage):
    loop = RolloutLoop(client=None, engine=engine, prompts=iter([]), scorer=InlineScorer(reward_is_nine),
                       tokenizer=DigitTokenizer(), rollout_cfg=RolloutConfig(), max_inflight_groups=1,
                       generator_id="g", stage=stage)
    loop.weights.latest = announcement(4)
    return loop


def test_a_failed_load_is_counted_and_sampling_continues_on_the_old_version():
    stage = FakeStage()
    loop = loop_with(FailingEngine(WeightLoadError("v4 did not load; kept v3")), stage)
    asyncio.run(loop.weights.ensure_latest())  # logged, not raised
    assert loop.stats.weight_failures == 1 and stage.ended == [(4, False)]


def test_a_broken_engine_stops_the_generator_with_the_reason():
    stage = FakeStage()
    loop = loop_with(FailingEngine(EngineBroken("v4 failed and so did the reload of v3")), stage)
    with pytest.raises(EngineBroken, match="reload of v3"):
        asyncio.run(loop.weights.ensure_latest())
    assert loop.stats.weight_failures == 1 and stage.ended == [(4, False)]


def test_rejections_the_learner_reports_are_logged_by_the_generator(caplog):
    """The zmq learner validates a group when it takes it, so its verdict arrives in a later reply."""
    loop = RolloutLoop(client=None, engine=ScriptedEngine(), prompts=iter([]), scorer=InlineScorer(reward_is_nine),
                       tokenizer=DigitTokenizer(), rollout_cfg=RolloutConfig(n=1, max_tokens=4), max_inflight_groups=1,
                       generator_id="g", reward_shaping=RewardConfig())
    loop.note_reply(Status())
    assert not caplog.records
    loop.note_reply(Status(rejected=Rejections(3, "reward: nan [bad_reward]")))
    assert "rejected 3 of this generator's groups" in caplog.text and "bad_reward" in caplog.text


def test_a_reply_announcing_newer_weights_is_kept_and_an_older_one_is_not():
    loop = RolloutLoop(client=None, engine=ScriptedEngine(), prompts=iter([]), scorer=InlineScorer(reward_is_nine),
                       tokenizer=DigitTokenizer(), rollout_cfg=RolloutConfig(n=1, max_tokens=4), max_inflight_groups=1,
                       generator_id="g", reward_shaping=RewardConfig())
    loop.note_reply(Status(weights=announcement(4)))
    loop.note_reply(Status(weights=announcement(3, tensors=2)))
    loop.note_reply(Status(weights=None))
    assert loop.weights.latest == announcement(4) and not loop.done


class LoadingEngine(ScriptedEngine):
    """Records each load; its version becomes the staged one (FakeStage stages the version number)."""

    def __init__(self):
        super().__init__()
        self.loads = []
        self.version = 0  # the model's own weights

    async def load_weights(self, staged, fallback):
        self.loads.append(staged)
        self.version = staged


def test_a_restarted_learners_messages_replace_the_previous_lives_even_at_lower_or_equal_versions():
    """A learner resumed from its step-2 checkpoint publishes v2 and v3 again, with other bytes: the generator
    follows the new life (its v3 is not the v3 it holds), and ignores the old life's stale replies."""
    engine = LoadingEngine()
    loop = RolloutLoop(client=None, engine=engine, prompts=iter([]), scorer=InlineScorer(reward_is_nine),
                       tokenizer=DigitTokenizer(), rollout_cfg=RolloutConfig(n=1, max_tokens=4), max_inflight_groups=1,
                       generator_id="g", reward_shaping=RewardConfig(), stage=FakeStage())
    loop.note_reply(Status(weights=announcement(3, publisher="old")))
    asyncio.run(loop.weights.ensure_latest())
    assert engine.loads == [3]
    loop.note_reply(Status(weights=announcement(2, publisher="new")))  # the resumed learner's first publish
    assert loop.weights.latest == announcement(2, publisher="new") and loop.weights.by_version == {
        2: announcement(2, publisher="new")}
    asyncio.run(loop.weights.ensure_latest())  # the engine's v3 is the old life's: v2 of the new one replaces it
    assert engine.loads == [3, 2]
    loop.note_reply(Status(weights=announcement(4, publisher="old")))  # a stale reply of the dead learner
    assert loop.weights.latest.publisher == "new"
    loop.note_reply(Status(weights=announcement(3, publisher="new")))
    asyncio.run(loop.weights.ensure_latest())
    asyncio.run(loop.weights.ensure_latest())  # nothing newer: no load
    assert engine.loads == [3, 2, 3]


class ClosingLearner:
    """A GeneratorBuffer that answers the first admit with "done"; every later request hangs, as a learner that has
    stopped listening."""

    def __init__(self):
        self.ops = []

    async def admit(self, want=1, version=None):
        self.ops.append(("admit", want))
        if len(self.ops) == 1:
            return AdmitReply(done=True, granted=0)
        await asyncio.Event().wait()  # never answered

    async def report(self, metrics, timeout_s=None):
        self.ops.append("stats")
        await asyncio.Event().wait()


def test_on_done_the_generator_stops_at_once_instead_of_waiting_on_requests_the_learner_will_not_answer():
    client = ClosingLearner()
    loop = RolloutLoop(client=client, engine=ScriptedEngine(), prompts=iter([]), scorer=InlineScorer(reward_is_nine),
                       tokenizer=DigitTokenizer(), rollout_cfg=RolloutConfig(n=1, max_tokens=4), max_inflight_groups=4,
                       generator_id="g", reward_shaping=RewardConfig(), stats_every_s=3600)

    async def scenario():
        started = asyncio.get_running_loop().time()
        await asyncio.wait_for(loop.run(), timeout=10)
        return asyncio.get_running_loop().time() - started

    assert asyncio.run(scenario()) < 2 and loop.done
    # the four workers asked together, once; no stats request after "done": nobody would answer it
    assert client.ops == [("admit", 4)]


class AlternatingEngine:
    """Prompt 1 gets n identical answers "9" (every reward 1: zero variance); any other prompt gets "9" and "7"."""

    version = 0
    resumed_requests = 0

    async def sample(self, prompt_ids, sampling, n):
        texts = [[9]] * n if prompt_ids[0] == 1 else [[9], [7]] * (n // 2)
        return [Completion(token_ids=ids, logprobs=[-0.1], versions=[0], finish_reason="stop") for ids in texts]


def test_dynamic_sampling_drops_zero_variance_groups_at_the_generator_and_releases_their_admissions():
    """With algo.dynamic_sampling the generator never sends a group that would teach nothing, and gives its admission
    back at once (a real zmq learner-side buffer and coordinator): with capacity for 2 groups it still delivers 2
    useful ones although every other group it samples is useless."""
    from asyncrl.buffer.staleness import Coordinator
    from asyncrl.buffer.zmq.client import ZmqBufferClient
    from asyncrl.buffer.zmq.server import ZmqBufferServer
    from tests.conftest import free_port

    server = ZmqBufferServer("127.0.0.1", free_port(), Coordinator(0, 2), vocab_size=16, config_hash="h",
                             max_message_bytes=4096, queue_groups=8, run_info=run_info())
    server.start()
    client = ZmqBufferClient(server.endpoint, "g", timeout_s=5)
    rows = (PromptRow(prompt_id=f"p{i}", prompt_ids=[1 + i % 2, 2], data_source="t", ground_truth="9",
                      extra_info={}) for i in range(1000))
    loop = RolloutLoop(client=client, engine=AlternatingEngine(), prompts=rows, scorer=InlineScorer(reward_is_nine),
                       tokenizer=DigitTokenizer(), rollout_cfg=RolloutConfig(n=2, max_tokens=4), max_inflight_groups=1,
                       generator_id="g", reward_shaping=RewardConfig(), stats_every_s=3600, drop_zero_variance=True)

    async def scenario():
        task = asyncio.create_task(loop.run())
        deadline = asyncio.get_running_loop().time() + 10
        while server.queued() < 2 and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)  # a third group would have arrived by now if admission let it start
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    try:
        asyncio.run(scenario())
        taken = [server.take(1.0), server.take(1.0), server.take(0.2)]
        assert taken[2] is None and all(not group.zero_variance() for group in taken[:2])
        assert loop.stats.filtered_groups >= 1 and server.coordinator.started == 2
        assert loop.stats.snapshot(0)["generator/filtered_groups"] == loop.stats.filtered_groups
        # every filtered group's rewards reached the learner with its release (the last may have been cancelled in
        # flight): its reward of what was sampled counts them beside the groups it took (buffer/sampled.py)
        seen = server.sampled_so_far()
        assert seen.varied_groups == 2 and loop.stats.filtered_groups - 1 <= seen.equal_groups <= \
            loop.stats.filtered_groups and seen.equal_groups >= 1
        assert dict(seen.equal_values) == {1.0: seen.equal_groups}  # both samples "9": reward 1
    finally:
        client.close()
        server.close()


class EvalLearner:
    """Records evaluation results (and prompts given back)."""

    def __init__(self):
        self.results = []

    async def eval_done(self, deal_id, rewards, lengths, texts=None):
        self.results.append((deal_id, rewards, lengths, texts))
        return Status()


def test_an_evaluation_prompt_is_sampled_at_its_version_or_given_back():
    """At v3 the engine samples a v3 prompt greedily and scores it without shaping; a v2 prompt (the engine is past
    it) goes back to its round; while a prompt is pinned to v3, the engine is not moved to the newer v5."""
    from asyncrl.buffer.interface import EvalTask
    from asyncrl.data.prompts import encode_prompt

    client, engine = EvalLearner(), ScriptedEngine()
    loop = RolloutLoop(client=client, engine=engine, prompts=None, scorer=InlineScorer(reward_is_nine),
                       tokenizer=DigitTokenizer(), rollout_cfg=RolloutConfig(n=1, max_tokens=4),
                       max_inflight_groups=1, generator_id="g",
                       reward_shaping=RewardConfig(overlong_buffer_len=2, overlong_penalty_factor=5.0))
    loop.note_reply(Status(weights=announcement(3)))
    loop.note_reply(Status(weights=announcement(5)))
    prompt = encode_prompt(PromptRow("t:0", [1], "t", "9", {}))
    loads = []

    async def never_load(target):
        loads.append(target.version)

    loop.weights._load = never_load

    async def scenario():
        await loop._evaluate(EvalTask("e1", 3, prompt, 1, 0.0, 4))
        await loop._evaluate(EvalTask("e2", 2, prompt, 1, 0.0, 4))

    asyncio.run(asyncio.wait_for(scenario(), 10))
    # 9 is right, no overlong shaping, and the completion's text for the learner's samples table
    assert client.results == [("e1", [1.0], [1], ["9"]), ("e2", None, None, None)]
    assert loads == [] and engine.requests == [(0.0, 1)] and loop.weights.pins == {}
    assert loop.stats.eval_prompts == 1


class RestartingLearner:
    """A GeneratorBuffer whose learner is gone from its `gone_at`-th request until `rejoin` is called (a learner
    killed and resuming from its checkpoint): every request meanwhile raises LearnerUnavailable, as a timed-out one
    does. It answers "done" once `groups` groups were accepted after it came back."""

    generator_id = "g"

    def __init__(self, gone_at: int, groups: int):
        self.gone_at, self.groups = gone_at, groups
        self.requests, self.rejoins, self.sent, self.back = 0, 0, [], False

    def _answer(self):
        self.requests += 1
        if self.requests >= self.gone_at and not self.back:
            raise LearnerUnavailable(f"learner at tcp://127.0.0.1:1 did not answer (request {self.requests})")

    async def admit(self, want=1, version=None):
        self._answer()
        await asyncio.sleep(0.001)
        return AdmitReply(granted=want, done=len([s for s in self.sent if s[1]]) >= self.groups)

    async def send(self, group_id, payload, deal=""):
        self._answer()
        self.sent.append((group_id, self.back))
        return SendReply(accepted=True)

    async def report(self, metrics, timeout_s=None):
        return Status()

    async def rejoin(self):
        self.rejoins += 1
        await asyncio.sleep(0.05)  # the learner resuming
        self.back = True
        return HelloReply(weights=announcement(1, publisher="resumed"))


def restart_loop(client, rejoin):
    return RolloutLoop(client=client, engine=ScriptedEngine(), prompts=iter(lambda: PromptRow(
        prompt_id="p", prompt_ids=[1, 2], data_source="t", ground_truth="9", extra_info={}), None),
        scorer=InlineScorer(reward_is_nine), tokenizer=DigitTokenizer(), rollout_cfg=RolloutConfig(n=2, max_tokens=4),
        max_inflight_groups=2, generator_id="g", reward_shaping=RewardConfig(), stats_every_s=3600, rejoin=rejoin)


def test_a_generator_waits_for_a_learner_that_stops_answering_and_delivers_to_it_when_it_is_back():
    """The soak killed a learner whose resume took longer than a request's timeout, and every generator exited
    (a restart each, engine and all). Now both workers, failing together, wait on one rejoin; the loop then follows
    the resumed learner's weights and delivers to it until it says the job is done."""
    client = RestartingLearner(gone_at=4, groups=3)
    loop = restart_loop(client, client.rejoin)
    asyncio.run(asyncio.wait_for(loop.run(), timeout=10))
    assert loop.done and client.rejoins == 1 and loop.stats.learner_lost == 1
    assert len([sent for sent in client.sent if sent[1]]) >= 3  # delivered after the learner came back
    assert loop.weights.latest.publisher == "resumed"
    assert loop.stats.snapshot(0)["generator/learner_lost"] == 1.0


def test_a_learner_that_does_not_come_back_within_the_patience_ends_the_run_and_without_rejoin_at_once():
    client = RestartingLearner(gone_at=2, groups=3)

    async def never_back():
        await asyncio.sleep(0.01)
        raise LearnerUnavailable("no learner answered at tcp://127.0.0.1:1 within 0 s")

    with pytest.raises(LearnerUnavailable, match="no learner answered"):
        asyncio.run(asyncio.wait_for(restart_loop(client, never_back).run(), timeout=10))
    with pytest.raises(LearnerUnavailable, match="did not answer"):
        asyncio.run(asyncio.wait_for(restart_loop(RestartingLearner(gone_at=2, groups=3), None).run(), timeout=10))
