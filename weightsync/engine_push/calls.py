"""The engine push's control plane: the learner calls vLLM's weight-sync client methods on a generator's engine
through the learner's TCPStore, and the generator runs them on the engine it hosts.

Why through the store: vLLM's trainer side (`NCCLTrainerWeightTransferEngine`) drives the inference side through a
client with four methods (`init_weight_transfer_engine`, `start_weight_update`, `update_weights`,
`finish_weight_update`; vLLM's `VLLMWeightSyncClient` protocol). vLLM ships HTTP and Ray clients; an asyncrl engine
lives inside a generator process with no HTTP server, and the generator must wrap each load in its own pause,
version and fallback logic. `StoreEngineClient` is that client: each call is "ep/call/{ticket}/{n}" = {op, args},
answered by the generator with "ep/reply/{ticket}/{n}" = {ok, error}. Every wait has a deadline and names the
member, so a dead or slow generator fails the call instead of hanging the learner.
"""
import json
import time

import torch.distributed as dist

from asyncrl.weightsync.broadcast.chain import PeerError
from asyncrl.weightsync.broadcast.protocol import ACK_POLL_S, ANNOUNCEMENT_POLL_S

OPS = ("init", "start", "update", "finish", "shutdown")
DROPPED_CHECK_EVERY = 200
"""Idle polls between two looks at whether the learner dropped us (about once a second)."""


class StoreEngineClient:
    """vLLM's `VLLMWeightSyncClient`, for one generator's engine, over the learner's store. `deadline` is a
    monotonic time set by the caller before each round; `version` is what `finish_weight_update` commits."""

    def __init__(self, store: dist.TCPStore, ticket: int, who: str):
        self.store, self.ticket, self.who = store, ticket, who
        self.deadline = time.monotonic() + 60.0
        self.version = 0
        self.transport = "nccl"
        """Which of vLLM's transfer engines the calls are for (the generator composes one per transport)."""
        self._n = 0

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self._call("init", {"init_info": init_info, "transport": self.transport})

    def start_weight_update(self) -> None:
        self._call("start", {"version": self.version})

    def update_weights(self, update_info: dict) -> None:
        self._call("update", {"update_info": json_safe(update_info), "transport": self.transport})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._call("finish", {"version": int(weight_version) if weight_version is not None else self.version})

    def shutdown_weight_transfer_engine(self) -> None:
        self._call("shutdown", {})

    def _call(self, op: str, args: dict) -> None:
        self._n += 1
        n = self._n
        remaining = self.deadline - time.monotonic()
        self.store.set(f"ep/call/{self.ticket}/{n}", json.dumps({"op": op, "args": args,
                                                                 "timeout_s": max(remaining, 0.0)}))
        self.store.add(f"ep/calls/{self.ticket}", 1)
        key = f"ep/reply/{self.ticket}/{n}"
        while not self.store.check([key]):
            if time.monotonic() >= self.deadline:
                raise PeerError(f"{op} on {self.who}: no answer within {max(remaining, 0):.1f} s (dead or stalled)")
            time.sleep(ACK_POLL_S)
        reply = json.loads(self.store.get(key))
        self.store.delete_key(key)
        self.store.delete_key(f"ep/call/{self.ticket}/{n}")
        if not reply.get("ok"):
            raise PeerError(f"{op} on {self.who}: {reply.get('error')}")


def json_safe(update_info: dict) -> dict:
    """vLLM's IPC trainer hands raw CUDA IPC handles (tuples of non-JSON objects): they travel pickled and base64
    encoded as `ipc_handles_pickled`, the field vLLM's own IPC engine decodes (it asks for
    VLLM_ALLOW_INSECURE_SERIALIZATION=1 on the engine's side). Other updates carry JSON already."""
    if update_info.get("ipc_handles") is None:
        return update_info
    import base64
    import pickle

    safe = {key: value for key, value in update_info.items() if key != "ipc_handles"}
    safe["ipc_handles_pickled"] = base64.b64encode(pickle.dumps(update_info["ipc_handles"])).decode()
    return safe


def serve_calls(store: dist.TCPStore, ticket: int, handle, stop) -> bool:
    """The generator's side: run each call addressed to `ticket` through `handle(op, args, timeout_s)` in order
    and answer it, until `stop` (a threading.Event) is set (returns False) or the learner dropped this ticket
    (returns True: register again). A handler's exception is the reply's error."""
    n = int(store.add(f"ep/calls/{ticket}", 0))  # calls posted before we registered are not ours
    idle = 0
    while not stop.is_set():
        key = f"ep/call/{ticket}/{n + 1}"
        if not store.check([key]):
            idle += 1
            if idle % DROPPED_CHECK_EVERY == 0 and store.check([f"ep/dropped/{ticket}"]):
                return True
            stop.wait(ANNOUNCEMENT_POLL_S)
            continue
        n += 1
        call = json.loads(store.get(key))
        try:
            if call.get("op") not in OPS:
                raise ValueError(f"unknown engine call {call.get('op')!r}")
            handle(call["op"], call["args"], float(call["timeout_s"]))
            reply = {"ok": True, "error": None}
        except Exception as err:  # noqa: BLE001 - every failure goes back to the learner, named
            reply = {"ok": False, "error": f"{type(err).__name__}: {err}"}
        store.set(f"ep/reply/{ticket}/{n}", json.dumps(reply))
    return False
