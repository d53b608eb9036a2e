"""The docs name files, definitions and config keys that exist: every repository path that README.md and docs/*.md
cite (`buffer/staleness.py`, `learner/host.py::LearnerHost.publish`, `docs/redis.md`) is checked against the tree, and
every config key against the config, because a moved module or a renamed key otherwise leaves the docs pointing at
nothing without any test noticing.

Only paths that start at one of the repository's top-level folders are checked: a path written from inside a
folder ("`client.py`" after "`buffer/redis/`") or an upstream project's file (vllm/..., verl/...) is prose."""
import glob
import os
import re

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOP = ("algos", "buffer", "configs", "data", "generator", "learner", "weightsync", "telemetry", "planner",
       "security", "launch", "bench", "tests", "docs", "scripts")
UPSTREAM = re.compile(r"\b(?:verl|vLLM|vllm|SGLang|sglang|AReaL|TRL|trl|slime|OpenRLHF)\W{0,3}$")
PATH = re.compile(r"(?<![\w/.{<-])((?:%s)/[\w/.{},-]*\.(?:py|sh|yaml|md|lua))(?:::([\w.]+))?" % "|".join(TOP))


def doc_files():
    return ["README.md"] + sorted(os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, "docs", "*.md")))


def expand(path):
    """`generator/engines/{vllm,hf}_engine.py` names two files."""
    brace = re.search(r"\{([^}]*)\}", path)
    if not brace:
        return [path]
    return [p for part in brace.group(1).split(",")
            for p in expand(path[:brace.start()] + part + path[brace.end():])]


def defines(source, dotted):
    """Each part of `Name.attr` is defined somewhere in the file: a def, a class, or an assignment."""
    return all(re.search(r"^\s*(?:async\s+def|def|class)\s+%s\b|^\s*%s\s*[:=]" % (name, name), source, re.M)
               for name in dotted.split("."))


def citations():
    for doc in doc_files():
        with open(os.path.join(REPO, doc)) as handle:
            for number, line in enumerate(handle, 1):
                for match in PATH.finditer(line):
                    if UPSTREAM.search(line[:match.start()]):
                        continue
                    for path in expand(match.group(1)):
                        yield doc, number, path, match.group(2)


def test_the_docs_cite_some_paths():
    assert len(list(citations())) > 100


@pytest.mark.parametrize("doc", doc_files())
def test_every_cited_path_and_name_exists(doc):
    missing = []
    for where, number, path, name in citations():
        if where != doc:
            continue
        full = os.path.join(REPO, path)
        if not os.path.isfile(full):
            missing.append(f"{doc}:{number}: {path} does not exist")
        elif name and path.endswith(".py"):
            with open(full) as handle:
                if not defines(handle.read(), name):
                    missing.append(f"{doc}:{number}: {path} does not define {name}")
    assert not missing, "\n".join(missing)


NOT_CONFIG_KEYS = {"model.generate", "model.load_weights", "learner.sbatch"}
"""Dotted names the docs cite that start like a config section but are not keys: an HF model's methods and the
sbatch file `asyncrl slurm` writes."""


def cited_config_keys():
    """`section.key` written as an override (`key=`) or alone in backticks; file names (`sft.py`) are paths."""
    from asyncrl.configs.reference import all_fields
    tops = sorted({f.key.split(".")[0] for f in all_fields()})
    pattern = re.compile(r"(?<![\w/.<{$-])((?:%s)(?:\.\w+)+)(?:=|`)" % "|".join(tops))
    for doc in doc_files():
        with open(os.path.join(REPO, doc)) as handle:
            for number, line in enumerate(handle, 1):
                for match in pattern.finditer(line):
                    key = match.group(1)
                    if key not in NOT_CONFIG_KEYS and not re.search(r"\.(py|png|sbatch|yaml|md|sh)$", key):
                        yield doc, number, key


def test_every_cited_config_key_exists():
    """A key the docs name is a key of the config (or a section), or an old name that still loads with a warning: a
    renamed key otherwise lives on in the docs, and a user who copies it gets an unknown-key error."""
    from asyncrl.configs.reference import all_fields
    from asyncrl.configs.run_config import MOVED_KEYS
    keys = {f.key for f in all_fields()}
    known = keys | {key.rsplit(".", 1)[0] for key in keys} | set(MOVED_KEYS)
    cited = list(cited_config_keys())
    assert len(cited) > 100
    unknown = [f"{doc}:{number}: {key}" for doc, number, key in cited if key not in known]
    assert not unknown, "config keys the docs cite that the config does not have:\n" + "\n".join(unknown)
