"""Resumable checkpoints with `torch.distributed.checkpoint` (DCP), in one process or under FSDP2 on any world size.

Layout of one checkpoint, `root/step-{version:08d}/`:

    dcp/               model + optimizer, DCP format (FSDP2 DTensors are written sharded, one file per rank); with
                       a companion model, PPO's critic (learner/critic.py) or PRIME's PRM (learner/prm.py), its
                       model and optimizer too, under `critic` and `critic_optim` (`prm`, `prm_optim`)
    scheduler.pt       the LR scheduler's state_dict (rank 0; identical on every rank)
    critic_scheduler.pt  the critic's (prm_scheduler.pt the PRM's), when there is one
    rng-rank{r}.pt     rank r's RNG states: torch CPU, CUDA (if any), python `random`, numpy
    hf/                config.json, generation_config.json and tokenizer files, so `asyncrl export` needs nothing else
    meta.json          the LearnerState (learner/state.py: version, consumed frontier, counters, receipts awaiting
                       their ack, the KL coefficient), world size; written last

Atomicity: everything is written under `root/.tmp-step-{version:08d}/` and renamed once meta.json is in it, so a
kill -9 at any point leaves nothing `latest_checkpoint` would pick (it also requires meta.json). Stale temporary
directories are removed by the next save.

Every rank calls every function here; with a process group initialised they are collective. Only rank 0 writes
meta.json, copies hf files, renames and prunes; barriers make the final directory visible to all ranks on return.
With `async_save=True` the DCP write runs in a background thread on its own gloo group (so its collectives never
interleave with training's); rank 0 puts it in place from DCP's writer thread as soon as the write completes (DCP's
finish step has gathered every rank's results by then), and the next save or `wait_for_pending_save()` waits for
that.
"""
import contextlib
import json
import os
import random
import re
import shutil
import threading
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from asyncrl.learner.lora import lora_meta
from asyncrl.learner.state import LearnerState

CHECKPOINT_PREFIX = "step-"
TMP_PREFIX = ".tmp-" + CHECKPOINT_PREFIX
META_FILE = "meta.json"
DCP_DIR = "dcp"
HF_DIR = "hf"
SCHEDULER_FILE = "scheduler.pt"
COMPANION_NAMES = ("critic", "prm")
"""The models trained beside the policy that a checkpoint can hold: each saved under its name in the DCP state, its
optimizer under `{name}_optim`, its scheduler in `{name}_scheduler.pt`, and `meta.json` says which are in."""
FORMAT_VERSION = 2
"""meta.json's layout. Format 1 (before LearnerState) is still read: its version and `consumed` dict become a state."""
HF_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model",
            "chat_template.jinja", "chat_template.json", "preprocessor_config.json", "processor_config.json")
_STEP_RE = re.compile(rf"^{re.escape(CHECKPOINT_PREFIX)}(\d+)$")


class CheckpointError(RuntimeError):
    """A path is not a complete checkpoint, or cannot be loaded into this job."""


@dataclass
class _PendingSave:
    """An async DCP write in flight, and what finalising it needs."""
    future: object
    tmp_dir: str
    final_dir: str
    root: str
    meta: dict
    keep_last: int
    finalized: threading.Event = field(default_factory=threading.Event)
    error: list = field(default_factory=list)


_pending: _PendingSave | None = None
_async_group = None  # (default group, a gloo group only background saves use), made on the first async save


