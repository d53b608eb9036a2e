"""The dataset cursor, owned by the coordinator: admission deals the prompt to sample (docs/architecture.md §1).

Why the learner deals: when each generator walked the whole dataset with a shuffle of its own, two generators
sampled the same prompts, nobody knew which prompts of an epoch had been trained, and a restart replayed. Here each
admission comes with one row of the dataset (its prompt tokens, data source, ground truth, extra info and chat
messages, encoded by data/prompts.py: the dealer keeps only the cursor and deals the bytes it was given), so a
generator needs no copy of the data, and every prompt of an epoch is trained exactly once:

- A prompt is in exactly one place: not yet dealt (after the cursor), returned (to be dealt again first), out (held
  by a generator under a deal id; delivered once its group is in the learner's queue), or consumed (the learner
  took its group and trained it, or the group was filtered: CONSUME_REASONS).
- A group comes back with its deal id; the learner accepts it only from the generator it was dealt to, for the
  prompt it was dealt (its id and, unless its prompt is an episode's opening, its very tokens: `answer_problem`),
  while the deal is out. Anything else is refused (`unknown_deal`), counted once under `data/refused`.
- A prompt goes back to the epoch, counted under `data/returned/<reason>`, when its group is dropped as too stale
  or rejected as invalid, when its step was poisoned, when the generator holding it leaves or dies before
  delivering it (a group already in the queue is still taken), when a grant was not used, or when its group is not
  delivered within `data.deal_timeout_s` (a group arriving after that is refused: its prompt was dealt again).
- The cursor (epoch, position, the returned prompts, and the prompts out at that moment, which a restart deals
  again) is part of the learner's checkpoint. Deal ids carry the dealer's incarnation, so a group dealt before a
  restart is refused after it rather than trained twice.

Thread-safe: the zmq server's thread deals and expires; the learner's thread accepts, gives back and snapshots.
"""
import hashlib
import itertools
import random
import threading
import time
import uuid
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass

import numpy as np

STATE_FORMAT = 1
RECENT_TAKES = 4096
"""Taken deals remembered for `give_back` (collect_batch gives back right after a take; a poisoned step's groups
are quarantined within the step)."""
RETURN_REASONS = ("stale", "poisoned_step", "failed_step", "rejected", "unused", "generator_gone", "expired",
                  "restart")
"""Why a prompt went back to the epoch; each is a metric, data/returned/<reason>."""
UNBOUNDED = 1 << 30
"""`available()` without data.epochs: more than any admission asks for."""
CONSUME_REASONS = ("zero_variance", "skipped", "empty", "no_baseline")
"""Why a prompt was consumed without training (data/filtered/<reason>): its group carried no signal (DAPO dynamic
sampling, on the generator or the learner), its episode's opening did not fit, or its group came back in a shape
that sampling it again would likely repeat (no completion token at all; ReMax without its greedy baseline), which
would otherwise keep the epoch from ever ending."""


class DealError(ValueError):
    """A dealt prompt that is not a well-formed deal or row (the generator refuses it; data/prompts.py checks the
    row), or a dealer state that does not fit this dataset (the learner refuses to resume with it)."""


@dataclass
class EncodedPrompts:
    """The dataset as the dealer (and the evaluation rounds, buffer/eval_rounds.py) hold it: each prompt's id (what
    its group names when it comes back), its row encoded for a deal, and its data source. The buffer never reads a
    row: data/prompts.py encodes it on the learner and decodes it on the generator, so the buffer needs no row type
    and stays below data/."""

    prompt_ids: list
    rows: list
    """bytes each, dealt as they are."""
    data_sources: list
    prompt_digests: list
    """`prompt_digest` of each row's prompt tokens: a group answering a deal must carry those tokens, and the
    learner compares digests instead of keeping (or decoding) every row's tokens."""


def prompt_digest(prompt_ids) -> bytes:
    """16 bytes naming a prompt's tokens (as int32 little-endian, their wire form)."""
    return hashlib.blake2b(np.asarray(prompt_ids, "<i4").tobytes(), digest_size=16).digest()


@dataclass(frozen=True)
class DealAnswer:
    """What a group says about the deal it answers, read from the group by `answer_of`."""

    deal_id: object
    """Its meta's `deal` (anything a generator wrote; a str when honest)."""
    prompt_id: str
    prompt_digest: bytes | None
    """`prompt_digest` of its prompt tokens; None when they are not compared: an episode's opening is rendered by
    its environment from the row's messages, so it need not be the row's tokens."""


