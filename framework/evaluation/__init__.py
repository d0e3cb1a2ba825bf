"""Judging what was generated: the built-in prompt sets (prompts), classifiers and Frechet distance (metrics),
the judges (judge), a prompt set generated and scored (scoring), own-data fid / clip_score (realdata) and
the evaluation settings (settings). Imports inference and below.
"""