def save_checkpoint(root: str, model, optimizer, scheduler, state: LearnerState, keep_last: int,
                    model_dir: str | None = None, async_save: bool = False, critic=None, prm=None) -> str:
    """Writes root/step-{state.version:08d}/ and returns its path. Holds: the model and optimizer (DCP, via
    torch.distributed.checkpoint.state_dict.get_state_dict so FSDP2 DTensors are saved sharded), the LR scheduler
    state, every rank's RNG state (torch CPU RNG, CUDA RNG if available, python `random`, numpy), and the whole
    LearnerState as it is at this call (a copy: the state may move on while a background save runs; rank 0's is the
    one written, and every rank holds the same). When model_dir is given,
    config.json, generation_config.json and tokenizer files from it are copied into step-X/hf/ so export needs
    nothing else (without it, the model's own `config` is written there when it has one).
    Atomic: written under a temporary name and renamed, with meta.json written last, so a kill -9 mid-save leaves no
    directory that latest_checkpoint would pick. Keeps the newest keep_last checkpoints (keep_last<=0 keeps all),
    deleting older ones (rank 0 deletes). With async_save=True, uses dcp.async_save; rank 0 renames and prunes as
    soon as the write completes, and the next save or wait_for_pending_save() waits for that. A `critic`
    (learner/critic.Critic) or `prm` (learner/prm.ImplicitPRM) is saved with the policy, in the same DCP write."""
    global _pending
    version = state.version
    companions = _companions(critic, prm)
    meta = {"format": FORMAT_VERSION, "state": state.to_json(), "world_size": _world_size(), "time": time.time(),
            **{name: name in companions for name in COMPANION_NAMES}, "lora": lora_meta(model)}
    json.dumps(meta)  # fail before writing anything if the state is not JSON-able
    if model_dir is not None and not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise CheckpointError(f"model_dir {model_dir} has no config.json")  # on every rank, so none waits alone
    wait_for_pending_save()
    name = f"{CHECKPOINT_PREFIX}{version:08d}"
    tmp_dir, final_dir = os.path.join(root, f"{TMP_PREFIX}{version:08d}"), os.path.join(root, name)
    rank = _rank()
    failed = None
    if rank == 0:
        try:
            _remove_stale_tmp_dirs(root)
            os.makedirs(tmp_dir)
            _write_hf_files(os.path.join(tmp_dir, HF_DIR), model_dir, model)
            torch.save(scheduler.state_dict(), os.path.join(tmp_dir, SCHEDULER_FILE))
            for name, part in companions.items():
                torch.save(part.scheduler.state_dict(), os.path.join(tmp_dir, f"{name}_scheduler.pt"))
        except (OSError, RuntimeError) as err:  # torch.save's zip writer says RuntimeError when the disk fills
            failed = err
    # every rank meets here (the temporary directory exists, empty of stale files, before any rank writes into
    # it), and learns whether rank 0 could write at all
    _agree_written(failed, tmp_dir)
    try:
        torch.save(capture_rng_state(), os.path.join(tmp_dir, f"rng-rank{rank}.pt"))
    except (OSError, RuntimeError) as err:
        failed = err
    _agree_written(failed, tmp_dir)
    state = checkpoint_state(model, optimizer, companions)
    dcp_dir = os.path.join(tmp_dir, DCP_DIR)
    if async_save:
        future = dcp.async_save(state, checkpoint_id=dcp_dir, process_group=_get_async_group(),
                                no_dist=not _distributed())
        _pending = _PendingSave(future, tmp_dir, final_dir, root, meta, keep_last)
        if rank == 0:  # in place as soon as it is written, even while training waits for data
            getattr(future, "upload_completion", future).add_done_callback(
                lambda done, pending=_pending: _finalize_in_background(done, pending))
    else:
        try:
            with quiet_single_process_dcp():
                dcp.save(state, checkpoint_id=dcp_dir, no_dist=not _distributed())
        except (OSError, RuntimeError, dcp.api.CheckpointException) as err:  # DCP raises the same on every rank
            causes = [exc for exc, _ in err.failures.values()] if isinstance(err, dcp.api.CheckpointException) else [err]
            # what a full disk raises depends on where the write stopped (OSError, or torch's zip writer's
            # RuntimeError); a SIGTERM's SystemExit or a Ctrl-C caught by DCP's writer on its way must go on up
            stop = next((exc for exc in causes if not isinstance(exc, Exception)), None)
            _discard(tmp_dir)
            if stop is not None:
                raise stop
            raise CheckpointWriteFailed(f"could not write checkpoint {final_dir}: {causes[0]!r}") from None
        _finalize(tmp_dir, final_dir, root, meta, keep_last)
    return final_dir


class CheckpointWriteFailed(RuntimeError):
    """A checkpoint could not be written (a full, read-only or vanished disk, on any rank). Every rank raises it
    alike and nothing of it is visible (the temporary directory is removed), so the caller can train on and try
    again at the next checkpoint: the last complete one is still the one a restart resumes from."""


