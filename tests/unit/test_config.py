"""Config loading and validation in process: overrides, unknown keys, recipes, algorithm combinations and the
registries (the CLI as a process: tests/integration/test_cli.py)."""
import pytest

from asyncrl.configs import ConfigError, load_config, shared_hash, to_yaml


def test_overrides_change_values_and_types():
    cfg = load_config(None, ["buffer.max_staleness=4", "learner.lr=1e-6", "generator.engine=hf"])
    assert cfg.buffer.max_staleness == 4 and cfg.learner.lr == 1e-6 and cfg.generator.engine == "hf"


def test_default_recipe_is_the_cpu_demo():
    cfg = load_config()
    assert cfg.demo.task == "sort_digits" and cfg.generator.engine == "hf"  # docs/platform.md: faster at this size
    assert (cfg.buffer.max_staleness, cfg.learner.torch_threads, cfg.generator.torch_threads) == (1, 1, 1)
    assert cfg.algo.dynamic_sampling  # docs/benchmarks.md: time to reward, with the generator's filter
    assert cfg.algo.prox_logprobs == "loglinear"  # docs/benchmarks.md: the staleness sweep, A-3PO ahead of η = 0 per step


@pytest.mark.parametrize("override, key", [
    (["buffer.nope=1"], "buffer.nope"),
    (["nosuch.key=1"], "nosuch"),
    (["buffer.max_staleness=abc"], "buffer.max_staleness"),
    (["buffer.max_staleness=-1"], "buffer.max_staleness"),
    (["algo.loss=nope"], "algo.loss"),
    (["rollout.temperature=0"], "rollout.temperature"),
    (["generator.engine=hf", "generator.update_mode=keep"], "generator.update_mode"),
    (["generator.engine=hf", "generator.update_mode=abort"], "generator.update_mode"),
    (["generator.engine=sglang", "generator.update_mode=abort"], "vllm engine only"),
    (["generator.torch_threads=-1"], "generator.torch_threads"),
    (["learner.sp_impl=megatron"], "learner.sp_impl"),
])
def test_unknown_keys_and_bad_values_name_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, override)


def test_override_without_equals_is_an_error():
    with pytest.raises(ConfigError, match="key=value"):
        load_config(None, ["buffer.max_staleness"])


def test_missing_recipe_is_named():
    with pytest.raises(ConfigError, match="no_such_recipe.yaml"):
        load_config("no_such_recipe.yaml")


def test_shared_hash_ignores_per_process_sections_but_not_shared_ones():
    base = load_config()
    assert shared_hash(base) == shared_hash(load_config(None, ["generator.engine=hf", "learner.lr=0.5"]))
    assert shared_hash(base) != shared_hash(load_config(None, ["buffer.max_staleness=7"]))


def test_learner_only_keys_name_keys_of_the_shared_sections_and_stay_out_of_the_hash():
    from dataclasses import asdict

    from asyncrl.configs.run_config import LEARNER_ONLY_KEYS, SHARED_SECTIONS, RunConfig, shared_sections

    tree = asdict(RunConfig())
    for path in LEARNER_ONLY_KEYS:
        *parents, leaf = path.split(".")
        assert parents[0] in SHARED_SECTIONS, path
        node = tree
        for part in parents:
            node = node[part]
        assert leaf in node, f"{path} names no config key"
    assert "done_grace_s" not in shared_sections(load_config())["buffer"]
    assert "reclaim_idle_s" not in shared_sections(load_config())["buffer"]["redis"]


def test_yaml_round_trips(tmp_path):
    cfg = load_config(None, ["buffer.max_staleness=3"])
    path = tmp_path / "r.yaml"
    path.write_text(to_yaml(cfg))
    assert load_config(str(path)) == cfg


