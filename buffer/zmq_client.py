"""The generator's side of the embedded buffer: an asyncio DEALER client with matched replies and timeouts.

Consumes: replies from the learner. Produces: requests. Every request waits at most `timeout_s`; when the
learner does not answer, the error names its endpoint, so a dead peer never hangs a generator.
"""
import asyncio
import itertools

import zmq
import zmq.asyncio

from asyncrl.buffer.protocol import pack, unpack_reply


class LearnerUnavailable(RuntimeError):
    """The learner did not answer in time (not started yet, crashed, or unreachable)."""


class BufferClient:
    def __init__(self, endpoint: str, generator_id: str, timeout_s: float):
        self.endpoint = endpoint
        self.generator_id = generator_id
        self.timeout_s = timeout_s
        self._ids = itertools.count()
        self._pending: dict[int, asyncio.Future] = {}
        self._context = zmq.asyncio.Context()
        self._socket = self._context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(endpoint)
        self._reader = None

    async def request(self, op: str, body: bytes | None = None, timeout_s: float | None = None, **fields) -> dict:
        if self._reader is None:
            self._reader = asyncio.get_running_loop().create_task(self._read_replies())
        req = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._pending[req] = future
        frames = [pack({"op": op, "req": req, "gen": self.generator_id, **fields})]
        if body is not None:
            frames.append(body)
        await self._socket.send_multipart(frames, copy=body is None or len(body) < 65536)
        try:
            return await asyncio.wait_for(future, timeout_s or self.timeout_s)
        except asyncio.TimeoutError:
            raise LearnerUnavailable(
                f"learner at {self.endpoint} did not answer {op!r} within {timeout_s or self.timeout_s:.0f} s"
            ) from None
        finally:
            self._pending.pop(req, None)

    async def _read_replies(self) -> None:
        while True:
            frames = await self._socket.recv_multipart()
            try:
                reply = unpack_reply(frames[-1])
            except Exception:
                continue  # a reply we cannot read is dropped; the request times out with a clear error
            future = self._pending.get(reply.get("req"))
            if future is not None and not future.done():
                future.set_result(reply)

    def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        self._socket.close(linger=0)
        self._context.term()
