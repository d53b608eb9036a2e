"""The embedded ZeroMQ buffer, hosted in the learner process (`interface.LearnerBuffer`).

A ROUTER socket served by one background thread. It consumes requests from generators (hello, admit, group,
stats, bye) and puts each group's bytes on a queue bounded in groups and in bytes, which the learner drains with
`take`; `take` validates every group with the codec and against the job's limits (see `take` for why there). When
the queue is full it tells the generator to retry: nothing is dropped and memory stays bounded. Bad input is
rejected, counted under `buffer/rejected/<reason>`, logged at a bounded rate (rejections.py), and the generator
that sent it is told in its next reply; it never stops either thread. A rejected or dropped group gives back an
admission only if it held one, and a group must carry the generator id of the connection that sent it. With a
`PromptDealer` the admissions carry the prompts to sample, and a group is taken only under the deal it answers
(buffer/dealing.py; docs/architecture.md §3.6).
"""
import logging
import queue
import threading
import time
import uuid
from collections import OrderedDict, deque

import zmq

from asyncrl.buffer.codec import CodecError, decode_group
from asyncrl.buffer.dealing import PromptDealer, answer_of
from asyncrl.buffer.done import wait_until_told
from asyncrl.buffer.eval_rounds import EvalRounds, evals_wanted
from asyncrl.buffer.fleet_stats import fleet_metrics
from asyncrl.buffer.interface import RunInfo
from asyncrl.buffer.plausibility import JobLimits, check_admit, check_stats
from asyncrl.buffer.sampled import SampledRewards, SampledSoFar, check_released_rewards
from asyncrl.telemetry.rejections import RejectionLog
from asyncrl.buffer.staleness import Coordinator
from asyncrl.buffer.zmq.wire import ProtocolError, pack, unpack_request
from asyncrl.security.curve import CurveGuard, warn_if_open
from asyncrl.weightsync.announcement import WeightsAnnouncement

log = logging.getLogger(__name__)

DRAIN_MAX_REQUESTS = 64
"""Requests answered per wake-up before the server polls again."""
EXPIRE_EVERY_S = 0.1
"""How often silent peers are looked for (their admissions reclaimed, their stats dropped)."""
MAX_LIFE_CHARS = 64
"""A hello's `life` (a process's random id) longer than this is ignored, as a hostile one would be."""
RELEASE_EVERY = 4
"""Requests answered, or groups accepted, between releases of replies and groups (see `_answer_waiting`)."""
RECENT_TAKES = 4096
"""Taken groups whose admission is remembered for `give_back` (collect_batch gives back right after a take)."""
TRANSPORT_SLACK = 2
"""libzmq's own message limit is this many times max_message_bytes (plus a MiB for the header): a group up to
there reaches the server and gets its too_large reply. ZmqBufferClient never sends a larger one (it answers
too_large itself), so only a client that ignores the limit meets libzmq's, which drops that connection."""


