"""The GPU tier: `pytest -m gpu` runs every GPU code path (bf16-mixed at real size, FSDP2's bf16 parameter gather
over NCCL, TF32, fused AdamW, pinned memory, torch.compile on CUDA, xformers, 16-mixed with the grad scaler,
precompute on a GPU, sampling and evaluation on the rank's GPU, low-precision norms).

On a machine without a CUDA device every `gpu` test skips with the one reason NO_GPU (pytest folds them into one
summary line). The `*_on_the_cpu` tests beside them run the same helpers on the CPU where that means something
(debug presets, the CPU optimizer path), so the tier's code is exercised in CI too. On a GPU machine run the tier
and the GPU bench together with `bash launch/gpu_check.sh` (docs/performance.md).
"""

from __future__ import annotations

import gc
import math
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from tests.helpers import make_image_folder, make_tiny_text_encoder, make_tiny_vae

NO_GPU = "no CUDA device: the GPU tier runs on a GPU machine (bash launch/gpu_check.sh)"

# Real-size presets: micro-batch and the bound their bf16-mixed AdamW step must peak under (GiB). Until the first
# GPU run the bounds are estimates: 16 bytes per parameter (fp32 weights, gradients, two AdamW moments) plus bf16
# activations at that batch, with room to spare; launch/gpu_check.sh prints the measured peaks to tighten them.
REAL_SIZE = {
    "pixart_xl_2_256": (8, 20.0),   # 611M parameters: 9.1 GiB of state
    "sana_1600m_1024": (2, 48.0),   # 1.6B: 24 GiB of state, 32x32 latents (DC-AE) = 1024 tokens
    "dit_xl_2_256": (8, 20.0),      # 675M: 10.1 GiB of state
    "sd2_base": (4, 32.0),          # 865M: 12.9 GiB of state, 64x64 latents
    # 1.42B: 21.1 GiB of state; 21 x 60 x 104 latents = 32,760 tokens a clip, trained with activation checkpointing
    # (each block's input kept, 0.1 GiB in bf16, and one block's recomputed activations at a time)
    "wan21_t2v_1_3b": (1, 40.0),
}
ACT_CKPT = {"wan21_t2v_1_3b"}  # presets whose step runs with activation checkpointing, as they train
DEBUG_OF = {"pixart_xl_2_256": "pixart_debug", "sana_1600m_1024": "sana_debug", "dit_xl_2_256": "dit_debug",
            "sd2_base": "sd2_unet_debug", "wan21_t2v_1_3b": "wan_debug"}
# Words of the digits captions and prompts, for a tokenizer made here (the tier needs no MiniLM package).
VOCAB = ("a an the of digit number handwritten written drawn picture image photo showing shows with in hand small "
         "big one two three four five six seven eight nine zero 0 1 2 3 4 5 6 7 8 9").split()


@pytest.fixture
def cuda() -> torch.device:
    """The GPU, its memory freed and its peak counter reset; skips (NO_GPU) without one."""
    if not torch.cuda.is_available():
        pytest.skip(NO_GPU)
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    yield torch.device("cuda", 0)
    import torch.distributed as dist

    if dist.is_initialized():  # an in-process strategy=fsdp run leaves its process group
        dist.destroy_process_group()
    gc.collect()
    torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def tier_text_encoder(tmp_path_factory) -> Path:
    return make_tiny_text_encoder(tmp_path_factory.mktemp("tier_text"), vocab=VOCAB)


@pytest.fixture(scope="module")
def tier_shards(tmp_path_factory, tier_text_encoder) -> Path:
    """The digits training set at 8x8 (pixel codec) captioned by a tiny text encoder with its own vocabulary."""
    from data_prep.precompute import precompute
    from tests.helpers import digits_config

    out = tmp_path_factory.mktemp("tier_digits") / "data"
    return precompute(digits_config(out, text_encoder=str(tier_text_encoder), device="cpu"), rank=0, world_size=1)


