"""Typed configs: strict YAML loading (loader.py), the topology schema (schema.py), presets."""

from hybridflow.config.loader import apply_overrides, config_hash, from_dict, load_yaml, to_dict

__all__ = ["apply_overrides", "config_hash", "from_dict", "load_yaml", "to_dict"]
