"""Studies: `python -m framework.studies STUDY key=value ...` (the command is __main__.py).

A study answers whether a method pays, over real training runs, with intervals: the cache router's quality against
measured speed (cache_curve), aspect-ratio buckets against square crops (buckets), growing a model against training
it from scratch at equal compute (growth, growth_report). Benchmarks (framework/bench/) time one thing; studies train
and evaluate. The two never import each other (tests/test_layers.py); both are commands and may use plugins.
"""
