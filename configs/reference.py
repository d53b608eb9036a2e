"""The config reference: every field of `RunConfig` with its type, default and docstring, for `asyncrl config` and the
generated `docs/config.md`.

A field's docstring is the string literal written under it in its dataclass, which Python does not keep at run
time, so it is read from the class's source with `ast`. Only the config modules are imported (stdlib only), so the
command answers without torch.
"""
import ast
import difflib
import inspect
import re
import textwrap
from dataclasses import MISSING, dataclass, fields, is_dataclass
from functools import lru_cache
from typing import List, Optional

from asyncrl.configs.run_config import MOVED_KEYS, RunConfig

REGENERATE = "asyncrl config --markdown > docs/config.md"
"""The command that writes docs/config.md (tests/unit/test_config_reference.py checks the file against it)."""


@dataclass
class FieldDoc:
    key: str
    """Dotted key as a recipe or override names it, e.g. `buffer.redis.url`."""
    type: str
    default: str
    """The default as YAML would show it; `(section)` for a nested section."""
    doc: str
    """The docstring under the field, dedented; empty only for a field nobody documented (a test forbids that)."""


@dataclass
class SectionDoc:
    key: str
    doc: str
    """The section dataclass's own docstring ("" when it has none)."""
    fields: List[FieldDoc]


@lru_cache(maxsize=None)
def field_docstrings(cls: type) -> dict:
    """name -> docstring of each field of the dataclass `cls`, from the string literal that follows it."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, after in zip(body, body[1:] + [None]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs


def type_name(annotation) -> str:
    if isinstance(annotation, type):
        return annotation.__name__
    return re.sub(r"\btyping\.", "", str(annotation)).replace("NoneType", "None")


def default_text(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return repr(value) if value == "" or value.strip() != value or not value.isprintable() else value
    return str(value)


def sections(cls: type = RunConfig, prefix: str = "") -> List[SectionDoc]:
    """Every section of `cls` (a config dataclass) in declaration order, nested ones right after their parent."""
    out = []
    docs = field_docstrings(cls)
    own, nested = [], []
    for f in fields(cls):
        key = f"{prefix}{f.name}"
        section_type = f.type if is_dataclass(f.type) else None
        if section_type is not None:
            nested.append((key, section_type))
            own.append(FieldDoc(key, section_type.__name__, "(section)", docs.get(f.name, "")))
            continue
        default = (f.default if f.default is not MISSING else
                   f.default_factory() if f.default_factory is not MISSING else None)
        own.append(FieldDoc(key, type_name(f.type), default_text(default), docs.get(f.name, "")))
    if prefix:
        out.append(SectionDoc(prefix[:-1], inspect.cleandoc(cls.__doc__ or "") if not _auto_doc(cls) else "", own))
    for key, section_type in nested:
        out += sections(section_type, f"{key}.")
    return out


def _auto_doc(cls: type) -> bool:
    """A dataclass without a docstring gets its signature as __doc__; that is not documentation."""
    return (cls.__doc__ or "").startswith(f"{cls.__name__}(")


def all_fields() -> List[FieldDoc]:
    return [f for section in sections() for f in section.fields]


def lookup(key: Optional[str]) -> List[SectionDoc]:
    """The sections to show for `key`: all (None), one section and those nested in it, or one field (as a section
    of one). An unknown key raises KeyError naming the closest known ones."""
    every = sections()
    if not key:
        return every
    if key in MOVED_KEYS:
        raise KeyError(f"{key} moved to {MOVED_KEYS[key]} (the old key still loads, with a warning)")
    chosen = [s for s in every if s.key == key or s.key.startswith(key + ".")]
    if chosen:
        return chosen
    for section in every:
        for f in section.fields:
            if f.key == key:
                return [SectionDoc(section.key, "", [f])]
    known = [s.key for s in every] + [f.key for s in every for f in s.fields]
    close = difflib.get_close_matches(key, known, n=3, cutoff=0.6)
    raise KeyError(f"no config section or key {key!r}" + (f"; did you mean {', '.join(close)}?" if close else ""))


def format_text(chosen: List[SectionDoc], width: int = 100) -> str:
    """For a terminal: `key: type = default` and the docstring indented under it."""
    lines = []
    for section in chosen:
        lines.append(f"[{section.key}]")
        lines += textwrap.wrap(_one_line(section.doc), width - 2, initial_indent="  ", subsequent_indent="  ")
        for f in section.fields:
            if f.default == "(section)":
                continue  # its own block follows
            lines.append(f"{f.key}: {f.type} = {f.default}")
            lines += textwrap.wrap(_one_line(f.doc) or "(undocumented)", width - 4, initial_indent="    ",
                                   subsequent_indent="    ")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


RECIPES_GUIDE = """\
## Recipes, inheritance and overrides

