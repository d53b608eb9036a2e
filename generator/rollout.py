"""The generator's rollout loop.

Each of `max_inflight_groups` workers repeats: ask the learner for admission -> follow the weights (load the newest
version it has heard of, docs/architecture.md §4: before sampling a new group; generator/weights.py) -> sample and
score one group (generator/sampling.py) -> send it. It talks to the learner only through
`interface.GeneratorBuffer` (either backend), whose typed replies it reads. It waits on: admission
(generator/admission.py: every waiting worker's in one request, polled with backoff while the learner says no),
weight loads, and the learner's replies (each bounded by a timeout). It stops when the learner says the job is done
(buffer/done.py). When the learner stops answering, its workers wait together for it to answer again (a learner
resuming from its checkpoint), and the loop fails only when it does not within the generator's patience.
"""
import asyncio
import logging
import time

import numpy as np

from asyncrl.buffer.codec import encode_group
from asyncrl.buffer.done import BYE_TIMEOUT_S, JobEnd
from asyncrl.buffer.group import Group
from asyncrl.buffer.interface import EvalTask, LearnerUnavailable, Status
from asyncrl.data.prompts import decode_prompt
from asyncrl.generator.admission import AdmissionGate
from asyncrl.generator.evaluation import eval_sampling, sample_and_score
from asyncrl.generator.sampling import GroupSampler
from asyncrl.generator.weights import WeightFollower
from asyncrl.telemetry.timing import BusyClock, idle_fraction

