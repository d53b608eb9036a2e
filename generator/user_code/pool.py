"""A bounded pool of worker processes for user code that must never block the generator's event loop.

Reward functions, tools and environment steps are written by other people and may hang, spin, or crash the
interpreter. Each call runs in a worker process (pool_worker.py), one call per worker at a time, under a
wall-clock timeout. A call past its timeout, or cancelled by its caller, has its worker killed and replaced: a
thread could not be stopped, and a process still running someone else's call must never answer the next caller.
A worker that dies (a segfault, `os._exit`) fails only the call it was running. Workers that die before ever
answering, three in a row, break the pool (`PoolBroken`): respawning them would only spin.

Contract: `await call(*args)` waits for a free worker (the pool is bounded: that is the back-pressure), writes
the arguments to its stdin and awaits the answer on its stdout (asyncio subprocess pipes: the loop never blocks).
It returns the callable's result or raises `CallTimeout` / `CallFailed`. Workers are fresh interpreters
(`python -m asyncrl.generator.user_code.pool_worker`), not forks of the generator, which has torch and engine
threads, and not `multiprocessing` children, which re-import the parent's main script. Each builds its callable
once from a `CallTarget`, an importable factory and its arguments, so only names and plain values cross the pipe.
"""
import asyncio
import importlib
import logging
import os
import pickle
import sys
from dataclasses import dataclass

from asyncrl.generator.user_code.pool_worker import HEADER

log = logging.getLogger(__name__)
KILL_WAIT_S = 2.0
"""How long a killed worker is waited for before it is left to the OS (SIGKILL cannot be ignored)."""
START_DEATHS_TO_BREAK = 3
"""Consecutive workers dying before their first answer that mark the pool broken."""


@dataclass(frozen=True)
class CallTarget:
    """What a worker runs: `factory` ("package.module:function") is imported in the worker and called once with
    `args`; what it returns is the callable every call of the pool runs."""

    factory: str
    args: tuple = ()

    def build(self):
        module_name, _, attribute = self.factory.partition(":")
        factory = getattr(importlib.import_module(module_name), attribute)
        return factory(*self.args)


class CallTimeout(TimeoutError):
    """The call ran past its timeout; its worker was killed."""


class CallFailed(RuntimeError):
    """The call raised (`kind` is the exception's type name) or its worker died (`WorkerDied`)."""

    def __init__(self, kind: str, message: str):
        super().__init__(f"{kind}: {message}")
        self.kind = kind


class PoolBroken(RuntimeError):
    """Every new worker dies before answering: the interpreter or the environment is broken, not one call."""


class _Worker:
    def __init__(self, process):
        self.process = process
        self.answered = False

    @property
    def pid(self) -> int:
        return self.process.pid

    async def kill(self) -> None:
        if self.process.returncode is None:
            try:
                self.process.kill()
            except ProcessLookupError:
                pass
        try:
            await asyncio.wait_for(self.process.wait(), KILL_WAIT_S)
        except asyncio.TimeoutError:
            log.warning("worker %d did not exit %g s after SIGKILL", self.pid, KILL_WAIT_S)


class ProcessCallPool:
    """`workers` processes running `target`'s callable, each call under `timeout_s` seconds."""

    def __init__(self, target: CallTarget, workers: int, timeout_s: float, name: str = "asyncrl-call"):
        if workers < 1:
            raise ValueError(f"a call pool needs at least 1 worker, got {workers}")
        if timeout_s <= 0:
            raise ValueError(f"a call pool's timeout must be > 0 s, got {timeout_s}")
        self.target, self.timeout_s, self.name, self.size = target, timeout_s, name, workers
        self._target_frame = _frame(target)
        self._idle: asyncio.Queue | None = None
        self._all: set = set()
        self._closed = False
        self._start_deaths = 0
        self._background: set = set()  # replacements being spawned
        self.replaced = 0  # workers killed (timeout, cancellation) or found dead, and replaced

    async def start(self) -> None:
        """Start the workers; they import and build the callable while the generator goes on."""
        self._idle = asyncio.Queue()
        for _ in range(self.size):
            self._idle.put_nowait(await self._spawn())

    async def _spawn(self) -> _Worker:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "asyncrl.generator.user_code.pool_worker", str(os.getpid()),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
        worker = _Worker(process)
        self._all.add(worker)
        process.stdin.write(self._target_frame)
        return worker

    def _retire(self, worker: _Worker) -> None:
        """Kill `worker` and put a fresh one in its place, in the background: the caller that gave up on it
        (timed out, cancelled) must not wait for that."""
        self._all.discard(worker)
        task = asyncio.ensure_future(self._replace(worker))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _replace(self, worker: _Worker) -> None:
        await worker.kill()
        if self._closed or self._start_deaths >= START_DEATHS_TO_BREAK:
            return
        self.replaced += 1
        self._idle.put_nowait(await self._spawn())

    async def call(self, *args, timeout_s: float | None = None):
        if self._idle is None:
            raise RuntimeError(f"{self.name}: start() the pool before calling it")
        if self._closed:
            raise CallFailed("PoolClosed", f"{self.name} is closed")
        if self._start_deaths >= START_DEATHS_TO_BREAK:
            raise PoolBroken(f"{self.name}: {self._start_deaths} workers in a row died before answering a call; "
                             f"run `{sys.executable} -m asyncrl.generator.user_code.pool_worker` to see why")
        limit = timeout_s or self.timeout_s
        worker = await self._idle.get()
        try:
            reply = await asyncio.wait_for(self._exchange(worker, args), limit)
        except asyncio.TimeoutError:
            self._retire(worker)
            raise CallTimeout(f"{self.name}: no answer within {limit:g} s") from None
        except (asyncio.IncompleteReadError, ConnectionError):
            code = await worker.process.wait()
            if not worker.answered:
                self._start_deaths += 1
            self._retire(worker)
            raise CallFailed("WorkerDied", f"{self.name}'s worker died (exit code {code})") from None
        except BaseException:  # cancelled: the worker may still be running the call
            self._retire(worker)
            raise
        worker.answered, self._start_deaths = True, 0
        self._idle.put_nowait(worker)
        if reply[0] == "ok":
            return reply[1]
        raise CallFailed(reply[1], reply[2])

    @staticmethod
    async def _exchange(worker: _Worker, args: tuple):
        worker.process.stdin.write(_frame(args))
        await worker.process.stdin.drain()
        (length,) = HEADER.unpack(await worker.process.stdout.readexactly(HEADER.size))
        return pickle.loads(await worker.process.stdout.readexactly(length))

    async def close(self) -> None:
        """Kill every worker, busy or not; later calls fail at once."""
        self._closed = True
        await asyncio.gather(*self._background, return_exceptions=True)
        workers, self._all = list(self._all), set()
        await asyncio.gather(*(worker.kill() for worker in workers))

    def pids(self) -> list:
        return [worker.pid for worker in self._all]


def _frame(obj) -> bytes:
    payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return HEADER.pack(len(payload)) + payload
