"""Evaluation rounds dealt to the generator fleet while training goes on (docs/architecture.md §3.7).

A round is the held-out prompts (eval.files) to sample at one weight version v, opened by the learner right after it
publishes v (every eval.every_steps, and at v = 0 with eval.before_train). Its prompts are dealt with admission
replies, beside the training grants and never more than half of a request, so training keeps its share of the
fleet. A round is pinned to v: it is dealt only to a generator whose engine is at v or behind (the admit request says
which version it holds), and that generator loads exactly v and holds it until its evaluation prompts of v are
sampled (generator/weights.py); a generator that finds itself past v gives the prompt back. Results come back per
prompt (its n rewards and lengths), are checked (a generator is not trusted: n rewards the training path would
accept, by the same function, plausibility.reward_problem; lengths within the round's max_tokens; a deal out to it),
and when every prompt of a round is in, the learner logs the metrics at step v with `eval/lag_steps`, how far
training had moved on by then. A round not finished within `timeout_s` is abandoned and counted
(`eval/rounds_abandoned`), never waited for.

Thread-safe: the zmq server's thread deals and receives results; the learner's thread opens and collects rounds.
"""
import itertools
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field

from asyncrl.buffer.dealing import DealError, EncodedPrompts
from asyncrl.buffer.interface import EvalTask
from asyncrl.buffer.plausibility import reward_problem

EVALS_PER_REQUEST = 8
"""Most evaluation prompts one admit request is dealt (however many it asks for), so no generator can take a whole
round and sit on it."""