# --------------------------------------------------------------------------------------------------
# One bf16-mixed training step per family at its real size
# --------------------------------------------------------------------------------------------------


class StepProbe(pl.Callback):
    """Each step's loss, the dtype the first attention's query projection computes in, and whether its weight
    changed."""

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.losses: list[float] = []
        self.compute_dtypes: set[torch.dtype] = set()
        linear = next(m for n, m in pl_module.model.named_modules() if n.endswith("to_q"))
        linear.register_forward_hook(lambda mod, args, out: self.compute_dtypes.add(out.dtype))
        self.model, self.watched = pl_module.model, linear.weight
        self.first = linear.weight.detach().cpu().clone()  # Lightning moves the module to the CPU after fit

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.losses.append(float(outputs["loss"]))

    def changed(self) -> bool:
        return not torch.equal(self.watched.detach().cpu(), self.first)


def bf16_steps(preset: str, batch_size: int, device: torch.device, steps: int = 2,
               act_ckpt: bool = False) -> tuple[StepProbe, int]:
    """`steps` bf16-mixed steps of the real training module (AdamW) on synthetic batches, its blocks checkpointed
    with `act_ckpt`; the probe and the peak memory (GPU memory on a GPU, the process's peak resident memory on a
    CPU)."""
    from framework.bench.harness import bench_module, peak_memory_bytes, synthetic_batches, timed_fit
    from framework.distributed.fsdp import prepare_blocks
    from framework.models.backbones import load_preset

    mcfg = load_preset(preset)
    torch.manual_seed(0)
    with torch.device(device):
        module = bench_module(mcfg)
    prepare_blocks(module.model, activation_checkpointing=act_ckpt, compile=False)
    module.flops_per_batch = 0  # no FLOP-counting pass before the first step: the steps alone
    probe = StepProbe()
    text_len = min(77, mcfg.text_len or 77)  # at most a wan model's own caption length
    timed_fit(module, synthetic_batches(mcfg, steps * batch_size, text_len=text_len), batch_size=batch_size, warmup=0,
              steps=steps, device=device, precision="bf16-mixed", callbacks=[probe])
    return probe, peak_memory_bytes(device)


def _check_steps(probe: StepProbe) -> None:
    assert len(probe.losses) == 2 and all(math.isfinite(x) for x in probe.losses), probe.losses
    assert probe.compute_dtypes == {torch.bfloat16}, probe.compute_dtypes
    assert probe.changed(), "the optimizer step left the weights unchanged"


@pytest.mark.gpu
@pytest.mark.parametrize("preset", list(REAL_SIZE))
def test_a_bf16_step_at_real_size_fits_its_recorded_memory_bound(cuda, preset):
    batch, bound_gib = REAL_SIZE[preset]
    probe, peak = bf16_steps(preset, batch, cuda, act_ckpt=preset in ACT_CKPT)
    _check_steps(probe)
    print(f"{preset}: batch {batch}, peak {peak / 2**30:.2f} GiB (bound {bound_gib} GiB)")
    assert peak < bound_gib * 2**30, f"{preset}: peak {peak / 2**30:.2f} GiB over the recorded {bound_gib} GiB"


@pytest.mark.parametrize("preset", list(DEBUG_OF))
def test_a_bf16_step_per_family_on_the_cpu(preset):
    """The same helper with each family's debug preset under CPU bf16 autocast."""
    probe, _ = bf16_steps(DEBUG_OF[preset], 2, torch.device("cpu"), act_ckpt=preset in ACT_CKPT)
    _check_steps(probe)


# --------------------------------------------------------------------------------------------------
# framework.train on one GPU: FSDP2's bf16 parameter gather over NCCL, TF32, fused AdamW, pinned memory
# --------------------------------------------------------------------------------------------------


