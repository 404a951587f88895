"""Typed configs: strict YAML loading (loader.py), the topology schema (schema.py), presets,
and the one `"package.module:attr"` loader (imports.py)."""

from hybridflow.config.imports import load_attr, split_spec
from hybridflow.config.loader import apply_overrides, config_hash, from_dict, load_yaml, to_dict
from hybridflow.config.schema import (
    DataConfig,
    LivenessConfig,
    MetricsConfig,
    OpConfig,
    RoleConfig,
    RunConfig,
    StageConfig,
    Topology,
    TransportConfig,
    load_topology,
    preset_names,
)

__all__ = [
    "DataConfig",
    "LivenessConfig",
    "MetricsConfig",
    "OpConfig",
    "RoleConfig",
    "RunConfig",
    "StageConfig",
    "Topology",
    "TransportConfig",
    "apply_overrides",
    "config_hash",
    "from_dict",
    "load_attr",
    "load_topology",
    "load_yaml",
    "preset_names",
    "split_spec",
    "to_dict",
]
