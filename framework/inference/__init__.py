"""Prompts to images, without Lightning: the checkpoint format as read by every command (checkpoint), the
sampling pipeline (pipeline), cached sampling (caching), decoupled denoise/decode ranks (decoupled) and
best-of-N selection (bestof). Never imports training.
"""
