"""The package works from a wheel, not only from an editable install, which imports from the source folders and so
hides whatever setup.py leaves out. The wheel is built from a copy of the source tree, installed non-editable into
a fresh venv, and used from a directory outside the source tree: every module imports from the venv, the recipes
and the vLLM plugin entry point are there, and `asyncrl run --dry-run` and a 3-step hf job work.

Built to stay fast on CI's two cores: installing torch and vLLM again from a registry would cost minutes, so the
fresh venv gets only asyncrl from the wheel and finds its third-party dependencies in the project's .venv through
one path line in a .pth file. A path line adds that site-packages to sys.path but does not run the .pth files in
it, so the editable install's finder stays inactive there; the test checks that every asyncrl module, and the
asyncrl distribution, resolve inside the fresh venv. The wheel is built with the project's setuptools
(--no-build-isolation: no registry) from a copy of the tree, so setuptools' build/ and egg-info, which it writes
beside setup.py and reuses on the next build, are neither left in nor taken from the source tree."""
import ast
import json
import os
import shutil
import subprocess
import sys
import sysconfig

import pytest

from tests.conftest import DEMO, free_port

pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NOT_SOURCE = ("tests", "docs", "build", "dist", "*.egg-info", ".*", "mlruns", "runs", "mlflow.db")
"""Top-level entries left out of the copy the wheel is built from (the .venv and .git among the dot folders)."""


def not_source(folder: str, names: list) -> set:
    """shutil.copytree's ignore: NOT_SOURCE at the top, __pycache__ everywhere."""
    top = shutil.ignore_patterns(*NOT_SOURCE)(folder, names) if os.path.samefile(folder, REPO) else set()
    return top | {name for name in names if name == "__pycache__"}


CHECK_INSTALL = r"""
import importlib, importlib.metadata, importlib.resources, json, os, sys
import asyncrl

venv = sys.argv[1]
inside = lambda path: os.path.realpath(path).startswith(os.path.realpath(venv) + os.sep)
roots = list(asyncrl.__path__)
modules, failed, outside = [], {}, []
for root in roots:
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(f for f in files if f.endswith(".py")):
            dotted = os.path.relpath(os.path.join(folder, name), root)[:-3].replace(os.sep, ".")
            modules.append("asyncrl." + dotted.removesuffix(".__init__"))
for module in modules:
    try:
        imported = importlib.import_module(module)
    except BaseException as err:
        failed[module] = f"{type(err).__name__}: {err}"
        continue
    if not inside(imported.__file__):
        outside.append(imported.__file__)
dist = importlib.metadata.distribution("asyncrl")
plugins = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="vllm.general_plugins")
           if ep.dist.name == "asyncrl" and callable(ep.load())}  # vLLM registers plugins of its own
recipes = sorted(p.name for p in importlib.resources.files("asyncrl.configs").iterdir() if p.name.endswith(".yaml"))
print(json.dumps({"roots": roots, "modules": modules, "failed": failed, "outside": outside, "recipes": recipes,
                  "dist_inside": inside(str(dist.locate_file("asyncrl"))), "plugins": plugins}))
"""