class TrainProbe(pl.Callback):
    """What framework.train set up on the GPU: the process group's backend, the float32 matmul precision, the data
    loader's pinning, the optimizer's fused kernel, the dtype the layers compute with and the masters' dtypes."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        import torch.distributed as dist

        self.backend = dist.get_backend() if dist.is_initialized() else None
        self.matmul_precision = torch.get_float32_matmul_precision()
        self.pin_memory = trainer.train_dataloader.pin_memory
        self.fused = trainer.optimizers[0].defaults.get("fused")
        self.forward_dtypes: set[torch.dtype] = set()
        # FSDP2 swaps the gathered parameters in for forward: the weight seen there is what the layer computes with.
        linear = next(m for m in pl_module.model.modules() if isinstance(m, torch.nn.Linear))
        linear.register_forward_hook(lambda mod, *_: self.forward_dtypes.add(mod.weight.dtype))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.master_dtypes = {p.dtype for p in pl_module.model.parameters()}


def _train_with(callback: pl.Callback, monkeypatch, overrides: list[str]) -> dict:
    from framework.train import train
    from tests.helpers import with_callback, compose_cfg

    with_callback(monkeypatch, callback)
    return train(compose_cfg(overrides))


def _gpu_run(tmp_path: Path, shards: Path, *extra: str, steps: int = 3, run: str = "run") -> list[str]:
    from tests.helpers import cheap

    return cheap(tmp_path, shards, "trainer.accelerator=gpu", "trainer.devices=1", *extra, steps=steps, run=run)


@pytest.mark.gpu
def test_fsdp_on_one_gpu_gathers_bf16_parameters_over_nccl(cuda, tmp_path, tier_shards, monkeypatch):
    """The CPU counterpart (two gloo ranks) is tests/test_distributed.py::test_fsdp_bf16_mixed_computes_with_bf16_
    parameters_and_keeps_fp32_masters."""
    probe = TrainProbe()
    _train_with(probe, monkeypatch, _gpu_run(tmp_path, tier_shards, "strategy=fsdp", "trainer.precision=bf16-mixed"))
    assert probe.backend == "nccl"
    assert probe.forward_dtypes == {torch.bfloat16} and probe.master_dtypes == {torch.float32}
    assert probe.matmul_precision == "high"  # TF32 for the fp32 matmuls left outside autocast
    assert probe.pin_memory and probe.fused


@pytest.mark.gpu
def test_compiled_blocks_on_cuda_follow_the_eager_losses(cuda, tmp_path, tier_shards, monkeypatch):
    """The CPU counterpart is tests/test_train.py::test_compiled_blocks_run_compiled_and_follow_the_eager_losses."""
    from tests.helpers import CompiledBlocks
    from tests.helpers import with_callback, losses

    eager = _train_with(TrainProbe(), monkeypatch, _gpu_run(tmp_path, tier_shards, "trainer.precision=bf16-mixed", run="eager"))
    model_probe, blocks = StepProbe(), CompiledBlocks()
    with_callback(monkeypatch, blocks)
    compiled = _train_with(model_probe, monkeypatch, _gpu_run(tmp_path, tier_shards, "trainer.precision=bf16-mixed",
                                                              "strategy.compile=true", run="compiled"))
    assert all(blocks.compiled), blocks.compiled
    assert model_probe.compute_dtypes == {torch.bfloat16}
    le, lc = losses(Path(eager["run_dir"])), losses(Path(compiled["run_dir"]))
    assert sorted(le) == sorted(lc)
    # bf16 keeps 8 significant bits and Inductor fuses in another order: a few parts in a hundred over 3 steps.
    torch.testing.assert_close(torch.tensor(list(lc.values())), torch.tensor(list(le.values())), rtol=3e-2, atol=3e-2)


# --------------------------------------------------------------------------------------------------
# Attention backends, the optimizer kernel
# --------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["pixart_xl_2_256", "sd2_base"])
def test_xformers_and_sdpa_attention_agree(cuda, preset):
    """The same weights and inputs through SDPA and through xformers' memory-efficient kernel (two blocks of the
    real-size model, bf16): outputs within bf16 tolerance."""
    pytest.importorskip("xformers", reason="xformers is not installed (pip install -e .[xformers])")
    from framework.bench.harness import synthetic_batches
    from framework.models.backbones import apply_attention_backend, build_denoiser, load_preset, xformers_problem

    problem = xformers_problem()
    if problem is not None:  # a wheel built for another torch: the product refuses it (test_backbones), skip here
        pytest.skip(problem)

    small = {"num_layers": 2} if preset != "sd2_base" else {}
    mcfg = load_preset(preset, **small)
    torch.manual_seed(0)
    net = build_denoiser(mcfg).to(cuda, torch.bfloat16).eval()
    batch = next(iter(torch.utils.data.DataLoader(synthetic_batches(mcfg, 2, 77), batch_size=2)))
    x, text = batch["latents"].to(cuda, torch.bfloat16), batch["text_embeds"].to(cuda, torch.bfloat16)
    mask, t = batch["text_mask"].to(cuda), torch.tensor([250.0, 750.0], device=cuda)
    with torch.no_grad():
        ref = net(x, t, text, mask).float()
        apply_attention_backend(net.net, "xformers")
        got = net(x, t, text, mask).float()
    rel = (got - ref).norm() / ref.norm()
    assert rel < 1e-2, f"{preset}: xformers vs SDPA relative error {rel:.2e}"


def adamw_against_reference(device: torch.device) -> tuple[bool, float]:
    """framework.training.optim's AdamW on `device` against torch's single-tensor AdamW in float64 on the CPU, for
    three steps on the same gradients: whether it used the fused kernel, and the largest relative difference."""
    from framework.training.optim import OPTIMIZERS, OptimizerConfig

    cfg = OptimizerConfig(name="adamw", lr=1e-2, weight_decay=0.1)
    g = torch.Generator().manual_seed(0)
    shapes = [(64, 48), (48,), (3, 5, 7)]
    start = [torch.randn(s, generator=g) for s in shapes]
    grads = [[torch.randn(s, generator=g) for s in shapes] for _ in range(3)]
    params = [torch.nn.Parameter(p.to(device)) for p in start]
    ref = [torch.nn.Parameter(p.double()) for p in start]
    opt = OPTIMIZERS["adamw"](params, cfg)
    ref_opt = torch.optim.AdamW(ref, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay,
                                foreach=False)
    for step in grads:
        for p, r, gr in zip(params, ref, step):
            p.grad, r.grad = gr.to(device), gr.double()
        opt.step()
        ref_opt.step()
    err = max(float(((p.detach().cpu().double() - r.detach()).norm() / r.detach().norm())) for p, r in zip(params, ref))
    return bool(opt.defaults.get("fused")), err


@pytest.mark.gpu
def test_fused_adamw_follows_the_reference_step(cuda):
    fused, err = adamw_against_reference(cuda)
    assert fused, "AdamW on CUDA parameters did not use the fused kernel"
    assert err < 1e-5, err


def test_adamw_follows_the_reference_step_on_the_cpu():
    fused, err = adamw_against_reference(torch.device("cpu"))
    assert fused, "AdamW on CPU parameters did not use the fused kernel"
    assert err < 1e-6, err


def test_fused_adamw_only_for_parameters_on_one_kind_of_device_without_a_grad_scaler():
    """The fused kernel unscales inside its own step, after the norm check and clipping read the gradients (on an
    H200, Lightning refused to clip a 16-mixed run for it): runs with a grad scaler go without it."""
    from types import SimpleNamespace

    from framework.training.optim import fused_adamw

    on_gpu, on_cpu, on_meta = (SimpleNamespace(device=torch.device(d)) for d in ("cuda", "cpu", "meta"))
    assert fused_adamw([on_gpu, {"params": [on_gpu]}], grad_scaler=False)
    assert fused_adamw([on_cpu, {"params": [on_cpu]}], grad_scaler=False)
    assert not fused_adamw([on_gpu, {"params": [on_gpu]}], grad_scaler=True)
    assert not fused_adamw([on_gpu, on_cpu], grad_scaler=False)
    assert not fused_adamw([on_meta], grad_scaler=False)
    assert not fused_adamw([], grad_scaler=False)


# --------------------------------------------------------------------------------------------------
# 16-mixed: an overflow is skipped by the grad scaler and skip_nonfinite together
# --------------------------------------------------------------------------------------------------


class OverflowProbe(pl.Callback):
    """Puts an inf into one gradient of step `at` (after backward) and records, per step, whether the watched
    weight changed and the grad scaler's scale after the step."""

    def __init__(self, at: int) -> None:
        self.at, self.changed, self.scales, self.scales_before = at, [], [], []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.weight = next(p for p in pl_module.model.parameters() if p.ndim == 2)
        self.before = self.weight.detach().clone()
        self.scales_before.append(trainer.precision_plugin.scaler.get_scale())

    def on_after_backward(self, trainer, pl_module) -> None:
        if trainer.global_step == self.at:
            self.weight.grad.view(-1)[0] = float("inf")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.changed.append(not torch.equal(self.weight.detach(), self.before))
        self.scales.append(trainer.precision_plugin.scaler.get_scale())


