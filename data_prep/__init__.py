"""Encode image-caption sources once into MDS latent shards (`python -m data_prep.precompute`)."""

import logging

# torchao is installed for adapter.base_dtype=int8|fp8. diffusers (0.39) then imports it with every model and warns
# that it cannot find torchao's tensor classes of before 0.18 (for checkpoints serialized with them, which nothing here
# reads), and torch warns about how torchao registers its enums: one line each in every command's output, about
# nothing a run does. Set here, the lowest layer, which framework/__init__.py imports: every command gets it.
logging.getLogger("diffusers.quantizers.torchao.torchao_quantizer").setLevel(logging.ERROR)
logging.getLogger("torch.utils._pytree").addFilter(lambda record: "register_constant()" not in record.getMessage())
