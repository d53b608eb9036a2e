"""The generator fleet of an `asyncrl ray` job: a named Ray actor that owns one `RoleProcess` actor per generator.

Elastic by design: generators already join and leave a job at any time (the learner deals prompts to whoever says
hello, and a generator stopped with SIGTERM finishes its step and says bye, its dealt prompts going back to the
epoch). The fleet only decides how many run: `scale(n)` from `asyncrl ray scale`, or its autoscale thread from the
learner's progress records and launch/autoscale.py's policy. A removed generator is the newest one; a new one gets
a new name (gen-<next index>), so a name is one generator's history in the job's logs and the learner's records.
"""
import threading
import time

from asyncrl.launch.ray_actors import RoleProcess

POLL_TIMEOUT_S = 2.0
UNPLACED_WARN_S = 120.0
"""A generator whose process has not started this long after it was asked for is named in the driver's output."""
AUTOSCALE_RECORDS = "autoscale.jsonl"
"""Each autoscale decision, a JSON line in the job directory (rank 0's node): the step it read up to, the fleet's
size before and after, the reason, and what it measured (autoscale/* numbers)."""
PROGRESS_KEEP = 200
"""Progress records the autoscale thread keeps (its decision reads the newest few)."""


class Fleet:
    def __init__(self, argv: list, job_dir: str, driver_cwd: str, actor_options: dict, count: int, learner,
                 policy=None):
        self.argv, self.job_dir, self.driver_cwd = list(argv), job_dir, driver_cwd
        self.actor_options = dict(actor_options)
        self.learner = learner
        self.live: dict = {}  # name -> {"actor", "wait" (ObjectRef), "pid"}
        self.exited: dict = {}  # name -> exit code
        self.events: list = []
        self.next_index = 0
        self.lock = threading.RLock()
        self.closing = False
        self.scale(count, "start")
        if policy is not None:
            threading.Thread(target=self._autoscale, args=(policy,), daemon=True, name="autoscale").start()

    # --- what the driver and `asyncrl ray scale` call ----------------------------------------------------------
    def scale(self, count: int, why: str = "asyncrl ray scale") -> dict:
        """Add or stop generators until `count` run; returns {"before", "after", "added", "removed"}."""
        if count < 1:
            raise ValueError(f"a fleet needs at least 1 generator, got {count}")
        with self.lock:
            if self.closing:
                raise RuntimeError("the job is finishing; the fleet no longer scales")
            before = len(self.live)
            added = [self._add() for _ in range(count - before)]
            removed = sorted(self.live, key=self._index)[count:] if count < before else []
            for name in removed:
                self._remove(name)
            if added or removed:
                self._say(f"fleet: {before} -> {len(self.live)} generators ({why})"
                          + (f"; started {', '.join(added)}" if added else "")
                          + (f"; stopped {', '.join(removed)} (their dealt prompts go back)" if removed else ""))
            return {"before": before, "after": len(self.live), "added": added, "removed": removed}

    def poll(self) -> dict:
        """Collect generators that exited, and notice restarts (a new child PID); returns the live names, the
        exits so far and how many of them failed (a code other than 0 and 143, SIGTERM's)."""
        import ray

        with self.lock:
            for name, entry in list(self.live.items()):
                done, _ = ray.wait([entry["wait"]], timeout=0)
                if done:
                    self._reap(name, entry)
                    continue
                pid_ref = entry["actor"].child_pid.remote()
                ready, _ = ray.wait([pid_ref], timeout=POLL_TIMEOUT_S)
                pid = ray.get(ready[0]) if ready else 0
                if pid and entry["pid"] and pid != entry["pid"]:
                    self._say(f"fleet: {name} restarted by Ray (process {entry['pid']} died; now {pid})")
                if pid:
                    entry["pid"] = pid
                elif not entry["warned"] and time.monotonic() - entry["since"] > UNPLACED_WARN_S:
                    entry["warned"] = True
                    self._say(f"fleet: {name} is not running after {UNPLACED_WARN_S:.0f} s: the cluster may have no "
                              f"room for {self.actor_options} (`ray status` shows what it has; it starts when room "
                              f"appears)")
            failed = [name for name, code in self.exited.items() if code not in (0, 143)]
            return {"live": sorted(self.live, key=self._index), "exited": dict(self.exited), "failed": failed}

    def events_since(self, index: int) -> list:
        with self.lock:
            return self.events[index:]

    def child_pid(self, name: str) -> int:
        """The PID of a generator's process on its node (tests kill it to see Ray restart it)."""
        import ray

        return ray.get(self.live[name]["actor"].child_pid.remote(), timeout=60)

    def finish(self, grace_s: float) -> dict:
        """The learner has finished: each generator has `grace_s` to hear "done" and exit; the rest are stopped."""
        import ray

        with self.lock:
            self.closing = True
            refs = {entry["wait"]: name for name, entry in self.live.items()}
        ray.wait(list(refs), num_returns=len(refs), timeout=grace_s)
        with self.lock:
            for name in list(self.live):
                self._remove(name)
            return dict(self.exited)

    # --- inside the actor ---------------------------------------------------------------------------------------
    def _add(self) -> str:
        import ray

        name = f"gen-{self.next_index}"
        self.next_index += 1
        options = {"max_task_retries": -1, "max_concurrency": 4, **self.actor_options}
        actor = ray.remote(RoleProcess).options(**options).remote(
            name, "generator", [*self.argv, f"generator.generator_id={name}"], self.job_dir, self.driver_cwd,
            True, True)
        self.live[name] = {"actor": actor, "wait": actor.wait.remote(), "pid": 0, "since": time.monotonic(),
                           "warned": False}
        return name

    def _remove(self, name: str) -> None:
        """Stop a generator (SIGTERM between groups) and its actor."""
        import ray

        entry = self.live.pop(name)
        try:
            code = ray.get(entry["actor"].stop.remote(), timeout=60)
        except Exception as err:  # the actor is restarting or gone: its child dies with it
            code = None
            self._say(f"fleet: {name} did not stop cleanly ({type(err).__name__}); killing its actor")
        self.exited[name] = 143 if code is None else code
        ray.kill(entry["actor"], no_restart=True)

    def _reap(self, name: str, entry: dict) -> None:
        import ray

        try:
            code = ray.get(entry["wait"])
        except Exception as err:  # the actor died more often than max_restarts allows
            code, tail = 1, f"its actor died: {err}".splitlines()[0]
        else:
            tail = log_tail(ray, entry["actor"]) if code not in (0, 143) else ""
        del self.live[name]
        self.exited[name] = code
        ray.kill(entry["actor"], no_restart=True)
        if code in (0, 143):
            self._say(f"fleet: {name} exited ({code})")
        else:
            self._say(f"fleet: {name} failed with exit code {code}; it is not restarted. Last lines of its log:\n"
                      + "".join("  | " + line for line in tail.splitlines(keepends=True)))

    def _say(self, line: str) -> None:
        self.events.append(f"{time.strftime('%H:%M:%S')} {line}")

    @staticmethod
    def _index(name: str) -> int:
        return int(name.rpartition("-")[2])

    def _autoscale(self, policy) -> None:
        """Every policy.interval_s: the learner's new progress records, the policy's decision, applied."""
        import ray

        from asyncrl.launch.autoscale import Autoscaler

        autoscaler = Autoscaler(policy)
        records, last_step, offset = [], 0, 0
        while not self.closing:
            time.sleep(policy.interval_s)
            try:
                fresh, offset = ray.get(self.learner.progress_since.remote(offset), timeout=30)
            except Exception as err:  # the learner is busy or finishing: decide next time
                self._say(f"autoscale: no progress records this round ({type(err).__name__})")
                continue
            if fresh:
                records = (records + fresh)[-PROGRESS_KEEP:]
                last_step = fresh[-1]["step"]
            with self.lock:
                if self.closing:
                    return
                current = len(self.live)
                decision = autoscaler.observe(records, current=current, now=time.monotonic())
                if decision is not None and decision.target != current:
                    self.scale(decision.target, f"autoscale: {decision.reason}")
                    self.learner.append_record.remote(AUTOSCALE_RECORDS, {
                        "step": last_step, "time": time.time(), "from": current, "to": decision.target,
                        "reason": decision.reason, **decision.metrics()})


def log_tail(ray, actor) -> str:
    """The last lines of a generator's log, from its actor; a line saying why when the actor does not answer within
    a minute (its node gone): the fleet goes on either way."""
    try:
        return ray.get(actor.log_tail.remote(), timeout=60)
    except Exception as err:  # noqa: BLE001 - any failure: the log is out of reach, the exit code is not
        return f"(its log is out of reach: {type(err).__name__})"
