"""The import rules of docs/architecture.md §2 hold in the code: this test reads the rules from the document's table
(so the document cannot drift from what is checked) and every import statement of every module with `ast`,
including the imports inside functions."""
import ast
import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ARCHITECTURE = os.path.join(REPO, "docs", "architecture.md")
PARTS_WITHOUT_RULES = ("tests", "docs", "scripts")  # may import anything: not installed parts of asyncrl


def read_rules() -> dict:
    """part -> (allowed asyncrl parts or None for any, allowed third-party modules or None for any)."""
    text = open(ARCHITECTURE).read()
    table = text.split("<!-- import-rules")[1].split("<!-- end import-rules -->")[0]
    rules = {}
    for line in table.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) != 3 or cells[0] in ("part", "") or set(cells[0]) <= {"-"}:
            continue
        part, parts, third = cells
        rules[part] = (parse_list(parts), parse_list(third))
    return rules


def parse_list(cell: str):
    if cell == "any":
        return None
    return set() if cell == "none" else {name.strip() for name in cell.split(",")}


def installed_parts() -> list[str]:
    """The top-level folders setup.py installs as asyncrl.<folder>: its PARTS list, read without running it."""
    tree = ast.parse(open(os.path.join(REPO, "setup.py")).read(), "setup.py")
    [parts] = [node.value for node in tree.body if isinstance(node, ast.Assign)
               and [getattr(target, "id", None) for target in node.targets] == ["PARTS"]]
    return ast.literal_eval(parts)


def modules_of(part: str) -> list[str]:
    found = []
    for root, dirs, files in os.walk(os.path.join(REPO, part)):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        found += [os.path.relpath(os.path.join(root, name), REPO) for name in files if name.endswith(".py")]
    return sorted(found)


def imports_of(path: str, source: str | None = None) -> list[str]:
    """Every absolute module name imported anywhere in the file (`from a.b import c` gives a.b)."""
    tree = ast.parse(source if source is not None else open(os.path.join(REPO, path)).read(), path)
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: relative import (asyncrl imports absolutely)"
            names.append(node.module)
    return names


def is_stdlib(module: str) -> bool:
    return module.split(".")[0] in sys.stdlib_module_names or module == "__future__"


def violations(path: str, rules: dict, source: str | None = None) -> list[str]:
    part = path.split(os.sep)[0]
    allowed_parts, allowed_third = rules[part]
    found = []
    for module in imports_of(path, source):
        if module.startswith("asyncrl."):
            target = module.split(".")[1]
            if target == part or allowed_parts is None or target in allowed_parts:
                continue
            if path == os.path.join("configs", "run_config.py") and module.endswith(".config"):
                continue  # RunConfig is made of every part's config dataclass
            if path == os.path.join("learner", "__main__.py") and module == "asyncrl.launch.cli":
                continue  # the module torchrun runs: it forwards to the CLI
            found.append(f"{path} imports {module}")
        elif not is_stdlib(module) and allowed_third is not None and module.split(".")[0] not in allowed_third:
            found.append(f"{path} imports {module}")
    return found


def test_every_installed_part_has_a_rule_and_every_rule_a_part():
    assert set(read_rules()) == set(installed_parts())


@pytest.mark.parametrize("part", installed_parts())
def test_each_part_imports_only_what_the_architecture_allows(part):
    rules = read_rules()
    problems = [problem for path in modules_of(part) for problem in violations(path, rules)]
    assert not problems, "\n".join(problems)


def stdlib_only(path: str, seen: frozenset = frozenset()) -> list[str]:
    """What in `path`, or in the asyncrl modules it imports (transitively), is not the standard library."""
    problems = []
    for module in imports_of(path):
        if module.startswith("asyncrl."):
            target = os.path.join(*module.split(".")[1:]) + ".py"
            if target not in seen:
                problems += stdlib_only(target, seen | {path, target})
        elif not is_stdlib(module):
            problems.append(f"{path} imports {module}")
    return problems


@pytest.mark.parametrize("path", [os.path.join(part, "config.py") for part in installed_parts()
                                  if os.path.isfile(os.path.join(REPO, part, "config.py"))]
                         + [os.path.join("configs", "run_config.py"), os.path.join("configs", "sections.py")])
def test_config_modules_need_nothing_but_the_standard_library(path):
    """So `asyncrl <cmd> --help` and `--dry-run` never import torch: omegaconf is imported inside load_config."""
    problems = [p for p in stdlib_only(path) if "omegaconf" not in p]
    assert not problems, "\n".join(problems)


def test_generator_and_learner_never_import_each_other():
    for part, other in (("generator", "learner"), ("learner", "generator")):
        for path in modules_of(part):
            assert not [m for m in imports_of(path) if m.startswith(f"asyncrl.{other}")], path


def test_only_the_ray_launcher_imports_ray():
    """Ray is an optional extra (`asyncrl[ray]`): launch/ray_job.py, ray_actors.py and ray_fleet.py are the only
    modules that import it, each inside the functions that need it, so every other command runs without it."""
    allowed = {"launch/ray_job.py", "launch/ray_actors.py", "launch/ray_fleet.py"}
    importers = {path for part in installed_parts() for path in modules_of(part)
                 if any(m == "ray" or m.startswith("ray.") for m in imports_of(path))}
    assert importers and importers <= allowed, importers - allowed
    for path in allowed:  # never at module level
        tree = ast.parse(open(os.path.join(REPO, path)).read(), path)
        top = [alias.name for node in tree.body if isinstance(node, ast.Import) for alias in node.names]
        top += [node.module for node in tree.body if isinstance(node, ast.ImportFrom)]
        assert not [m for m in top if m == "ray" or m.startswith("ray.")], path


def test_the_checker_sees_a_violation():
    """A rule that cannot fail checks nothing: a weightsync module importing the learner is caught."""
    rules = read_rules()
    assert rules["weightsync"][0] == {"configs", "security"}
    fake = os.path.join("weightsync", "imaginary.py")
    source = "import os\nfrom asyncrl.learner.loop import run_learner\n\ndef f():\n    import transformers\n"
    assert violations(fake, rules, source) == [f"{fake} imports asyncrl.learner.loop", f"{fake} imports transformers"]


def test_data_sits_below_generator_and_learner_and_above_buffer():
    """One PromptRow for both processes (data/prompts.py): generator and learner may import data; buffer, which
    carries a dealt row as bytes, may not."""
    rules = read_rules()
    assert "data" in rules["generator"][0] and "data" in rules["learner"][0] and "buffer" in rules["data"][0]
    fake = os.path.join("buffer", "imaginary.py")
    assert violations(fake, rules, "from asyncrl.data.prompts import PromptRow\n") == [
        f"{fake} imports asyncrl.data.prompts"]


def test_no_test_module_imports_from_another():
    """Shared test helpers live in helper modules (docs/testing.md): a test module imported by another runs its
    module-level code and collects its fixtures twice, and couples two files' tests to one file's internals."""
    found = []
    for root, _, files in os.walk(os.path.join(REPO, "tests")):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(root, name)
            for node in ast.walk(ast.parse(open(path).read(), path)):
                module = node.module if isinstance(node, ast.ImportFrom) else None
                names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else [module or ""]
                found += [(os.path.relpath(path, REPO), target) for target in names
                          if target.startswith("tests.") and target.rsplit(".", 1)[-1].startswith("test_")]
    assert not found, found
