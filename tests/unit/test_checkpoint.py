"""DCP checkpoints in one process: bit-identical resume with the whole LearnerState, atomicity, pruning, async
save, older formats, and `asyncrl export` into an HF directory. The 2-rank FSDP2 cases and the export CLI run as
processes: tests/integration/test_checkpoint_ranks.py."""
import json
import os
import shutil
import time
from collections import Counter

import pytest
import torch

from asyncrl.learner.checkpoint import (CHECKPOINT_PREFIX, CheckpointError, latest_checkpoint, load_checkpoint,
                                        save_checkpoint, wait_for_pending_save)
from asyncrl.learner.export import export_checkpoint
from asyncrl.learner.state import LearnerState
from tests.checkpoint_training import build_training, seed_all, train_steps


def test_resume_gives_bit_identical_losses_lr_and_the_whole_learner_state(tmp_path):
    model, optimizer, scheduler = build_training()
    seed_all(123)
    train_steps(model, optimizer, scheduler, 3)
    state = LearnerState(version=3, groups_consumed=12, groups_by_generator={"gen-0": 7, "gen-1": 5},
                         dropped_total=Counter(stale=2), unacked=["1-0", "1-1"], kl_coef=0.0123,
                         data_cursor={"epoch": 1})
    path = save_checkpoint(str(tmp_path), model, optimizer, scheduler, state, keep_last=0)
    state.unacked.append("2-0")  # the checkpoint keeps the state as it was at the call
    assert path == str(tmp_path / f"{CHECKPOINT_PREFIX}00000003") and latest_checkpoint(str(tmp_path)) == path
    expected = train_steps(model, optimizer, scheduler, 3)
    expected_lr = scheduler.get_last_lr()

    model, optimizer, scheduler = build_training(seed=7)  # different init and RNG: the load must restore both
    seed_all(999)
    got = load_checkpoint(path, model, optimizer, scheduler)
    assert got == LearnerState(version=3, groups_consumed=12, groups_by_generator={"gen-0": 7, "gen-1": 5},
                               dropped_total=Counter(stale=2), unacked=["1-0", "1-1"], kl_coef=0.0123,
                               data_cursor={"epoch": 1})
    assert train_steps(model, optimizer, scheduler, 3) == expected
    assert scheduler.get_last_lr() == expected_lr and optimizer.param_groups[0]["lr"] == expected_lr[0]


def test_keep_last_prunes_and_an_unfinished_directory_is_never_latest(tmp_path):
    model, optimizer, scheduler = build_training()
    root = str(tmp_path)
    os.makedirs(os.path.join(root, ".tmp-step-00000099"))  # a save killed before its rename
    for version in range(1, 6):
        save_checkpoint(root, model, optimizer, scheduler, LearnerState(version=version), keep_last=2)
    assert sorted(os.listdir(root)) == ["step-00000004", "step-00000005"]
    # A step directory that never got its meta.json (killed mid-save) is ignored, however new it is.
    shutil.copytree(os.path.join(root, "step-00000005"), os.path.join(root, "step-00000009"))
    os.remove(os.path.join(root, "step-00000009", "meta.json"))
    assert latest_checkpoint(root) == os.path.join(root, "step-00000005")
    with pytest.raises(CheckpointError, match="step-00000009"):
        load_checkpoint(os.path.join(root, "step-00000009"), model, optimizer, scheduler)
    save_checkpoint(root, model, optimizer, scheduler, LearnerState(version=6), keep_last=0)  # 0 keeps all
    assert latest_checkpoint(root).endswith("step-00000006") and len(os.listdir(root)) == 4
    assert latest_checkpoint(str(tmp_path / "nothing-here")) is None


