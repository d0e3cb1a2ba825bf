"""Where plugins plug in. Plugins import this module and register themselves; the framework never
imports a plugin by name (train.py imports the `plugins` package once, which runs the registrations).

A plugin is a typed config dataclass plus a builder that turns it into a Lightning callback. Model
surgery belongs in the callback's `setup()` hook: Lightning calls it before `configure_model`
(sharding) and before `configure_optimizers`, the one moment a swap is safe.

A callback can also provide a hook the framework calls: a `WeightAverager` (below) offers averaged
weights, which sample grids and the end-of-training evaluation then use; a `TrainingLoss` replaces the
denoising loss of the training step (a distillation stage such as plugins/cache_router.py); `ParamGroups`
splits the trainable parameters into groups with their own lr scale and warm-up (the new blocks of a grown
model, plugins/growth).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Protocol, runtime_checkable

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


def logging_step(trainer: pl.Trainer, stepped: bool = False) -> bool:
    """Whether this training step's values are logged, by Lightning's rule from public trainer state: the optimizer
    step numbered n from 1 is logged when n is a multiple of trainer.log_every_n_steps, and any step once the trainer
    is stopping. Every micro-batch of an accumulated step shares its number, trainer.global_step + 1 until the step
    is taken; after it (on_train_batch_end of a batch that stepped) pass stepped=True, the number then being
    trainer.global_step (tests/test_train.py checks this against Lightning's own private flag at every hook)."""
    every = trainer.log_every_n_steps
    if not every:
        return False
    return (trainer.global_step + (0 if stepped else 1)) % every == 0 or trainer.should_stop


def register_plugin(name: str, config: type, build: Callable[[Any, Any], pl.Callback]) -> None:
    PLUGINS[name] = Plugin(name, config, build)


def typed_fields(kind: type, given: Any, where: str) -> Any:
    """The user's fields `given` (a Hydra node, a dict or None) over dataclass `kind`'s defaults, as a `kind`: a
    misspelled field, a wrong type or a failed __post_init__ check raises ValueError naming `where` (the config key
    the fields came from). Plugins' and optimizers' own settings are read through it."""
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(kind), given or {}))
    except Exception as e:  # OmegaConf wraps the error; show the user only its message
        raise ValueError(f"{where}: {e.__cause__ or e}") from None


def plugin_config(name: str, fields: Any) -> Any:
    """Plugin `name`'s typed config from its `plugins.<name>` fields: a misspelled field, a wrong type or a failed
    __post_init__ check raises, naming the plugin."""
    if name not in PLUGINS:
        raise ValueError(f"plugins=[{name}] is unknown; available plugins: {sorted(PLUGINS)}")
    return typed_fields(PLUGINS[name].config, fields, f"plugins.{name}")


def build_plugin_callbacks(plugins: dict[str, Any], run_cfg: Any) -> list[pl.Callback]:
    """Validate each selected plugin's fields against its dataclass and build its callback."""
    return [PLUGINS[name].build(plugin_config(name, fields), run_cfg) for name, fields in plugins.items()]


# --------------------------------------------------------------------------------------------
# Hooks a plugin callback may provide
# --------------------------------------------------------------------------------------------


@runtime_checkable
class WeightAverager(Protocol):
    """A callback that keeps an average of the weights (plugins/ema.py): sample grids, the end-of-training
    evaluation and the checkpoint's default weights use the average instead of the training weights.

    `averaged_weights(pl_module)` is a context manager: inside it `pl_module.model` holds the averaged
    weights, and on exit exactly the training weights again (bit for bit; training continues from them).
    Before an average exists (e.g. before its start step) it changes nothing. Under fsdp every rank
    enters it, each swapping its own shards.
    """

    def averaged_weights(self, pl_module: pl.LightningModule) -> AbstractContextManager[None]: ...


def averaged_weights(trainer: pl.Trainer, pl_module: pl.LightningModule) -> AbstractContextManager[None]:
    """The averaged weights of the run's WeightAverager callback in `pl_module` for a `with` block; the
    training weights (nothing to do) when no plugin averages them."""
    found = _the_one(trainer, WeightAverager, "keep averaged weights")
    return found.averaged_weights(pl_module) if found is not None else nullcontext()


@runtime_checkable
class TrainingLoss(Protocol):
    """A callback that computes the training step's loss in place of the denoising loss.

    DiffusionModule.training_step still draws the step's noise and caption / label dropout (seeded, the
    same on any number of ranks) and handles non-finite losses, logging and the optimizer; the hook gets
    this rank's batch with dropout applied. The optimizer trains every parameter of the LightningModule
    that requires grad, so a stage that trains only its own module freezes the backbone in setup().
    """

    def training_loss(self, pl_module: pl.LightningModule, x0: Any, noise: Any, text: Any, text_mask: Any,
                      labels: Any) -> Any: ...


def _the_one(trainer: pl.Trainer, hook: type, does: str) -> Any:
    """The run's one callback providing `hook`, or None; two of them are refused (they would compete)."""
    found = [cb for cb in trainer.callbacks if isinstance(cb, hook)]
    if len(found) > 1:
        names = ", ".join(type(cb).__name__ for cb in found)
        raise ValueError(f"plugins: {names} each {does}; select one of them")
    return found[0] if found else None


def training_loss_hook(trainer: pl.Trainer) -> TrainingLoss | None:
    """The run's TrainingLoss callback, or None for the ordinary denoising loss."""
    return _the_one(trainer, TrainingLoss, "replace the training loss")


@runtime_checkable
class ParamGroups(Protocol):
    """A callback that splits the optimizer's parameters into groups: `param_groups(pl_module, params)` returns
    dicts with "params" (together exactly `params`), and optionally "lr_scale" (times optimizer.lr and its
    schedule) and "warmup_steps" (the group's own linear ramp from its first step)."""

    def param_groups(self, pl_module: pl.LightningModule, params: list[Any]) -> list[dict[str, Any]]: ...


def param_groups_hook(trainer: pl.Trainer) -> ParamGroups | None:
    """The run's ParamGroups callback, or None for one group."""
    return _the_one(trainer, ParamGroups, "split the optimizer's parameters")
