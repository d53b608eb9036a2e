"""The learner's side of the engine push: each version goes straight from the learner's GPU into every
registered generator's engine, one NCCL group per engine: vLLM's own NCCL weight-transfer engine for vLLM, SGLang's
distributed update (`init_weights_update_group` + `update_weights_from_distributed`, sglang_trainer.py) for SGLang.
The vLLM flow is described below; SGLang's is the same with its calls.

Per engine (a generator registered under "ep/", see broadcast/roster.py, with the number of ranks its engine has):
- the first send opens vLLM's trainer endpoint (`NCCLTrainerWeightTransferEngine.trainer_init`, rank 0 of a group
  of 1 + the engine's ranks, on a fresh port) while the generator's engine joins it
  (`init_weight_transfer_engine`, driven through calls.py);
- every version runs vLLM's `send_weights()`: start, update (the engine's workers receive while the learner
  broadcasts vLLM's packed buffers), finish with the version, which vLLM stamps on every token it samples after.
The tensors are typed views of the publisher's buckets on the learner's GPU (`BucketSource`), filled once per
version from the FSDP gathers and cast once.

Why a group per engine and not one for the fleet: an NCCL group cannot lose a member. With one group, a generator
killed mid-broadcast would hang every other engine's receive; with one per engine it hangs only its own, and the
watchdog ends it. The learner's GPU sends the bytes once per engine (in parallel threads); for a handful of
engines on NVLink or InfiniBand that is well below a training step.

No hangs: NCCL calls have no timeout of their own, so each engine's round runs in a thread with a deadline. Past
it the learner aborts that engine's communicator (vLLM's `shutdown`, which runs `ncclCommAbort`), names the member
in the report, and the next version opens a new group. The generator, whose workers may be stuck in the receive,
sees its own deadline pass and stops its engine (generator/weights.py). Every engine that missed a version
loads it from the staging paths (shared memory, catch-up) like any generator that missed a broadcast.
"""
import collections
import socket
import threading
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist

from asyncrl.weightsync.buckets import FlatBuckets
from asyncrl.weightsync.engine_push.calls import StoreEngineClient
from asyncrl.weightsync.engine_push.delta import sparse_patches
from asyncrl.weightsync.broadcast.sender import SendReport
from asyncrl.weightsync.broadcast.protocol import describe_member, timedelta_s
from asyncrl.weightsync.broadcast.roster import Roster, warn_if_store_open


def bucket_source(buckets: FlatBuckets):
    """vLLM's `WeightSource` over typed views of the publisher's buckets: `metadata()` from the layout, iteration
    yields each tensor in layout order (no gather here: the publisher did it). A learner without vLLM (SGLang
    generators only) gets the same two channels without vLLM's base class."""
    from asyncrl.weightsync.dtypes import DTYPES

    try:
        from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource
    except ImportError:
        ParamMeta, WeightSource = collections.namedtuple("ParamMeta", "name dtype shape"), object

    class BucketSource(WeightSource):
        def metadata(self) -> list:
            return [ParamMeta(e.name, DTYPES[e.dtype], tuple(e.shape)) for e in buckets.layout.entries]

        def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
            return ((entry.name, buckets.view(entry)) for entry in buckets.layout.entries)

    return BucketSource()


def open_trainer(engine: str, transport: str, master_address: str, master_port: int, world_size: int, client,
                 source):
    """The trainer side for an engine of kind `engine` over `transport`: vLLM's own trainer engines (`nccl`,
    dense and packed, its default wire format; `sparse_nccl`, patches only; `ipc`, no rendezvous), or SGLang's
    distributed update (sglang_trainer.py, whatever the transport)."""
    if engine == "sglang":
        from asyncrl.weightsync.engine_push.sglang_trainer import SglangTrainer

        return SglangTrainer(master_address, master_port, world_size, client, source)
    if engine != "vllm":
        raise ValueError(f"an engine of kind {engine!r} registered for the push; asyncrl pushes to vllm and sglang")
    if transport == "ipc":
        from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo, IPCTrainerWeightTransferEngine

        return IPCTrainerWeightTransferEngine.trainer_init(IPCTrainerInitInfo(rank=0), client=client, source=source)
    if transport == "sparse_nccl":
        from vllm.distributed.weight_transfer.sparse_nccl_engine import (SparseNCCLTrainerInitInfo,
                                                                         SparseNCCLTrainerWeightTransferEngine)

        info = SparseNCCLTrainerInitInfo(master_address=master_address, master_port=master_port,
                                         world_size=world_size, rank=0)
        return SparseNCCLTrainerWeightTransferEngine.trainer_init(info, client=client)
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo, NCCLTrainerWeightTransferEngine

    info = NCCLTrainerInitInfo(master_address=master_address, master_port=master_port, world_size=world_size,
                               rank=0)
    return NCCLTrainerWeightTransferEngine.trainer_init(info, client=client, source=source)