def test_async_save_snapshots_the_state_and_lands_as_soon_as_written(tmp_path):
    model, optimizer, scheduler = build_training()
    seed_all(5)
    train_steps(model, optimizer, scheduler, 2)
    root = str(tmp_path)
    path = save_checkpoint(root, model, optimizer, scheduler, LearnerState(version=2, groups_consumed=9), keep_last=2,
                           async_save=True)
    expected = train_steps(model, optimizer, scheduler, 2)  # mutates the weights while the write may be running
    deadline = time.monotonic() + 60  # in place once written, without anyone waiting (training may wait for data)
    while latest_checkpoint(root) != path:
        assert time.monotonic() < deadline, "the background checkpoint never landed"
        time.sleep(0.01)
    wait_for_pending_save()
    assert latest_checkpoint(root) == path

    fresh, fresh_optimizer, fresh_scheduler = build_training(seed=3)
    assert load_checkpoint(path, fresh, fresh_optimizer, fresh_scheduler) == LearnerState(version=2, groups_consumed=9)
    assert train_steps(fresh, fresh_optimizer, fresh_scheduler, 2) == expected

    save_checkpoint(root, model, optimizer, scheduler, LearnerState(version=4), keep_last=2, async_save=True)
    save_checkpoint(root, model, optimizer, scheduler, LearnerState(version=5), keep_last=2)  # v4 lands, v2 goes
    assert sorted(os.listdir(root)) == ["step-00000004", "step-00000005"]


def test_loading_a_non_checkpoint_names_the_path(tmp_path):
    model, optimizer, scheduler = build_training()
    for path in (tmp_path / "missing", tmp_path):
        with pytest.raises(CheckpointError, match=str(path)):
            load_checkpoint(str(path), model, optimizer, scheduler)
        with pytest.raises(CheckpointError, match=str(path)):
            export_checkpoint(str(path), str(tmp_path / "out"))


def test_export_writes_an_hf_model_with_tied_weights_and_dtype(tmp_path):
    model, optimizer, scheduler = build_training()
    seed_all(1)
    train_steps(model, optimizer, scheduler, 1)
    model_dir = tmp_path / "base"
    model.config.save_pretrained(model_dir)
    (model_dir / "tokenizer_config.json").write_text("{}")
    save_checkpoint(str(tmp_path / "ckpt"), model, optimizer, scheduler, LearnerState(version=1), keep_last=0,
                    model_dir=str(model_dir))
    from transformers import AutoModelForCausalLM

    from asyncrl.launch.cli import main

    out = tmp_path / "hf-bf16"
    assert main(["export", "--checkpoint", str(tmp_path / "ckpt"), "--out", str(out), "--dtype", "bfloat16"]) == 0
    assert (out / "tokenizer_config.json").read_text() == "{}" and (out / "model.safetensors").is_file()
    exported = AutoModelForCausalLM.from_pretrained(out)
    assert exported.lm_head.weight.data_ptr() == exported.model.embed_tokens.weight.data_ptr()
    want = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    got = exported.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_a_format_1_checkpoint_is_read_into_a_learner_state(tmp_path):
    """Checkpoints written before LearnerState (meta.json format 1: a version and a `consumed` dict) still resume."""
    model, optimizer, scheduler = build_training()
    path = save_checkpoint(str(tmp_path), model, optimizer, scheduler, LearnerState(version=3), keep_last=0)
    meta_path = os.path.join(path, "meta.json")
    meta = json.load(open(meta_path))
    old = {"format": 1, "version": 3, "world_size": meta["world_size"], "time": meta["time"],
           "consumed": {"groups": 12, "by_generator": {"g": 12}, "dropped_total": {"stale": 1}, "unacked": ["5-0"]}}
    json.dump(old, open(meta_path, "w"))
    state = load_checkpoint(path, model, optimizer, scheduler)
    assert state == LearnerState(version=3, groups_consumed=12, groups_by_generator={"g": 12},
                                 dropped_total=Counter(stale=1), unacked=["5-0"])
    json.dump({**old, "format": 7}, open(meta_path, "w"))
    with pytest.raises(CheckpointError, match="format 7"):
        load_checkpoint(path, model, optimizer, scheduler)


def test_an_unreadable_learner_state_names_the_checkpoint(tmp_path):
    model, optimizer, scheduler = build_training()
    path = save_checkpoint(str(tmp_path), model, optimizer, scheduler, LearnerState(version=1), keep_last=0)
    meta_path = os.path.join(path, "meta.json")
    meta = json.load(open(meta_path))
    json.dump({**meta, "state": {"format": 1, "version": "x"}}, open(meta_path, "w"))
    with pytest.raises(CheckpointError, match=f"{path}.*learner state"):
        load_checkpoint(path, model, optimizer, scheduler)