@pytest.mark.parametrize("override, message", [
    (["algo.loss=topr", "algo.correction=tis"], "corrects twice"),
    (["algo.correction=vtrace", "algo.loss=ppo"], "needs algo.loss=reinforce"),
    (["algo.correction=vtrace", "algo.loss=reinforce", "algo.advantage=rloo"], "would be ignored"),
    (["algo.correction=bypass", "algo.prox_logprobs=loglinear"], "no proximal policy"),
    (["algo.correction=m2po", "algo.prox_logprobs=loglinear"], "exact"),
    (["algo.kl_loss_coef=0.1", "algo.kl_loss_type=k1"], "zero expected gradient"),
    (["algo.kl_loss_coef=0.1", "algo.kl_reward_coef=0.1"], "twice"),
    (["algo.tau_pos=2.0"], "algo.tau_pos is set"),
    (["algo.loss=gspo", "algo.dual_clip_c=3"], "algo.dual_clip_c is set"),
    (["algo.correction=tis", "algo.is_mode=mask"], "algo.is_mode is set"),
    (["algo.advantage=rloo", "rollout.n=1"], "rollout.n must be >= 2"),
    (["algo.dynamic_sampling=true", "rollout.n=1"], "rollout.n >= 2"),
    (["reward.overlong_buffer_len=10", "rollout.max_tokens=10"], "overlong_buffer_len"),
    (["algo.ppo_minibatches=0"], "algo.ppo_minibatches"),
    (["tools.functions=[t.py:add]"], "rollout.max_turns >= 2"),
    (["rollout.max_turns=3"], "nothing answers the model"),
    (["tools.functions=[t.py:add]", "env.path=e.py", "env.name=E", "rollout.max_turns=3"], "both set"),
    (["tools.functions=[add]", "rollout.max_turns=3"], "path/to/file.py:function"),
    (["tools.parser=json", "rollout.max_turns=1"], "tools.parser"),
    (["env.path=e.py"], "env.name"),
    (["rollout.max_episode_tokens=4", "rollout.max_tokens=10"], "max_episode_tokens"),
    (["tools.functions=[t.py:add]", "rollout.max_turns=3", "algo.advantage=remax"], "single-turn only"),
    (["reward.timeout_s=0"], "reward.timeout_s"),
    (["tools.builtins=[bash]", "rollout.max_turns=3"], "the built-in tools are"),
    (["agent.path=a.py", "env.path=e.py", "env.name=E"], "env.path and agent.path are both set"),
    (["tools.builtins=[calculator]", "agent.path=a.py", "rollout.max_turns=3"],
     r"tools and agent.path are both set.*to drop a recipe's tools, add tools.builtins=\[\]"),
    (["agent.timeout_s=0"], "agent.timeout_s"),
    (["tools.builtins=[python]"], "rollout.max_turns >= 2"),
    (["tools.sandbox.memory_mb=0"], "tools.sandbox"),
    (["generator.reward_workers=0"], "reward_workers"),
    (["algo.loss=sppo", "algo.correction=bypass", "algo.loss_agg=seq-mean-token-mean",
      "algo.prox_logprobs=recompute"], "go together"),
    (["algo.advantage=sppo"], "go together"),
    (["algo.loss=sppo", "algo.advantage=sppo", "algo.loss_agg=seq-mean-token-mean"], "needs algo.correction=bypass"),
    (["algo.loss=sppo", "algo.advantage=sppo", "algo.correction=bypass", "algo.prox_logprobs=recompute"],
     "seq-mean-token-mean"),
    (["algo.loss=sppo", "algo.advantage=sppo", "algo.correction=bypass", "algo.loss_agg=seq-mean-token-mean",
      "algo.prox_logprobs=recompute", "algo.sppo_eta=0"], "sppo_eta must be > 0"),
    (["algo.sppo_eta=2.0"], "does not use it"),
    (["algo.sppo_target=bradley_terry"], "sppo advantage's; algo.advantage=grpo does not read it"),
    (["learner.moe_routing_replay=true", "learner.packing=true"], "turn off learner.packing"),
    (["learner.moe_routing_replay=true", "learner.sp_size=2"], "keep learner.sp_size=1"),
    (["learner.moe_routing_replay=true", "generator.engine=sglang"], "records routes"),
    (["learner.moe_routing_replay=true", "tools.builtins=[calculator]", "rollout.max_turns=3"],
     "single-turn samples"),
    (["algo.loss=sppo", "algo.advantage=sppo", "algo.correction=bypass", "algo.loss_agg=seq-mean-token-mean",
      "algo.prox_logprobs=recompute", "algo.sppo_target=elo"], "sppo_target must be one of softmean, bradley_terry"),
    (["algo.loss=sppo", "algo.advantage=sppo", "algo.correction=bypass", "algo.loss_agg=seq-mean-token-mean",
      "algo.prox_logprobs=recompute", "rollout.n=1"], "rollout.n must be >= 2"),
])
def test_invalid_algorithm_combinations_are_rejected_with_the_reason(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, override)


def test_the_learner_bounds_episodes_by_their_budget_and_single_samples_by_max_tokens():
    from asyncrl.buffer.backends import job_limits

    def limits(overrides):
        cfg = load_config(None, overrides)
        return job_limits(cfg.rollout, cfg.data.max_prompt_tokens, 128, episodes=cfg.samples_episodes())

    assert limits(["rollout.max_tokens=10"]).max_completion_tokens == 10
    multi = ["tools.functions=[t.py:add]", "rollout.max_turns=3", "rollout.max_tokens=10"]
    assert limits(multi).max_completion_tokens == 128
    assert limits([*multi, "rollout.max_episode_tokens=60"]).max_completion_tokens == 60


