"""DCP checkpoints across processes: 2 ranks of FSDP2 on gloo resume from a fresh restart with identical losses and
export in one process, and the export CLI names a missing checkpoint.

The 2-rank runs are subprocesses of this very module (`python -m tests.integration.test_checkpoint_ranks PHASE ROOT
OUT`), each rank a fresh interpreter, so "resume" really is a restart.
"""
import json
import os
import socket
import subprocess
import sys

import pytest
import torch

from asyncrl.learner.build import build_optimizer
from asyncrl.learner.checkpoint import (CheckpointError, latest_checkpoint, load_checkpoint, save_checkpoint,
                                        wait_for_pending_save)
from asyncrl.learner.config import LearnerConfig
from asyncrl.learner.export import export_checkpoint
from asyncrl.learner.state import LearnerState
from tests.checkpoint_training import build_training, seed_all, train_steps

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FSDP_WORLD = 2


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
    module = "tests.integration.test_checkpoint_ranks"
    procs = [subprocess.Popen([sys.executable, "-m", module, phase, root, out], cwd=REPO_ROOT,
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
            save_checkpoint(root, model, optimizer, scheduler, LearnerState(version=1, groups_consumed=1), keep_last=1)
            train_steps(model, optimizer, scheduler, 1)
            full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            if rank == 0:
                torch.save(full, os.path.join(out, "full.pt"))
            save_checkpoint(root, model, optimizer, scheduler, LearnerState(version=2, groups_consumed=2), keep_last=1,
                            async_save=True)
            result["losses"] = train_steps(model, optimizer, scheduler, 2)
            wait_for_pending_save()
        else:
            state = load_checkpoint(latest_checkpoint(root), model, optimizer, scheduler)
            result.update(state=state.to_json(), losses=train_steps(model, optimizer, scheduler, 2))
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
        assert LearnerState.from_json(resumed[rank]["state"]) == LearnerState(version=2, groups_consumed=2)
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