A recipe is a YAML file of sections (`--config my_task.yaml`, or the name of a shipped one: `demo_cpu.yaml`). The
config is merged in layers: the defaults below, the recipe's bases, the recipe, then each `key=value` override in
order; the last layer to set a key wins (`configs/recipes.py`).

A recipe may inherit from others and change only what differs:

```yaml
# my_task.yaml: the CPU demo's settings, with my own model, data and reward
base: demo_cpu.yaml        # a shipped recipe, or a path (relative to this file)
demo: null                 # the demo section back to its defaults: no demo task
job: {name: my-task}
model: {path: ./my-model}
data: {train_files: [train.parquet]}
reward:
  functions: [{name: exact, path: reward.py}]
eval: {files: [heldout.parquet]}
```

- `base` is a recipe name or path, or a list of them merged in order; Hydra's spelling, `defaults: [demo_cpu.yaml,
  _self_]`, means the same (entries after `_self_` override the recipe itself). A relative path is looked up next to
  the recipe that names it, then among the shipped recipes; `.yaml` may be left out. Bases chain; a cycle is an
  error naming it; a base two parents share is merged once, where it is first reached. `base` is not a config key:
  the parts never see it.
- A section set to null (`demo: null` in a recipe, `demo=null` on the command line) goes back to its defaults. A
  single key may be null only where its type is `Optional` (`model.path=null`).
- `--dry-run` (every command that reads a recipe takes it) prints the resolved config as YAML with a comment on each
  value that is not a default, saying where it was set: `# from demo_cpu.yaml`, `# from ./my_task.yaml`, `# command
  line`, or `# set from other keys by validation`. The output loads as a recipe.

Override values are YAML; quote an override that holds brackets, braces or spaces for the shell:

| value | on the command line |
|---|---|
| text | `job.name=my-task` |
| the empty string | `demo.task=` (or `'demo.task=""'`) |
| null, for an `Optional` key | `model.path=null` |
| a list (one item is still a list) | `'data.train_files=[a.parquet,b.parquet]'`, `'eval.files=[heldout.parquet]'` |
| a list of mappings | `'reward.functions=[{name: exact, path: reward.py}, {name: short, weight: 0.1, path: short.py}]'` |
| a section's defaults | `demo=null` |

A value of the wrong shape or type is an error naming the key, the type it wants, the value given and a spelling
that works (`eval.files is a list of str, got one value a.parquet: write it as a list, 'eval.files=[a.parquet]'`).
"""
"""Prose for docs/config.md: how recipes inherit and how to spell a value (configs/recipes.py, configs/schema.py)."""


def format_markdown() -> str:
    """docs/config.md: how recipes and overrides work, then one table per section."""
    out = ["# Configuration reference", "",
           f"<!-- generated from the config dataclasses' docstrings by `{REGENERATE}`; do not edit by hand -->", "",
           "Every key a recipe or a `section.key=value` override may set, with its type and default. "
           "`asyncrl config SECTION` or `asyncrl config KEY` prints the same in a terminal. Units are in each "
           "description and in the name's suffix (`_s` seconds, `_mb` MiB, `_gib` GiB).", "", RECIPES_GUIDE]
    for section in sections():
        out += [f"## `{section.key}`", ""]
        if section.doc:
            out += [_one_line(section.doc), ""]
        out += ["| key | type | default | description |", "|---|---|---|---|"]
        for f in section.fields:
            doc = f"see [`{f.key}`](#{f.key.replace('.', '')})" if f.default == "(section)" else _one_line(f.doc)
            out.append(f"| `{f.key}` | `{f.type}` | {_cell(f.default)} | {_escape(doc)} |")
        out.append("")
    return "\n".join(out)


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _cell(default: str) -> str:
    return "" if default == "(section)" else f"`{_escape(default)}`"


def _escape(text: str) -> str:
    return text.replace("|", "\\|")
