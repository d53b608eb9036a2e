"""One worker process of a `ProcessCallPool` (pool.py): `python -m asyncrl.generator.user_code.pool_worker PPID`.

It reads frames from stdin and writes frames to its private copy of stdout; a frame is a 4-byte big-endian length
and a pickle. The first frame is the `CallTarget`; every later one is a call's arguments, answered by
("ok", result) or ("error", exception type name, message). User code that prints goes to stderr: file descriptor
1 is pointed there before any user code runs, so nothing it writes can corrupt a frame.
"""
import ctypes
import os
import pickle
import signal
import struct
import sys

HEADER = struct.Struct(">I")


def read_frame(stream):
    header = stream.read(HEADER.size)
    if len(header) < HEADER.size:
        return None  # the pool closed the pipe
    (length,) = HEADER.unpack(header)
    return pickle.loads(stream.read(length))


def write_frame(stream, obj) -> None:
    payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(HEADER.pack(len(payload)) + payload)
    stream.flush()


def die_with_parent(parent_pid: int) -> None:
    """Linux: SIGKILL this worker when the generator dies, even in the middle of a hung call (an orphan would spin
    until its call ended, if ever). Elsewhere, or if the parent is already gone, the closed stdin ends it."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent_pid:
        sys.exit(0)


def answer(fn, args) -> tuple:
    try:
        return ("ok", fn(*args))
    except BaseException as err:  # SystemExit from user code too: the worker lives on
        return ("error", type(err).__name__, str(err)[:2000])


def main(argv: list) -> int:
    die_with_parent(int(argv[0]))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the generator decides
    requests = os.fdopen(os.dup(0), "rb")
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # user prints go to stderr, never into a frame
    sys.stdout = sys.stderr
    target = read_frame(requests)
    try:
        fn, build_error = target.build(), None
    except BaseException as err:  # reported on every call, so the caller sees why
        fn, build_error = None, ("error", type(err).__name__, f"could not build {target.factory}: {err}")
    while (args := read_frame(requests)) is not None:
        reply = build_error or answer(fn, args)
        try:
            write_frame(replies, reply)
        except (pickle.PicklingError, TypeError, AttributeError) as err:  # an unpicklable result
            write_frame(replies, ("error", type(err).__name__, f"the result could not be sent back: {err}"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
