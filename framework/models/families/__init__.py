"""The backbone families, one file each, and their registry: `FAMILIES[name]`, `family_of(cfg)`.

Each family file defines one `Family` (framework/models/families/base.py) as FAMILY; adding a family is that file, a
line below, a preset in conf/model/ and a row in the family-parametrised tests (docs/adding-a-family.md).
"""

from __future__ import annotations

from typing import Any, Callable

from framework.models.families import dit, latte, pixart, sana, unet, wan
from framework.models.families.base import Family
from framework.models.plans import ParallelPlan

# In this order in messages that list families (pixart, dit, sana, ...).
FAMILIES: dict[str, Family] = {m.FAMILY.name: m.FAMILY for m in (pixart, dit, sana, unet, latte, wan)}


def family_of(cfg: Any) -> Family:
    """The family of a model config (anything with `.family`) or of a family name; one clear error for an unknown one."""
    name = cfg if isinstance(cfg, str) else cfg.family
    if name not in FAMILIES:
        raise ValueError(f"model.family={name!r} is unknown; choose one of {sorted(FAMILIES)}.")
    return FAMILIES[name]


def names_with(feature: Callable[[Family], object]) -> list[str]:
    """The names of the families that have `feature`, in registry order."""
    return [name for name, fam in FAMILIES.items() if feature(fam)]


def plan_of(family: str) -> ParallelPlan:
    """The parallel plan of a family (framework/models/plans.py); an unknown one refused as family_of refuses it."""
    return family_of(family).plan


def families_with(feature: Callable[[ParallelPlan], object]) -> str:
    """'pixart, dit and sana': the families whose plan has `feature` (for messages)."""
    names = names_with(lambda fam: feature(fam.plan))
    return ", ".join(names[:-1]) + f" and {names[-1]}" if len(names) > 1 else "".join(names)


__all__ = ["FAMILIES", "Family", "families_with", "family_of", "names_with", "plan_of"]
