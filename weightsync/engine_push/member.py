"""A generator's side of the engine push (sender.py): register the engine it hosts, keep a heartbeat, and run each
call the learner makes (calls.py) through a handler that owns the engine (generator/weights.py)."""
import threading

import torch.distributed as dist

from asyncrl.weightsync.engine_push.calls import serve_calls
from asyncrl.weightsync.broadcast.roster import connect_store, register, start_heartbeat


class EnginePushMember:
    def __init__(self, store: dist.TCPStore, address: str, member_id: str, ranks: int, handle,
                 heartbeat_s: float = 0.5, engine: str = "vllm"):
        self.store, self.address, self.member_id, self.ranks, self.engine = store, address, member_id, ranks, engine
        self.handle = handle
        self._stop = threading.Event()
        self.info = register(store, "ep", member_id, {"ranks": ranks, "engine": engine})
        self._heartbeat = start_heartbeat(address, "ep", lambda: self.info["ticket"], heartbeat_s, self._stop,
                                          f"engine-push-heartbeat-{member_id}")
        self.fatal: BaseException | None = None
        """Set when serving stopped for good (the learner's store went away)."""
        self._server = threading.Thread(target=self._serve, daemon=True, name=f"engine-push-{member_id}")
        self._server.start()

    @classmethod
    def connect(cls, address: str, member_id: str, ranks: int, handle, timeout_s: float,
                engine: str = "vllm") -> "EnginePushMember":
        """Register at the learner's store ("host:port") an engine of `ranks` ranks and kind `engine` ("vllm",
        "sglang": which trainer side the learner opens); `handle(op, args, timeout_s)` runs each call."""
        return cls(connect_store(address, f"engine push {member_id!r}", timeout_s), address, member_id, ranks, handle,
                   engine=engine)

    def _serve(self) -> None:
        try:
            while serve_calls(self.store, self.info["ticket"], self.handle, self._stop):
                self.info = register(self.store, "ep", self.member_id,
                                     {"ranks": self.ranks, "engine": self.engine})  # dropped: rejoin
        except Exception as exc:  # noqa: BLE001 - the store is gone: nothing more will come
            self.fatal = exc

    def close(self) -> None:
        self._stop.set()
        self._server.join(timeout=5.0)
        try:
            self.store.set(f"ep/left/{self.info['ticket']}", "1")
        except Exception:  # noqa: BLE001 - the learner is gone already
            pass
