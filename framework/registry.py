"""Where plugins plug in. Plugins import this module and register themselves; the framework never
imports a plugin by name (train.py imports the `plugins` package once, which runs the registrations).

A plugin is a typed config dataclass plus a builder that turns it into a Lightning callback. Model
surgery belongs in the callback's `setup()` hook: Lightning calls it before `configure_model`
(sharding) and before `configure_optimizers`, the one moment a swap is safe.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import lightning.pytorch as pl
from omegaconf import OmegaConf


@dataclass
class Plugin:
    name: str
    config: type
    """The plugin's config dataclass (its fields are `plugins.<name>.*`)."""
    build: Callable[[Any, Any], pl.Callback]
    """build(plugin_config, run_config) -> callback."""


PLUGINS: dict[str, Plugin] = {}


def register_plugin(name: str, config: type, build: Callable[[Any, Any], pl.Callback]) -> None:
    PLUGINS[name] = Plugin(name, config, build)


def build_plugin_callbacks(plugins: dict[str, Any], run_cfg: Any) -> list[pl.Callback]:
    """Validate each selected plugin's fields against its dataclass and build its callback."""
    out = []
    for name, fields in plugins.items():
        if name not in PLUGINS:
            raise ValueError(f"plugins=[{name}] is unknown; available plugins: {sorted(PLUGINS)}")
        p = PLUGINS[name]
        try:
            merged = OmegaConf.merge(OmegaConf.structured(p.config), fields or {})
            cfg = OmegaConf.to_object(merged)
        except Exception as e:  # a misspelled field or a failed __post_init__ check
            raise ValueError(f"plugins.{name}: {e.__cause__ or e}") from None
        out.append(p.build(cfg, run_cfg))
    return out