def test_remax_switches_on_the_generators_greedy_baseline():
    assert not load_config().rollout.greedy_baseline
    assert load_config(None, ["algo.advantage=remax"]).rollout.greedy_baseline


@pytest.mark.parametrize("recipe", ["demo_cpu.yaml", "grpo.yaml", "dapo.yaml", "gspo.yaml", "cispo.yaml", "sppo.yaml",
                                    "prime.yaml", "sppo_rm.yaml"])
def test_shipped_recipes_load(recipe):
    cfg = load_config(recipe)
    assert cfg.demo.task == "sort_digits"


def test_the_tool_demo_recipe_loads():
    cfg = load_config("tools_cpu.yaml")
    assert cfg.demo.task == "add_numbers" and cfg.tools.builtins == ["calculator"] and cfg.rollout.max_turns == 3


def test_config_names_match_the_algos_registries():
    from dataclasses import fields

    from asyncrl.algos import config
    from asyncrl.algos.advantages import ADVANTAGES
    from asyncrl.algos.corrections import CORRECTION_WEIGHTS
    from asyncrl.algos.kl import KL_ESTIMATORS
    from asyncrl.algos.losses import LOSS_AGGREGATIONS, POLICY_LOSSES
    from asyncrl.algos.registry import CORRECTIONS, LOSSES

    from asyncrl.algos.registry import PRM_ESTIMATORS

    # gae reads the critic, prime the implicit PRM
    assert set(config.ADVANTAGE_NAMES) == set(ADVANTAGES) | set(config.CRITIC_ADVANTAGES) | set(PRM_ESTIMATORS)
    assert config.LOSS_NAMES == tuple(LOSSES) and set(config.LOSS_NAMES) == set(POLICY_LOSSES)
    assert config.CORRECTION_NAMES == tuple(CORRECTIONS)
    assert set(CORRECTION_WEIGHTS) < set(config.CORRECTION_NAMES)
    assert set(config.KL_NAMES) == set(KL_ESTIMATORS)
    assert set(config.LOSS_AGG_NAMES) == set(LOSS_AGGREGATIONS)
    algo_fields = {f.name for f in fields(config.AlgoConfig)}
    for registry in (LOSSES, CORRECTIONS):  # every registry field is a field users can set
        for name, spec in registry.items():
            assert set(spec.fields) <= algo_fields, name


def test_publishing_less_often_than_eta_allows_is_refused_with_the_reason():
    assert load_config(None, ["weightsync.every_steps=3", "buffer.max_staleness=2"]).weightsync.every_steps == 3
    with pytest.raises(ConfigError, match="every_steps=3.*max_staleness=1.*wait for a batch forever"):
        load_config(None, ["weightsync.every_steps=3", "buffer.max_staleness=1"])
    with pytest.raises(ConfigError, match="weightsync.every_steps must be >= 1"):
        load_config(None, ["weightsync.every_steps=0"])


def test_an_admission_lead_must_lie_within_eta_and_bounds_publishing_as_eta_does():
    cfg = load_config(None, ["buffer.max_staleness=2", "buffer.admission_lead=1"])
    assert cfg.buffer.lead_steps == 1 and load_config(None, ["buffer.max_staleness=2"]).buffer.lead_steps == 2
    with pytest.raises(ConfigError, match=r"admission_lead must be in \[0, buffer.max_staleness=1\].*got 2"):
        load_config(None, ["buffer.max_staleness=1", "buffer.admission_lead=2"])
    with pytest.raises(ConfigError, match="every_steps=2 with buffer.admission_lead=0.*wait for a batch forever"):
        load_config(None, ["buffer.max_staleness=2", "buffer.admission_lead=0", "weightsync.every_steps=2"])


def test_a_generator_id_must_be_usable_as_a_file_and_metric_name():
    with pytest.raises(ConfigError, match="generator.generator_id.*'/'"):
        load_config(None, ["generator.generator_id=a/b"])
    with pytest.raises(ConfigError, match="generator.generator_id must be at most 1024 characters, got 1025"):
        load_config(None, ["generator.generator_id=" + "g" * 1025])  # the learner would refuse every group


def test_the_end_of_job_grace_is_one_buffer_setting():
    assert load_config(None, ["buffer.done_grace_s=3"]).buffer.done_grace_s == 3
    with pytest.raises(ConfigError, match="learner.done_grace_s"):
        load_config(None, ["learner.done_grace_s=3"])  # the old key: one setting bounds the whole handshake