log = logging.getLogger(__name__)
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
        self.learner_lost = 0  # times the learner stopped answering and this generator waited for it
        self.episode_counts: list = []  # per episode this window: (turns, tool calls, environment tokens)
        self._episode_means: dict = {}  # of the last window that finished an episode
        self.pushes = None  # generator/weights.py PushedWeights, once the learner pushes to this engine
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
            "generator/tokens": float(self.tokens),
            "generator/busy_s": busy,
            "generator/version": float(version),
            "generator/weight_failures": float(self.weight_failures),
            "generator/rejected_groups": float(self.rejected_groups),
            "generator/filtered_groups": float(self.filtered_groups),
            "generator/eval_prompts": float(self.eval_prompts),
            "generator/learner_lost": float(self.learner_lost),
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
                 drop_zero_variance: bool = False, episodes=None, rejoin=None):
        """`prompts`: an endless iterator of PromptRow, or None when the learner deals them (buffer/dealing.py);
        `stage`: weightsync.receiver.WeightStage, verified copies of announced versions; `scorer`:
        generator/rewards/scorer.py RewardScorer; `episodes`: agents/episode.py EpisodeRunner, with tools or an
        environment."""
        self.client = client
        self.engine = engine
        self.prompts = prompts
        self.scorer = scorer
        self.tokenizer = tokenizer
        self.max_inflight_groups = max_inflight_groups
        self.on_stats = on_stats
        self.stats_every_s = stats_every_s
        self.delivered = False
        """A group of this process was accepted (logged once)."""
        self.drop_zero_variance = drop_zero_variance
        """algo.dynamic_sampling: a group whose rewards are all equal is dropped here and its admission released,
        so a replacement starts at once. Dropped by the learner instead (learner/collect.py), it would hold its
        admission in the queue until the learner took it, keeping the fleet's staleness budget waiting on the
        learner and the learner waiting on the fleet. The learner still re-checks every group."""
        self.stats = RolloutStats(scorer=scorer, episodes=episodes)
        self.weights = WeightFollower(engine, stage, generator_id, self.stats)
        self.sampler = GroupSampler(engine, scorer, tokenizer, rollout_cfg, generator_id, self.stats,
                                    reward_shaping=reward_shaping, episodes=episodes)
        self.job_end = JobEnd()
        self.admission = AdmissionGate(client, self.note_reply, version_of=lambda: self.engine.version)
        """Every waiting worker's admission in one request, so the grants of a reply are sampled in one batch."""
        self.rejoin = rejoin
        """An async callable that says hello until the learner answers (its HelloReply) or the patience runs out
        (LearnerUnavailable): a worker whose request went unanswered waits on it (`_learner_back`). None: such a
        worker ends the run."""
        self._rejoining: asyncio.Task | None = None

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
            self.weights.close()
            await self.admission.close()
            tasks = (reporter, heard_done, *workers, *([self._rejoining] if self._rejoining else []))
            for task in tasks:
                task.cancel()
            # reaped here, so a worker that failed while another ended the run is not reported as never retrieved
            await asyncio.gather(*tasks, return_exceptions=True)
            # the last report waits no longer than the bye: a generator stopping because its learner is gone
            # would otherwise wait out STATS_TIMEOUT_S for nobody
            await self._send_stats(timeout_s=BYE_TIMEOUT_S)

    def note_reply(self, reply: Status) -> None:
        """What every reply says: the newest weights, whether the job is over, groups rejected since."""
        self.weights.hear(reply.weights)
        self.job_end.hear(reply)
        if reply.rejected is not None:  # groups the learner found invalid when it took them (read, with Redis)
            log.error("learner rejected %s of this generator's groups since its last reply; the last: %s",
                      reply.rejected.count, reply.rejected.last_error)

    async def _worker(self) -> None:
        while not self.done:
            try:
                await self._one_prompt()
            except LearnerUnavailable as err:
                if self.rejoin is None:
                    raise
                await self._learner_back(err)

    async def _one_prompt(self) -> None:
        dealt = await self.admission.take()
        if isinstance(dealt, EvalTask):
            await self._evaluate(dealt)
            return
        if dealt is None and self.prompts is None:
            raise RuntimeError("the learner granted an admission without a prompt, but it deals the prompts "
                               "(the learner and this generator run different asyncrl versions?)")
        row = dealt if dealt is not None else next(self.prompts)
        deals = [row.deal_id] if row.deal_id is not None else None
        await self.weights.ensure_latest()
        with self.stats.busy:  # sampling and scoring: the generator's work; the rest is waiting
            group = await self.sampler.sample(row)
        if group is None:  # nothing to send for this prompt: its admission goes back at once
            self.note_reply(await self.client.release(1, deals=deals, outcome="skipped"))
            return
        if self.drop_zero_variance and group.zero_variance():
            self.stats.filtered_groups += 1  # its rewards are in stats.rewards: reward/mean is the fleet's
            # and in the release: the learner's reward/sampled_mean counts every group sampled (buffer/sampled.py)
            self.note_reply(await self.client.release(1, deals=deals, outcome="zero_variance",
                                                      rewards=group.episode_rewards()))
            return
        await self._send(group)

    async def _learner_back(self, err: LearnerUnavailable) -> None:
        """Wait, with every other worker, for the learner to answer again (`rejoin`), rather than end the run.

        Why: a learner that is killed and resumed from its checkpoint takes longer than a request's timeout to
        answer again (its process starts, loads the model and the checkpoint), and every generator would then exit
        and need restarting, with its engine. Whatever this worker held is left to the learner: a deal of a dead
        learner life is unknown to the next one, and a deal of a live learner expires after data.deal_timeout_s and
        is dealt again, so nothing is lost or trained twice. The newest weights are loaded before the next sample,
        as always (a resumed learner's versions repeat or go back: generator/weights.py follows its new life). One
        wait is shared by the workers that fail together; it raises LearnerUnavailable when the learner does not
        answer within the patience (generator.connect_timeout_s), and the run ends as before."""
        if self._rejoining is None or self._rejoining.done():
            self._rejoining = asyncio.create_task(self._rejoin_once(err))
        await asyncio.shield(self._rejoining)

    async def _rejoin_once(self, err: LearnerUnavailable) -> None:
        self.stats.learner_lost += 1
        started = time.monotonic()
        log.warning("generator %s: %s; waiting for it to answer again", self.client.generator_id, err)
        hello = await self.rejoin()
        self.note_reply(hello)
        log.warning("generator %s: the learner answers again after %.1f s%s", self.client.generator_id,
                    time.monotonic() - started, " and says the job is done" if self.done else "")

    async def _evaluate(self, task: EvalTask) -> None:
        """Sample an evaluation prompt with the weights of exactly its round's version (WeightFollower.pinned); a
        generator already past the version gives the prompt back."""
        async with self.weights.pinned(task.version) as at_version:
            if not at_version:
                self.note_reply(await self.client.eval_done(task.deal_id, None, None))
                return
            with self.stats.busy:
                rewards, lengths, texts = await sample_and_score(self.engine, self.scorer, self.tokenizer,
                                                          decode_prompt(task.deal_id, task.row),
                                                          eval_sampling(task.temperature, task.max_tokens), task.n)
            self.stats.eval_prompts += 1
            self.note_reply(await self.client.eval_done(task.deal_id, rewards, lengths, texts))

    async def _send(self, group: Group) -> None:
        payload = encode_group(group)
        while True:
            reply = await self.client.send(group.group_id, payload, deal=str(group.meta.get("deal", "")))
            self.note_reply(reply)
            if reply.accepted and not self.delivered:
                # one line a person (or a launcher) reads to know this generator delivers, e.g. after a restart
                self.delivered = True
                log.info("generator %s: its first group was accepted (v%d)", self.client.generator_id,
                         self.engine.version)
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

    async def _send_stats(self, timeout_s: float = STATS_TIMEOUT_S) -> None:
        """To the learner (not after "done": it has stopped listening, and the request would wait out its timeout),
        and to MLflow."""
        metrics = {**self.stats.snapshot(self.engine.version),
                   "rollout/resumed_turns": float(self.engine.resumed_requests)}
        if not self.done:
            try:
                await self.client.report(metrics, timeout_s=timeout_s)
            except Exception as err:
                log.debug("could not send stats: %s", err)
        if self.on_stats is not None:
            self.on_stats(metrics)