def vllm_patches(patches) -> list:
    """delta.sparse_patches output as vLLM's `SparseWeightPatch`es."""
    from vllm.distributed.weight_transfer.sparse_nccl_engine import SparseWeightPatch

    return [SparseWeightPatch(name=name, indices=indices, values=values, full_shape=shape)
            for name, indices, values, shape in patches]


TRANSPORTS = ("nccl", "sparse_nccl", "ipc")


def free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class EnginePushSender:
    """Owns the store generators register in and one vLLM trainer engine per registered engine.

    `transport` (weightsync.engine_transport): `nccl`, `sparse_nccl` (patches of what changed to every vLLM engine
    that holds the previous version, pushed by us; dense otherwise and for SGLang) or `ipc` (vLLM on the learner's
    GPU). `trainer_factory(engine kind, transport, master_address, master_port, world_size, client, source)` opens
    a trainer side (default `open_trainer`; CPU tests pass stand-ins). Not thread-safe: call `send` from the
    publisher's thread.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, advertise: str = "", heartbeat_timeout_s: float = 5.0,
                 store_timeout_s: float = 30.0, trainer_factory=open_trainer, transport: str = "nccl",
                 to_patches=vllm_patches):
        if transport not in TRANSPORTS:
            raise ValueError(f"engine push transport must be one of {TRANSPORTS}, got {transport!r}")
        self.transport = transport
        self.to_patches = to_patches
        warn_if_store_open(host, "weightsync.backend=engine_push")
        self.store = dist.TCPStore(host, port, None, True, timedelta_s(store_timeout_s), wait_for_workers=False)
        self.bind_host = host
        self.advertise = advertise or host
        self.address = f"{self.advertise}:{self.store.port}"
        self.roster = Roster(self.store, "ep", heartbeat_timeout_s)
        self.trainer_factory = trainer_factory
        self._trainers: dict[tuple, object] = {}  # (ticket, transport) -> trainer side (its group), until it fails
        self._clients: dict[int, StoreEngineClient] = {}  # ticket -> client: its call numbers outlive any group
        self._buckets: FlatBuckets | None = None
        self._holds: dict[int, int] = {}  # ticket -> the version its engine holds from our last push to it
        self._previous: FlatBuckets | None = None  # sparse_nccl: the last version pushed (on the learner's GPU)
        self._previous_version: int | None = None

    def send(self, version: int, buckets: FlatBuckets, timeout_s: float) -> SendReport:
        """Push `buckets` (complete) to every live engine in parallel; returns within about `timeout_s`, naming
        every engine that did not take the version."""
        start = time.monotonic()
        deadline = start + timeout_s
        report = SendReport(version, 0)
        self._buckets = buckets
        tickets = self.roster.live(lambda info, reason: self._forget(info, reason, report))
        for ticket in list(self._clients):
            if ticket not in tickets:  # left, or replaced by a restart
                self._close_trainer(ticket)
                self._clients.pop(ticket)
        patches = self._patches(buckets, tickets)
        results: dict[int, str | None] = {}
        threads = [threading.Thread(target=self._push_one, args=(ticket, version, deadline, results, patches),
                                    daemon=True, name=f"asyncrl-engine-push-{ticket}") for ticket in tickets]
        for thread in threads:
            thread.start()
        for ticket, thread in zip(tickets, threads):
            thread.join(max(deadline - time.monotonic(), 0.0))
            info = self.roster.members[ticket]
            if thread.is_alive():  # the watchdog: abort the communicator the round is stuck in
                self._close_trainer(ticket)
                report.failed[info["member_id"]] = (f"{describe_member(info)}: push of v{version} still running "
                                                    f"after {timeout_s:.1f} s; its transfer was aborted")
            elif results.get(ticket) is not None:
                self._close_trainer(ticket)
                report.failed[info["member_id"]] = results[ticket]
            else:
                report.delivered.append(info["member_id"])
                self._holds[ticket] = version
        if self.transport == "sparse_nccl":
            self._keep_previous(version, buckets)
        report.seconds = time.monotonic() - start
        return report

    def _patches(self, buckets: FlatBuckets, tickets: list[int]):
        """sparse_nccl: the patches from the previous version to this one, if any vLLM engine holds the previous
        one (computed once for all of them); None: every engine gets the version dense."""
        if self.transport != "sparse_nccl" or self._previous is None:
            return None
        if not any(self._holds.get(t) == self._previous_version and self.roster.members[t].get("engine", "vllm")
                   == "vllm" for t in tickets):
            return None
        found = sparse_patches(self._previous, buckets)
        return None if found is None else self.to_patches(found)

    def _keep_previous(self, version: int, buckets: FlatBuckets) -> None:
        if self._previous is None or self._previous.layout.fingerprint != buckets.layout.fingerprint:
            self._previous = FlatBuckets(buckets.layout, device=buckets.buffers[0].device)
        for mine, theirs in zip(self._previous.buffers, buckets.buffers):
            mine.copy_(theirs)
        self._previous_version = version

    def _push_one(self, ticket: int, version: int, deadline: float, results: dict, patches) -> None:
        info = self.roster.members[ticket]
        who = describe_member(info)
        try:
            client = self._clients.setdefault(ticket, StoreEngineClient(self.store, ticket, who))
            client.deadline, client.version = deadline, version
            kind = info.get("engine", "vllm")
            if patches is not None and kind == "vllm" and self._holds.get(ticket) == self._previous_version:
                self._send_patches(self._trainer(ticket, "sparse_nccl", info, client), client, patches)
            else:
                self._trainer(ticket, "ipc" if self.transport == "ipc" else "nccl", info, client).send_weights()
            results[ticket] = None
        except Exception as err:  # noqa: BLE001 - named in the report; the engine catches up from staging
            self._holds.pop(ticket, None)
            results[ticket] = f"{who}: push of v{version} failed: {type(err).__name__}: {err}"

    def _trainer(self, ticket: int, transport: str, info: dict, client: StoreEngineClient):
        """The open trainer side for this engine and transport, opened now if needed; `client` then names it."""
        client.transport = transport
        trainer = self._trainers.get((ticket, transport))
        if trainer is None:
            trainer = self.trainer_factory(info.get("engine", "vllm"), transport, self.advertise,
                                           free_port(self.bind_host), 1 + int(info.get("ranks", 1)), client,
                                           bucket_source(_Current(self)))
            self._trainers[(ticket, transport)] = trainer
        return trainer

    @staticmethod
    def _send_patches(trainer, client: StoreEngineClient, patches: list) -> None:
        """vLLM's sparse round; with nothing changed it sends nothing, so the new version is committed by an
        empty round of our own (start, finish)."""
        if patches:
            trainer.send_weights(patches)
        else:
            client.start_weight_update()
            client.finish_weight_update()

    def _forget(self, info: dict, reason: str, report: SendReport) -> None:
        report.failed[info["member_id"]] = reason
        report.dropped.append(info["member_id"])
        self._close_trainer(info["ticket"])
        self._clients.pop(info["ticket"], None)

    def _close_trainer(self, ticket: int) -> None:
        """Abort every trainer side of this engine (after a failure its state is unknown: the next push is dense)."""
        self._holds.pop(ticket, None)
        for key in [key for key in self._trainers if key[0] == ticket]:
            trainer = self._trainers.pop(key)
            try:
                trainer.shutdown()  # vLLM's: ncclCommAbort, bounded by its own 5 s join
            except Exception:  # noqa: BLE001 - the group is being thrown away either way
                pass

    def close(self) -> None:
        for ticket in {key[0] for key in self._trainers}:
            self._close_trainer(ticket)


class _Current:
    """The host's current buckets, read at each iteration: a trainer engine keeps its source for its lifetime,
    and the publisher hands a new set when the layout changes."""

    def __init__(self, host: EnginePushSender):
        self.host = host

    @property
    def layout(self):
        return self.host._buckets.layout

    def view(self, entry):
        return self.host._buckets.view(entry)