def test_an_override_whose_value_is_not_yaml_is_a_config_error_naming_it():
    from asyncrl.configs import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"override 'data.train_files=\[a,\[b\]': its value is not valid YAML"):
        load_config(None, ["data.train_files=[a,[b]"])


def test_backend_knobs_load_under_their_backend():
    cfg = load_config(None, ["buffer.backend=redis", "buffer.redis.url=rediss://r.example:6380/1",
                             "buffer.redis.lease_s=5", "generator.engine=vllm", "generator.vllm.enforce_eager=true",
                             "generator.vllm.tensor_parallel_size=2"])
    assert cfg.buffer.redis.url == "rediss://r.example:6380/1" and cfg.buffer.redis.lease_s == 5
    assert cfg.generator.vllm.enforce_eager is True and cfg.generator.vllm.tensor_parallel_size == 2


@pytest.mark.parametrize("old, new, value, expected", [
    ("buffer.redis_url", "buffer.redis.url", "redis://h:1/0", "redis://h:1/0"),
    ("buffer.lease_s", "buffer.redis.lease_s", "7", 7.0),
    ("buffer.redis_namespace", "buffer.redis.namespace", "ns", "ns"),
    ("generator.gpu_memory_utilization", "generator.vllm.gpu_memory_utilization", "0.5", 0.5),
])
def test_an_old_flat_key_still_loads_with_a_warning_naming_its_new_key(tmp_path, old, new, value, expected):
    backends = ["buffer.backend=redis", "generator.engine=vllm"]
    with pytest.warns(FutureWarning, match=f"{old} is deprecated: it is now {new}"):
        from_override = load_config(None, [*backends, f"{old}={value}"])
    section, key = old.split(".")
    lines = {"buffer": ["  backend: redis"], "generator": ["  engine: vllm"]}
    lines[section].append(f"  {key}: {value}")
    recipe = tmp_path / "old.yaml"
    recipe.write_text("".join(f"{name}:\n" + "\n".join(body) + "\n" for name, body in lines.items()))
    with pytest.warns(FutureWarning, match=f"{old} is deprecated: it is now {new}"):
        from_recipe = load_config(str(recipe))
    for cfg in (from_override, from_recipe):
        node = cfg
        for part in new.split("."):
            node = getattr(node, part)
        assert node == expected


@pytest.mark.parametrize("old, new, value", [("learner.publish_bucket_mb", "learner.gather_bucket_mb", 32.0),
                                             ("weightsync.catchup_host", "weightsync.host", "0.0.0.0"),
                                             ("weightsync.catchup_advertise", "weightsync.advertise", "node-a")])
def test_a_renamed_key_still_loads_with_a_warning_naming_its_new_name(old, new, value):
    with pytest.warns(FutureWarning, match=f"{old} is deprecated: it is now {new}"):
        cfg = load_config(None, [f"{old}={value}"])
    section, key = new.split(".")
    assert getattr(getattr(cfg, section), key) == value


def test_a_recipe_setting_a_key_under_its_old_and_new_name_is_refused(tmp_path):
    recipe = tmp_path / "both.yaml"
    recipe.write_text("weightsync:\n  catchup_host: 0.0.0.0\n  host: 10.0.0.1\n")
    with pytest.warns(FutureWarning), pytest.raises(ConfigError, match="weightsync.catchup_host and weightsync.host"):
        load_config(str(recipe))


@pytest.mark.parametrize("overrides, named", [
    (["generator.engine=hf", "generator.vllm.enforce_eager=true"],
     "generator.vllm.enforce_eager is only read by generator.engine=vllm"),
    (["generator.engine=sglang", "generator.tensor_parallel_size=2"],
     "generator.vllm.tensor_parallel_size is only read by generator.engine=vllm"),
    (["buffer.backend=zmq", "buffer.redis.lease_s=5"], "buffer.redis.lease_s is only read by buffer.backend=redis"),
    (["buffer.backend=zmq", "buffer.redis_url=redis://h:1/0"],
     "buffer.redis.url is only read by buffer.backend=redis"),
])
@pytest.mark.filterwarnings("ignore::FutureWarning")  # the old flat keys among them warn as well
def test_another_backends_knob_is_an_error_naming_it(overrides, named):
    with pytest.raises(ConfigError, match=named):
        load_config(None, overrides)


def test_a_backend_knob_left_at_its_default_is_not_an_error():
    assert load_config(None, ["generator.engine=hf", "generator.vllm.enable_prefix_caching=true"]).generator.engine == "hf"