def _agree_written(failed: Exception | None, tmp_dir: str) -> None:
    """A meeting of every rank that also tells each whether any rank failed to write (a max over a gloo group, as
    the background saves use: NCCL would want a device tensor); on a failure every rank raises
    CheckpointWriteFailed, so none is left waiting in a collective the others skipped."""
    flag = torch.tensor([1 if failed is not None else 0], dtype=torch.int32)
    if _distributed():
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=_get_async_group())
    if flag.item():
        if _rank() == 0:
            _discard(tmp_dir)
        raise CheckpointWriteFailed(f"could not write the checkpoint in {tmp_dir}: "
                                    f"{failed if failed is not None else 'another rank failed'}")


def _discard(tmp_dir: str) -> None:
    shutil.rmtree(tmp_dir, ignore_errors=True)


def wait_for_pending_save() -> None:
    """Blocks until the in-flight async save (if any) is written, then renames it into place and prunes."""
    global _pending
    pending, _pending = _pending, None
    if pending is None:
        return
    # dcp.async_save returns a Future, or an AsyncSaveResponse whose upload_completion is the Future.
    future = getattr(pending.future, "upload_completion", pending.future)
    future.result()
    if _rank() == 0:
        pending.finalized.wait()
        if pending.error:
            raise CheckpointError(f"checkpoint {pending.final_dir}: finalising the background save failed: "
                                  f"{pending.error[0]}")
    _barrier()  # the next save (or the exit) sees the finished directory on every rank


def _finalize_in_background(future, pending: _PendingSave) -> None:
    """Rank 0, in DCP's writer thread, once the write is done: DCP's own finish step has gathered every rank's
    write results before the future completes, so every shard is on disk. No collective here."""
    try:
        if future.exception() is None:
            _write_meta_and_rename(pending.tmp_dir, pending.final_dir, pending.root, pending.meta, pending.keep_last)
        else:
            pending.error.append(repr(future.exception()))
    except Exception as err:  # surfaced by wait_for_pending_save
        pending.error.append(repr(err))
    finally:
        pending.finalized.set()


def _companions(critic, prm) -> dict:
    """{name: part} of the companion models given (each with .model, .optimizer, .scheduler)."""
    return {name: part for name, part in (("critic", critic), ("prm", prm)) if part is not None}


COMPANION_MISSING = {
    "critic": "this job trains one (algo.advantage=gae or algo.vtrace_values=critic)",
    "prm": "this job trains PRIME's implicit PRM (algo.advantage=prime)",
}


def checkpoint_state(model, optimizer, companions: dict | None = None) -> dict:
    """What DCP saves and loads: the policy and its optimizer, and each companion model's and its optimizer's."""
    model_state, optim_state = get_state_dict(model, optimizer)  # initialises the optimizer state to load into
    state = {"model": model_state, "optim": optim_state}
    for name, part in (companions or {}).items():
        state[name], state[f"{name}_optim"] = get_state_dict(part.model, part.optimizer)
    return state


