"""Each shipped algorithm recipe (GRPO, DAPO, GSPO, CISPO, PPO with a critic, LoRA) runs the CPU demo end to end for a
few steps, and its algorithm's own metrics reach the progress log. The generator decodes with the hf engine whatever
the recipe says: what differs between recipes is the learner's algorithm, and a vLLM engine start costs each run
about 45 s of CI (the real vLLM engine runs whole jobs in test_run.py, test_gpu_check.py and the benchmarks). The LoRA
recipe is the exception: what it changes reaches the engine (each version is an adapter vLLM serves), so its job
runs the real vLLM engine."""
import json
import subprocess
import sys

import pytest

from tests.conftest import free_port
from tests.e2e.jobs import common_overrides, job_env, read_progress

RECIPE_METRICS = {
    "grpo.yaml": ("kl/ref_k3", "loss/kl", "offpolicy/mismatch_k3"),
    "dapo.yaml": ("buffer/dropped_total/zero_variance", "offpolicy/staleness/mean"),
    "gspo.yaml": ("policy/seq_ratio_mean", "policy/clip_frac_high"),
    "cispo.yaml": ("policy/cispo_weight_mean", "policy/clip_frac_high"),
    "ppo_cpu.yaml": ("critic/vf_loss", "critic/explained_var", "critic/vpred/mean", "critic/vf_clipfrac"),
    "lora_cpu.yaml": ("weightsync/publish_bytes", "weightsync/publish_bytes_frac", "weightsync/unchanged_versions"),
}
RECIPE_OVERRIDES = {"ppo_cpu.yaml": ["critic.warmup_steps=1", "generator.engine=hf", "generator.torch_threads=1"],
                    "lora_cpu.yaml": ["generator.engine=vllm", "learner.torch_threads=1"]}
"""PPO: a few steps leave no room for the recipe's 10 critic-only ones; one shows the warmup, the others train both.
LoRA: the real vLLM engine serves the adapters."""


def run_recipe(recipe: str, steps: int, tmp_path, demo_cache, job_dir) -> None:
    """`asyncrl run --config recipe` for `steps` steps in `job_dir` (a second call resumes from its checkpoint)."""
    env = {**job_env(tmp_path), "ASYNCRL_JOB_DIR": str(job_dir)}
    out = subprocess.run([sys.executable, "-m", "asyncrl.launch.cli", "run", "--config", recipe,
                          *common_overrides(demo_cache, free_port(), steps=steps),
                          *RECIPE_OVERRIDES.get(recipe, ["generator.engine=hf", "generator.torch_threads=1"])],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("recipe", sorted(RECIPE_METRICS))
def test_recipe_runs_the_demo_end_to_end(recipe, tmp_path, demo_assets, demo_cache):
    job_dir = tmp_path / "job"
    run_recipe(recipe, 3, tmp_path, demo_cache, job_dir)
    summary = json.loads((job_dir / "summary.json").read_text())
    assert summary["steps"] == 3
    progress = read_progress(job_dir)
    for key in RECIPE_METRICS[recipe]:
        assert key in progress[-1], (key, sorted(progress[-1]))
    assert all(p["loss/pg"] == p["loss/pg"] for p in progress)  # finite, not NaN
    if recipe == "ppo_cpu.yaml":  # the critic alone, then both; the checkpoint holds the critic
        assert [p["critic/warmup"] for p in progress] == [1.0, 0.0, 0.0]
        assert (job_dir / "checkpoints" / "step-00000003" / "critic_scheduler.pt").exists()
        # one step more, resumed from that checkpoint, critic included (test_critic.py checks what it restores)
        run_recipe(recipe, 4, tmp_path, demo_cache, job_dir)
        resumed = json.loads((job_dir / "summary.json").read_text())
        assert resumed["start_version"] == 3 and resumed["steps"] == 1
        (step4,) = [p for p in read_progress(job_dir) if p["step"] == 4]
        assert step4["critic/warmup"] == 0.0 and "critic/vf_loss" in step4
    if recipe == "lora_cpu.yaml":  # every version is the adapter alone, each one new; the checkpoint holds it
        assert all(0 < p["weightsync/publish_bytes_frac"] < 0.25 for p in progress)
        assert progress[-1]["weightsync/unchanged_versions"] == 0
        meta = json.loads((job_dir / "checkpoints" / "step-00000003" / "meta.json").read_text())
        assert meta["lora"]["r"] == 16
        # η = 1: the last step's groups were sampled on v1 or later, which the generator only ever served as adapters
        assert progress[-1]["offpolicy/staleness/max"] <= 1
