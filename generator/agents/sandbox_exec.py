"""The sandbox's child (generator/agents/sandbox.py): `python -I -m asyncrl.generator.agents.sandbox_exec LIMITS`,
the code on stdin. It confines itself, then becomes `python -I -c CODE`:

1. joins the pids cgroup the parent made for this call, if any (before anything can fork);
2. leaves the network: a new network namespace has only a loopback that is down (CAP_SYS_ADMIN, or an
   unprivileged user namespace where the kernel allows one); exits 97 when `require_no_network` is set and
   neither works;
3. sets resource limits: CPU seconds, address space, processes, open files, file size, no core dumps;
4. execs the interpreter on the code, with a scrubbed environment, in the parent's temporary directory.

Exit codes 96/97 are this wrapper's own (a failed setup); everything else is the code's.
"""
import ctypes
import json
import os
import resource
import sys

CLONE_NEWNET = 0x40000000
CLONE_NEWUSER = 0x10000000
SETUP_FAILED, NO_NETWORK_ISOLATION = 96, 97


def leave_network() -> bool:
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    if libc.unshare(CLONE_NEWNET) == 0:
        return True
    uid, gid = os.getuid(), os.getgid()
    if libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) != 0:
        return False
    try:  # map ourselves, so files keep their owner and the interpreter stays readable
        with open("/proc/self/setgroups", "w") as handle:
            handle.write("deny")
        with open("/proc/self/uid_map", "w") as handle:
            handle.write(f"{uid} {uid} 1")
        with open("/proc/self/gid_map", "w") as handle:
            handle.write(f"{gid} {gid} 1")
    except OSError:
        pass
    return True


def user_process_count(uid: int) -> int:
    """Processes and threads of `uid` now: RLIMIT_NPROC counts all of them, not only this call's."""
    count = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}").st_uid == uid:
                    count += len(os.listdir(f"/proc/{entry}/task"))
            except OSError:
                continue
    return count


def set_limits(limits: dict) -> None:
    mb = 1 << 20
    resource.setrlimit(resource.RLIMIT_CPU, (limits["cpu_s"], limits["cpu_s"] + 1))
    resource.setrlimit(resource.RLIMIT_AS, (limits["memory_mb"] * mb, limits["memory_mb"] * mb))
    resource.setrlimit(resource.RLIMIT_NOFILE, (limits["max_open_files"], limits["max_open_files"]))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits["max_file_mb"] * mb, limits["max_file_mb"] * mb))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if os.getuid() != 0:  # the kernel ignores RLIMIT_NPROC for root; the pids cgroup covers root
        processes = user_process_count(os.getuid()) + limits["max_processes"]
        resource.setrlimit(resource.RLIMIT_NPROC, (processes, processes))


def main(argv: list) -> int:
    limits = json.loads(argv[0])
    code = sys.stdin.read()
    try:
        if limits.get("cgroup_procs"):
            with open(limits["cgroup_procs"], "w") as handle:
                handle.write(str(os.getpid()))
        isolated = leave_network()
        if not isolated and limits["require_no_network"]:
            print("sandbox: no network namespace could be made here and tools.sandbox.require_no_network is set",
                  file=sys.stderr)
            return NO_NETWORK_ISOLATION
        set_limits(limits)
    except OSError as err:
        print(f"sandbox: setting up failed: {err}", file=sys.stderr)
        return SETUP_FAILED
    env = {"PATH": "/usr/bin:/bin", "HOME": os.getcwd(), "TMPDIR": os.getcwd(), "LANG": "C.UTF-8",
           "PYTHONDONTWRITEBYTECODE": "1", "PYTHONIOENCODING": "utf-8"}
    os.execve(sys.executable, [sys.executable, "-I", "-c", code], env)
    return SETUP_FAILED  # not reached: execve replaces this process


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
