"""The generator's side of the embedded buffer (`interface.GeneratorBuffer`): an asyncio DEALER client with matched
replies, timeouts and typed replies.

Consumes: replies from the learner. Produces: requests (wire.py). Every request waits at most `timeout_s`, and no
longer than the learner's end of the connection stays open (a learner that died is noticed at once); when the
learner does not answer, the error names its endpoint, so a dead peer never hangs a generator.

Why not `zmq.asyncio`: it wraps every send and recv in its own future and re-polls the socket per call, which
cost about 150 us of CPU per request here, more than encoding the group. This client uses a plain socket with
non-blocking calls: requests made in one loop iteration are sent together by one callback (consecutive groups in
one message, see `_flush`), and one reader callback on the socket's fd drains every waiting reply at once.
libzmq's fd is edge-triggered (a send can consume the edge of a reply that already arrived), so every flush ends
with a drain; a drain stops at EAGAIN, so a spurious one costs a single failed recv.
"""
import asyncio
import itertools
import logging
import uuid
from collections import deque

import zmq
from zmq.utils.monitor import recv_monitor_message

from asyncrl.buffer.dealing import check_deal
from asyncrl.buffer.eval_rounds import decode_eval_task
from asyncrl.buffer.interface import (AdmitReply, GeneratorRefused, HelloReply, LearnerUnavailable, RunInfo, SendReply,
                                     Status, decode_weights, too_large_reply)
from asyncrl.buffer.zmq.wire import pack, status_fields, unpack_reply
from asyncrl.security.curve import secure_client
from asyncrl.weightsync.announcement import AnnouncementError, WeightsAnnouncement

BATCH_MAX_GROUPS = 16
"""Most groups sent in one message (wire.py); one more than that starts another."""
log = logging.getLogger(__name__)
ZERO_COPY_MIN_BYTES = 1 << 20
"""Bodies this large are handed to libzmq without a copy; below it the copy is cheaper than the bookkeeping (a
zero-copy frame is released through pyzmq's garbage-collector thread, under the GIL). At 64 KB, sending without a
copy cost the producer 210 us of CPU per group, against 135-150 us with the copy (bench/buffer.py)."""
SEND_RETRY_S = 0.001
"""How often a send that met a full pipe (the high-water mark) is retried, until the request times out."""


