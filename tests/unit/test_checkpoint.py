"""DCP checkpoints: bit-identical resume (one process and 2-rank FSDP2 on gloo), atomicity, pruning, async save,
and `asyncrl export` of a sharded checkpoint into an HF directory.

The 2-rank runs are subprocesses of this very module (`python -m tests.unit.test_checkpoint PHASE ROOT OUT`), each
rank a fresh interpreter, so "resume" really is a restart.
"""
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from asyncrl.learner.checkpoint import (CHECKPOINT_PREFIX, CheckpointError, latest_checkpoint, load_checkpoint,
                                        save_checkpoint, wait_for_pending_save)
from asyncrl.learner.config import LearnerConfig
from asyncrl.learner.export import export_checkpoint
from asyncrl.learner.loop import build_optimizer
from asyncrl.learner.model import build_qwen2

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VOCAB = 64
FSDP_WORLD = 2


def build_training(seed: int = 0):
    model = build_qwen2(vocab_size=VOCAB, hidden_size=64, num_layers=2, eos_token_id=1, pad_token_id=0, seed=seed)
    optimizer, scheduler = build_optimizer(model, LearnerConfig(warmup_steps=10))  # lr changes every step
    return model, optimizer, scheduler


def train_steps(model, optimizer, scheduler, steps: int) -> list[float]:
    """A toy LM loss on inputs drawn from torch's RNG, weighted by python and numpy draws: resuming is only exact
    when all three RNG states come back."""
    losses = []
    for _ in range(steps):
        ids = torch.randint(2, VOCAB, (2, 12))
        weight = 1.0 + 0.1 * random.random() + 0.1 * float(np.random.rand())
        loss = model(input_ids=ids, labels=ids).loss * weight
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def test_resume_gives_bit_identical_losses_lr_version_and_consumed(tmp_path):
    model, optimizer, scheduler = build_training()
    seed_all(123)
    train_steps(model, optimizer, scheduler, 3)
    consumed = {"gen-0": [3, 17], "groups": 12}
    path = save_checkpoint(str(tmp_path), model, optimizer, scheduler, 3, consumed, keep_last=0)
    assert path == str(tmp_path / f"{CHECKPOINT_PREFIX}00000003") and latest_checkpoint(str(tmp_path)) == path
    expected = train_steps(model, optimizer, scheduler, 3)
    expected_lr = scheduler.get_last_lr()

    model, optimizer, scheduler = build_training(seed=7)  # different init and RNG: the load must restore both
    seed_all(999)
    version, got_consumed = load_checkpoint(path, model, optimizer, scheduler)
    assert (version, got_consumed) == (3, consumed)
    assert train_steps(model, optimizer, scheduler, 3) == expected
    assert scheduler.get_last_lr() == expected_lr and optimizer.param_groups[0]["lr"] == expected_lr[0]


def test_keep_last_prunes_and_an_unfinished_directory_is_never_latest(tmp_path):
    model, optimizer, scheduler = build_training()
    root = str(tmp_path)
    os.makedirs(os.path.join(root, ".tmp-step-00000099"))  # a save killed before its rename
    for version in range(1, 6):
        save_checkpoint(root, model, optimizer, scheduler, version, {"v": version}, keep_last=2)
    assert sorted(os.listdir(root)) == ["step-00000004", "step-00000005"]
    # A step directory that never got its meta.json (killed mid-save) is ignored, however new it is.
    shutil.copytree(os.path.join(root, "step-00000005"), os.path.join(root, "step-00000009"))
    os.remove(os.path.join(root, "step-00000009", "meta.json"))
    assert latest_checkpoint(root) == os.path.join(root, "step-00000005")
    with pytest.raises(CheckpointError, match="step-00000009"):
        load_checkpoint(os.path.join(root, "step-00000009"), model, optimizer, scheduler)
    save_checkpoint(root, model, optimizer, scheduler, 6, {}, keep_last=0)  # keep_last <= 0 keeps all
    assert latest_checkpoint(root).endswith("step-00000006") and len(os.listdir(root)) == 4
    assert latest_checkpoint(str(tmp_path / "nothing-here")) is None


def test_async_save_snapshots_the_state_and_lands_as_soon_as_written(tmp_path):
    model, optimizer, scheduler = build_training()
    seed_all(5)
    train_steps(model, optimizer, scheduler, 2)
    root = str(tmp_path)
    path = save_checkpoint(root, model, optimizer, scheduler, 2, {"n": 2}, keep_last=2, async_save=True)
    expected = train_steps(model, optimizer, scheduler, 2)  # mutates the weights while the write may be running
    deadline = time.monotonic() + 60  # in place once written, without anyone waiting (training may wait for data)
    while latest_checkpoint(root) != path:
        assert time.monotonic() < deadline, "the background checkpoint never landed"
        time.sleep(0.01)
    wait_for_pending_save()
    assert latest_checkpoint(root) == path

    fresh, fresh_optimizer, fresh_scheduler = build_training(seed=3)
    assert load_checkpoint(path, fresh, fresh_optimizer, fresh_scheduler) == (2, {"n": 2})
    assert train_steps(fresh, fresh_optimizer, fresh_scheduler, 2) == expected

    save_checkpoint(root, model, optimizer, scheduler, 4, {}, keep_last=2, async_save=True)
    save_checkpoint(root, model, optimizer, scheduler, 5, {}, keep_last=2)  # finalises v4 first, then prunes v2
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
    save_checkpoint(str(tmp_path / "ckpt"), model, optimizer, scheduler, 1, {}, keep_last=0, model_dir=str(model_dir))
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


