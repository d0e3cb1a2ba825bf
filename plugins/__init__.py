"""LatentForge plugins. Importing this package registers every plugin and plugin optimizer with the
framework (framework/training/registry.py, framework/training/optim.py); one plugin per module."""

from plugins import cache_router, came, ema, growth, low_precision_norm  # noqa: E402,F401
