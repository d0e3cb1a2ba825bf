"""Backbones and what they compute: the diffusers backbones behind one Denoiser interface (backbones), a
uniform view of their blocks and residual branches (blocks), the noise objectives and samplers (objectives),
text conditioning inputs (conditioning) and FLOP counts (flops). Imports nothing else of the framework.
"""
