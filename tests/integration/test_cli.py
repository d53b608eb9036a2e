"""The `asyncrl` command line as a user runs it: each test starts real processes (`python -m asyncrl.launch.cli ...`
or a fresh interpreter), so an import or exit-code mistake shows up as it would in a shell."""
import os
import subprocess
import sys

import pytest

from tests.conftest import DEMO


def test_dry_run_prints_yaml_and_never_imports_torch():
    code = (
        "import sys; from asyncrl.launch.cli import main; rc = main(['run', '--dry-run', 'buffer.max_staleness=5']);"
        "assert rc == 0; assert 'torch' not in sys.modules, 'torch imported'; assert 'vllm' not in sys.modules"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "max_staleness: 5" in out.stdout


@pytest.mark.parametrize("argv, shows", [(["--help"], "reward-server"), (["learner", "--help"], "--resume"),
                                         (["config", "buffer.redis.url"], "buffer.redis.url: str = redis://")])
def test_help_and_the_config_reference_never_import_torch(argv, shows):
    code = (f"import sys; from asyncrl.launch.cli import main\ntry: rc = main({argv!r})\nexcept SystemExit as e: "
            f"rc = e.code\nassert rc == 0, rc; assert 'torch' not in sys.modules, 'torch imported'")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert shows in out.stdout


def test_asyncrl_config_names_an_unknown_key_with_exit_code_2():
    out = subprocess.run([sys.executable, "-m", "asyncrl.launch.cli", "config", "buffer.redis_url"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "buffer.redis.url" in out.stderr


def test_cli_reports_bad_override_with_exit_code_2():
    out = subprocess.run([sys.executable, "-m", "asyncrl.launch.cli", "learner", "--dry-run", "buffer.bogus=1"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "buffer.bogus" in out.stderr


def test_the_config_reads_the_registry_without_importing_torch():
    code = ("import sys; from asyncrl.algos.config import AlgoConfig; from asyncrl.algos.offpolicy_plan import OffPolicyPlan; "
            "OffPolicyPlan.from_algo(AlgoConfig(loss='reinforce', correction='bypass')); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
@pytest.mark.slow
@pytest.mark.parametrize("launch", [[], ["--nproc", "2", "learner.sp_size=2", "learner.packing=true"]],
                         ids=["one-process", "two-ranks-ulysses-packed"])
def test_asyncrl_sft_trains_and_saves_a_model(tmp_path, demo_assets, demo_cache, launch):
    env = {**os.environ, "ASYNCRL_JOB_DIR": str(tmp_path / "job")}
    out = subprocess.run([sys.executable, "-m", "asyncrl.launch.cli", "sft", *launch, f"demo.cache_dir={demo_cache}",
                          *DEMO, "sft.steps=10", "sft.batch_size=32"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    for noise in ("Setting accelerator", "Loading weights", "Writing model shards"):  # launch/cli.py quiet_third_party
        assert noise not in out.stderr, out.stderr[-2000:]
    first, last = (float(x) for x in out.stdout.split("loss ")[1].split(";")[0].split(" -> "))
    assert last < first
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "job" / "model")  # full weights, not a shard
    assert saved.get_output_embeddings().weight.shape[0] == saved.config.vocab_size


@pytest.mark.slow
def test_asyncrl_sft_runs_epochs_with_a_schedule_validation_checkpoints_and_resume(tmp_path, demo_assets,
                                                                                    demo_cache):
    """One epoch with warmup and cosine decay, a held-out validation split and checkpoints; then `--resume` with a
    second epoch carries on from the checkpoint's step; the MLflow run holds both lives' losses and the
    validation curve."""
    from mlflow.tracking import MlflowClient

    env = {**os.environ, "ASYNCRL_JOB_DIR": str(tmp_path / "job")}
    common = ["-m", "asyncrl.launch.cli", "sft", f"demo.cache_dir={demo_cache}", *DEMO, "sft.batch_size=64", "sft.val_fraction=0.25", "sft.val_every=2",
              "sft.checkpoint_every=2", "sft.warmup_steps=1", "sft.lr_schedule=cosine", "sft.min_lr_ratio=0.1",
              f"telemetry.tracking_uri=sqlite:///{tmp_path}/mlflow.db", "telemetry.progress=false"]
    first = subprocess.run([sys.executable, *common, "sft.epochs=1"], env=env, capture_output=True, text=True,
                           timeout=300, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    steps = int(first.stdout.split("sft: ")[1].split(" steps")[0])
    assert steps >= 2 and "validation loss" in first.stdout
    checkpoints = sorted(os.listdir(tmp_path / "job" / "checkpoints"))
    assert checkpoints[-1] == f"step-{steps:08d}"
    second = subprocess.run([sys.executable, *common, "sft.epochs=2", "--resume"], env=env, capture_output=True,
                            text=True, timeout=300, cwd=tmp_path)
    assert second.returncode == 0, second.stderr[-2000:]
    assert f"{steps} steps from step {steps}," in second.stdout and f"resumed from" in second.stderr
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("asyncrl").experiment_id])
    assert len(runs) == 2  # one per life, as the RL learner's

    def history(key):
        return {point.step: point.value for run in runs for point in client.get_metric_history(run.info.run_id, key)}

    assert sorted(history("sft/loss")) == list(range(1, 2 * steps + 1))
    assert set(history("sft/val_loss")) >= {steps, 2 * steps}
    lrs = history("policy/lr")
    assert lrs[1] < lrs[2] and lrs[2 * steps] < lrs[steps + 1]  # warmup, then decay across the resume
