"""`python -m framework.studies STUDY key=value ...`: what a method buys, measured over training runs.

Studies (one file each, framework/studies/<name>.py):
  cache_curve    quality (fd, accuracy, paired error to the full sampler, bootstrap intervals) against measured speed:
                 routers trained per sparsity and read at several thresholds, uniform:K, fewer steps; cache_curve.png
  buckets        aspect-ratio buckets against square crops on synthetic mixed-aspect scenes: whether the blocks a
                 held-out caption names near the edges are drawn (framework/evaluation/shapes.py); buckets.png
  growth         does growing (plugins=[growth]) pay at equal training compute: small, control, grown per init and
                 scratch arms over several seeds; growth.png and growth.json with paired intervals
  growth_report  three finished runs (small, grown, scratch) on one step axis; growth.png and growth.json
  optimizers     loss curves and final quality of several optimizers (AdamW, CAME, CAME-8bit) over seeds on one recipe,
                 with their state bytes per parameter; optimizers.png and optimizers.json with paired intervals
cache_curve and buckets print a table and write one JSON row per variant to `out`; growth, growth_report and
optimizers write their report into `out`.
"""

from __future__ import annotations

from typing import Any, Callable

from framework.cli import named_command
from framework.studies import buckets, cache_curve, growth, growth_report, optimizers

# name -> (the study's config dataclass, run(cfg) -> JSON rows, or None when it writes its own report)
STUDIES: dict[str, tuple[type, Callable[[Any], Any]]] = {
    "cache_curve": (cache_curve.CacheCurveStudy, cache_curve.run),
    "buckets": (buckets.BucketsStudy, buckets.run),
    "growth": (growth.GrowthStudy, growth.run),
    "growth_report": (growth_report.GrowthReport, growth_report.run),
    "optimizers": (optimizers.OptimizersStudy, optimizers.run),
}


def main() -> None:
    named_command("framework.studies", STUDIES, "STUDY")


if __name__ == "__main__":
    main()