@pytest.mark.gpu
def test_16_mixed_skips_an_overflowing_step_under_skip_nonfinite(cuda, tmp_path, tier_shards, monkeypatch):
    probe = OverflowProbe(at=2)
    out = _train_with(probe, monkeypatch, _gpu_run(tmp_path, tier_shards, "trainer.precision=16-mixed",
                                                   "trainer.skip_nonfinite=true", steps=5))
    # A step changes the weights exactly when the scaler did not back off. Besides the planted inf, the scaler may
    # back off on its own at the start (its first scale, 2**16, can overflow fp16 gradients: seen on an H200).
    backed_off = [after < before for before, after in zip(probe.scales_before, probe.scales)]
    assert probe.changed == [not b for b in backed_off], (probe.changed, probe.scales_before, probe.scales)
    assert probe.changed[1] and not probe.changed[2] and probe.changed[3:] == [True, True], probe.changed
    assert probe.scales[2] == probe.scales_before[2] / 2, probe.scales  # the planted inf halved the scale
    ckpt = torch.load(out["checkpoint"], weights_only=True, map_location="cpu")
    assert ckpt["global_step"] == 5
    assert all(torch.isfinite(v).all() for v in ckpt["state_dict"].values() if v.is_floating_point())


# --------------------------------------------------------------------------------------------------
# Precompute with a GPU VAE; sampling and evaluation on the local rank's GPU
# --------------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_precompute_on_the_gpu_matches_the_cpu_encode(cuda, tmp_path, tier_text_encoder):
    from data_prep.precompute import precompute
    from tests.helpers import read_rows

    src, vae = make_image_folder(tmp_path / "images", n=8, size=32), make_tiny_vae(tmp_path / "vae")
    outs = {}
    for device in ("cpu", "cuda:0"):
        cfg = {"source": {"name": "folder", "path": str(src)}, "vae": str(vae), "text_encoder": str(tier_text_encoder),
               "resolution": 16, "out": str(tmp_path / device.replace(":", "")), "progress": False, "device": device,
               "dtype": "float32"}
        outs[device] = {r["key"]: r for r in read_rows(precompute(cfg, rank=0, world_size=1))}
    assert sorted(outs["cpu"]) == sorted(outs["cuda:0"]) and len(outs["cpu"]) == 8
    for key, row in outs["cpu"].items():
        for col in ("latents", "text_embeds"):
            a, b = torch.as_tensor(row[col]).float(), torch.as_tensor(outs["cuda:0"][key][col]).float()
            # stored as fp16 (relative step 1e-3); TF32 convolutions on the GPU add about as much
            assert (a - b).norm() / a.norm() < 5e-3, (key, col)