@pytest.fixture(scope="module")
def wheel_venv(tmp_path_factory):
    """(the fresh venv, a working directory outside the source tree, its environment)."""
    base = tmp_path_factory.mktemp("wheel")
    source, dist, venv, work = base / "source", base / "dist", base / "venv", base / "work"
    shutil.copytree(REPO, source, ignore=not_source)
    run([sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation", "-q", "-w",
         str(dist)], cwd=base)
    [wheel] = dist.glob("asyncrl-*.whl")
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=base)
    python = venv / "bin" / "python"
    # installed before the venv can see the project's site-packages, so pip finds no asyncrl there to replace
    run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "-q",
         str(wheel)], cwd=base)
    site = run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=base).strip()
    with open(os.path.join(site, "zz_asyncrl_test_dependencies.pth"), "w") as handle:
        handle.write(sysconfig.get_paths()["purelib"] + "\n")
    work.mkdir()
    env = {key: value for key, value in os.environ.items()
           if key not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV") and not key.startswith("ASYNCRL_")}
    env.update(PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1",
               MLFLOW_TRACKING_URI=f"sqlite:///{work}/mlflow.db")
    yield venv, work, env
    shutil.rmtree(base, ignore_errors=True)


def source_modules() -> list[str]:
    """Every module of the parts setup.py's PARTS names, as the source tree has them."""
    tree = ast.parse(open(os.path.join(REPO, "setup.py")).read(), "setup.py")
    [parts] = [node.value for node in tree.body if isinstance(node, ast.Assign)
               and [getattr(target, "id", None) for target in node.targets] == ["PARTS"]]
    found = []
    for part in ast.literal_eval(parts):
        for folder, dirs, files in os.walk(os.path.join(REPO, part)):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            for name in files:
                if name.endswith(".py"):
                    dotted = os.path.relpath(os.path.join(folder, name), REPO)[:-3].replace(os.sep, ".")
                    found.append("asyncrl." + dotted.removesuffix(".__init__"))
    return sorted(found)


def run(command: list, cwd, env=None, timeout=300) -> str:
    out = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{command}: {out.stdout[-3000:]}{out.stderr[-3000:]}"
    return out.stdout


def test_every_module_imports_from_the_installed_wheel_with_its_recipes_and_plugin(wheel_venv):
    venv, work, env = wheel_venv
    report = json.loads(run([str(venv / "bin" / "python"), "-c", CHECK_INSTALL, str(venv)], cwd=work,
                            env=env).splitlines()[-1])
    assert len(report["roots"]) == 1 and report["roots"][0].startswith(str(venv)), report["roots"]
    assert not report["failed"], json.dumps(report["failed"], indent=1)
    assert not report["outside"], report["outside"]
    assert sorted(report["modules"]) == source_modules()  # every subpackage, whatever its name
    shipped = sorted(name for name in os.listdir(os.path.join(REPO, "configs")) if name.endswith(".yaml"))
    assert report["recipes"] == shipped
    assert report["dist_inside"], "importlib.metadata finds the editable install's asyncrl, not the wheel's"
    assert report["plugins"] == {"asyncrl_weight_transfer": "asyncrl.generator.engines.vllm_transfer:register"}


@pytest.mark.usefixtures("demo_assets")  # the demo model and prompts, built once into demo_cache
def test_asyncrl_run_dry_run_and_a_three_step_hf_job_from_the_installed_wheel(wheel_venv, demo_cache):
    venv, work, env = wheel_venv
    asyncrl = str(venv / "bin" / "asyncrl")
    dry = run([asyncrl, "run", "--dry-run", "learner.total_steps=3"], cwd=work, env=env, timeout=120)
    assert "total_steps: 3" in dry, dry[-2000:]
    job_dir = work / "job"
    overrides = [f"demo.cache_dir={demo_cache}", *DEMO,
                 "learner.total_steps=3", f"buffer.port={free_port()}", "buffer.groups_per_step=2", "rollout.n=2",
                 "rollout.max_tokens=8", "algo.dynamic_sampling=false", "generator.engine=hf",
                 "generator.max_inflight_groups=2", "learner.torch_threads=1", "eval.every_steps=0",
                 "eval.before_train=false", "telemetry.plots=false", "telemetry.system_metrics_every_s=0"]
    job = subprocess.Popen([asyncrl, "run", *overrides], cwd=work, env={**env, "ASYNCRL_JOB_DIR": str(job_dir)},
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = job.communicate(timeout=400)
    finally:
        if job.poll() is None:  # SIGTERM: the supervisor stops the learner and generator it started
            job.terminate()
            try:
                job.wait(timeout=60)
            except subprocess.TimeoutExpired:
                job.kill()
                job.wait()
    assert job.returncode == 0, out[-3000:]
    summary = json.loads((job_dir / "summary.json").read_text())
    assert summary["steps"] == 3, out[-3000:]
