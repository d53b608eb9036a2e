"""Building one suite task's assets the way a user would, through the public path only: verl-format parquet
(train, sft, held-out test), a reward file, `asyncrl init-model`, an `asyncrl sft` warm start, and a recipe that
inherits demo_cpu.yaml, each command run as a subprocess of the CLI (README "Your own task", examples/reverse/).

A build is done once per folder: a marker written last records the build's settings, so a half-built folder or
one built with other settings is wiped and rebuilt, and a file lock keeps two runs from building at once.
"""
import fcntl
import json
import os
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass
from typing import Callable

MARKER = "BUILT.json"
SPLITS = ("train", "sft", "test")


@dataclass(frozen=True)
class BuildSettings:
    """Everything a build depends on besides the task's code; the marker stores it."""
    name: str
    seed: int
    num_train: int
    num_sft: int
    num_test: int
    hidden: int
    layers: int
    sft_steps: int
    sft_batch_size: int
    recipe: dict
    """Keys of the task's recipe besides the ones every task has (model, data, reward, eval files)."""


@dataclass(frozen=True)
class TaskPaths:
    folder: str
    recipe: str
    model: str
    """The warm start (asyncrl sft's save_dir)."""
    train: str
    sft: str
    test: str
    reward: str


def task_paths(folder: str) -> TaskPaths:
    data = os.path.join(folder, "data")
    return TaskPaths(folder=folder, recipe=os.path.join(folder, "recipe.yaml"),
                     model=os.path.join(folder, "models", "sft"), train=os.path.join(data, "train.parquet"),
                     sft=os.path.join(data, "sft.parquet"), test=os.path.join(data, "test.parquet"),
                     reward=os.path.join(folder, "reward.py"))


def task_folder(root: str, name: str, seed: int) -> str:
    """root/<name>/seed<seed>: each seed its own data, model init and warm start."""
    return os.path.join(os.path.abspath(root), name, f"seed{seed}")


