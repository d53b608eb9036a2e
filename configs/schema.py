"""The config tree's types, read from the dataclasses, and errors that say how to spell a value of each.

OmegaConf checks a value against its field, but its messages name the type in its own terms ("Incompatible value
'None' for field of type 'str'", "AnyNode is not a ListConfig") and say nothing of the spelling that works. So each
layer (a recipe, one override) is checked here for the shape of its values first: null where the type is not
Optional, a single value where a list is wanted, a mapping where a scalar is, and a scalar where a section is; the
error names the key, the type wanted, the value given and a spelling that works, in the layer's own syntax
(`key=value` for the command line, quoted for the shell; nested YAML for a recipe). A section set to null is not an
error: it goes back to its defaults (`demo: null` turns the demo off). Conversions (`learner.lr=abc`) are left to
OmegaConf, and its error is explained the same way (`explain`). Stdlib only, like the config modules.
"""
import difflib
import json
import re
import shlex
import typing
from dataclasses import MISSING, fields, is_dataclass
from typing import List, Optional, Tuple

from asyncrl.configs.run_config import ConfigError, RunConfig

PLACEHOLDERS = {int: 1, float: 0.5, bool: True, str: "text"}
"""An example value of each scalar type, for a field whose default is empty or null."""
TYPE_NAMES = {int: "an integer (int)", float: "a number (float)", bool: "true or false (bool)", str: "text (str)"}


def strip_optional(annotation) -> Tuple[object, bool]:
    """(the type inside Optional[...], whether it was Optional)."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is typing.Union and type(None) in args:
        inner = [arg for arg in args if arg is not type(None)]
        return (inner[0] if len(inner) == 1 else typing.Union[tuple(inner)]), True
    return annotation, False


def list_item(annotation):
    """The item type of List[T], else None."""
    return typing.get_args(annotation)[0] if typing.get_origin(annotation) in (list, List) else None


def field_of(key: str):
    """(annotation, default) of the field a dotted key names (`reward.functions[0].weight` too), or None when no
    field has that name. A section's default is its dataclass's defaults."""
    annotation, default = RunConfig, None
    for part in re.findall(r"[^.\[\]]+|\[\d+\]", key):
        inner, _ = strip_optional(annotation)
        if part.startswith("["):
            if list_item(inner) is None:
                return None
            annotation, default = list_item(inner), None
            continue
        if not is_dataclass(inner):
            return None
        found = {f.name: f for f in fields(inner)}.get(part)
        if found is None:
            return None
        annotation = found.type
        default = (found.default if found.default is not MISSING else
                   found.default_factory() if found.default_factory is not MISSING else None)
    return annotation, default


def describe_type(annotation) -> str:
    inner, optional = strip_optional(annotation)
    item = list_item(inner)
    if is_dataclass(inner):
        text = f"a section ({inner.__name__})"
    elif item is not None:
        text = (f"a list of mappings ({item.__name__}: {', '.join(f.name for f in fields(item))})"
                if is_dataclass(item) else f"a list of {getattr(item, '__name__', item)}")
    else:
        text = TYPE_NAMES.get(inner, str(inner))
    return text + (" or null" if optional else "")


def flow(value, nested: bool = False) -> str:
    """`value` as one line of YAML: flow style for lists and mappings, OmegaConf's quoting for scalars (JSON's
    for a string a flow collection or a line cannot hold as it is)."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{key}: {flow(item, True)}" for key, item in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(flow(item, True) for item in value) + "]"
    from omegaconf import OmegaConf

    text = OmegaConf.to_yaml({"v": value})[3:].rstrip("\n")
    if "\n" in text or (nested and isinstance(value, str) and re.search(r"[,\[\]{}#]|: ", value)):
        return json.dumps(value)
    return text


def spell(key: str, value_text: str, cli: bool) -> str:
    """How to write `key` = `value_text` on the command line (`key=value`, quoted for the shell) or in a recipe
    (nested YAML, one line)."""
    if cli:
        return shlex.quote(f"{key}={value_text}")
    *parents, leaf = key.split(".")
    text = f"{leaf}: {value_text}"
    for parent in reversed(parents):
        text = f"{parent}: {{{text}}}"
    return text