def answer_of(group, compare_tokens: bool) -> DealAnswer:
    """The deal a decoded `Group` answers, its prompt, and (`compare_tokens`) its prompt tokens' digest."""
    return DealAnswer(group.meta.get("deal"), group.prompt_id,
                      prompt_digest(group.prompt_ids) if compare_tokens else None)


def answer_problem(deal_id: str, answer: DealAnswer, prompt_id: str, digest: bytes) -> str | None:
    """Why a group sent under `deal_id` (a deal out to its generator, for prompt `prompt_id` whose tokens have
    `digest`) does not answer it; None when it does. Both backends ask this: a generator that keeps the deal and the
    prompt id but swaps the prompt's tokens would otherwise have its group trained, and recorded, as the dealt
    prompt."""
    if answer.deal_id != deal_id:
        return f"it was sent under deal {deal_id!r}, its meta names {answer.deal_id!r}"
    if answer.prompt_id != prompt_id:
        return f"deal {deal_id!r} was for prompt {prompt_id!r}, not {answer.prompt_id!r}"
    if answer.prompt_digest is not None and answer.prompt_digest != digest:
        return f"deal {deal_id!r} was for prompt {prompt_id!r}, and these are not its prompt tokens"
    return None


def check_deal(entry) -> tuple:
    """One deal of an admit reply, [deal id, row bytes], as (deal id, row bytes) for the generator to decode
    (data/prompts.py::decode_prompt); DealError for anything else."""
    if not (isinstance(entry, (list, tuple)) and len(entry) == 2 and isinstance(entry[0], str)
            and isinstance(entry[1], bytes)):
        raise DealError("a deal must be [deal id, row bytes]")
    return entry[0], entry[1]


def epoch_order(size: int, epoch: int, shuffle: bool, seed: int) -> list:
    """The order of epoch `epoch`: the same for the same (seed, epoch), so a resumed job walks the same epoch."""
    order = list(range(size))
    if shuffle:
        random.Random(f"{seed}:{epoch}").shuffle(order)
    return order


def fingerprint(prompt_ids: list) -> str:
    """Names the dataset a cursor belongs to (its prompt ids in file order)."""
    digest = hashlib.sha256()
    for prompt_id in prompt_ids:
        digest.update(prompt_id.encode() + b"\0")
    return digest.hexdigest()[:16]


@dataclass
class Deal:
    epoch: int
    index: int
    holder: str
    deadline: float
    delivered: bool = False
    """Its group is in the learner's queue: neither its holder leaving nor its deadline takes the prompt back."""


