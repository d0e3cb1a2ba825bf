"""Benchmarks: `python -m framework.bench SUITE key=value ...` (the command is __main__.py).

They measure; tests assert behaviour. `harness.py` holds what every suite shares and depends on the
core only; each `suite_<name>.py` holds one suite: its config dataclass and `run(cfg) -> rows`.
"""
