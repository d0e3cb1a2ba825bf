"""LatentForge's training framework: the commands (train, sample, eval, export, bench) and what they are built of."""

import data_prep  # noqa: F401  (its import quiets torchao's import-time warnings for every command)
