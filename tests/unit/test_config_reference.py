"""The config reference reaches the user: every field has a docstring, `asyncrl config` prints them, and
docs/config.md is generated from them (the CLI as a process: tests/integration/test_cli.py)."""
import os

import pytest

from asyncrl.configs.reference import REGENERATE, all_fields, format_markdown, format_text, lookup

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_every_config_field_has_a_docstring():
    bare = [f.key for f in all_fields() if not f.doc]
    assert not bare, f"config fields without a docstring under them: {bare}"


def test_docs_config_md_is_generated_from_the_docstrings():
    with open(os.path.join(REPO, "docs", "config.md")) as handle:
        written = handle.read()
    assert written == format_markdown(), f"docs/config.md is out of date: regenerate it with `{REGENERATE}`"


def test_a_key_prints_its_type_default_and_docstring():
    text = format_text(lookup("buffer.redis.lease_s"))
    assert "buffer.redis.lease_s: float = 120.0" in text and "given back" in text
    assert "buffer.max_staleness" not in text


def test_a_section_prints_its_fields_and_nested_sections():
    keys = [f.key for section in lookup("buffer") for f in section.fields]
    assert "buffer.max_staleness" in keys and "buffer.redis.url" in keys
    assert [section.key for section in lookup("generator.vllm")] == ["generator.vllm"]


def test_an_unknown_key_names_the_close_ones():
    with pytest.raises(KeyError, match="did you mean buffer.redis.lease_s"):
        lookup("buffer.redis.lease")


def test_defaults_are_shown_as_yaml_writes_them():
    fields = {f.key: f for f in all_fields()}
    assert fields["model.path"].default == "null" and fields["generator.vllm.enable_prefix_caching"].default == "true"
    assert fields["buffer.redis.namespace"].default == "''"
    assert fields["generator.vllm.enforce_eager"].type == "Optional[bool]"


def test_a_moved_key_says_where_it_went():
    with pytest.raises(KeyError, match="generator.enforce_eager moved to generator.vllm.enforce_eager"):
        lookup("generator.enforce_eager")
