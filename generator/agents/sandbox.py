"""The built-in `python` tool: a model's code runs in a fresh, confined subprocess per call.

Each call gets its own temporary working directory (removed after), a scrubbed environment, and the limits of
`tools.sandbox` (generator/config.py `SandboxConfig`): CPU seconds, address space, processes, open files, file size, output bytes, and
a wall-clock timeout. The child confines itself before the code runs (generator/agents/sandbox_exec.py): a new
network namespace (no network) where the kernel allows one, resource limits, and a pids cgroup of its own when the
cgroup filesystem is writable (as root, where RLIMIT_NPROC does not apply). Past the timeout, or once the output
passes its cap, the whole process group and every process of the cgroup is killed. Whatever happens, the model gets
one text: what the code printed, or an error that says which limit it hit; the generator is never at risk.

What it does not isolate (docs/agents.md, "The sandboxed `python` tool"): the filesystem outside the working
directory is readable and, as far as file permissions allow, writable (run generators as an unprivileged user, or in
a container, to keep them apart); without a writable cgroup and as root, processes are bounded only by the timeout;
where no network namespace can be made the network is reachable, unless `require_no_network` refuses to run.
"""
import asyncio
import json
import os
import shutil
import signal
import sys
import tempfile
from dataclasses import asdict, dataclass

from asyncrl.generator.agents.sandbox_exec import NO_NETWORK_ISOLATION, SETUP_FAILED
from asyncrl.generator.config import SandboxConfig

CGROUP_PIDS_ROOTS = ("/sys/fs/cgroup/pids", "/sys/fs/cgroup")
"""cgroup v1's pids hierarchy, then v2's unified one (where the pids controller must be enabled)."""


@dataclass
class SandboxResult:
    stdout: str
    stderr: str
    exit_code: int | None
    error: str | None = None  # timeout, output_too_long, setup; None: the code ran to its end (maybe failing)

    def text(self) -> str:
        """What the model reads."""
        if self.error == "timeout":
            return f"error: the code did not finish within its time limit\n{self.stdout}"[:4000]
        if self.error == "output_too_long":
            return "error: the code printed more than the sandbox's output limit; print less"
        if self.error == "setup":
            return f"error: the sandbox could not start: {self.stderr.strip()[-500:]}"
        if self.exit_code == -signal.SIGKILL or self.exit_code == -signal.SIGXCPU:
            return f"error: the code used up its CPU time\n{self.stdout}"[:4000]
        if self.exit_code != 0:
            return f"{self.stdout}error (exit code {self.exit_code}):\n{self.stderr.strip()[-2000:]}"
        return self.stdout


class PidsCgroup:
    """A pids cgroup with `pids.max`, for one call; None from `make` where cgroups cannot be written."""

    def __init__(self, path: str):
        self.path = path

    @classmethod
    def make(cls, max_processes: int):
        for root in CGROUP_PIDS_ROOTS:
            if not os.path.isfile(os.path.join(root, "cgroup.procs")) or not os.access(root, os.W_OK):
                continue
            path = tempfile.mkdtemp(prefix="asyncrl-sandbox-", dir=root)  # mkdir in cgroupfs makes a cgroup
            try:
                with open(os.path.join(path, "pids.max"), "w") as handle:
                    handle.write(str(max_processes))
                return cls(path)
            except OSError:  # v2 without the pids controller here
                os.rmdir(path)
        return None

    @property
    def procs(self) -> str:
        return os.path.join(self.path, "cgroup.procs")

    def kill_all(self) -> None:
        for _ in range(50):  # a fork bomb forks while we kill: repeat until it is empty
            try:
                with open(self.procs) as handle:
                    pids = [int(line) for line in handle if line.strip()]
            except OSError:
                return
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    async def remove(self) -> None:
        for _ in range(200):
            self.kill_all()
            try:
                os.rmdir(self.path)
                return
            except OSError:  # busy until its last process is gone
                await asyncio.sleep(0.01)


