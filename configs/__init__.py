"""Configuration: one `RunConfig` made of the per-part configs, `load_config`, and the shipped YAML recipes."""
from asyncrl.configs.run_config import (  # noqa: F401
    ConfigError,
    RunConfig,
    describe_difference,
    flatten,
    shared_hash,
    shared_sections,
    training_eval_blocker,
    to_dict,
    to_yaml,
)
from asyncrl.configs.recipes import load_config, recipe_path  # noqa: F401