def sample_and_eval_devices(ckpt: str, out: Path, monkeypatch) -> list[str]:
    """framework.sample and framework.eval (device=auto) under a launcher's LOCAL_RANK=0: the devices the
    pipeline's denoiser was loaded onto, in order."""
    from framework.eval import EvalCommand
    from framework.eval import run as run_eval
    from framework.inference.pipeline import Pipeline
    from framework.sample import SampleCommand
    from framework.sample import run as run_sample

    seen: list[str] = []
    load = Pipeline.from_checkpoint_dict.__func__

    def spy(cls, *args, **kwargs):
        pipe = load(cls, *args, **kwargs)
        seen.append(str(next(pipe.model.parameters()).device))
        return pipe

    monkeypatch.setattr(Pipeline, "from_checkpoint_dict", classmethod(spy))
    monkeypatch.setenv("LOCAL_RANK", "0")
    paths = run_sample(SampleCommand(ckpt=ckpt, out=str(out / "s"), prompts=["a handwritten 3"], steps=2))
    assert paths and all(p.exists() for p in paths)
    run_eval(EvalCommand(ckpt=ckpt, out=str(out / "e"), seeds=1, phrasings=1, steps=2))
    assert (out / "e").is_dir() and any((out / "e").iterdir())
    return seen


@pytest.mark.gpu
def test_sampling_and_evaluation_run_on_the_local_ranks_gpu(cuda, tmp_path, tier_shards, monkeypatch):
    out = _train_with(TrainProbe(), monkeypatch, _gpu_run(tmp_path, tier_shards, steps=2))
    assert sample_and_eval_devices(out["checkpoint"], tmp_path, monkeypatch) == ["cuda:0", "cuda:0"]