def load_checkpoint(path: str, model, optimizer, scheduler, critic=None, prm=None) -> LearnerState:
    """Loads everything save_checkpoint wrote into the given (already FSDP-wrapped if distributed) model/optimizer/
    scheduler (and `critic`'s and `prm`'s), restores this rank's RNG state, returns the LearnerState. Clear error
    naming the path if it is not a complete checkpoint, if it was written with a different world size where that
    matters (RNG per rank), or if this job has a critic or PRM and the checkpoint none (a checkpoint's companion is
    ignored by a job without one)."""
    meta = read_meta(path)
    companions = _companions(critic, prm)
    for name in companions:
        if not meta.get(name):
            raise CheckpointError(
                f"checkpoint {path} holds no {name}, and {COMPANION_MISSING[name]}: export its policy with `asyncrl "
                f"export` and start a new job from it (model.path), whose {name} then starts from the policy's "
                f"weights")
    if meta.get("lora") != lora_meta(model):
        raise CheckpointError(
            f"checkpoint {path} holds {_describe_lora(meta.get('lora'))} and this job trains "
            f"{_describe_lora(lora_meta(model))} (learner.lora): resume with the checkpoint's settings, or export it "
            f"with `asyncrl export` (LoRA merged) and start a new job from that model")
    world, rank = _world_size(), _rank()
    if meta["world_size"] != world:
        raise CheckpointError(
            f"checkpoint {path} was written by {meta['world_size']} ranks but this job has {world}: per-rank RNG "
            f"states cannot be restored (export it with `asyncrl export` to start a new run from its weights)")
    rng_file = os.path.join(path, f"rng-rank{rank}.pt")
    # Every rank checks every file, so all ranks raise together instead of some waiting in dcp.load's collectives.
    files = [os.path.join(path, f"rng-rank{r}.pt") for r in range(world)]
    files += [os.path.join(path, SCHEDULER_FILE), os.path.join(path, DCP_DIR, ".metadata")]
    files += [os.path.join(path, f"{name}_scheduler.pt") for name in companions]
    for needed in files:
        if not os.path.exists(needed):
            raise CheckpointError(f"checkpoint {path} is incomplete: {os.path.relpath(needed, path)} is missing")
    state = checkpoint_state(model, optimizer, companions)
    with quiet_single_process_dcp():
        dcp.load(state, checkpoint_id=os.path.join(path, DCP_DIR), no_dist=not _distributed())
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    scheduler.load_state_dict(torch.load(os.path.join(path, SCHEDULER_FILE), weights_only=True))
    for name, part in companions.items():
        set_state_dict(part.model, part.optimizer, model_state_dict=state[name],
                       optim_state_dict=state[f"{name}_optim"])
        part.scheduler.load_state_dict(torch.load(os.path.join(path, f"{name}_scheduler.pt"), weights_only=True))
    restore_rng_state(torch.load(rng_file, weights_only=True))
    _barrier()
    return read_state(path)


def _describe_lora(meta: dict | None) -> str:
    if not meta:
        return "full weights (no LoRA)"
    return f"a rank-{meta['r']} LoRA adapter (alpha {meta['lora_alpha']}, on {', '.join(meta['target_modules'])})"


def latest_checkpoint(root: str) -> str | None:
    """The newest complete checkpoint under root (a step-* directory with meta.json), or None."""
    found = _list_checkpoints(root, complete_only=True)
    return found[-1][1] if found else None


def read_meta(path: str) -> dict:
    """meta.json of a complete checkpoint; CheckpointError naming the path otherwise."""
    meta_file = os.path.join(path, META_FILE)
    if not os.path.isfile(meta_file):
        why = "does not exist" if not os.path.exists(path) else f"has no {META_FILE} (not a complete checkpoint)"
        raise CheckpointError(f"checkpoint {path} {why}")
    try:
        with open(meta_file) as f:
            meta = json.load(f)
    except (OSError, ValueError) as err:
        raise CheckpointError(f"checkpoint {path}: unreadable {META_FILE}: {err}") from err
    if meta.get("format") not in (1, FORMAT_VERSION):
        raise CheckpointError(f"checkpoint {path}: format {meta.get('format')!r}, expected {FORMAT_VERSION}")
    return meta


def read_state(path: str) -> LearnerState:
    """The LearnerState a complete checkpoint holds (format 1: its version and consumed frontier)."""
    meta = read_meta(path)
    if meta["format"] == 1:  # before LearnerState: a version and a `consumed` dict
        consumed = meta.get("consumed") or {}
        return LearnerState(version=int(meta["version"]), groups_consumed=int(consumed.get("groups", 0)),
                            groups_by_generator=dict(consumed.get("by_generator", {})),
                            dropped_total=Counter(consumed.get("dropped_total", {})),
                            unacked=list(consumed.get("unacked", [])))
    try:
        return LearnerState.from_json(meta["state"])
    except (KeyError, TypeError, ValueError) as err:
        raise CheckpointError(f"checkpoint {path}: unreadable learner state in {META_FILE}: {err!r}") from None


def resolve_checkpoint(path: str) -> str:
    """path itself if it is a complete checkpoint, else the latest checkpoint under it; CheckpointError if neither."""
    if os.path.isfile(os.path.join(path, META_FILE)):
        return path
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint {path} does not exist")
    latest = latest_checkpoint(path)
    if latest is None:
        raise CheckpointError(f"checkpoint {path} has no {META_FILE} and no complete {CHECKPOINT_PREFIX}* "
                              f"checkpoint under it")
    return latest