def example(annotation, default) -> str:
    """A value of the field's type, as YAML: its default when that says something, else a placeholder."""
    inner, _ = strip_optional(annotation)
    item = list_item(inner)
    if item is not None:
        if is_dataclass(item):
            first = fields(item)[0]
            return flow([{first.name: PLACEHOLDERS.get(first.type, "text")}])
        return flow(default if default else [PLACEHOLDERS.get(item, "text")])
    if default not in (None, "") and not is_dataclass(inner):
        return flow(default)
    return flow(PLACEHOLDERS.get(inner, "text"))


def check_shapes(tree: dict, cli: bool, prefix: str = "") -> List[str]:
    """Raise ConfigError (with the spelling that works) for a value of the wrong shape in one layer's `tree`; remove
    the sections set to null from it and return their keys (the caller resets them to their defaults)."""
    nulled = []
    for name in list(tree):
        key, value = f"{prefix}{name}", tree[name]
        found = field_of(key)
        if found is None or (isinstance(value, str) and value.startswith("${")):
            continue  # an unknown key, or an interpolation: OmegaConf says so, or resolves it
        annotation, default = found
        inner, optional = strip_optional(annotation)
        if is_dataclass(inner):
            if value is None and not optional:
                nulled.append(key)
                del tree[name]
            elif isinstance(value, dict):
                nulled += check_shapes(value, cli, key + ".")
            elif value is not None:
                first = fields(inner)[0]
                raise ConfigError(f"{key} is {describe_type(annotation)}, got {flow(value)}: set its keys, e.g. "
                                  f"{spell(f'{key}.{first.name}', example(first.type, None), cli)}, or "
                                  f"{spell(key, 'null', cli)} for its defaults")
        elif value is None:
            if not optional:
                raise ConfigError(null_message(key, annotation, default, cli))
        elif list_item(inner) is not None:
            check_list(key, value, annotation, cli)
        elif inner in TYPE_NAMES and isinstance(value, (dict, list)):  # a Dict or Any field takes them
            shape = "a mapping" if isinstance(value, dict) else "a list"
            raise ConfigError(f"{key} is {describe_type(annotation)}, got {shape} {flow(value)}: e.g. "
                              f"{spell(key, example(annotation, default), cli)}")
    return nulled


def check_list(key: str, value, annotation, cli: bool) -> None:
    item = list_item(strip_optional(annotation)[0])
    wanted = describe_type(annotation)
    if not isinstance(value, list):
        got = "one mapping" if isinstance(value, dict) else "one value"
        raise ConfigError(f"{key} is {wanted}, got {got} {flow(value)}: write it as a list, "
                          f"{spell(key, flow([value]), cli)}")
    if not is_dataclass(item):
        return
    for index, entry in enumerate(value):
        if not isinstance(entry, dict):
            first = fields(item)[0].name
            fixed = [entry if isinstance(other, dict) else {first: other} for other in value]
            raise ConfigError(f"{key}[{index}] must be a mapping of {item.__name__}'s keys "
                              f"({', '.join(f.name for f in fields(item))}), got {flow(entry)}: e.g. "
                              f"{spell(key, flow(fixed), cli)}")
        check_shapes(entry, cli, f"{key}[{index}].")
        check_item(key, index, value, item, cli)


