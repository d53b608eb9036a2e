"""setup.py installs every module of asyncrl: its package list, read from the Distribution setuptools builds from
it, covers every folder of every part (tests/e2e/test_wheel.py builds and installs the wheel itself)."""
import fnmatch
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def distribution():
    """What setup() is given, without building anything (distutils stops after reading setup.py's arguments)."""
    import setuptools  # noqa: F401  (first: it provides distutils on Python 3.12+)
    from distutils.core import run_setup

    return run_setup(os.path.join(REPO, "setup.py"), stop_after="init")


def parts_of(distribution) -> list[str]:
    return [name.split(".")[1] for name in distribution.packages if name.count(".") == 1]


def folders_under(part: str):
    for root, dirs, files in os.walk(os.path.join(REPO, part)):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        yield os.path.relpath(root, REPO), files


def test_every_folder_with_an_init_under_a_part_is_a_package_mapped_to_that_folder(distribution):
    parts = parts_of(distribution)
    assert {"generator", "weightsync", "buffer", "configs"} <= set(parts), parts
    for part in parts:
        for folder, files in folders_under(part):
            if "__init__.py" in files:
                name = "asyncrl." + folder.replace(os.sep, ".")
                assert name in distribution.packages, f"setup.py does not install {folder} (as {name})"
                assert os.path.normpath(distribution.package_dir[name]) == folder, name


def test_no_module_of_a_part_lies_outside_a_package(distribution):
    """A module in a folder without __init__.py would be in the source tree (and an editable install) but not
    in the wheel."""
    installed = {os.path.normpath(folder) for folder in distribution.package_dir.values()}
    for part in parts_of(distribution):
        for folder, files in folders_under(part):
            stray = [name for name in files if name.endswith(".py")]
            assert folder in installed or not stray, f"{folder} is not installed (no __init__.py?) but has {stray}"


def test_the_shipped_recipes_are_package_data(distribution):
    recipes = [name for name in os.listdir(os.path.join(REPO, "configs")) if name.endswith(".yaml")]
    patterns = distribution.package_data["asyncrl.configs"]
    assert recipes and all(any(fnmatch.fnmatch(name, p) for p in patterns) for name in recipes), patterns


def test_the_vllm_plugin_and_the_cli_are_entry_points(distribution):
    assert distribution.entry_points["console_scripts"] == ["asyncrl=asyncrl.launch.cli:main"]
    [plugin] = distribution.entry_points["vllm.general_plugins"]
    assert plugin.replace(" ", "") == "asyncrl_weight_transfer=asyncrl.generator.engines.vllm_transfer:register"


@pytest.mark.parametrize("extra", ["cpu", "gpu", "sglang"])
def test_the_engine_extras_pin_every_package_they_name(distribution, extra):
    """The engines pin torch exactly, so an unpinned package beside them may resolve to a release that cannot
    install with them (setup.py says why SGLang has an extra of its own)."""
    requirements = distribution.extras_require[extra]
    assert requirements and all("==" in requirement for requirement in requirements), requirements
