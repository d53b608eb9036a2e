"""Recipes that inherit (`base:`, `defaults:`), sections set to null, where each value came from (`--dry-run`), and
config errors that say the spelling that works (configs/recipes.py, configs/schema.py, configs/provenance.py)."""
import os
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from asyncrl.configs import ConfigError, load_config, shared_hash, to_yaml
from asyncrl.configs.recipes import COMMAND_LINE, load_with_sources
from asyncrl.configs.sections import DemoConfig, RewardFunction


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return str(path)


def test_a_recipe_inherits_a_shipped_one_and_overrides_what_it_sets(tmp_path):
    child = write(tmp_path / "mine.yaml", "base: demo_cpu.yaml\njob: {name: mine}\nrollout: {n: 4}\n")
    cfg, demo = load_config(child), load_config("demo_cpu.yaml")
    assert (cfg.job.name, cfg.rollout.n) == ("mine", 4)
    assert cfg.demo == demo.demo and cfg.learner == demo.learner and cfg.rollout.max_tokens == demo.rollout.max_tokens


def test_bases_chain_and_a_relative_base_is_found_next_to_the_recipe_naming_it(tmp_path, monkeypatch):
    write(tmp_path / "recipes" / "middle.yaml", "base: demo_cpu\nlearner: {lr: 0.5}\nrollout: {n: 4}\n")
    child = write(tmp_path / "recipes" / "top.yaml", "base: middle.yaml\nrollout: {n: 2}\n")
    monkeypatch.chdir(tmp_path)  # not the recipes' folder: the base is looked up next to top.yaml
    loaded = load_with_sources(child, ["learner.total_steps=7"])
    cfg = loaded.config
    assert (cfg.learner.lr, cfg.rollout.n, cfg.demo.task, cfg.learner.total_steps) == (0.5, 2, "sort_digits", 7)
    assert loaded.recipes == ["demo_cpu.yaml", "recipes/middle.yaml", "recipes/top.yaml"]
    assert loaded.sources["learner.lr"] == "recipes/middle.yaml" and loaded.sources["rollout.n"] == "recipes/top.yaml"
    assert loaded.sources["buffer.groups_per_step"] == "demo_cpu.yaml"
    assert loaded.sources["learner.total_steps"] == COMMAND_LINE and "learner.seed" not in loaded.sources


def test_a_defaults_list_merges_in_order_and_self_may_come_before_later_entries(tmp_path):
    write(tmp_path / "a.yaml", "learner: {lr: 0.1, total_steps: 11}\n")
    write(tmp_path / "b.yaml", "learner: {lr: 0.2}\n")
    after = load_config(write(tmp_path / "after.yaml", "defaults: [a.yaml, _self_, b.yaml]\nlearner: {lr: 0.3}\n"))
    last = load_config(write(tmp_path / "last.yaml", "defaults: [a.yaml, b.yaml]\nlearner: {lr: 0.3}\n"))
    assert (after.learner.lr, after.learner.total_steps) == (0.2, 11)
    assert (last.learner.lr, last.learner.total_steps) == (0.3, 11)


def test_a_base_two_parents_share_is_merged_once_so_it_cannot_undo_the_first_parent(tmp_path):
    write(tmp_path / "shared.yaml", "learner: {lr: 0.1}\n")
    write(tmp_path / "left.yaml", "base: shared.yaml\nlearner: {lr: 0.2}\n")
    write(tmp_path / "right.yaml", "base: shared.yaml\nrollout: {n: 4}\n")
    cfg = load_config(write(tmp_path / "top.yaml", "base: [left.yaml, right.yaml]\n"))
    assert (cfg.learner.lr, cfg.rollout.n) == (0.2, 4)


def test_a_recipe_named_like_the_shipped_one_it_inherits_gets_the_shipped_one(tmp_path):
    cfg = load_config(write(tmp_path / "demo_cpu.yaml", "base: demo_cpu.yaml\nrollout: {n: 4}\n"))
    assert cfg.rollout.n == 4 and cfg.demo.task == "sort_digits"


def test_a_cycle_is_refused_naming_the_chain(tmp_path):
    write(tmp_path / "a.yaml", "base: b.yaml\n")
    write(tmp_path / "b.yaml", "base: c.yaml\n")
    write(tmp_path / "c.yaml", "base: a.yaml\n")
    with pytest.raises(ConfigError, match=r"cycle: .*a\.yaml -> .*b\.yaml -> .*c\.yaml -> .*a\.yaml"):
        load_config(str(tmp_path / "a.yaml"))