class PromptDealer:
    def __init__(self, prompts: EncodedPrompts, *, shuffle: bool, seed: int, epochs: int | None, timeout_s: float,
                 clock=time.monotonic):
        """`prompts`: the dataset, already tokenized, filtered and encoded (data/prompts.py::encode_prompts);
        `epochs`: None deals forever."""
        if not prompts.rows:
            raise DealError("no prompts to deal")
        self._blobs = list(prompts.rows)
        self._prompt_ids = list(prompts.prompt_ids)
        self._digests = list(prompts.prompt_digests)
        self.fingerprint = fingerprint(self._prompt_ids)
        self.data_sources = sorted(set(prompts.data_sources))
        self.shuffle, self.seed, self.epochs, self.timeout_s, self.clock = shuffle, seed, epochs, timeout_s, clock
        self.epoch, self.position = 0, 0
        self._order = epoch_order(self.size, 0, shuffle, seed)
        self._returned: deque = deque()  # (epoch, index), dealt again before the cursor moves
        self._out: OrderedDict = OrderedDict()  # deal id -> Deal, in dealing order (= deadline order)
        self._by_holder: dict = {}  # holder -> its deal ids (a dict: in dealing order)
        self._taken: OrderedDict = OrderedDict()  # deal id -> (epoch, index), the recent takes
        self._incarnation = uuid.uuid4().hex[:8]
        self._serial = itertools.count()
        self.dealt, self.consumed = 0, 0
        self.returned, self.filtered = Counter(), Counter()
        self.refused = 0
        self._lock = threading.Lock()

    @property
    def size(self) -> int:
        return len(self._blobs)

    def row_blob(self, index: int) -> bytes:
        """Row `index` of the dataset as a deal carries it (the Redis dealer keeps its ready deals in Redis)."""
        return self._blobs[index]

    def prompt_id_at(self, index: int) -> str:
        return self._prompt_ids[index]

    def prompt_digest_at(self, index: int) -> bytes:
        return self._digests[index]

    # --- the server's side ---------------------------------------------------------------------------------
    def available(self) -> int:
        """Prompts that can be dealt now: the returned ones and the rest of the epochs (endless without
        data.epochs)."""
        with self._lock:
            if self.epochs is None:
                return UNBOUNDED
            later = (self.epochs - self.epoch - 1) * self.size
            return len(self._returned) + max(0, self.size - self.position) + max(0, later)

    def deal(self, holder: str, count: int) -> list:
        """Up to `count` deals for `holder`: [deal id, row bytes] each, returned prompts first."""
        out = []
        with self._lock:
            while len(out) < count:
                place = self._next_place()
                if place is None:
                    break
                deal_id = f"{self._incarnation}-{next(self._serial)}"
                self._out[deal_id] = Deal(place[0], place[1], holder, self.clock() + self.timeout_s)
                self._by_holder.setdefault(holder, {})[deal_id] = None
                self.dealt += 1
                out.append([deal_id, self._blobs[place[1]]])
        return out

    def settle(self, holder: str, deal_ids, outcome: str) -> int:
        """Deals `holder` hands back without a group: `unused` grants go back to the epoch; `zero_variance` and
        `skipped` prompts are consumed (filtered). Only deals it holds count; returns how many did."""
        if outcome not in ("unused", *CONSUME_REASONS) or not isinstance(deal_ids, (list, tuple)):
            return 0
        settled = 0
        with self._lock:
            for deal_id in deal_ids[:len(self._by_holder.get(holder, ()))]:
                deal = self._pop_out(deal_id, holder)
                if deal is None:
                    continue
                settled += 1
                if outcome == "unused":
                    self._give_back_place((deal.epoch, deal.index), "unused")
                else:
                    self.consumed += 1
                    self.filtered[outcome] += 1
        return settled

    def delivered(self, holder: str, deal_id) -> bool:
        """The group of `deal_id` reached the learner's queue (the server thread, before the learner validates
        it); False when it is no deal out to `holder`."""
        with self._lock:
            deal = self._out.get(deal_id) if isinstance(deal_id, str) else None
            if deal is None or deal.holder != holder:
                return False
            deal.delivered = True
            return True

    def forget(self, holder: str) -> int:
        """`holder` left or died: the prompts it held and had not delivered go back to the epoch."""
        with self._lock:
            held = self._by_holder.pop(holder, {})
            returned = 0
            for deal_id in held:
                deal = self._out[deal_id]
                if deal.delivered:
                    continue  # in the queue: the learner takes it (accept checks the holder's name, not its life)
                del self._out[deal_id]
                self._give_back_place((deal.epoch, deal.index), "generator_gone")
                returned += 1
            return returned

    def expire(self) -> int:
        """Deals out past their deadline, undelivered, go back to the epoch."""
        now, expired = self.clock(), []
        with self._lock:
            for deal_id, deal in self._out.items():  # in dealing order, so in deadline order
                if deal.deadline > now:
                    break
                if not deal.delivered:
                    expired.append(deal_id)
            for deal_id in expired:
                deal = self._pop_out(deal_id, self._out[deal_id].holder)
                self._give_back_place((deal.epoch, deal.index), "expired")
        return len(expired)

    # --- the learner's side --------------------------------------------------------------------------------
    def accept(self, holder: str, deal_id, answer: DealAnswer) -> str | None:
        """A group arrived under `deal_id` (its request's header): None when that is a deal out to `holder` and
        the group answers it (`answer_problem`; the prompt is then consumed, unless given back), else why it is
        refused, counted once in `refused` (data/refused)."""
        with self._lock:
            deal = self._out.get(deal_id) if isinstance(deal_id, str) else None
            if deal is None or deal.holder != holder:
                problem = (f"deal {deal_id!r} is not out to {holder!r} (never dealt, dealt before a restart, expired "
                           f"after data.deal_timeout_s, or already delivered)")
            else:
                problem = answer_problem(deal_id, answer, self._prompt_ids[deal.index], self._digests[deal.index])
            if problem is not None:
                self.refused += 1
                return problem
            self._pop_out(deal_id, holder)
            self._taken[deal_id] = (deal.epoch, deal.index)
            while len(self._taken) > RECENT_TAKES:
                self._taken.popitem(last=False)
            self.consumed += 1
            return None

    def reject(self, holder: str, deal_id, reason: str = "rejected") -> bool:
        """The group delivered under `deal_id` will not be taken: its prompt goes back to the epoch, counted under
        `reason` (`rejected` when it was invalid, `stale` when sampled by weights a restart discarded, as the Redis
        learner counts it)."""
        with self._lock:
            deal = self._pop_out(deal_id, holder)
            if deal is None:
                return False
            self._give_back_place((deal.epoch, deal.index), reason)
            return True

    def give_back(self, deal_id, reason: str) -> bool:
        """A taken group will not be trained: `zero_variance` keeps its prompt consumed (filtered), any other
        reason returns it to the epoch."""
        with self._lock:
            place = self._taken.pop(deal_id, None) if isinstance(deal_id, str) else None
            if place is None:
                return False
            if reason in CONSUME_REASONS:
                self.filtered[reason] += 1
            else:
                self.consumed -= 1
                self._give_back_place(place, reason)
            return True

    def exhausted(self) -> bool:
        """Every prompt of the last epoch (data.epochs) was dealt and none is out: nothing more will come."""
        with self._lock:
            return self._cursor_done() and not self._returned and not self._out

    def snapshot(self) -> dict:
        """The cursor for the learner's checkpoint. The prompts out now are dealt again after a restart (returned
        under `restart`): whatever becomes of their groups, a learner resumed from this checkpoint has not trained
        them."""
        with self._lock:
            return {"format": STATE_FORMAT, "fingerprint": self.fingerprint, "size": self.size,
                    "epoch": self.epoch, "position": self.position,
                    "returned": [list(place) for place in self._returned],
                    "out": [[deal.epoch, deal.index] for deal in self._out.values()], "dealt": self.dealt,
                    "consumed": self.consumed, "returned_by_reason": dict(self.returned),
                    "filtered_by_reason": dict(self.filtered)}

    def restore(self, state: dict) -> None:
        """Carry on from a checkpoint's cursor; a cursor of another dataset is refused (DealError)."""
        if state.get("format") != STATE_FORMAT:
            raise DealError(f"data cursor format {state.get('format')!r} is not {STATE_FORMAT}")
        if state.get("fingerprint") != self.fingerprint:
            raise DealError(f"the checkpoint's data cursor belongs to another dataset (fingerprint "
                            f"{state.get('fingerprint')} over {state.get('size')} prompts; this job has "
                            f"{self.fingerprint} over {self.size}): resume with the same data files, "
                            f"data.max_prompt_tokens and tokenizer, or start a new job")
        with self._lock:
            self.epoch, self.position = int(state["epoch"]), int(state["position"])
            self._order = epoch_order(self.size, self.epoch, self.shuffle, self.seed)
            self._returned = deque((int(epoch), int(index)) for epoch, index in state["returned"] + state["out"])
            self.dealt, self.consumed = int(state["dealt"]), int(state["consumed"])
            self.returned = Counter(state["returned_by_reason"])
            self.returned["restart"] += len(state["out"])
            self.filtered = Counter(state["filtered_by_reason"])

    def metrics(self) -> dict:
        with self._lock:
            out = {"data/epoch": self.epoch + self.position / self.size, "data/dealt": float(self.dealt),
                   "data/consumed": float(self.consumed), "data/out": float(len(self._out)),
                   "data/refused": float(self.refused)}
        for reason in RETURN_REASONS:
            if self.returned[reason]:
                out[f"data/returned/{reason}"] = float(self.returned[reason])
        for reason in CONSUME_REASONS:
            if self.filtered[reason]:
                out[f"data/filtered/{reason}"] = float(self.filtered[reason])
        return out

    # --- under the lock ------------------------------------------------------------------------------------
    def _cursor_done(self) -> bool:
        return self.position >= self.size and self.epochs is not None and self.epoch + 1 >= self.epochs

    def _next_place(self) -> tuple | None:
        if self._returned:
            return self._returned.popleft()
        if self.position >= self.size:
            if self._cursor_done():
                return None
            self.epoch += 1
            self.position = 0
            self._order = epoch_order(self.size, self.epoch, self.shuffle, self.seed)
        place = (self.epoch, self._order[self.position])
        self.position += 1
        return place

    def _pop_out(self, deal_id, holder: str) -> Deal | None:
        deal = self._out.get(deal_id) if isinstance(deal_id, str) else None
        if deal is None or deal.holder != holder:
            return None
        del self._out[deal_id]
        held = self._by_holder.get(holder)
        if held is not None:
            held.pop(deal_id, None)
            if not held:
                del self._by_holder[holder]
        return deal

    def _give_back_place(self, place: tuple, reason: str) -> None:
        self._returned.append(place)
        self.returned[reason] += 1