def build_assets(root: str, settings: BuildSettings, make_splits: Callable[[], dict], reward_file: str,
                 say=print) -> TaskPaths:
    """Builds the task under root/<name>/seed<seed>/ unless a finished build with the same settings is there.
    `make_splits()` returns {"train": rows, "sft": rows, "test": rows} in verl's row format."""
    folder = task_folder(root, settings.name, settings.seed)
    paths = task_paths(folder)
    os.makedirs(folder, exist_ok=True)
    wanted = asdict(settings)
    with open(os.path.join(folder, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if read_marker(folder) == wanted:
            return paths
        say(f"suite: building {settings.name} (seed {settings.seed}) in {folder}")
        clear_folder(folder)
        write_splits(paths, make_splits())
        shutil.copyfile(reward_file, paths.reward)
        init_model(paths, settings)
        warm_start(paths, settings)
        write_recipe(paths, settings)
        with open(os.path.join(folder, MARKER), "w") as handle:  # last: its presence means the build finished
            json.dump(wanted, handle, sort_keys=True)
    return paths


def read_marker(folder: str):
    try:
        with open(os.path.join(folder, MARKER)) as handle:
            return json.load(handle)
    except (OSError, ValueError):
        return None


def clear_folder(folder: str) -> None:
    """Removes a previous build (the lock file stays: we hold it)."""
    for entry in os.listdir(folder):
        path = os.path.join(folder, entry)
        if entry == ".lock":
            continue
        shutil.rmtree(path) if os.path.isdir(path) and not os.path.islink(path) else os.remove(path)


def write_splits(paths: TaskPaths, splits: dict) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    if set(splits) != set(SPLITS):
        raise ValueError(f"a suite task's splits are {SPLITS}, got {sorted(splits)}")
    check_held_out(splits)
    os.makedirs(os.path.dirname(paths.train), exist_ok=True)
    for split in SPLITS:
        pq.write_table(pa.Table.from_pylist(splits[split]), getattr(paths, split))


def check_held_out(splits: dict) -> None:
    """The judge's split must be unseen: no test prompt may appear in train or sft."""
    seen = {prompt_text(row) for split in ("train", "sft") for row in splits[split]}
    leaked = [prompt_text(row) for row in splits["test"] if prompt_text(row) in seen]
    if leaked:
        raise ValueError(f"{len(leaked)} held-out prompts are also in train/sft, e.g. {leaked[0]!r}")


def prompt_text(row: dict) -> str:
    return "\n".join(message["content"] for message in row["prompt"])


def run_cli(args: list, cwd: str) -> str:
    """One `asyncrl ...` command as a user runs it (a subprocess of the CLI), its output returned; a failure raises
    with the command and the end of its output."""
    env = {key: value for key, value in os.environ.items() if not key.startswith(("MLFLOW_", "ASYNCRL_"))}
    env.setdefault("HF_HUB_OFFLINE", "1")
    out = subprocess.run([sys.executable, "-m", "asyncrl.launch.cli", *args], cwd=cwd, env=env,
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"asyncrl {' '.join(args)} failed in {cwd} (exit {out.returncode}):\n"
                           f"{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
    return out.stdout


def init_model(paths: TaskPaths, settings: BuildSettings) -> None:
    """A character tokenizer from every split's text (the held-out one too, so no test character is unknown) and
    a random-init Qwen2."""
    run_cli(["init-model", "--out", os.path.join(paths.folder, "models", "base"), "--corpus", paths.train,
             paths.sft, paths.test, "--hidden", str(settings.hidden), "--layers", str(settings.layers),
             "--seed", str(settings.seed), "--force"], cwd=paths.folder)


def warm_start(paths: TaskPaths, settings: BuildSettings) -> None:
    run_cli(["sft", f"model.path={os.path.join(paths.folder, 'models', 'base')}",
             f"data.train_files=[{paths.sft}]", f"sft.steps={settings.sft_steps}",
             f"sft.batch_size={settings.sft_batch_size}", f"sft.save_dir={paths.model}", f"job.seed={settings.seed}",
             # one thread, the same on every machine (a warm start is reproducible only at a fixed thread count);
             # torch's default of one per core spins in OpenMP barriers when the cores are shared
             "sft.torch_threads=1", "telemetry.plots=false", "telemetry.system_metrics_every_s=0"], cwd=paths.folder)


def write_recipe(paths: TaskPaths, settings: BuildSettings) -> None:
    """demo_cpu.yaml's settings with the task's model, data, reward and held-out file (like
    examples/reverse/reverse.yaml), plus the task's own keys (answer length, prompt length)."""
    import yaml

    recipe = {"base": "demo_cpu.yaml", "demo": None, "job": {"name": f"suite-{settings.name}"},
              "model": {"path": paths.model}, "data": {"train_files": [paths.train]},
              "reward": {"path": paths.reward}, "eval": {"files": [paths.test]}}
    for section, keys in settings.recipe.items():
        recipe[section] = {**recipe.get(section, {}), **keys}
    with open(paths.recipe, "w") as handle:
        handle.write(f"# suite task {settings.name}, built by asyncrl.bench.suite (seed {settings.seed})\n")
        yaml.safe_dump(recipe, handle, sort_keys=False)


def verl_row(data_source: str, prompt: str, ground_truth: str, split: str, index: int, **extra) -> dict:
    """One row as verl and asyncrl read it (examples/reverse/make_data.py)."""
    return {"data_source": data_source, "prompt": [{"role": "user", "content": prompt}],
            "reward_model": {"style": "rule", "ground_truth": ground_truth},
            "extra_info": {"split": split, "index": index, **extra}}


def draw_unique(count: int, draw: Callable[[], str], taken: set) -> list:
    """`count` new items from `draw()`, none already in `taken` (which grows): the held-out split is drawn first,
    so neither training split can contain its items."""
    out, tries = [], 0
    while len(out) < count:
        tries += 1
        if tries > 100 * count + 1000:
            raise ValueError(f"could not draw {count} distinct items (only {len(out)} new): the task's space is "
                             "too small for the sizes asked")
        item = draw()
        if item not in taken:
            taken.add(item)
            out.append(item)
    return out