@pytest.mark.parametrize("text, message", [
    ("base: nope.yaml\n", r"mine\.yaml: its base 'nope\.yaml' is neither a file next to it .* nor a shipped recipe "
                          r"\(.*demo_cpu\.yaml"),
    ("base: {name: demo_cpu.yaml}\n", r"base \(or defaults\) is a recipe name or path, or a list of them"),
    ("base: demo_cpu.yaml\ndefaults: [demo_cpu.yaml]\n", "sets both base and defaults"),
    ("- a\n- b\n", "must be a mapping of sections"),
    ("base: mine\n", r"mine\.yaml names itself as its base 'mine'"),
])
def test_a_missing_or_malformed_base_is_an_error_naming_the_recipe(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message):
        load_config(write(tmp_path / "mine.yaml", text))


def test_base_is_not_a_config_key_and_an_inherited_recipe_hashes_as_its_flat_copy(tmp_path):
    child = load_config(write(tmp_path / "mine.yaml", "base: demo_cpu.yaml\nrollout: {n: 4}\n"))
    flat = load_config(write(tmp_path / "flat.yaml", to_yaml(child)))
    assert not hasattr(child, "base") and "base" not in OmegaConf.to_container(OmegaConf.structured(child))
    assert flat == child and shared_hash(flat) == shared_hash(child)
    assert shared_hash(child) != shared_hash(load_config("demo_cpu.yaml"))
    with pytest.raises(ConfigError, match="--config names the recipe"):
        load_config(None, ["base=demo_cpu.yaml"])


def test_a_section_set_to_null_goes_back_to_its_defaults_in_a_recipe_and_on_the_command_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    loaded = load_with_sources(write(tmp_path / "mine.yaml", "base: demo_cpu.yaml\ndemo: null\n"))
    assert loaded.config.demo == DemoConfig() and loaded.config.demo.task == ""
    assert loaded.resets == {"demo": "./mine.yaml"}
    assert not [key for key in loaded.sources if key.startswith("demo.")]
    assert load_config(None, ["demo=null"]).demo == DemoConfig()
    assert load_config(None, ["buffer.redis.lease_s=5", "buffer.redis=null"]).buffer.redis.lease_s == 120.0
    assert load_config(None, ["demo=null", "demo.task=add_numbers"]).demo.task == "add_numbers"


def test_an_old_flat_key_in_a_base_still_loads_with_its_warning(tmp_path):
    write(tmp_path / "old.yaml", "weightsync:\n  catchup_host: 0.0.0.0\n")
    with pytest.warns(FutureWarning, match="weightsync.catchup_host is deprecated: it is now weightsync.host"):
        cfg = load_config(write(tmp_path / "mine.yaml", "base: old.yaml\nrollout: {n: 4}\n"))
    assert cfg.weightsync.host == "0.0.0.0" and cfg.rollout.n == 4


def test_reward_functions_take_a_list_of_mappings_on_the_command_line():
    cfg = load_config(None, ["reward.functions=[{name: exact, path: r.py}, {name: short, weight: 0.1, path: s.py}]"])
    assert cfg.reward.functions == [RewardFunction(name="exact", path="r.py"),
                                    RewardFunction(name="short", weight=0.1, path="s.py")]


def test_an_empty_value_is_the_empty_string_for_a_text_key_and_null_for_an_optional_one():
    assert load_config(None, ["demo.task="]).demo.task == ""
    assert load_config(None, ['demo.task=""']).demo.task == ""
    assert load_config(None, ["model.path=/m", "model.path="]).model.path is None


@pytest.mark.parametrize("override, message", [
    ("demo.task=null", "demo.task is text (str) and cannot be null: for the empty string write demo.task= "
                       "(or 'demo.task=\"\"')"),
    ("rollout.n=", "rollout.n is an integer (int) and cannot be null: give one, e.g. rollout.n=8"),
    ("learner.lr=abc", "learner.lr is a number (float), got abc: e.g. learner.lr="),
    ("rollout.n=2.5", "rollout.n is an integer (int), got 2.5: e.g. rollout.n=8"),
    ("eval.files=a.parquet", "eval.files is a list of str, got one value a.parquet: write it as a list, "
                             "'eval.files=[a.parquet]'"),
    ("eval.files=", "eval.files is a list of str and cannot be null: for an empty list write 'eval.files=[]'"),
    ("reward.functions=[exact]", "reward.functions[0] must be a mapping of RewardFunction's keys (name, weight, "
                                 "path, function, server), got exact: e.g. 'reward.functions=[{name: exact}]'"),
    ("reward.functions={name: exact, path: r.py}", "got one mapping {name: exact, path: r.py}: write it as a list, "
                                                   "'reward.functions=[{name: exact, path: r.py}]'"),
    ("reward.functions=[{name: a, weight: heavy}]", "reward.functions[0].weight is a number (float), got heavy: "
                                                    "e.g. 'reward.functions=[{name: a, weight: 0.5}]'"),
    ("reward.functions=[{name: a, pth: r.py}]", "reward.functions[0] has no key 'pth' (did you mean path?)"),
    ("learner.lr={a: 1}", "learner.lr is a number (float), got a mapping {a: 1}: e.g. learner.lr="),
    ("job.name=[a]", "job.name is text (str), got a list [a]: e.g. job.name=asyncrl"),
    ("demo=sort_digits", "demo is a section (DemoConfig), got sort_digits: set its keys, e.g. demo.task=text, or "
                         "demo=null for its defaults"),
    ("buffer.max_stalenes=2", "buffer.max_stalenes is not a config key; did you mean buffer.max_staleness?"),
])
def test_a_value_of_the_wrong_shape_or_type_names_the_key_and_the_spelling_that_works(override, message):
    with pytest.raises(ConfigError) as caught:
        load_config(None, [override])
    assert message in str(caught.value) and f"(override {override!r})" in str(caught.value)