def test_sampling_and_evaluation_devices_on_the_cpu(tmp_path, tier_shards, monkeypatch):
    from tests.helpers import cheap

    out = _train_with(TrainProbe(), monkeypatch, cheap(tmp_path, tier_shards, "trainer.accelerator=cpu", steps=2))
    assert sample_and_eval_devices(out["checkpoint"], tmp_path, monkeypatch) == ["cpu", "cpu"]


# --------------------------------------------------------------------------------------------------
# Low-precision norms pay on a GPU
# --------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["sd2_base", "pixart_xl_2_256"])
def test_low_precision_norms_compute_a_real_size_forward_in_bf16(cuda, preset):
    """Every norm of the real-size model is swapped and computes in bf16 under CUDA autocast, and the output stays
    within bf16 tolerance of the fp32-norm forward. Their speed is a figure, not a test: `python -m framework.bench
    gpu` (its lp_norm row) and `python -m framework.bench norm`."""
    from framework.bench.harness import synthetic_batches
    from framework.models.backbones import build_denoiser, load_preset
    from plugins.low_precision_norm import SWAPS, apply_low_precision_norms

    mcfg = load_preset(preset, **({"num_layers": 2} if preset != "sd2_base" else {}))
    torch.manual_seed(0)
    with torch.device(cuda):
        net = build_denoiser(mcfg).eval()
    batch = next(iter(torch.utils.data.DataLoader(synthetic_batches(mcfg, 2, 77), batch_size=2)))
    x, text = batch["latents"].to(cuda), batch["text_embeds"].to(cuda)
    mask, t = batch["text_mask"].to(cuda), torch.tensor([250.0, 750.0], device=cuda)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        ref = net(x, t, text, mask).float()
        norms = [m for m in net.modules() if any(type(m) in pairs for pairs in SWAPS.values())]
        swapped = apply_low_precision_norms(net)
        dtypes: set[torch.dtype] = set()
        for m in norms:
            m.register_forward_hook(lambda mod, args, out: dtypes.add(out.dtype))
        got = net(x, t, text, mask).float()
    assert norms and sum(swapped.values()) == len(norms), (swapped, len(norms))
    assert dtypes == {torch.bfloat16}, dtypes
    rel = (got - ref).norm() / ref.norm()
    assert rel < 2e-2, f"{preset}: low-precision norms moved the output by {rel:.2e}"


