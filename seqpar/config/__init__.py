"""Run configuration in one place: the typed run schema (``schema``), the strict YAML/override
loader (``loader``) and the configs shipped with the package (``shipped``).

``GPTConfig``, the model's own section, lives with the model in :mod:`seqpar.model.config`.
"""
from .loader import (
    ConfigError,
    dump_yaml,
    from_dict,
    load,
    load_sections,
    merge,
    parse_overrides,
    read_yaml,
    to_dict,
    yaml_load,
)
from .schema import CheckpointConfig, DataConfig, ParallelConfig, RunConfig, TrainConfig, dump, load_run_config
from .shipped import resolve_config, shipped_configs, shipped_dir

__all__ = [
    "RunConfig", "ParallelConfig", "DataConfig", "TrainConfig", "CheckpointConfig", "load_run_config", "dump",
    "ConfigError", "from_dict", "to_dict", "load", "load_sections", "merge", "parse_overrides", "dump_yaml",
    "read_yaml", "yaml_load", "resolve_config", "shipped_configs", "shipped_dir",
]