def check_item(key: str, index: int, value: list, item: type, cli: bool) -> None:
    """The keys and values of `value[index]`, a mapping for the dataclass `item`: OmegaConf checks them, and its
    error (which names the item's key without the list's) is told with the whole list's spelling, fixed."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    entry = value[index]
    names = [f.name for f in fields(item)]
    unknown = [name for name in entry if name not in names]
    if unknown:
        close = difflib.get_close_matches(str(unknown[0]), names, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise ConfigError(f"{key}[{index}] has no key {unknown[0]!r}{hint}; {item.__name__}'s keys are "
                          f"{', '.join(names)}")
    try:
        OmegaConf.merge(OmegaConf.structured(item), entry)
    except OmegaConfBaseException as err:
        name = getattr(err, "full_key", None)
        if name not in names:
            raise ConfigError(f"{key}[{index}]: {first_line(err)}") from None
        found = {f.name: f for f in fields(item)}[name]
        fixed = [dict(other) for other in value]
        fixed[index][name] = PLACEHOLDERS.get(strip_optional(found.type)[0], "text")
        raise ConfigError(f"{key}[{index}].{name} is {describe_type(found.type)}, got {flow(entry[name])}: e.g. "
                          f"{spell(key, flow(fixed), cli)}") from None


def null_message(key: str, annotation, default, cli: bool) -> str:
    inner, _ = strip_optional(annotation)
    if inner is str:
        quoted = spell(key, '""', cli)
        empty = f"{key}= (or {quoted})" if cli else spell(key, "''", cli)
        return f"{key} is {describe_type(annotation)} and cannot be null: for the empty string write {empty}"
    if list_item(inner) is not None:
        return f"{key} is {describe_type(annotation)} and cannot be null: for an empty list write " \
               f"{spell(key, '[]', cli)}"
    return (f"{key} is {describe_type(annotation)} and cannot be null: give one, e.g. "
            f"{spell(key, example(annotation, default), cli)}")


def empty_string_override(item: str) -> str:
    """`demo.task=` -> `demo.task=""` for a text key that cannot be null: the only thing an empty value can mean
    there. An Optional key keeps OmegaConf's reading (null), and another type gets null's error."""
    key, _, value = item.partition("=")
    found = field_of(key.strip()) if value == "" else None
    if found is not None and found[0] is str:
        return f'{key}=""'
    return item


def explain(key: Optional[str], message: str, given, cli: bool) -> str:
    """OmegaConf's error for `key`, with the type wanted, the value given and a spelling that works."""
    found = field_of(key) if key else None
    if found is None and key and re.search(r"not in '\w+'", message):
        return unknown_key(key)
    if found is None or not re.search(r"could not be converted|Cannot convert|Incompatible value", message):
        return f"config key {key!r}: {message}" if key else message
    annotation, default = found
    return (f"{key} is {describe_type(annotation)}, got {flow(given)}: e.g. "
            f"{spell(key, example(annotation, default), cli)}")


def value_at(tree: dict, key: str):
    """The value a dotted key (with [i] for list items) names in a plain tree, or None."""
    node = tree
    for part in re.findall(r"[^.\[\]]+|\[\d+\]", key):
        try:
            node = node[int(part[1:-1])] if part.startswith("[") else node[part]
        except (KeyError, IndexError, TypeError, ValueError):
            return None
    return node


def leaves(tree: dict, prefix: str = "") -> List[str]:
    """The dotted keys a layer sets: a list (reward.functions) is one value; a section's mapping is walked."""
    out = []
    for name, value in tree.items():
        key = f"{prefix}{name}"
        found = field_of(key)
        if isinstance(value, dict) and found is not None and is_dataclass(strip_optional(found[0])[0]):
            out += leaves(value, key + ".")
        else:
            out.append(key)
    return out


def first_line(err: Exception) -> str:
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__


def unknown_key(key: str) -> str:
    """`buffer.nope is not a config key`, with the closest keys of its section."""
    parent, _, leaf = key.rpartition(".")
    found = field_of(parent) if parent else (RunConfig, None)
    inner = strip_optional(found[0])[0] if found else None
    names = [f.name for f in fields(inner)] if is_dataclass(inner) else []
    close = difflib.get_close_matches(leaf, names, n=3)
    hint = f"; did you mean {', '.join(f'{parent}.{n}' if parent else n for n in close)}?" if close else ""
    command = f"asyncrl config {parent}" if parent else "asyncrl config"
    return f"{key} is not a config key{hint} (`{command}` lists the keys)"