def evals_wanted(want: int) -> int:
    """Evaluation prompts dealt to an admit request for `want`: at most half of it (training keeps its share of the
    fleet), at least one, never more than EVALS_PER_REQUEST."""
    return max(1, min(want // 2, EVALS_PER_REQUEST))


@dataclass
class EvalRound:
    version: int
    n: int
    temperature: float
    max_tokens: int
    deadline: float
    todo: deque = field(default_factory=deque)  # row indexes not dealt (or given back)
    out: dict = field(default_factory=dict)  # deal id -> (row index, holder)
    results: dict = field(default_factory=dict)  # row index -> (rewards, lengths, texts or None)


@dataclass
class FinishedRound:
    version: int
    results: list
    """(data_source, [reward per sample], [length per sample]) per prompt: telemetry/eval_metrics.py's input."""
    samples: list = field(default_factory=list)
    """(prompt row bytes, [completion text per sample], [reward per sample]) per prompt whose generator sent the
    texts: what the learner's samples/eval table shows."""


class EvalRounds:
    def __init__(self, prompts: EncodedPrompts, timeout_s: float, clock=time.monotonic):
        """`prompts`: the eval prompts, encoded for a deal (data/prompts.py::encode_prompts); each one's data source
        names its metrics."""
        self.data_sources = list(prompts.data_sources)
        self.blobs = list(prompts.rows)
        self.timeout_s, self.clock = timeout_s, clock
        self._rounds: dict = {}  # version -> EvalRound, open ones
        self._finished: list = []
        self._incarnation = uuid.uuid4().hex[:8]
        self._serial = itertools.count()
        self.abandoned = 0
        self.refused = 0
        self.engines: dict = {}  # generator -> the version its engine last said it holds (an admit's `ver`)
        self._dealt_at: dict = {}  # deal id -> when it was dealt, for slowest_answer_s
        self.slowest_answer_s = 0.0
        """The longest an accepted result took from its deal (0 before the first): how long the fleet needs to
        answer a prompt, which bounds the end-of-job wait (learner/evals.py::Evaluations.finish)."""
        self.last_result_at: float | None = None
        self._lock = threading.Lock()

    def open(self, version: int, n: int, temperature: float, max_tokens: int) -> None:
        with self._lock:
            self._rounds[version] = EvalRound(version, n, temperature, max_tokens, self.clock() + self.timeout_s,
                                              deque(range(len(self.blobs))))

    def note_engine(self, holder: str, version) -> None:
        """`holder` says its engine holds `version` (each admit request's `ver`; with Redis, EVAL_TAKE records it);
        what `unservable` judges by. A request without one changes nothing."""
        if type(version) is int:
            with self._lock:
                self.engines[holder] = version

    def deal(self, holder: str, holder_version, want: int) -> list:
        """Up to `want` prompts of the oldest open rounds at or after `holder_version` (the generator's engine):
        [[deal id, version, row bytes, n, temperature, max_tokens], ...]."""
        if not isinstance(holder_version, int) or want < 1:
            return []
        out = []
        with self._lock:
            for version in sorted(self._rounds):
                round_ = self._rounds[version]
                while version >= holder_version and round_.todo and len(out) < want:
                    index = round_.todo.popleft()
                    deal_id = f"e{self._incarnation}-{next(self._serial)}"
                    round_.out[deal_id] = (index, holder)
                    self._dealt_at[deal_id] = self.clock()
                    out.append([deal_id, version, self.blobs[index], round_.n, round_.temperature,
                                round_.max_tokens])
        return out

    def result(self, holder: str, deal_id, rewards, lengths, texts=None) -> str | None:
        """A prompt's samples scored: None when accepted, else why refused. `rewards` None gives the prompt back
        (the generator could not pin the round's version). `texts`, optional: the n completions as text, for the
        learner's table of the round's samples (checked like the rest: n strings of a plausible length)."""
        with self._lock:
            round_, index = self._find(deal_id, holder)
            if round_ is None:
                self.refused += 1
                return f"evaluation deal {deal_id!r} is not out to {holder!r}"
            del round_.out[deal_id]
            dealt_at = self._dealt_at.pop(deal_id, None)
            if rewards is None:
                round_.todo.append(index)
                return None
            problem = check_result(rewards, lengths, round_.n, round_.max_tokens, texts)
            if problem is not None:
                self.refused += 1
                round_.todo.append(index)  # another generator samples it
                return problem
            self.last_result_at = self.clock()
            if dealt_at is not None:
                self.slowest_answer_s = max(self.slowest_answer_s, self.last_result_at - dealt_at)
            kept = None if texts is None else [text[:EVAL_TEXT_KEPT_CHARS] for text in texts]
            round_.results[index] = ([float(r) for r in rewards], [int(x) for x in lengths], kept)
            if len(round_.results) == len(self.blobs):
                del self._rounds[round_.version]
                done = sorted(round_.results)
                self._finished.append(FinishedRound(
                    round_.version, [(self.data_sources[i], *round_.results[i][:2]) for i in done],
                    [(self.blobs[i], round_.results[i][2], round_.results[i][0]) for i in done
                     if round_.results[i][2] is not None]))
            return None

    def forget(self, holder: str) -> int:
        """`holder` left or died: its evaluation prompts go back to their rounds."""
        returned = 0
        with self._lock:
            for round_ in self._rounds.values():
                for deal_id, (index, owner) in list(round_.out.items()):
                    if owner == holder:
                        del round_.out[deal_id]
                        self._dealt_at.pop(deal_id, None)
                        round_.todo.append(index)
                        returned += 1
        return returned

    def expire(self) -> list:
        """Rounds past their deadline are abandoned; returns their versions."""
        now = self.clock()
        with self._lock:
            late = [version for version, round_ in self._rounds.items() if round_.deadline <= now]
            self._abandon(late)
        return late

    def unservable(self, live) -> list:
        """The open rounds no generator in `live` can serve. A round is pinned to its version v: only an engine at v
        or behind is dealt its prompts, and a generator holding one stays at v (pinned) until it answers. So when
        every live engine is past v (a generator that joined at v1 never takes the v0 round), or no live generator
        has said which version it holds, nothing will ever answer the round."""
        with self._lock:
            engines = [self.engines[gen] for gen in live if gen in self.engines]
            return [version for version in sorted(self._rounds) if not any(e <= version for e in engines)]

    def abandon(self, versions) -> None:
        """Give up these open rounds (counted in `abandoned`, as a late round is)."""
        with self._lock:
            self._abandon([version for version in versions if version in self._rounds])

    def _abandon(self, versions: list) -> None:
        for version in versions:
            for deal_id in self._rounds.pop(version).out:
                self._dealt_at.pop(deal_id, None)
        self.abandoned += len(versions)

    def finished(self) -> list:
        """Rounds completed since the last call (FinishedRound each), oldest first."""
        with self._lock:
            done, self._finished = self._finished, []
        return sorted(done, key=lambda round_: round_.version)

    def open_versions(self) -> list:
        with self._lock:
            return sorted(self._rounds)

    def _find(self, deal_id, holder: str):
        if not isinstance(deal_id, str):
            return None, None
        for round_ in self._rounds.values():
            entry = round_.out.get(deal_id)
            if entry is not None and entry[1] == holder:
                return round_, entry[0]
        return None, None


def first_due(start_version: int, every: int) -> int | None:
    """The first version due an evaluation in a learner starting at `start_version` (None: eval.every_steps off). A
    resumed learner evaluates its start version again if it was due: that round died with the previous learner."""
    if not every:
        return None
    if start_version and start_version % every == 0:
        return start_version
    return (start_version // every + 1) * every


def eval_due(version: int, next_due: int | None, every: int, before_train: bool) -> tuple[bool, int | None]:
    """(whether published `version` is evaluated, the next version due): version 0 with eval.before_train, then
    the first published version at or past each multiple of eval.every_steps (with weightsync.every_steps > 1 not
    every multiple is published)."""
    if next_due is not None and version >= next_due:
        return True, (version // every + 1) * every
    return version == 0 and before_train, next_due


def decode_eval_task(entry) -> EvalTask:
    """[deal id, version, row bytes, n, temperature, max_tokens] (`EvalRounds.deal`) as an EvalTask, on the
    generator (which decodes its row: data/prompts.py::decode_prompt); DealError for anything else."""
    if not (isinstance(entry, list) and len(entry) == 6 and isinstance(entry[0], str) and isinstance(entry[1], int)
            and isinstance(entry[2], bytes) and isinstance(entry[3], int) and isinstance(entry[4], (int, float))
            and isinstance(entry[5], int)):
        raise DealError("an evaluation deal must be [id, version, row, n, temperature, max_tokens]")
    return EvalTask(entry[0], entry[1], entry[2], entry[3], float(entry[4]), entry[5])


EVAL_TEXT_CHARS_PER_TOKEN = 32
"""The longest an evaluation completion's text may be, per token of the round's max_tokens: a token decodes to a
few characters (a byte-level BPE piece, an escape); a longer text did not come from the tokens it claims."""
EVAL_TEXT_KEPT_CHARS = 2000
"""What the learner keeps of each accepted text until its round finishes (the samples table shows no more): a
round's texts then cost at most prompts x n x this, whatever a generator sends."""


def check_result(rewards, lengths, n: int, max_tokens: int, texts=None) -> str | None:
    """Why a prompt's evaluation result is implausible, or None."""
    if not (isinstance(rewards, list) and isinstance(lengths, list) and len(rewards) == len(lengths) == n):
        return f"an evaluation result needs {n} rewards and {n} lengths"
    for reward in rewards:  # the training path's reward check: a reward it would refuse is refused here too
        problem = reward_problem(reward)
        if problem is not None:
            return f"evaluation reward {problem} [bad_reward]"
    if not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= max_tokens for x in lengths):
        return f"evaluation lengths must be integers in [0, {max_tokens}]"
    if texts is not None:
        longest = EVAL_TEXT_CHARS_PER_TOKEN * max(max_tokens, 1)
        if not (isinstance(texts, list) and len(texts) == n and all(isinstance(t, str) for t in texts)):
            return f"evaluation texts must be {n} strings"
        if any(len(t) > longest for t in texts):
            return f"an evaluation text is longer than {longest} characters ({max_tokens} tokens)"
    return None