def test_export_cli_missing_checkpoint_exits_2_naming_the_path(tmp_path):
    missing = str(tmp_path / "no-such-checkpoint")
    out = subprocess.run([sys.executable, "-m", "asyncrl.launch.cli", "export", "--checkpoint", missing, "--out",
                          str(tmp_path / "x")], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert out.returncode == 2, out.stderr
    assert missing in out.stderr


# ---- 2 ranks of FSDP2 on gloo -------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_ranks(phase: str, root: str, out: str, timeout_s: float = 240) -> list[dict]:
    """Runs `phase` on FSDP_WORLD fresh ranks (this module as a script); returns each rank's result."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(FSDP_WORLD),
           "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    procs = [subprocess.Popen([sys.executable, "-m", "tests.unit.test_checkpoint", phase, root, out], cwd=REPO_ROOT,
                              env={**env, "RANK": str(rank)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for rank in range(FSDP_WORLD)]
    try:
        logs = [proc.communicate(timeout=timeout_s)[0] for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for rank, proc in enumerate(procs):
        assert proc.returncode == 0, f"{phase} rank {rank} failed:\n{logs[rank][-4000:]}"
    results = []
    for rank in range(FSDP_WORLD):
        with open(os.path.join(out, f"{phase}-rank{rank}.json")) as f:
            results.append(json.load(f))
    return results


def fsdp_phase(phase: str, root: str, out: str) -> None:
    """first: 1 step, sync save (v1), 1 step, async save (v2, keep_last=1), 2 steps. resume: load latest, 2 steps."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    try:
        model, _, _ = build_training(seed=0 if phase == "first" else 11)
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        optimizer, scheduler = build_optimizer(model, LearnerConfig(warmup_steps=10))
        result = {}
        if phase == "first":
            seed_all(100 + rank)  # every rank draws different data, so every rank's RNG file matters
            train_steps(model, optimizer, scheduler, 1)
            save_checkpoint(root, model, optimizer, scheduler, 1, {"step": 1}, keep_last=1)
            train_steps(model, optimizer, scheduler, 1)
            full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            if rank == 0:
                torch.save(full, os.path.join(out, "full.pt"))
            save_checkpoint(root, model, optimizer, scheduler, 2, {"step": 2}, keep_last=1, async_save=True)
            result["losses"] = train_steps(model, optimizer, scheduler, 2)
            wait_for_pending_save()
        else:
            version, consumed = load_checkpoint(latest_checkpoint(root), model, optimizer, scheduler)
            result.update(version=version, consumed=consumed, losses=train_steps(model, optimizer, scheduler, 2))
        result["lr"] = scheduler.get_last_lr()
        with open(os.path.join(out, f"{phase}-rank{rank}.json"), "w") as f:
            json.dump(result, f)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def fsdp_checkpoint(tmp_path_factory):
    """(checkpoint root, out dir, first-run results, resumed results) of the 2-rank FSDP2 runs."""
    root, out = str(tmp_path_factory.mktemp("fsdp-ckpt")), str(tmp_path_factory.mktemp("fsdp-out"))
    first = run_ranks("first", root, out)
    resumed = run_ranks("resume", root, out)
    return root, out, first, resumed


def test_fsdp2_two_ranks_resume_from_a_fresh_restart_with_identical_losses(fsdp_checkpoint):
    root, _, first, resumed = fsdp_checkpoint
    assert sorted(os.listdir(root)) == ["step-00000002"]  # v1 pruned by keep_last=1 once v2 landed
    for rank in range(FSDP_WORLD):
        assert (resumed[rank]["version"], resumed[rank]["consumed"]) == (2, {"step": 2})
        assert resumed[rank]["losses"] == first[rank]["losses"], rank
        assert resumed[rank]["lr"] == first[rank]["lr"]
    assert first[0]["losses"] != first[1]["losses"]  # the ranks really drew different data


def test_fsdp2_checkpoint_exports_in_one_process_to_the_full_state(fsdp_checkpoint, tmp_path):
    root, out, _, _ = fsdp_checkpoint
    from transformers import AutoModelForCausalLM

    exported_dir = export_checkpoint(root, str(tmp_path / "hf"))  # the root means its latest checkpoint
    exported = AutoModelForCausalLM.from_pretrained(exported_dir).state_dict()
    full = torch.load(os.path.join(out, "full.pt"), weights_only=True)
    assert set(full) <= set(exported) and all(torch.equal(exported[k], full[k]) for k in full)
    assert torch.equal(exported["lm_head.weight"], full["model.embed_tokens.weight"])  # tied
    with pytest.raises(CheckpointError, match="2 ranks"):
        model, optimizer, scheduler = build_training()
        load_checkpoint(latest_checkpoint(root), model, optimizer, scheduler)


if __name__ == "__main__":
    fsdp_phase(*sys.argv[1:4])
