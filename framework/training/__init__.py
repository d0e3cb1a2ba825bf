"""The training loop's pieces: the LightningModule (module), optimizer and schedule (optim), checkpoint
writing, resume and preemption (checkpointing), loggers, the plugin registry and hooks (registry) and the
callbacks that sample grids (callbacks). Imports everything below it; plugins import it.
"""
