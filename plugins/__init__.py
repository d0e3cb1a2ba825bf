"""LatentForge plugins. Importing this package registers every plugin and plugin optimizer with the
framework (framework/registry.py, framework/optim.py); one plugin per module."""

from plugins import cache_router, came, ema, growth, low_precision_norm  # noqa: E402,F401