def test_a_checkpoint_that_cannot_be_written_leaves_nothing_and_the_next_one_lands(tmp_path):
    """A full or broken disk (here a root that is a file; the DCP write itself: test below) raises
    CheckpointWriteFailed, leaves no directory, and the learner's loop trains on: the failure is counted, no group is
    acknowledged (the buffer keeps them for the next checkpoint), and the next due checkpoint is written."""
    from asyncrl.configs import load_config
    from asyncrl.learner.checkpoint import CheckpointWriteFailed
    from asyncrl.learner.loop import checkpoint_if_due

    model, optimizer, scheduler = build_training()
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    with pytest.raises(CheckpointWriteFailed, match="not-a-dir"):
        save_checkpoint(str(blocker / "ckpts"), model, optimizer, scheduler, LearnerState(version=1), keep_last=2)

    class Acks:
        calls = 0

        def checkpointed(self, background):
            Acks.calls += 1

    learner = load_config(None, ["learner.checkpoint_every=2", f"learner.checkpoint_dir={blocker / 'ckpts'}"]).learner
    state = LearnerState(version=2, unacked=["1-0"])
    checkpoint_if_due(learner, str(tmp_path), None, model, optimizer, scheduler, state, Acks())
    assert state.checkpoint_failures == 1 and Acks.calls == 0 and state.unacked == ["1-0"]
    good = load_config(None, ["learner.checkpoint_every=2", f"learner.checkpoint_dir={tmp_path / 'ckpts'}"]).learner
    state.version = 4
    checkpoint_if_due(good, str(tmp_path), None, model, optimizer, scheduler, state, Acks())
    assert Acks.calls == 1 and latest_checkpoint(str(tmp_path / "ckpts")).endswith("step-00000004")
    assert LearnerState.from_json(state.to_json()).checkpoint_failures == 1


def test_a_write_that_fails_inside_dcp_raises_the_same_and_leaves_the_last_checkpoint(tmp_path):
    """A real failed write in the middle of the checkpoint: a child process whose files may not grow past 64 KiB
    (RLIMIT_FSIZE, SIGXFSZ ignored, so the write fails with EFBIG) saves one small checkpoint's worth, then fails
    on the model's shards: the first checkpoint stays the latest and no temporary directory is left."""
    import subprocess
    import sys

    script = f"""
import resource, signal, sys
sys.path.insert(0, {os.getcwd()!r})
from tests.checkpoint_training import build_training
from asyncrl.learner.checkpoint import CheckpointWriteFailed, save_checkpoint
from asyncrl.learner.state import LearnerState
model, optimizer, scheduler = build_training()
save_checkpoint({str(tmp_path)!r}, model, optimizer, scheduler, LearnerState(version=1), keep_last=2)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, resource.RLIM_INFINITY))
try:
    save_checkpoint({str(tmp_path)!r}, model, optimizer, scheduler, LearnerState(version=2), keep_last=2)
except CheckpointWriteFailed as err:
    print("FAILED:", err)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "FAILED: could not write checkpoint" in out.stdout, out.stdout + out.stderr
    assert sorted(os.listdir(tmp_path)) == ["step-00000001"]
    assert latest_checkpoint(str(tmp_path)).endswith("step-00000001")


def test_a_sigterm_inside_the_write_still_stops_the_learner(tmp_path, monkeypatch):
    """DCP catches whatever its writer raises, SIGTERM's SystemExit included, and raises a CheckpointException:
    only an Exception (a full disk raises OSError or torch's RuntimeError) may become CheckpointWriteFailed (trained
    through); SystemExit and KeyboardInterrupt go on up as themselves,
    or a learner told to stop mid-save would train on (found by the soak)."""
    import torch.distributed.checkpoint as dcp

    from asyncrl.learner import checkpoint

    model, optimizer, scheduler = build_training()

    def interrupted(*args, **kwargs):
        raise dcp.api.CheckpointException("save", {0: (SystemExit(143), None)})

    monkeypatch.setattr(checkpoint.dcp, "save", interrupted)
    with pytest.raises(SystemExit):
        save_checkpoint(str(tmp_path), model, optimizer, scheduler, LearnerState(version=1), keep_last=2)
    assert os.listdir(tmp_path) == []
