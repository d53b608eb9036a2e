"""The generator's rollout loop.

Each of `max_inflight_groups` workers repeats: ask the learner for admission -> load the newest weights it has
heard of (docs/architecture.md §4: before sampling a new group) -> sample n completions -> score them (off the
event loop: generator/scoring.py) -> send the group. It talks to the learner only through
`interface.GeneratorBuffer` (either backend), whose typed replies it reads. It waits on: admission
(generator/admission.py: every waiting worker's in one request, polled with backoff while the learner says no),
weight loads, and the learner's replies (each bounded by a timeout). It stops when the learner says the job is done
(buffer/done.py), or fails when the learner is gone.
"""
import asyncio
import logging
import math
import time
from collections import Counter

import numpy as np

from asyncrl.buffer.codec import encode_group
from asyncrl.buffer.dealer import DealtPrompt
from asyncrl.buffer.done import JobEnd
from asyncrl.buffer.group import Group, Sample, Sampling, new_group_id
from asyncrl.buffer.interface import EvalTask, Status
from asyncrl.configs.sections import RewardConfig
from asyncrl.generator.admission import AdmissionGate
from asyncrl.generator.agents.episode import PromptTooLong, episodes_to_samples
from asyncrl.generator.engines.base import EngineBroken, WeightLoadError
from asyncrl.generator.pushed_weights import join_push
from asyncrl.generator.rewards import overlong_penalty
from asyncrl.telemetry.timing import BusyClock, idle_fraction
from asyncrl.weightsync.announcement import WeightsAnnouncement
from asyncrl.weightsync.receiver import WeightSyncError

log = logging.getLogger(__name__)
KEPT_WEIGHT_MESSAGES = 8
"""Control messages of recent versions kept, so an evaluation round can load the version it is pinned to."""
STATS_TIMEOUT_S = 5.0
"""A stats report is informational: waiting longer for its answer would only delay the next one."""


class RolloutStats:
    """Counters the generator reports to the learner and to MLflow."""

    def __init__(self, clock=time.monotonic, scorer=None, episodes=None):
        self.clock = clock
        self.scorer = scorer  # its failures and seconds are reported with the rest
        self.episodes = episodes  # agents/episode.py EpisodeRunner: environment and tool metrics
        self.busy = BusyClock(clock)
        self.started = clock()
        self.tokens = 0
        self.groups = 0
        self.rewards: list = []
        self.weight_wait_s = 0.0
        self.weight_loads = 0
        self.weight_failures = 0
        self.rejected_groups = 0  # groups refused at once (too_large, a malformed batch)
        self.filtered_groups = 0  # zero-variance groups dropped here (algo.dynamic_sampling), never sent
        self.skipped_prompts = 0  # prompts whose episode opening was longer than data.max_prompt_tokens
        self.eval_prompts = 0  # held-out prompts sampled for the learner's evaluation rounds
        self.episode_counts: list = []  # per episode this window: (turns, tool calls, environment tokens)
        self._episode_means: dict = {}  # of the last window that finished an episode
        self.pushes = None  # generator/pushed_weights.py PushedWeights, once the learner pushes to this engine
        self._last = (self.started, 0, 0.0)
        self._reward_last = (0.0, 0)

    def snapshot(self, version: int) -> dict:
        now, busy = self.clock(), self.busy.total()
        then, tokens_then, busy_then = self._last
        self._last = (now, self.tokens, busy)
        rewards, self.rewards = self.rewards, []
        return {**self._reward_metrics(), **self._episode_metrics(),
            "perf/generator/tokens_per_s": (self.tokens - tokens_then) / max(now - then, 1e-6),
            "generator/groups": float(self.groups),
            "generator/version": float(version),
            "generator/weight_failures": float(self.weight_failures),
            "generator/rejected_groups": float(self.rejected_groups),
            "generator/filtered_groups": float(self.filtered_groups),
            "generator/eval_prompts": float(self.eval_prompts),
            "timing/generator/wait_for_weights_s": self.weight_wait_s,
            "timing/generator/idle_frac": idle_fraction(busy - busy_then, now - then),
            **({"reward/mean": float(np.mean(rewards))} if rewards else {}),
            **({f"generator/weight_pushes/{kind}": float(count) for kind, count in self.pushes.counts.items()}
               if self.pushes is not None else {}),
        }

    def _episode_metrics(self) -> dict:
        """Means over this window's episodes, and the environments' and tools' failure counts so far. A window in
        which no episode finished (the generator idle while the learner trains, or a window shorter than an
        episode) repeats the last window's means: the learner reads each generator's latest report when it logs a
        step, and a gap there is not a change in the episodes."""
        if self.episodes is None:
            return {}
        counts, self.episode_counts = self.episode_counts, []
        if counts:
            turns, calls, env_tokens = (np.asarray(column, dtype=np.float64) for column in zip(*counts))
            self._episode_means = {"rollout/turns/mean": float(turns.mean()),
                                   "rollout/tool_calls/mean": float(calls.mean()),
                                   "rollout/tool_use_frac": float((calls > 0).mean()),
                                   "rollout/env_tokens/mean": float(env_tokens.mean())}
        return {**self._episode_means, **self.episodes.metrics(),
                "generator/skipped_prompts": float(self.skipped_prompts)}

    def _reward_metrics(self) -> dict:
        """Failed reward calls by reason (and their total), and the mean seconds of a reward call this window."""
        if self.scorer is None:
            return {}
        errors = self.scorer.error_counts()
        seconds, calls = self.scorer.seconds, self.scorer.calls
        seconds_then, calls_then = self._reward_last
        self._reward_last = (seconds, calls)
        return {
            "generator/reward_errors": float(sum(errors.values())),
            **{f"generator/reward_errors/{reason}": float(count) for reason, count in sorted(errors.items())},
            **({"timing/reward_s": (seconds - seconds_then) / (calls - calls_then)} if calls > calls_then else {}),
        }


