"""The docs name files and definitions that exist: every repository path that README.md and docs/*.md cite
(`buffer/staleness.py`, `learner/host.py::LearnerHost.publish`, `docs/redis.md`) is checked against the tree,
because a moved module otherwise leaves the docs pointing at nothing without any test noticing.

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
