"""Recipes that inherit, merged in layers, remembering where each value came from.

A recipe may name the recipes it builds on: `base: demo_cpu.yaml` (or a list), or Hydra's spelling, `defaults:
[demo_cpu.yaml, _self_]` (entries after `_self_` override the recipe itself). A base is a path, looked up next to
the recipe that names it first, then among the shipped recipes (a recipe named like the shipped one it inherits from
gets the shipped one); bases chain, and a cycle is an error naming it. The recipes are merged bases first, each
recipe once (the first time it is reached, so a base two parents share does not come back to undo the first parent),
then each command-line override in order. Every layer is checked for the shape of its values (configs/schema.py),
and a section set to null goes back to its defaults. `LoadedConfig.sources` says which layer set each value last;
`asyncrl <cmd> --dry-run` prints it (configs/provenance.py). The sources live beside the RunConfig, not in it, so
nothing a part reads (nor `shared_hash`) sees them, and `base` is never a config key.
"""
import os
from dataclasses import dataclass, field, fields, is_dataclass
from importlib import resources
from typing import Dict, List, Optional

from asyncrl.configs.schema import check_shapes, empty_string_override, explain, first_line, flow, leaves, value_at
from asyncrl.configs.run_config import ConfigError, RunConfig, move_flat_keys, move_flat_override

DEFAULT_RECIPE = "demo_cpu.yaml"
COMMAND_LINE = "command line"
SELF = "_self_"


@dataclass
class Layer:
    source: str
    """Where the values come from: a recipe's name (a shipped one's file name, else its path) or COMMAND_LINE."""
    tree: dict
    override: Optional[str] = None
    """The `key=value` text of a command-line layer."""

    def where(self) -> str:
        return f"override {self.override!r}" if self.override is not None else f"recipe {self.source}"


@dataclass
class LoadedConfig:
    config: RunConfig
    sources: Dict[str, str] = field(default_factory=dict)
    """Dotted key -> the layer that set it last (a recipe's name or COMMAND_LINE); keys absent are defaults."""
    resets: Dict[str, str] = field(default_factory=dict)
    """Section -> the layer that set it to null (back to its defaults)."""
    recipes: List[str] = field(default_factory=list)
    """The recipes merged, bases first."""


def recipe_path(name_or_path: Optional[str]) -> str:
    """A recipe is a file path, or the name of one shipped in `asyncrl/configs/` (e.g. `demo_cpu.yaml`)."""
    name = name_or_path or DEFAULT_RECIPE
    if os.path.exists(name):
        return name
    shipped = resources.files("asyncrl.configs").joinpath(name)
    if shipped.is_file():
        return str(shipped)
    raise ConfigError(f"recipe not found: {name!r} (neither a file nor a recipe shipped in asyncrl/configs/)")


def load_config(recipe: Optional[str] = None, overrides: Optional[List[str]] = None) -> RunConfig:
    """Recipe YAML (and the recipes it inherits from), then `a.b=value` overrides, validated. Unknown keys and bad
    values raise ConfigError naming the key and a spelling that works."""
    return load_with_sources(recipe, overrides).config


def load_with_sources(recipe: Optional[str] = None, overrides: Optional[List[str]] = None) -> LoadedConfig:
    """Recipe chain, then `a.b=value` overrides, validated, with where each value came from."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    layers = recipe_layers(recipe_path(recipe))
    recipes = [layer.source for layer in layers]
    layers += [override_layer(item) for item in overrides or []]
    cfg = OmegaConf.structured(RunConfig)
    loaded = LoadedConfig(None, recipes=recipes)
    for layer in layers:
        cfg = merge_layer(cfg, layer, loaded)
    try:
        loaded.config = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None)
        raise ConfigError(f"config key {key!r}: {first_line(err)} (recipe {recipes[-1]})") from None
    except ValueError as err:  # raised by a part's __post_init__; its message names the key
        if isinstance(err, ConfigError):
            raise
        raise ConfigError(f"{err} (recipe {recipes[-1]})") from None
    return loaded


def merge_layer(cfg, layer: Layer, loaded: LoadedConfig):
    """`cfg` with `layer` merged in: its null sections reset to their defaults, then its values."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        for key in check_shapes(layer.tree, cli=layer.override is not None):
            OmegaConf.update(cfg, key, section_defaults(key), merge=False)
            loaded.resets[key] = layer.source
            for set_key in [k for k in loaded.sources if k.startswith(key + ".")]:
                del loaded.sources[set_key]
        cfg = OmegaConf.merge(cfg, OmegaConf.create(layer.tree))
    except ConfigError as err:
        raise ConfigError(f"{err} ({layer.where()})") from None
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None) or None
        given = value_at(layer.tree, key) if key else None
        message = explain(key, first_line(err), given, cli=layer.override is not None)
        raise ConfigError(f"{message} ({layer.where()})") from None
    for key in leaves(layer.tree):
        loaded.sources[key] = layer.source
    return cfg


def section_defaults(key: str):
    """The default of the section `key` names: what its parent's field makes."""
    *parents, name = key.split(".")
    cls = RunConfig
    for part in parents:
        cls = {f.name: f.type for f in fields(cls)}[part]
    [found] = [f for f in fields(cls) if f.name == name]
    value = found.default_factory() if callable(found.default_factory) else found.default
    assert is_dataclass(value), key
    return value