def test_a_recipe_error_is_spelled_as_yaml_and_names_the_recipe(tmp_path):
    recipe = write(tmp_path / "mine.yaml", "base: demo_cpu.yaml\ndemo:\n  task: null\n")
    with pytest.raises(ConfigError, match=r"demo\.task is text \(str\) and cannot be null: for the empty string "
                                          r"write demo: \{task: ''\} \(recipe .*mine\.yaml\)"):
        load_config(recipe)
    recipe = write(tmp_path / "files.yaml", "eval:\n  files: a.parquet\n")
    with pytest.raises(ConfigError, match=r"write it as a list, eval: \{files: \[a\.parquet\]\} \(recipe"):
        load_config(recipe)


def test_dry_run_marks_where_each_value_came_from_and_still_loads_as_the_same_config(tmp_path):
    write(tmp_path / "mine.yaml", "base: demo_cpu.yaml\njob: {name: mine}\ndemo: null\n"
                                  "reward:\n  functions: [{name: exact, path: r.py}]\n")
    asyncrl = os.path.join(os.path.dirname(sys.executable), "asyncrl")
    command = [asyncrl] if os.path.exists(asyncrl) else [sys.executable, "-m", "asyncrl.launch.cli"]
    out = subprocess.run([*command, "run", "--dry-run", "--config", "mine.yaml", "learner.lr=3e-4",
                          "algo.advantage=remax"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines, sections = {}, []
    for line in out.stdout.splitlines()[2:]:  # dotted key -> its line (a section's line too)
        depth, name = (len(line) - len(line.lstrip())) // 2, line.split(":")[0].strip()
        sections[depth:] = [name]
        lines[".".join(sections)] = line
    assert out.stdout.startswith("# resolved from: demo_cpu.yaml <- ./mine.yaml <- command line\n")
    assert lines["job.name"].endswith("# from ./mine.yaml")
    assert lines["buffer.groups_per_step"].endswith("# from demo_cpu.yaml")
    assert lines["learner.lr"].split() == ["lr:", "0.0003", "#", "command", "line"]
    assert lines["demo"].endswith("# set to null in ./mine.yaml: its defaults")
    assert lines["rollout.greedy_baseline"].endswith("# set from other keys by validation")  # algo.advantage=remax
    assert lines["reward.functions"].startswith("  functions: [{name: exact, weight: 1.0, path: r.py")
    assert "#" not in lines["job.seed"]  # a default
    (tmp_path / "dry.yaml").write_text(out.stdout)
    assert load_config(str(tmp_path / "dry.yaml")) == load_config(str(tmp_path / "mine.yaml"),
                                                                  ["learner.lr=3e-4", "algo.advantage=remax"])


def test_the_recipes_guide_in_docs_config_md_loads_as_written(tmp_path, monkeypatch):
    """docs/config.md's inheriting recipe and each command-line spelling in its table load as they are written."""
    import re
    import shlex

    from asyncrl.configs.reference import RECIPES_GUIDE

    monkeypatch.chdir(tmp_path)
    [recipe] = re.findall(r"```yaml\n(.*?)```", RECIPES_GUIDE, re.S)
    cfg = load_config(write(tmp_path / "my_task.yaml", recipe))
    assert (cfg.demo.task, cfg.job.name, cfg.rollout.n) == ("", "my-task", 8)  # rollout.n from demo_cpu.yaml
    assert cfg.reward.functions == [RewardFunction(name="exact", path="reward.py")]
    rows = [line for line in RECIPES_GUIDE.splitlines() if line.startswith("| ") and "`" in line]
    spellings = [shlex.split(cell)[0] for row in rows for cell in re.findall(r"`([^`]+)`", row.split("|")[2])]
    assert len(spellings) >= 8 and "demo.task=" in spellings
    for item in spellings:
        load_config(None, [item])