def _lora_step_peak(preset: str, device: torch.device, *, base_dtype: str, offload: bool) -> tuple[float, float]:
    """(peak GPU bytes of a bf16 forward and backward of a rank-16 LoRA on `preset`'s frozen base, activations
    checkpointed, with its blocks offloaded or not; the bytes of the blocks' frozen weights as held)."""
    from framework.distributed.fsdp import prepare_blocks, shard_units
    from framework.models.adapters import AdapterConfig, add_adapter, held_bytes, offload_frozen_blocks
    from framework.models.backbones import build_denoiser, load_preset

    torch.manual_seed(0)
    model = build_denoiser(load_preset(preset))
    add_adapter(model, AdapterConfig(kind="lora", rank=16, base_dtype=base_dtype))
    prepare_blocks(model, True, False)
    blocks = sum(held_bytes(block, base_dtype) for block in shard_units(model))
    model.to(device).train()
    if offload:
        offload_frozen_blocks(shard_units(model), device)
    cfg = model.cfg
    h, w = cfg.latent_hw
    x = torch.randn(1, cfg.in_channels, h, w, device=device)
    text = torch.randn(1, 77, cfg.text_dim, device=device)
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        model(x, torch.tensor([500.0], device=device), text, torch.ones(1, 77, dtype=torch.bool, device=device)).float() \
            .square().mean().backward()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    del model
    return float(peak), float(blocks)


@pytest.mark.gpu
def test_offloaded_blocks_leave_the_gpu_one_blocks_frozen_weights(cuda, base_dtype="bf16"):
    """adapter.offload_blocks on a real-size model (a bf16 base; the int8 one runs offloaded through framework.train
    below): the step's GPU peak falls by at least 80% of the blocks' frozen weights less one block's (what stays: the
    layers outside the blocks, the block being computed)."""
    kept, blocks = _lora_step_peak("pixart_xl_2_256", cuda, base_dtype=base_dtype, offload=False)
    offloaded, _ = _lora_step_peak("pixart_xl_2_256", cuda, base_dtype=base_dtype, offload=True)
    print(f"pixart_xl_2_256 LoRA, {base_dtype} base: peak {kept / 2**30:.2f} GiB kept, {offloaded / 2**30:.2f} GiB "
          f"offloaded (blocks' frozen weights {blocks / 2**30:.2f} GiB)")
    assert kept - offloaded > 0.8 * blocks * (1 - 1 / 28), (kept, offloaded, blocks)


@pytest.mark.gpu
def test_a_lora_on_an_offloaded_int8_base_trains_samples_and_evaluates_on_the_gpu(cuda, tmp_path, tier_shards):
    """Through framework.train on the GPU: a base run, then a LoRA on it held in int8 with its blocks offloaded, in
    bf16-mixed, with the final grid and the final evaluation (which run after Lightning moved the module to the CPU)."""
    from framework.train import train
    from tests.helpers import compose_cfg

    base = train(compose_cfg(_gpu_run(tmp_path, tier_shards, "sample.every_n_steps=0", steps=2, run="base")))
    out = train(compose_cfg(_gpu_run(tmp_path, tier_shards, f"init_from={base['checkpoint']}", "adapter=lora",
                                     "adapter.rank=4", "adapter.base_dtype=int8", "adapter.offload_blocks=true",
                                     "strategy.activation_checkpointing=true", "trainer.precision=bf16-mixed",
                                     "eval.at_end=true", "eval.seeds=1", "eval.phrasings=1", "eval.steps=2", run="lora")))
    assert out["eval"]["num_images"] > 0 and math.isfinite(out["eval"]["fd"]), out["eval"]