def capture_rng_state() -> dict:
    numpy_state = np.random.get_state(legacy=False)
    state = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": {**numpy_state, "state": {"key": numpy_state["state"]["key"].tolist(),
                                           "pos": int(numpy_state["state"]["pos"])}},
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    numpy_state = state["numpy"]
    np.random.set_state({**numpy_state, "state": {"key": np.array(numpy_state["state"]["key"], dtype=np.uint32),
                                                  "pos": numpy_state["state"]["pos"]}})
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])


@contextlib.contextmanager
def quiet_single_process_dcp():
    """DCP warns on every single-process save/load even when no_dist=True is passed explicitly, as it is here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _finalize(tmp_dir: str, final_dir: str, root: str, meta: dict, keep_last: int) -> None:
    """Rank 0 writes meta.json (last), renames the temporary directory into place and prunes; then all ranks meet."""
    _barrier()  # every rank's DCP shards and RNG file are written
    if _rank() == 0:
        _write_meta_and_rename(tmp_dir, final_dir, root, meta, keep_last)
    _barrier()


def _write_meta_and_rename(tmp_dir: str, final_dir: str, root: str, meta: dict, keep_last: int) -> None:
    """Rank 0 only: meta.json last, then the rename that makes the checkpoint visible, then pruning."""
    with open(os.path.join(tmp_dir, META_FILE), "w") as f:
        json.dump(meta, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    if os.path.exists(final_dir):  # the same version saved again (e.g. after a resume): replace it
        _remove_checkpoint(final_dir)
    os.rename(tmp_dir, final_dir)
    _fsync_dir(root)
    _prune(root, keep_last)


def _prune(root: str, keep_last: int) -> None:
    """Deletes complete checkpoints beyond the newest keep_last, and any step-* directory older than those kept."""
    if keep_last <= 0:
        return
    complete = _list_checkpoints(root, complete_only=True)
    if len(complete) <= keep_last:
        return
    oldest_kept = complete[-keep_last][0]
    for version, path in _list_checkpoints(root, complete_only=False):
        if version < oldest_kept:
            _remove_checkpoint(path)


def _remove_checkpoint(path: str) -> None:
    # meta.json first: a half-deleted directory must never look complete.
    meta_file = os.path.join(path, META_FILE)
    if os.path.exists(meta_file):
        os.remove(meta_file)
    shutil.rmtree(path, ignore_errors=True)


def _list_checkpoints(root: str, complete_only: bool) -> list[tuple[int, str]]:
    """[(version, path)] of step-* directories under root, oldest first."""
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        match = _STEP_RE.match(name)
        path = os.path.join(root, name)
        if match and os.path.isdir(path) and (not complete_only or os.path.isfile(os.path.join(path, META_FILE))):
            found.append((int(match.group(1)), path))
    return sorted(found)


def _remove_stale_tmp_dirs(root: str) -> None:
    """Temporary directories of saves that were killed (no async save is pending when this runs)."""
    if os.path.isdir(root):
        for name in os.listdir(root):
            if name.startswith(TMP_PREFIX):
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def _write_hf_files(hf_dir: str, model_dir: str | None, model) -> None:
    os.makedirs(hf_dir)
    if model_dir is not None:
        for name in os.listdir(model_dir):
            if name in HF_FILES or name.startswith("tokenizer"):
                shutil.copy2(os.path.join(model_dir, name), os.path.join(hf_dir, name))
    elif hasattr(getattr(model, "config", None), "save_pretrained"):
        model.config.save_pretrained(hf_dir)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _get_async_group():
    """A gloo group used only by background saves; collective to create, so every rank makes it on the same save."""
    global _async_group
    if not _distributed():
        return None
    if _async_group is None or _async_group[0] is not dist.group.WORLD:  # none yet, or made for an older PG
        _async_group = (dist.group.WORLD, dist.new_group(backend="gloo"))
    return _async_group[1]


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _world_size() -> int:
    return dist.get_world_size() if _distributed() else 1


def _barrier() -> None:
    if _distributed():
        dist.barrier()