class RolloutLoop:
    def __init__(self, client, engine, prompts, scorer, tokenizer, rollout_cfg, max_inflight_groups: int,
                 generator_id: str, on_stats=None, stats_every_s: float = 5.0, reward_shaping=None, stage=None,
                 drop_zero_variance: bool = False, episodes=None):
        self.client = client
        self.engine = engine
        self.stage = stage  # weightsync.receiver.WeightStage: verified copies of announced versions
        self.prompts = prompts  # endless iterator of PromptRow; None when the learner deals them (buffer/dealer.py)
        self.scorer = scorer  # generator/scoring.py RewardScorer: `await score(...)`, never blocking the loop
        self.tokenizer = tokenizer
        self.rollout = rollout_cfg
        self.reward_shaping = reward_shaping or RewardConfig()  # reward.overlong_* (DAPO)
        self.max_inflight_groups = max_inflight_groups
        self.generator_id = generator_id
        self.on_stats = on_stats
        self.stats_every_s = stats_every_s
        self.drop_zero_variance = drop_zero_variance
        """algo.dynamic_sampling: a group whose rewards are all equal is dropped here and its admission released,
        so a replacement starts at once. Dropped by the learner instead (learner/collect.py), it would hold its
        admission in the queue until the learner took it; under η = 1 that kept a third of the fleet's budget
        waiting on the learner and the learner waiting on the fleet. The learner still re-checks every group."""
        self.episodes = episodes
        """agents/episode.py EpisodeRunner: with tools or an environment, each sample is a multi-turn episode."""
        self.stats = RolloutStats(scorer=scorer, episodes=episodes)
        self.latest_weights: WeightsAnnouncement | None = None
        self.job_end = JobEnd()
        self._weights_lock = asyncio.Lock()
        self.push_member = None  # weightsync/engine_push member, once a control message names a push
        self.admission = AdmissionGate(client, self.note_reply, version_of=lambda: self.engine.version)
        """Every waiting worker's admission in one request, so the grants of a reply are sampled in one batch."""
        self.weights_by_version: dict = {}  # version -> the last few announcements heard of, for evaluation rounds
        self._publisher: str | None = None  # the learner life whose messages are current (weightsync publisher)
        self._retired: set = set()  # earlier lives: their messages, late in stale replies, are ignored
        self._loaded_publisher: str | None = None  # the life whose weights the engine holds (None: the model's)
        self.pins: Counter = Counter()  # version -> evaluation prompts being sampled at it
        self._unpinned = asyncio.Event()

    @property
    def done(self) -> bool:
        """The learner said the job is over."""
        return self.job_end.heard

    async def run(self) -> None:
        """Sample until the learner says the job is done, or a worker fails (its error is raised).

        On "done" the workers still waiting on the learner are cancelled rather than awaited (buffer/done.py): the
        learner stops answering once every generator has heard it, so each would wait out its request timeout
        for a reply that never comes."""
        workers = {asyncio.create_task(self._worker()) for _ in range(self.max_inflight_groups)}
        reporter = asyncio.create_task(self._report())
        heard_done = asyncio.create_task(self.job_end.wait())
        try:
            pending = set(workers)
            while pending and not heard_done.done():
                finished, pending = await asyncio.wait(pending | {heard_done}, return_when=asyncio.FIRST_COMPLETED)
                pending.discard(heard_done)
                for task in finished - {heard_done}:
                    task.result()  # a worker's error ends the run
        finally:
            if self.push_member is not None:
                self.push_member.close()
            await self.admission.close()
            tasks = (reporter, heard_done, *workers)
            for task in tasks:
                task.cancel()
            # reaped here, so a worker that failed while another ended the run is not reported as never retrieved
            await asyncio.gather(*tasks, return_exceptions=True)
            await self._send_stats()

    def note_reply(self, reply: Status) -> None:
        """What every reply says: the newest weights, whether the job is over, groups rejected since."""
        if reply.weights is None:  # nothing published yet
            version, life = -1, None
        else:
            version, life = reply.weights.version, reply.weights.publisher
        retired = life in self._retired  # a dead learner's message, late: ignored
        if life is not None and not retired and life != self._publisher:
            # a learner that restarted from a checkpoint: its versions repeat or go back, with other bytes, and
            # replace everything the previous life announced
            if self._publisher is not None:
                self._retired.add(self._publisher)
                log.info("generator %s: the learner restarted (publisher %s); following its v%d", self.generator_id,
                         life, version)
            self._publisher = life
            self.latest_weights = reply.weights
            self.weights_by_version = {version: reply.weights}
        elif life is not None and not retired and version > (
                self.latest_weights.version if self.latest_weights is not None else -1):
            self.latest_weights = reply.weights
            self.weights_by_version[version] = reply.weights
            for old in sorted(self.weights_by_version)[:-KEPT_WEIGHT_MESSAGES]:
                del self.weights_by_version[old]
        self.job_end.hear(reply)
        if reply.rejected is not None:  # groups the learner found invalid when it took them (zmq backend)
            log.error("learner rejected %s of this generator's groups since its last reply; the last: %s",
                      reply.rejected.count, reply.rejected.last_error)

    async def _worker(self) -> None:
        while not self.done:
            dealt = await self.admission.take()
            if isinstance(dealt, EvalTask):
                await self._evaluate(dealt)
                continue
            if dealt is None and self.prompts is None:
                raise RuntimeError("the learner granted an admission without a prompt, but it deals the prompts "
                                   "(the learner and this generator run different asyncrl versions?)")
            row = dealt if dealt is not None else next(self.prompts)
            deals = [dealt.deal_id] if dealt is not None else None
            await self.ensure_latest_weights()
            with self.stats.busy:  # sampling and scoring: the generator's work; the rest is waiting
                group = await self._sample_group(row)
            if group is None:  # nothing to send for this prompt: its admission goes back at once
                self.note_reply(await self.client.release(1, deals=deals, outcome="skipped"))
                continue
            if self.drop_zero_variance and group.zero_variance():
                self.stats.filtered_groups += 1  # its rewards are in stats.rewards: reward/mean is the fleet's
                self.note_reply(await self.client.release(1, deals=deals, outcome="zero_variance"))
                continue
            await self._send(group)

    async def ensure_latest_weights(self) -> None:
        """Load the newest announced version if the engine is behind (while evaluation prompts are pinned to a
        version, that one instead); one load at a time."""
        async with self._weights_lock:
            target = self.latest_weights if not self.pins else self.weights_by_version.get(min(self.pins))
            if target is None:
                return
            if self.push_member is None and target.engines and self.stage is not None:
                self.push_member, self.stats.pushes = await join_push(
                    target, self.engine, self._weights_lock, lambda: self.latest_weights, self.stage,
                    self.generator_id, self.stage.catchup_timeout_s)
            foreign = (self._loaded_publisher is not None
                       and target.publisher != self._loaded_publisher)  # an earlier learner life's weights
            if target.version <= self.engine.version and not foreign:
                return
            started = time.monotonic()
            try:
                with self.stats.busy:
                    await self._load(target)
            finally:
                self.stats.weight_wait_s += time.monotonic() - started

    async def _load(self, target: WeightsAnnouncement) -> None:
        """Stage `target` and load it; a failed load is counted and logged, and sampling goes on on the last good
        version, unless the engine is broken (EngineBroken is raised: nothing good is left to sample from)."""
        staged = None
        try:
            staged = await asyncio.to_thread(self.stage.stage, target)  # whole and checksummed, or an error
            await self.engine.load_weights(staged, self.stage.good)
            self.stage.end_load(staged, ok=True)
            self._loaded_publisher = target.publisher
            self.stats.weight_loads += 1
        except (WeightSyncError, WeightLoadError) as err:
            if staged is not None:
                self.stage.end_load(staged, ok=False)
            self.stats.weight_failures += 1
            if isinstance(err, EngineBroken):
                raise
            log.error("generator %s: %s; continuing on v%d", self.generator_id, err, self.engine.version)

    async def _evaluate(self, task: EvalTask) -> None:
        """Sample an evaluation prompt with the weights of exactly its round's version (buffer/eval_rounds.py):
        the engine is held there, training groups included, until this generator's prompts of that round are done;
        rounds of later versions wait their turn. A generator already past the version gives the prompt back."""
        self.pins[task.version] += 1
        try:
            while min(self.pins) != task.version:
                self._unpinned.clear()
                await self._unpinned.wait()
            await self.ensure_latest_weights()
            if self.engine.version != task.version:
                self.note_reply(await self.client.eval_done(task.deal_id, None, None))
                return
            with self.stats.busy:
                row = task.prompt
                completions = await self.engine.sample(row.prompt_ids, Sampling(task.temperature, 1.0, -1,
                                                                                 task.max_tokens), task.n)
                texts = [self.tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in completions]
                scores = await asyncio.gather(*(self.scorer.score(row.data_source, text, row.ground_truth,
                                                                  row.extra_info, prompt_id=row.prompt_id,
                                                                  prompt=row.messages) for text in texts))
            self.stats.eval_prompts += 1
            self.note_reply(await self.client.eval_done(task.deal_id, [reward for reward, _ in scores],
                                                        [len(c.token_ids) for c in completions]))
        finally:
            self.pins[task.version] -= 1
            if not self.pins[task.version]:
                del self.pins[task.version]
            self._unpinned.set()

    async def _sample_group(self, row) -> Group | None:
        sampling = Sampling(self.rollout.temperature, self.rollout.top_p, self.rollout.top_k, self.rollout.max_tokens)
        created = time.time()
        meta = {"data_source": row.data_source}
        if isinstance(row, DealtPrompt):  # the learner accepts the group only under its deal
            meta["deal"] = row.deal_id
        if self.episodes is not None:
            return await self._sample_episodes(row, sampling, created, meta)
        sampled = self.engine.sample(row.prompt_ids, sampling, self.rollout.n)
        if self.rollout.greedy_baseline:
            # ReMax: one greedy decode of the same prompt, scored like the others; its reward is the baseline.
            greedy = Sampling(0.0, 1.0, -1, self.rollout.max_tokens)
            completions, (baseline,) = await asyncio.gather(sampled, self.engine.sample(row.prompt_ids, greedy, 1))
            meta["baseline_reward"], _ = await self._score(row, baseline)
            self.stats.tokens += len(baseline.token_ids)
        else:
            completions = await sampled
        scores = await asyncio.gather(*(self._score(row, completion) for completion in completions))
        samples = []
        for completion, (reward, info) in zip(completions, scores):
            self.stats.rewards.append(reward)
            self.stats.tokens += len(completion.token_ids)
            samples.append(Sample(
                completion_ids=np.asarray(completion.token_ids, dtype=np.int32),
                logprobs=np.asarray(completion.logprobs, dtype=np.float32),
                versions=np.asarray(completion.versions, dtype=np.int32),
                reward=reward, finish_reason=completion.finish_reason, reward_info=info,
            ))
        self.stats.groups += 1
        return Group(group_id=new_group_id(), prompt_id=row.prompt_id, generator_id=self.generator_id,
                     prompt_ids=np.asarray(row.prompt_ids, dtype=np.int32), samples=samples, sampling=sampling,
                     created_at=created, meta=meta)

    async def _sample_episodes(self, row, sampling: Sampling, created: float, meta: dict) -> Group | None:
        """n episodes of the prompt, concurrently; None (skipped, counted) when the opening is too long."""
        runs = await asyncio.gather(*(self.episodes.run(row, sampling) for _ in range(self.rollout.n)),
                                    return_exceptions=True)
        for outcome in runs:
            if isinstance(outcome, PromptTooLong):
                self.stats.skipped_prompts += 1
                log.warning("generator %s: %s; skipped", self.generator_id, outcome)
                return None
            if isinstance(outcome, BaseException):
                raise outcome
        scores = await asyncio.gather(*(self._episode_reward(row, episode) for episode in runs))
        prompt_ids, samples = episodes_to_samples(runs, [reward for reward, _ in scores], [info for _, info in scores])
        if len(prompt_ids) == 0:
            self.stats.skipped_prompts += 1
            log.warning("generator %s: the %d episodes of %s share no opening token; skipped", self.generator_id,
                        len(runs), row.prompt_id)
            return None
        for episode, (reward, _) in zip(runs, scores):
            self.stats.rewards.append(reward)
            self.stats.tokens += sum(episode.loss_mask)
            self.stats.episode_counts.append((episode.turns, episode.tool_calls, episode.env_tokens))
        self.stats.groups += 1
        return Group(group_id=new_group_id(), prompt_id=row.prompt_id, generator_id=self.generator_id,
                     prompt_ids=prompt_ids, samples=samples, sampling=sampling, created_at=created, meta=meta)

    async def _episode_reward(self, row, episode) -> tuple[float, dict]:
        """The environment's rewards when it gave any, else the reward function on the last model turn; an episode
        the environment broke scores 0."""
        if episode.env_error:
            return 0.0, {"env_error": 1.0}
        info = {key: float(value) for key, value in episode.info.items()
                if isinstance(value, (int, float)) and math.isfinite(value)}
        if episode.rewards:
            reward = float(sum(episode.rewards))
            if not math.isfinite(reward):  # the learner would reject the whole group for it
                self.episodes.env_errors["bad_reward"] += 1
                return 0.0, {**info, "env_error": 1.0}
            return reward, info
        reward, scored = await self.scorer.score(row.data_source, episode.last_text, row.ground_truth,
                                                 row.extra_info, prompt_id=row.prompt_id, prompt=row.messages)
        return reward, {**info, **scored}

    async def _score(self, row, completion) -> tuple[float, dict]:
        """Task reward plus DAPO overlong shaping (reward.overlong_*), with the shaping also in reward_info. A
        reward call that fails scores 0 (the scorer counts it); it never stops the generator."""
        text = self.tokenizer.decode(completion.token_ids, skip_special_tokens=True)
        reward, info = await self.scorer.score(row.data_source, text, row.ground_truth, row.extra_info,
                                               prompt_id=row.prompt_id, prompt=row.messages)
        if self.reward_shaping.overlong_buffer_len > 0:
            penalty = overlong_penalty(len(completion.token_ids), self.rollout.max_tokens,
                                       self.reward_shaping.overlong_buffer_len,
                                       self.reward_shaping.overlong_penalty_factor)
            info = {**info, "overlong_penalty": penalty}
            reward += penalty
        return reward, info

    async def _send(self, group: Group) -> None:
        payload = encode_group(group)
        while True:
            reply = await self.client.send(group.group_id, payload, deal=str(group.meta.get("deal", "")))
            self.note_reply(reply)
            if reply.accepted or not reply.retry:
                if not reply.accepted:
                    self.stats.rejected_groups += 1
                    log.error("learner rejected group %s: %s %s", group.group_id, reply.reason, reply.error)
                return
            await asyncio.sleep(0.05)  # the learner's queue is full: keep the group and retry

    async def _report(self) -> None:
        while True:
            await asyncio.sleep(self.stats_every_s)
            await self._send_stats()

    async def _send_stats(self) -> None:
        """To the learner (not after "done": it has stopped listening, and the request would wait out its timeout),
        and to MLflow."""
        metrics = {**self.stats.snapshot(self.engine.version),
                   "rollout/resumed_turns": float(self.engine.resumed_requests)}
        if not self.done:
            try:
                await self.client.report(metrics, timeout_s=STATS_TIMEOUT_S)
            except Exception as err:
                log.debug("could not send stats: %s", err)
        if self.on_stats is not None:
            self.on_stats(metrics)

