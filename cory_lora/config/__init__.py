"""Recipes: the schema (sections.py, pydantic), the checks between keys (checks.py), reading
and writing them (load.py). `from cory_lora.config import Recipe, load_recipe` is the API."""

from cory_lora.config.checks import template_fields
from cory_lora.config.docs import describe_keys
from cory_lora.config.load import load_recipe, recipe_from_dict, recipe_toml, toml_value
from cory_lora.config.sections import (
    DATA_FILE_BUILDERS,
    DATA_FILE_SUFFIXES,
    PER_AGENT,
    REQUIRED,
    SECTIONS,
    AgentOverride,
    CoryConfig,
    DataConfig,
    GenerationConfig,
    LogConfig,
    LoraConfig,
    ModelConfig,
    PPOConfig,
    Recipe,
    ResetConfig,
    RewardConfig,
    TrainConfig,
    greedy,
    to_dict,
)
from cory_lora.errors import ConfigError

__all__ = [
    "DATA_FILE_BUILDERS",
    "DATA_FILE_SUFFIXES",
    "PER_AGENT",
    "REQUIRED",
    "SECTIONS",
    "AgentOverride",
    "ConfigError",
    "CoryConfig",
    "DataConfig",
    "GenerationConfig",
    "LogConfig",
    "LoraConfig",
    "ModelConfig",
    "PPOConfig",
    "Recipe",
    "ResetConfig",
    "RewardConfig",
    "TrainConfig",
    "describe_keys",
    "greedy",
    "load_recipe",
    "recipe_from_dict",
    "recipe_toml",
    "template_fields",
    "to_dict",
    "toml_value",
]
