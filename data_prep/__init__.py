"""Encode image-caption sources once into MDS latent shards (`python -m data_prep.precompute`)."""
