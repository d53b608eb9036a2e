"""Loading a name from a user's Python file (a reward function, a tool, an environment class).

The file runs as a module of its own, once per call, in the process that loads it: the generator, to read a tool's
schema or check an environment's interface, and each worker process that runs the code (pool.py).
"""
import importlib.util
import os


def load_from_file(path: str, name: str, key: str):
    """`name` from the Python file `path`, or None if the file has no such name; `key` (the recipe's key, e.g.
    `reward.path`) names the file in the error when it does not exist."""
    path = os.path.expanduser(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{key} {path!r} does not exist")
    spec = importlib.util.spec_from_file_location(f"asyncrl_user_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name, None)
