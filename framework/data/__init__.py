"""Training data: the Streaming data module over precomputed latents (datamodule) and the shard dataset whose
failures are raised (shards). Imports models (conditioning inputs) and data_prep.
"""