class ZmqBufferServer:
    def __init__(self, host: str, port: int, coordinator: Coordinator, *, vocab_size: int, config_hash: str,
                 max_message_bytes: int, queue_groups: int, run_info: RunInfo, peer_timeout_s: float = 120.0,
                 queue_bytes: int = 0, limits: JobLimits | None = None, shared_config: dict | None = None,
                 dealer: PromptDealer | None = None, evals: EvalRounds | None = None, keys=None):
        self.coordinator = coordinator
        self.dealer = dealer  # deals the prompts with the admissions (buffer/dealing.py); None: generators walk theirs
        self.evals = evals  # evaluation rounds dealt beside the admissions (buffer/eval_rounds.py)
        self.vocab_size = vocab_size
        self.config_hash = config_hash
        self.shared_config = shared_config or {}  # told to a generator whose config hash differs (it names keys)
        self.max_message_bytes = max_message_bytes
        self.run_info = run_info.to_wire()  # as every hello reply carries it
        self.peer_timeout_s = peer_timeout_s
        self.queue_groups = queue_groups
        self.queue_bytes = queue_bytes  # 0: bounded in groups only
        self.limits = limits
        # Groups travel to `take` in lists, one per release (`_release`): the taking thread, when it had run dry,
        # wakes once per list instead of once per group. Each count has one writer, so `queued` needs no lock.
        self._released: queue.SimpleQueue = queue.SimpleQueue()  # lists of (generator, bytes, held an admission,
        # the deal its header named)
        self._taking: deque = deque()  # the list being taken from: the taking thread's alone
        self._queued_in, self._queued_out = 0, 0  # groups released (server thread) and taken (taking thread)
        self._bytes_in, self._bytes_out = 0, 0  # their bytes, counted the same way
        self._rejections = RejectionLog(log, "input")  # groups, requests and stats; both threads reject
        self.received = 0  # valid groups taken
        self.sampled = SampledRewards()  # the rewards of every group taken or filtered (buffer/sampled.py)
        self.dropped_future = 0  # valid groups sampled with weights newer than the learner's (a resumed learner)
        self._held: OrderedDict = OrderedDict()  # group id -> it held an admission, for the recent takes
        self._unheard_rejections: dict[str, tuple[int, str]] = {}  # generator -> (count, last error) not yet told
        self._rejections_lock = threading.Lock()
        self.generator_stats: dict[str, dict] = {}
        self.last_seen: dict[str, float] = {}
        self.lives: dict[str, str] = {}  # generator -> the life of its newest hello (buffer/zmq/client.py)
        self.joins: dict[str, dict] = {}  # generator -> version at hello, min token version of its first group
        # (id, announcement) of the newest weights, replaced whole so the server thread never reads a new
        # message under an old id; the id names one set_weights call, and a generator holding it is not sent it again
        self._weights: tuple[str, dict | None] = ("", None)
        self._done = False
        self.told_done: set[str] = set()  # generators that received a reply saying the job is done
        self._stop = threading.Event()
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.MAXMSGSIZE, TRANSPORT_SLACK * max_message_bytes + (1 << 20))
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.curve = CurveGuard(self._context, keys, "the buffer")  # keys: security.curve.ServerKeys, or None
        self.curve.before_bind(self._socket)
        try:
            self._socket.bind(f"tcp://{host}:{port}")
        except zmq.ZMQError as err:
            self.curve.close()
            self._socket.close()
            self._context.term()
            raise RuntimeError(f"buffer cannot bind tcp://{host}:{port}: {err} (is another job using buffer.port?)")
        self.curve.after_bind(self._socket)
        warn_if_open(host, keys, "the buffer")
        self.endpoint = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._thread = threading.Thread(target=self._serve, name="asyncrl-buffer", daemon=True)

    # --- learner side -------------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def take(self, timeout_s: float):
        """The next valid group, or None after `timeout_s`; invalid ones met on the way are rejected and counted.

        Groups are validated here, on the thread that takes them, not on the server thread, as the Redis backend
        does. When the server thread validated, two Python threads ran Python per group and handed the GIL back
        and forth: the taking thread was woken 0.77 times per group and the consumer process spent 45-70 us of CPU
        per 4 KB group over raw PUSH/PULL (bench/buffer.py). Validating here, the server thread only parses the
        small request and replies, mostly inside libzmq with the GIL released: 170 against raw's 168 us per
        group. The learner pays for validation in `collect_batch`, about 0.1 ms per 4 KB group, which is small
        beside a training step; a generator hears of a rejection in its next reply instead of this one. Handing
        groups over in lists (one per release) took the taking thread's CPU per group from 144-185 to 110-157 us
        (raw's decoding: 91-175 us; this machine's speed drifts that much between runs)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if not self._taking:
                    self._taking.extend(self._released.get(timeout=max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                return None
            gen, data, admitted, deal = self._taking.popleft()
            self._queued_out += 1
            self._bytes_out += len(data)
            try:
                group = decode_group(data, vocab_size=self.vocab_size, max_version=self.coordinator.version,
                                     max_message_bytes=self.max_message_bytes, limits=self.limits)
            except CodecError as err:
                if err.reason == "future_version":  # sampled by weights a restart discarded: no policy can use it
                    self.dropped_future += 1
                    if admitted:
                        self.coordinator.give_back(1)
                    if self.dealer is not None and deal:
                        self.dealer.reject(gen, deal, "stale")
                else:
                    self._reject(gen, err.reason, str(err), admitted, deal=deal)
                continue
            if group.generator_id != gen:  # one identity: a connection speaks only for itself
                self._reject(gen, "generator_id", f"generator_id: {group.generator_id!r} sent by {gen!r} "
                                                  f"[generator_id]", admitted, deal=deal)
                continue
            if self.dealer is not None:  # a dealt prompt (its tokens too), delivered by the generator it was dealt to
                problem = self.dealer.accept(gen, deal, answer_of(group, compare_tokens=not (
                    self.limits is not None and self.limits.episodes)))
                if problem is not None:
                    self._reject(gen, "unknown_deal", f"group {group.group_id}: {problem} [unknown_deal]", admitted,
                                 deal=deal)
                    continue
            self._held[group.group_id] = admitted
            while len(self._held) > RECENT_TAKES:
                self._held.popitem(last=False)
            self.received += 1
            join = self.joins.setdefault(gen, {"hello_version": None})
            if "first_group_min_version" not in join:  # only the first group counts; skip the scan for the rest
                join["first_group_min_version"] = group.min_version()
            self.sampled.add(group.episode_rewards())
            return group

    def take_sampled(self) -> dict:
        return self.sampled.take_window()

    def sampled_so_far(self) -> SampledSoFar:
        return self.sampled.seen()

    def give_back(self, group, reason: str = "stale") -> None:
        """A taken group the learner will not train: its admission frees capacity, if it held one (a group sent
        without asking, or after its generator's admissions were reclaimed, did not); its dealt prompt goes back
        to the epoch, or stays consumed when the group was filtered (buffer/dealing.py)."""
        if self._held.pop(group.group_id, False):
            self.coordinator.give_back(1, token=group.group_id)
        if self.dealer is not None:
            self.dealer.give_back(group.meta.get("deal"), reason)

    def quarantine(self, groups: list, reason: str, detail: str = "poisoned a step") -> None:
        for group in groups:  # each generator hears it in its next reply
            self.give_back(group, reason)
            self._rejections.reject(reason, group.generator_id, error := f"group {group.group_id}: {detail} [{reason}]")
            self._tell(group.generator_id, error)

    @property
    def rejected(self) -> dict:
        """reason -> groups (and requests) rejected so far."""
        return self._rejections.snapshot()

    def announce_weights(self, message: WeightsAnnouncement) -> None:
        """Announce published weights; generators learn of them in their next reply.

        The announcement lists every tensor (17 KB for a 0.5B model, over 1 MB for a large MoE), so a reply
        carries it only to a generator whose request names another `weights_id` than the newest (`_handle`):
        packing it into every reply cost more than validating the group it answered. The id is fresh per call,
        not the version: a learner resumed from a checkpoint republishes a version number with other addresses."""
        self._weights = (uuid.uuid4().hex[:16], message.to_wire())

    def set_version(self, version: int) -> None:
        self.coordinator.set_version(version)

    def take_receipts(self) -> list[str]:
        """Nothing to acknowledge: groups queued in memory are lost with the learner (the Redis backend is durable)."""
        return []

    def on_checkpoint(self, receipts: list[str]) -> None:
        """Nothing to forget (see take_receipts)."""

    def finish(self, grace_s: float) -> list[str]:
        """The job is over (buffer/done.py): every further reply says so; keep serving until every generator seen
        in the last `grace_s` has been told, at most `grace_s`. Returns those never told (crashed, or still
        loading their model)."""
        self._done = True
        return wait_until_told(self._untold_since, grace_s)

    def _untold_since(self, since: float) -> list[str]:
        return [gen for gen, seen in list(self.last_seen.items()) if gen not in self.told_done and seen > since]

    def generators(self) -> dict:
        return {gen: dict(record) for gen, record in list(self.joins.items())}

    def metrics(self) -> dict:
        """Copies first (one C call each, so atomic): the server thread adds keys while the learner reads."""
        out = {"buffer/size": float(self.queued()), "buffer/size_bytes": float(self._bytes_in - self._bytes_out),
               "buffer/received": float(self.received), "buffer/dropped/future_version": float(self.dropped_future),
               "buffer/refused_connections": float(self.curve.refused)}
        for reason, count in self.rejected.items():
            out[f"buffer/rejected/{reason}"] = float(count)
        if self.dealer is not None:
            out.update(self.dealer.metrics())
        live = set(self.live_generators())  # a dead generator's last report no longer counts
        out.update(fleet_metrics([stats for gen, stats in list(self.generator_stats.items()) if gen in live]))
        return out

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self.curve.close(self._socket)
        self._socket.close(linger=0)
        self._context.term()

    def queued(self) -> int:
        """Valid groups waiting for the learner."""
        return self._queued_in - self._queued_out

    def serve_evals(self) -> None:
        """Nothing to do: the server thread deals evaluation prompts and takes their results as requests come."""

    def live_generators(self) -> list[str]:
        now = time.monotonic()
        return [g for g, seen in list(self.last_seen.items()) if now - seen < self.peer_timeout_s]

    # --- server thread --------------------------------------------------------------------------------------
    def _serve(self) -> None:
        """Wait for requests (up to 100 ms) and answer every one already waiting; expire silent peers every 100 ms
        whether or not others are talking (a busy fleet must not keep a dead generator's admissions alive)."""
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        next_expiry = time.monotonic() + EXPIRE_EVERY_S
        while not self._stop.is_set():
            if poller.poll(int(EXPIRE_EVERY_S * 1000)):
                self._answer_waiting()
            if time.monotonic() >= next_expiry:
                self._expire_peers()
                next_expiry = time.monotonic() + EXPIRE_EVERY_S

    def _answer_waiting(self) -> None:
        """Answer the requests waiting now, releasing replies and groups every `RELEASE_EVERY` requests or groups.

        Why in small batches: every libzmq call releases the GIL and may wake another thread. Queueing each
        group before its reply made the server wait for the GIL once per group (the woken learner thread took
        it), and replying after each request woke the I/O threads once per group. Holding every reply until the
        whole drain was handled went wrong the other way: a generator with 16 groups in flight sat idle while
        the server worked through all 16 (bench/buffer.py, 4 KB groups, when this thread still validated: 0.56
        of raw PUSH/PULL; releasing every 4, 0.77; every 2, 0.65). Replies go out before their groups are
        queued, so the learner thread wakes just after the I/O thread. The server thread is the only one that
        adds to the queue, so the room it counted when it said "accepted" is still there.
        """
        accepted, replies = [], []
        for _ in range(DRAIN_MAX_REQUESTS):
            try:
                frames = self._socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            try:
                reply = self._handle(frames[1:], accepted)
            except Exception as err:  # a bug in one request must not kill the buffer
                log.exception("buffer: request failed")
                reply = {"req": -1, "ok": False, "error": f"internal error: {err}"}
            replies.append((frames[0], pack(reply)))
            if len(replies) >= RELEASE_EVERY or len(accepted) >= RELEASE_EVERY:
                self._release(replies, accepted)
        self._release(replies, accepted)

    def _release(self, replies: list, accepted: list) -> None:
        """Send the replies, then hand the accepted groups to `take` as one list; empties both lists."""
        for identity, reply in replies:
            try:
                self._socket.send_multipart([identity, reply], zmq.NOBLOCK)
            except zmq.ZMQError as err:
                log.warning("buffer: could not reply to a generator (%s); it is gone", err)
        if accepted:
            self._queued_in += len(accepted)
            self._released.put(list(accepted))
        replies.clear()
        accepted.clear()

    def _handle(self, payload: list, accepted: list) -> dict:
        """The reply to one request; a valid group that fits is appended to `accepted` for `_answer_waiting`."""
        if not payload:
            self._reject_request("malformed", "empty message")
            return {"req": -1, "ok": False, "error": "empty message"}
        try:
            request = unpack_request(payload[0])
        except ProtocolError as err:
            self._reject_request("malformed", str(err))
            return {"req": -1, "ok": False, "error": str(err)}
        gen = request["gen"]
        self.last_seen[gen] = time.monotonic()
        weights_id, weights = self._weights
        reply = {"req": request["req"], "ok": True, "version": self.coordinator.version,
                 "weights_id": weights_id, "done": self._done}
        if request.get("wid") != weights_id:  # a generator without it (or one that predates `wid`)
            reply["weights"] = weights
        if self._done:
            self.told_done.add(gen)
        if gen in self._unheard_rejections:
            with self._rejections_lock:
                count, last = self._unheard_rejections.pop(gen)
            reply["rejected"] = {"count": count, "last_error": last}
        op = request["op"]
        if op == "hello":
            return self._hello(request, reply)
        if op == "admit":
            want = request.get("want", 1)
            problem = check_admit(want, request.get("ver"))
            if problem is not None:  # refused, not coerced: nothing is dealt or granted
                self._rejections.reject("malformed", gen, problem)
                reply.update(ok=False, granted=0, error=f"{problem} [malformed]")
                return reply
            if self.evals is not None:  # which rounds it can serve (EvalRounds.unservable)
                self.evals.note_engine(gen, request.get("ver"))
            if self.evals is not None and not self._done:  # at most half: training keeps its share of the fleet
                reply["evals"] = self.evals.deal(gen, request.get("ver"), evals_wanted(want))
                want -= len(reply["evals"])
            if want <= 0:
                reply["granted"] = 0
            elif self.dealer is None:
                reply["granted"] = 0 if self._done else self.coordinator.try_admit(gen, want)
            else:
                reply["deals"] = [] if self._done else self._deal(gen, want)
                reply["granted"] = len(reply["deals"])
        elif op == "group":
            self._receive_groups(gen, request, payload[1:], reply, accepted)
        elif op == "release":  # admissions the generator will not deliver (buffer/staleness.py Coordinator.release)
            count = request.get("count", 1)
            reply["released"] = self.coordinator.release(gen, count) if isinstance(count, int) and count > 0 else 0
            if self.dealer is not None and request.get("deals"):
                self.dealer.settle(gen, request["deals"], request.get("outcome"))
            if "rewards" in request:
                self._note_filtered(gen, request["rewards"], reply["released"])
        elif op == "eval":
            problem = (self.evals.result(gen, request.get("deal"), request.get("rewards"), request.get("lengths"),
                                         request.get("texts")) if self.evals is not None
                       else "this learner runs no evaluation rounds")
            if problem is not None:
                self._rejections.reject("eval_result", gen, problem)
                reply.update(ok=False, error=problem)
        elif op == "stats":
            problem = check_stats(request.get("metrics"))
            if problem is None:
                self.generator_stats[gen] = request["metrics"]
            else:  # reports are data: a bad one is dropped, counted and said
                self._rejections.reject("stats", gen, problem)
                reply.update(ok=False, error=f"stats rejected: {problem}")
        elif op == "bye":
            self._forget(gen, "said bye")
        return reply

    def _note_filtered(self, gen: str, rewards, released: int) -> None:
        """The rewards of the group a release gives back (filtered by its generator) join the sampled tally, when
        they are valid and the release freed an admission (a generator reports no more groups than it was
        granted); bad ones are counted under buffer/rejected/release_rewards and ignored."""
        problem = check_released_rewards(rewards, self.limits.group_size if self.limits else None)
        if problem is not None:
            self._rejections.reject("release_rewards", gen, problem)
        elif released > 0:
            self.sampled.add(rewards)

    def _deal(self, gen: str, want: int) -> list:
        """Admissions within the staleness budget, each with the prompt to sample; fewer when the data runs out."""
        granted = self.coordinator.try_admit(gen, min(want, self.dealer.available()))
        deals = self.dealer.deal(gen, granted)
        if len(deals) < granted:  # the learner's thread cannot take prompts away, but never grant one without
            self.coordinator.release(gen, granted - len(deals))
        return deals

    def _hello(self, request: dict, reply: dict) -> dict:
        if request.get("config_hash") != self.config_hash:
            reply.update(ok=False, shared_config=self.shared_config, error=(
                f"config mismatch: generator {request['gen']!r} has shared-config hash {request.get('config_hash')!r}, "
                f"the learner has {self.config_hash!r}; start both with the same recipe and shared overrides"))
            return reply
        reply["run_info"] = self.run_info
        gen, life = request["gen"], request.get("life")
        if isinstance(life, str) and 0 < len(life) <= MAX_LIFE_CHARS:
            previous = self.lives.get(gen)
            self.lives[gen] = life
            if previous is not None and previous != life:  # the old process died without a bye
                self._forget(gen, "restarted (a new process said hello)")
                self.last_seen[gen] = time.monotonic()
        self.joins.setdefault(gen, {"hello_version": self.coordinator.version})
        return reply

    def _receive_groups(self, gen: str, request: dict, bodies: list, reply: dict, accepted: list) -> None:
        """One group (no `reqs`: the reply is its result) or several, one result each in `results`."""
        reqs = request.get("reqs")
        if reqs is None:
            deal = request.get("deal")
            reply.update(self._receive_group(gen, bodies[0] if bodies else b"", accepted,
                                             deal if isinstance(deal, str) else ""))
        elif (isinstance(reqs, list) and len(reqs) == len(bodies) > 0
              and all(isinstance(req, int) for req in reqs)):
            deals = request.get("deals")
            if not (isinstance(deals, list) and len(deals) == len(reqs)):
                deals = [""] * len(reqs)
            reply["results"] = [{"req": req, **self._receive_group(gen, body, accepted,
                                                                   deal if isinstance(deal, str) else "")}
                                for req, body, deal in zip(reqs, bodies, deals)]
        else:
            error = f"'reqs' must list one integer request id per group frame ({len(bodies)} frames)"
            self._reject_request("malformed", f"from {gen}: {error}")
            reply.update(ok=False, error=error)

    def _receive_group(self, gen: str, data: bytes, accepted: list, deal: str) -> dict:
        """Queue the group's bytes for `take`, which validates them; only the size is checked here, so an
        oversized message never sits in the queue. Its deal, if out to `gen`, is marked delivered."""
        if len(data) > self.max_message_bytes:
            err = f"message: {len(data)} bytes exceeds max_message_bytes={self.max_message_bytes} [too_large]"
            self._reject(gen, "too_large", err, self.coordinator.delivered(gen), tell=False, deal=deal)
            return {"accepted": False, "reason": "too_large", "error": err}
        if self._queue_full(accepted, len(data)):
            return {"accepted": False, "retry": True}  # back-pressure; the generator keeps the group
        if self.dealer is not None and deal:
            self.dealer.delivered(gen, deal)
        accepted.append((gen, data, self.coordinator.delivered(gen), deal))
        self._bytes_in += len(data)
        return {"accepted": True}

    def _queue_full(self, accepted: list, size: int) -> bool:
        """Bounded in groups and in bytes (an empty queue always takes one group, however large)."""
        queued = self.queued() + len(accepted)
        if self.queue_groups > 0 and queued >= self.queue_groups:
            return True
        held_bytes = self._bytes_in - self._bytes_out
        return self.queue_bytes > 0 and queued > 0 and held_bytes + size > self.queue_bytes

    def _reject(self, gen: str, reason: str, error: str, admitted: bool, tell: bool = True, deal: str = "") -> None:
        """Count and log a rejected group, free its admission if it held one, return its dealt prompt to the
        epoch, and (`tell`) note it for the generator's next reply. A group sent without an admission gives nothing
        back: freeing capacity it never took would let generators run further ahead than the staleness bound
        allows."""
        if admitted:
            self.coordinator.give_back(1)
        if self.dealer is not None and deal:
            self.dealer.reject(gen, deal)
        self._rejections.reject(reason, gen, error)
        if tell:
            self._tell(gen, error)

    def _tell(self, gen: str, error: str) -> None:
        """Note a rejection for the generator's next reply (`rejected`: how many since, and the last)."""
        with self._rejections_lock:
            count, _ = self._unheard_rejections.get(gen, (0, ""))
            self._unheard_rejections[gen] = (count + 1, error)

    def _reject_request(self, reason: str, detail: str) -> None:
        self._rejections.reject(reason, "a peer", detail)

    def _expire_peers(self) -> None:
        if self.dealer is not None and self.dealer.expire():
            log.warning("buffer: dealt prompts not delivered within data.deal_timeout_s went back to the epoch")
        for version in self.evals.expire() if self.evals is not None else ():
            log.warning("buffer: the evaluation of v%d was not done within eval.timeout_s; abandoned", version)
        now = time.monotonic()
        for gen, seen in list(self.last_seen.items()):
            if now - seen > self.peer_timeout_s:
                self._forget(gen, f"silent for {self.peer_timeout_s:.0f} s")

    def _forget(self, gen: str, why: str) -> None:
        self.last_seen.pop(gen, None)
        self.generator_stats.pop(gen, None)  # a generator that left no longer adds to the fleet's throughput
        with self._rejections_lock:
            self._unheard_rejections.pop(gen, None)
        held = self.coordinator.forget_generator(gen)
        if held:
            log.warning("buffer: generator %s %s; gave back %d admitted groups", gen, why, held)
        if self.dealer is not None and self.dealer.forget(gen):
            log.warning("buffer: generator %s %s; its dealt prompts went back to the epoch", gen, why)
        if self.evals is not None:
            self.evals.forget(gen)
