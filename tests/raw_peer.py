"""A generator written by someone else: the buffer's wire protocol over a raw DEALER socket, for the hostile-input
tests."""
import msgpack
import zmq

from asyncrl.buffer.zmq.wire import pack


class RawPeer:
    """A generator written by someone else: the wire protocol over a DEALER socket, with no client-side checks."""

    def __init__(self, endpoint: str, gen: str):
        self.gen, self.req = gen, 0
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(endpoint)

    def ask(self, op: str, *bodies: bytes, wait_ms: int = 10_000, **fields) -> dict:
        self.req += 1
        self.socket.send_multipart([pack({"op": op, "req": self.req, "gen": self.gen, "wid": "", **fields}),
                                    *bodies])
        while True:  # a reply to an earlier request that timed out is stale: skipped
            assert self.socket.poll(wait_ms), f"no reply to {op}"
            reply = msgpack.unpackb(self.socket.recv_multipart()[-1], raw=False)
            if reply.get("req") in (self.req, -1):
                return reply

    def close(self) -> None:
        self.socket.close()
        self.context.term()