def processes_bounded() -> bool:
    """Whether the sandbox can bound the code's processes here: a writable pids cgroup, or not running as root
    (RLIMIT_NPROC). Otherwise only the timeout stops a fork bomb."""
    cgroup = PidsCgroup.make(1)
    if cgroup is not None:
        os.rmdir(cgroup.path)
        return True
    return os.getuid() != 0


async def run_python(code: str, limits: SandboxConfig) -> SandboxResult:
    """Run `code` confined; never raises for what the code does."""
    workdir = tempfile.mkdtemp(prefix="asyncrl-sandbox-")
    cgroup = PidsCgroup.make(limits.max_processes)
    child_limits = {**asdict(limits), "cgroup_procs": cgroup.procs if cgroup else None}
    started = asyncio.get_running_loop().time()
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-I", "-m", "asyncrl.generator.agents.sandbox_exec", json.dumps(child_limits),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=workdir,
        env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}, start_new_session=True)
    readers = [asyncio.ensure_future(read_capped(stream, limits.max_output_bytes))
               for stream in (process.stdout, process.stderr)]
    try:
        process.stdin.write(code.encode())
        process.stdin.close()
        pending = set(readers)
        while pending:  # both streams to their end, unless one passes the cap or time runs out
            done, pending = await asyncio.wait(pending, timeout=max(limits.timeout_s - elapsed(started), 0.0),
                                               return_when=asyncio.FIRST_COMPLETED)
            if not done:
                return SandboxResult(stdout="", stderr="", exit_code=None, error="timeout")
            if any(task.result()[1] for task in done):
                return SandboxResult(stdout="", stderr="", exit_code=None, error="output_too_long")
        (stdout, _), (stderr, _) = readers[0].result(), readers[1].result()
        exit_code = await asyncio.wait_for(process.wait(), max(limits.timeout_s - elapsed(started), 0.1))
        result = SandboxResult(stdout.decode(errors="replace"), stderr.decode(errors="replace"), exit_code)
        if exit_code in (SETUP_FAILED, NO_NETWORK_ISOLATION) and result.stderr.startswith("sandbox:"):
            result.error = "setup"
        return result
    except asyncio.TimeoutError:
        return SandboxResult(stdout="", stderr="", exit_code=None, error="timeout")
    finally:  # also on cancellation: nothing the code started outlives the call
        kill_group(process)
        if cgroup is not None:
            cgroup.kill_all()
        await reap(process, readers)
        if cgroup is not None:
            await cgroup.remove()
        shutil.rmtree(workdir, ignore_errors=True)


def elapsed(started: float) -> float:
    return asyncio.get_running_loop().time() - started


async def reap(process, readers: list) -> None:
    """Wait for the killed process; its pipes must be read to their end too, or asyncio never reports the exit."""
    for reader in readers:
        reader.cancel()
    await asyncio.gather(*readers, return_exceptions=True)
    for stream in (process.stdout, process.stderr):
        try:
            while await asyncio.wait_for(stream.read(1 << 20), 2.0):
                pass
        except (asyncio.TimeoutError, ConnectionError):
            pass
    try:
        await asyncio.wait_for(process.wait(), 5.0)
    except asyncio.TimeoutError:
        pass


async def read_capped(stream, cap: int) -> tuple[bytes, bool]:
    """Up to `cap` bytes of the stream until it ends; (data, True) as soon as it would pass the cap."""
    data = b""
    while True:
        chunk = await stream.read(65536)
        if not chunk:
            return data, False
        data += chunk
        if len(data) > cap:
            return data[:cap], True


def kill_group(process) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)  # start_new_session: the code's own process group
    except (ProcessLookupError, PermissionError):
        pass


def python_tool(limits: SandboxConfig):
    """The `python` tool the model calls, bound to the job's limits."""

    async def python(code: str) -> str:
        """Run Python code in a fresh sandboxed interpreter and return what it prints (stdout).

        Args:
            code: a complete Python program; print the values you want to see
        """
        return (await run_python(code, limits)).text()

    return python
