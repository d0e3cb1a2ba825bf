"""Released weights: what a diffusers folder's config.json says about the model, as ModelConfig fields.

`init_from=` a diffusers folder (a backbone saved with `save_pretrained`, or a whole pipeline whose transformer/ or
unet/ holds it) loads the weights of the model its config.json describes. framework/preflight.py sets the model
config from it before anything is built, and refuses a user's key that says otherwise.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

from framework.models.backbones import _backbone_subfolder
from framework.models.families import family_of

def config_file(path: str | Path, family: str) -> Path | None:
    """The config.json of the backbone in a diffusers folder (or a pipeline's transformer/ / unet/); None when
    `path` is a weights file rather than a folder."""
    path = Path(path).expanduser()
    if not path.is_dir():
        return None
    sub = _backbone_subfolder(path, family)
    file = (path / sub if sub else path) / "config.json"
    if not file.is_file():
        raise FileNotFoundError(f"init_from={path} is a folder without {file.relative_to(path)}: expected a diffusers "
                                "model folder (save_pretrained) or a pipeline folder with model_index.json")
    return file


def model_fields(config: dict[str, Any], family: str, file: Path) -> dict[str, Any]:
    """The ModelConfig fields a diffusers config.json of `family` fixes: the architecture (sizes, the text width, the
    learned variance, the class count, the size conditioning) and, as `kwargs`, every other constructor argument of
    the family's class that the file sets to something other than the constructor's default. The latent size is left
    to the dataset: every family here computes its positional embedding for the size it is given."""
    fam = family_of(family)
    cls = fam.diffusers_class
    kind = config.get("_class_name")
    if kind is not None and kind != cls.__name__:
        raise ValueError(f"init_from: {file} describes a {kind}, but model.family={family} builds a {cls.__name__}: "
                         f"choose the model= preset of that family")
    params = inspect.signature(cls.__init__).parameters
    given = {k: v for k, v in config.items() if k in params}
    value = {k: given.get(k, params[k].default) for k in params if k != "self"}
    in_channels = value["in_channels"]
    out = value["out_channels"] or in_channels
    fields: dict[str, Any] = {"in_channels": in_channels, "learned_sigma": out == 2 * in_channels}
    fields.update(fam.released_fields(value))  # the architecture, as the family's arguments spell it
    own = set(fam.derived) | fam.released_own
    fields["kwargs"] = {k: v for k, v in given.items() if k not in own and v != constructor_default(family, k)}
    return fields


def constructor_default(family: str, key: str) -> Any:
    """The default of argument `key` of the family's diffusers class (what a config without it builds)."""
    default = inspect.signature(family_of(family).diffusers_class.__init__).parameters[key].default
    return list(default) if isinstance(default, tuple) else default


def read_model_fields(path: str | Path, family: str) -> tuple[Path, dict[str, Any]] | None:
    """(config.json, model_fields of it) for a diffusers folder; None for a weights file (.ckpt, .safetensors)."""
    file = config_file(path, family)
    if file is None:
        return None
    return file, model_fields(json.loads(file.read_text()), family, file)