class ZmqBufferClient:
    def __init__(self, endpoint: str, generator_id: str, timeout_s: float, max_message_bytes: int = 0, keys=None):
        self.endpoint = endpoint
        self.max_message_bytes = max_message_bytes  # the job's limit (buffer.max_message_bytes); 0: not checked here
        self.generator_id = generator_id
        self.timeout_s = timeout_s
        self._ids = itertools.count()
        self._pending: dict[int, asyncio.Future] = {}
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        secure_client(self._socket, keys)  # keys: security.curve.ClientKeys, or None for plain TCP
        self.curve = keys is not None
        self._monitor = self._socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        """Tells when the learner's end of the connection closes (`_drain_monitor`)."""
        self._socket.connect(endpoint)
        self._fd = self._socket.getsockopt(zmq.FD)
        self._monitor_fd = self._monitor.getsockopt(zmq.FD)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._outbox: deque = deque()  # (op, req, fields, body, reply future) not yet handed to libzmq
        self._flush_scheduled = False
        self.weights: WeightsAnnouncement | None = None  # the newest announcement heard of, and its id (wire.py)
        self.weights_id = ""
        self.life = uuid.uuid4().hex[:16]
        """This client's process life, sent with every hello: a generator restarted under the same id (by Ray, by
        SLURM's requeue, by hand) says hello with a new one, and the learner gives back what the dead life held."""

    # --- interface.GeneratorBuffer ------------------------------------------------------------------------------
    async def hello(self, config_hash: str, timeout_s: float | None = None) -> HelloReply:
        reply = await self._request("hello", timeout_s=timeout_s, config_hash=config_hash, life=self.life)
        if not reply.get("ok"):
            raise GeneratorRefused(str(reply.get("error", "refused")), reply.get("shared_config"))
        return HelloReply(**status_fields(reply), run_info=RunInfo.from_wire(reply.get("run_info"), self.endpoint))

    async def admit(self, want: int = 1, version: int | None = None) -> AdmitReply:
        reply = await self._request("admit", want=want, **({"ver": version} if version is not None else {}))
        granted = reply.get("granted") if reply.get("ok") else 0
        deals = reply.get("deals") if reply.get("ok") else None
        deals = [check_deal(deal) for deal in deals] if isinstance(deals, list) else []
        evals = reply.get("evals") if reply.get("ok") else None
        evals = [decode_eval_task(entry) for entry in evals] if isinstance(evals, list) else []
        return AdmitReply(**status_fields(reply), granted=granted if isinstance(granted, int) else 0, deals=deals,
                          evals=evals)

    async def eval_done(self, deal_id: str, rewards: list | None, lengths: list | None,
                        texts: list | None = None) -> Status:
        reply = await self._request("eval", deal=deal_id, rewards=rewards, lengths=lengths, texts=texts)
        if not reply.get("ok"):
            log.error("the learner refused an evaluation result: %s", reply.get("error"))
        return Status(**status_fields(reply))

    async def send(self, group_id: str, payload: bytes, deal: str = "") -> SendReply:
        if self.max_message_bytes and len(payload) > self.max_message_bytes:
            return too_large_reply(len(payload), self.max_message_bytes, self.weights)
        reply = await self._request("group", body=payload, group_id=group_id, deal=deal)
        accepted = reply.get("ok") is True and reply.get("accepted") is True
        return SendReply(**status_fields(reply), accepted=accepted, retry=not accepted and reply.get("retry") is True,
                         reason=str(reply.get("reason", "")), error=str(reply.get("error", "")))

    async def release(self, count: int = 1, deals: list | None = None, outcome: str = "unused",
                      rewards: list | None = None) -> Status:
        fields = {"deals": list(deals), "outcome": outcome} if deals else {}
        if rewards is not None:
            fields["rewards"] = [float(reward) for reward in rewards]
        return Status(**status_fields(await self._request("release", count=count, **fields)))

    async def report(self, metrics: dict, timeout_s: float | None = None) -> Status:
        return Status(**status_fields(await self._request("stats", timeout_s=timeout_s, metrics=metrics)))

    async def bye(self, timeout_s: float | None = None) -> None:
        await self._request("bye", timeout_s=timeout_s)

    async def _request(self, op: str, body: bytes | None = None, timeout_s: float | None = None, **fields) -> dict:
        """Send one request and await its reply (a wire dict), at most `timeout_s` (else the client's)."""
        loop = self._attach()
        timeout_s = timeout_s or self.timeout_s
        req = next(self._ids)
        reply = loop.create_future()
        self._pending[req] = reply
        timer = loop.call_later(timeout_s, _expire, reply)
        self._outbox.append((op, req, fields, body, reply))
        if not self._flush_scheduled:
            self._flush_scheduled = True
            loop.call_soon(self._flush)
        try:
            return await reply
        except asyncio.TimeoutError:
            raise LearnerUnavailable(f"learner at {self.endpoint} did not answer {op!r} within {timeout_s:.0f} s"
                                     + self._curve_hint()) from None
        except ConnectionClosed:
            raise LearnerUnavailable(f"learner at {self.endpoint} did not answer {op!r}: it closed the connection "
                                     f"(stopped, restarted, or refused this generator)" + self._curve_hint()) from None
        finally:
            timer.cancel()
            self._pending.pop(req, None)

    def _curve_hint(self) -> str:
        return (" (with CURVE keys: is the learner using them too, with this generator's public key in its "
                "security.keys_dir/clients/?)" if self.curve else "")

    def close(self) -> None:
        self._detach()
        self._socket.disable_monitor()
        self._monitor.close(linger=0)
        self._socket.close(linger=0)
        self._context.term()

    # --- socket plumbing (runs on the event loop) -------------------------------------------------------------
    def _attach(self) -> asyncio.AbstractEventLoop:
        """Register the reader on the running loop; a client reused under a new `asyncio.run` moves with it."""
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            self._detach()
            loop.add_reader(self._fd, self._drain_replies)
            loop.add_reader(self._monitor_fd, self._drain_monitor)
            self._loop = loop
            self._drain_monitor()  # events from before this loop (edge-triggered fd: they would not wake it)
        return loop

    def _detach(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._fd)
            self._loop.remove_reader(self._monitor_fd)
        self._loop = None
        self._outbox.clear()  # requests of a finished loop: their awaiting coroutines are gone
        self._flush_scheduled = False

    def _flush(self) -> None:
        """Send every request queued since the last flush, back to back.

        Requests issued in one loop iteration (several rollouts finishing at once) leave together, so libzmq's
        I/O thread is woken once and writes them in one TCP segment, and the server drains them in one pass.
        Consecutive group requests go as one message with one reply (wire.py): the learner's server thread
        then parses one request and sends one reply for all of them, and that thread's Python runs under the
        same GIL as the learner's, so every microsecond it spends per group is taken from training. A full pipe
        (high-water mark) keeps the rest queued and retries; a request whose timeout fired is skipped.
        """
        self._flush_scheduled = False
        while self._outbox:
            span, batch = self._next_message()
            if batch:
                try:
                    self._socket.send_multipart(self._frames(batch), zmq.NOBLOCK,
                                                copy=all(body is None or len(body) < ZERO_COPY_MIN_BYTES
                                                         for _, _, _, body, _ in batch))
                except zmq.Again:
                    self._flush_scheduled = True
                    self._loop.call_later(SEND_RETRY_S, self._flush)
                    break
            for _ in range(span):
                self._outbox.popleft()
        self._drain_replies()  # a send may have consumed the fd's edge for a reply that is already waiting

    def _next_message(self) -> tuple[int, list]:
        """The requests that leave in the next message (the first live one, and up to BATCH_MAX_GROUPS
        consecutive groups with it), and how many outbox entries that message covers (expired ones included)."""
        batch, span = [], 0
        for entry in self._outbox:
            op, _, _, _, reply = entry
            if batch and (op != "group" or batch[0][0] != "group" or len(batch) == BATCH_MAX_GROUPS):
                break
            span += 1
            if not reply.done():
                batch.append(entry)
        return span, batch

    def _frames(self, batch: list) -> list:
        op, req, fields, body, _ = batch[0]
        header = {"op": op, "req": req, "gen": self.generator_id, "wid": self.weights_id, **fields}
        if len(batch) > 1:
            header["reqs"] = [entry[1] for entry in batch]
            header["deals"] = [entry[2].get("deal", "") for entry in batch]
        return [pack(header)] + [entry[3] for entry in batch if entry[3] is not None]

    def _drain_replies(self) -> None:
        while True:
            try:
                frames = self._socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            except zmq.ZMQError:
                return  # the socket was closed under us
            try:
                reply = unpack_reply(frames[-1])
            except Exception:
                continue  # a reply we cannot read is dropped; the request times out with a clear error
            results = reply.pop("results", None)
            try:
                self._note_weights(reply)
            except AnnouncementError as err:  # each request it answers fails with it, naming the field
                answered = [result.get("req") for result in results if isinstance(result, dict)] \
                    if isinstance(results, list) else [reply.get("req")]
                for req in answered:
                    self._fail(req, err)
                continue
            if not isinstance(results, list):
                self._resolve(reply.get("req"), reply)
                continue
            for result in results:  # one reply for a message of several groups: one result each
                if isinstance(result, dict):
                    self._resolve(result.get("req"), {**reply, **result})

    def _drain_monitor(self) -> None:
        """The learner's end closed (its process died, or it stopped or refused us): every request waiting on it now
        fails, rather than waiting out its timeout for a reply that cannot come. A learner killed and resumed is
        thus noticed at once, and the generator says hello to the new one as soon as it listens
        (generator/rollout.py); libzmq reconnects by itself. A link that merely stops carrying packets closes
        nothing: that is still the timeout's to find."""
        closed = False
        while True:
            try:
                event = recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except zmq.Again:
                break
            except zmq.ZMQError:
                return  # the monitor was closed under us
            closed = closed or event["event"] == zmq.EVENT_DISCONNECTED
        if closed:
            for future in list(self._pending.values()):
                if not future.done():
                    future.set_exception(ConnectionClosed())

    def _resolve(self, req, reply: dict) -> None:
        future = self._pending.get(req)
        if future is not None and not future.done():
            future.set_result(reply)

    def _fail(self, req, error: Exception) -> None:
        future = self._pending.get(req)
        if future is not None and not future.done():
            future.set_exception(error)

    def _note_weights(self, reply: dict) -> None:
        """Keep the announcement a reply carries; give the kept one to a reply that carries only its id."""
        if "weights" in reply:
            self.weights = decode_weights(reply["weights"], self.endpoint)
            self.weights_id = str(reply.get("weights_id", ""))
            reply["weights"] = self.weights
        else:
            reply["weights"] = self.weights


class ConnectionClosed(Exception):
    """The learner's end of the connection closed while a request waited (`_drain_monitor`)."""


def _expire(reply: asyncio.Future) -> None:
    if not reply.done():
        reply.set_exception(asyncio.TimeoutError())