def override_layer(item: str) -> Layer:
    """One `key=value` override as a layer; `key=` is the empty string for a text key (empty_string_override)."""
    from omegaconf import OmegaConf

    if "=" not in item:
        raise ConfigError(f"override {item!r} is not of the form key=value")
    item = move_flat_override(item)
    if item.partition("=")[0].strip() in ("base", "defaults"):
        raise ConfigError(f"override {item!r}: a recipe names its bases inside the file; on the command line, "
                          f"--config names the recipe")
    try:
        tree = OmegaConf.to_container(OmegaConf.from_dotlist([empty_string_override(item)]), resolve=False)
    except Exception as err:  # PyYAML's errors, without importing PyYAML here (omegaconf wraps it)
        if not type(err).__module__.startswith("yaml"):
            raise
        raise ConfigError(f"override {item!r}: its value is not valid YAML ({first_line(err)}); quote or "
                          f"bracket it as YAML wants") from None
    return Layer(COMMAND_LINE, tree, override=item)


def recipe_layers(path: str) -> List[Layer]:
    """The recipe at `path` and its bases, bases first, each recipe once."""
    layers, seen = [], set()
    for real, layer in _visit(path, ()):
        if real not in seen:
            seen.add(real)
            layers.append(layer)
    return layers


def _visit(path: str, chain: tuple) -> list:
    real = os.path.realpath(path)
    if real in chain:
        names = [display_name(p) for p in (*chain[chain.index(real):], real)]
        raise ConfigError(f"recipes inherit in a cycle: {' -> '.join(names)} (each names the next as its base)")
    tree = read_recipe(path)
    before, after = parents_of(tree, path)
    found = []
    for name in before:
        found += _visit(find_base(name, path), (*chain, real))
    found.append((real, Layer(display_name(path), move_flat_keys(tree))))
    for name in after:
        found += _visit(find_base(name, path), (*chain, real))
    return found


def read_recipe(path: str) -> dict:
    from omegaconf import OmegaConf

    try:
        tree = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    except Exception as err:  # PyYAML's errors, as above
        if not type(err).__module__.startswith("yaml"):
            raise
        raise ConfigError(f"recipe {display_name(path)} is not valid YAML: {first_line(err)}") from None
    if tree is None:
        return {}
    if not isinstance(tree, dict):
        raise ConfigError(f"recipe {display_name(path)} must be a mapping of sections (job:, learner:, ...), got "
                          f"{flow(tree)[:80]}")
    return tree


def parents_of(tree: dict, path: str) -> tuple:
    """(the bases merged before the recipe, those merged after it), taken out of `tree`."""
    base, defaults = tree.pop("base", None), tree.pop("defaults", None)
    if base is not None and defaults is not None:
        raise ConfigError(f"recipe {display_name(path)} sets both base and defaults: they are the same thing, keep one")
    entries = [base] if isinstance(base, str) else base if base is not None else defaults
    if entries is None:
        return [], []
    if not isinstance(entries, list) or not all(isinstance(e, str) and e for e in entries):
        raise ConfigError(f"recipe {display_name(path)}: base (or defaults) is a recipe name or path, or a list of "
                          f"them, e.g. base: demo_cpu.yaml or defaults: [demo_cpu.yaml, _self_]; got "
                          f"{flow(entries)}")
    if entries.count(SELF) > 1:
        raise ConfigError(f"recipe {display_name(path)}: defaults names {SELF} more than once")
    at = entries.index(SELF) if SELF in entries else len(entries)
    return entries[:at], entries[at + 1:]


def find_base(name: str, child: str) -> str:
    """The file a base names: an absolute path; else next to the recipe naming it, then a shipped recipe. A name
    without .yaml also matches name.yaml (Hydra's spelling). A candidate that is the child itself is skipped."""
    here = os.path.dirname(os.path.abspath(child))
    names = [name] if name.endswith((".yaml", ".yml")) else [name, name + ".yaml"]
    candidates = [n if os.path.isabs(n) else os.path.join(here, n) for n in names]
    candidates += [str(resources.files("asyncrl.configs").joinpath(n)) for n in names if not os.path.isabs(n)]
    itself = [c for c in candidates if os.path.isfile(c) and os.path.realpath(c) == os.path.realpath(child)]
    for candidate in candidates:
        if os.path.isfile(candidate) and candidate not in itself:
            return candidate
    if itself:
        raise ConfigError(f"recipe {display_name(child)} names itself as its base {name!r}")
    shipped = sorted(p.name for p in resources.files("asyncrl.configs").iterdir() if p.name.endswith(".yaml"))
    raise ConfigError(f"recipe {display_name(child)}: its base {name!r} is neither a file next to it "
                      f"({os.path.join(here, name)}) nor a shipped recipe ({', '.join(shipped)})")


def display_name(path: str) -> str:
    """A shipped recipe by its file name (`demo_cpu.yaml`); another by its path, relative to the working directory
    when it lies under it (`./my.yaml`)."""
    real = os.path.realpath(path)
    if os.path.dirname(real) == os.path.realpath(str(resources.files("asyncrl.configs"))):
        return os.path.basename(real)
    relative = os.path.relpath(real)
    if relative.startswith(".."):
        return real
    return relative if os.sep in relative else f".{os.sep}{relative}"
