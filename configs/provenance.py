"""The resolved config as YAML, each value that is not a default marked with where it was set: what
`asyncrl <cmd> --dry-run` prints.

The marks are YAML comments (`max_staleness: 1  # from demo_cpu.yaml`), so the output still loads as a recipe
(`--config` of a saved dry run gives the same config). Each value is written on one line (lists and mappings in flow
style) so that a comment can follow it. A value no layer set that differs from its default was set by validation
from other keys (`algo.advantage=remax` turns on `rollout.greedy_baseline`): it is marked so, rather than passed off
as a default.
"""
from dataclasses import is_dataclass

from asyncrl.configs.schema import field_of, flow, strip_optional
from asyncrl.configs.recipes import COMMAND_LINE, LoadedConfig
from asyncrl.configs.run_config import RunConfig

COMMENT_COLUMN = 44
"""Marks start at this column when the value is shorter, so that they line up."""


def format_with_sources(loaded: LoadedConfig) -> str:
    from omegaconf import OmegaConf

    tree = OmegaConf.to_container(OmegaConf.structured(loaded.config))
    defaults = OmegaConf.to_container(OmegaConf.structured(RunConfig))
    from_command_line = COMMAND_LINE in {*loaded.sources.values(), *loaded.resets.values()}
    chain = " <- ".join([*loaded.recipes, *([COMMAND_LINE] if from_command_line else [])])
    lines = [f"# resolved from: {chain}",
             "# a comment says where a value was set; a value without one is its default (asyncrl config KEY)"]
    lines += annotate(tree, defaults, loaded, "", 0)
    return "\n".join(lines) + "\n"


def annotate(tree: dict, defaults: dict, loaded: LoadedConfig, prefix: str, depth: int) -> list:
    out = []
    for name, value in tree.items():
        key, indent = f"{prefix}{name}", "  " * depth
        found = field_of(key)
        if isinstance(value, dict) and found is not None and is_dataclass(strip_optional(found[0])[0]):
            reset = loaded.resets.get(key)
            where = "on the command line" if reset == COMMAND_LINE else f"in {reset}"
            out.append(mark(f"{indent}{name}:", f"set to null {where}: its defaults" if reset else ""))
            out += annotate(value, defaults.get(name) or {}, loaded, key + ".", depth + 1)
            continue
        source = loaded.sources.get(key)
        note = (describe(source) if source else
                "" if value == defaults.get(name) else "set from other keys by validation")
        out.append(mark(f"{indent}{name}: {flow(value)}", note))
    return out


def describe(source: str) -> str:
    return source if source == COMMAND_LINE else f"from {source}"


def mark(line: str, note: str) -> str:
    return f"{line.ljust(COMMENT_COLUMN - 2)}  # {note}" if note else line
