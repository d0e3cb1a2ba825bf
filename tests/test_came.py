"""CAME / CAME-8bit (plugins/came.py): the reference, the 8-bit state, FSDP2, checkpoints and the config."""

from __future__ import annotations

import csv
import os
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import plugins  # noqa: F401  (registers optimizer=came / came8bit)
from framework.training.optim import build_optimizer
from plugins.came import CAME, CameSettings, is_8bit, state_shapes
from plugins.quant8 import dequantize_blocks, quantize_blocks, row_blocks
from tests.workers.came_fsdp import OPT_KW, STEPS, build_model, train_steps
from tests.zygote import torchrun

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _one_thread():
    """These tiny models run fastest on one thread; the machine's cores are shared with other jobs."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

# --------------------------------------------------------------------------------------------
# The reference: came-pytorch
# --------------------------------------------------------------------------------------------


class _Tiny(nn.Module):
    """A linear layer (2-D weight, 1-D bias) and a 1x1 conv, with the conv weight held 4-D or 2-D.

    came-pytorch factors a 4-D tensor over its last two dims, so for a 1x1 conv it feeds the 2-D
    (out, in) view of the same weight -- what CAME does after squeezing the conv. Both forms run the
    same conv2d on the same numbers, so the gradients are bit-identical.
    """

    def __init__(self, conv_4d: bool) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w = nn.Parameter(0.1 * torch.randn(32, 16, generator=g))
        self.b = nn.Parameter(0.1 * torch.randn(32, generator=g))
        conv = 0.1 * torch.randn(8, 32, 1, 1, generator=g)
        self.conv = nn.Parameter(conv if conv_4d else conv.view(8, 32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(F.linear(x, self.w, self.b))  # (B, 32)
        y = F.conv2d(h[:, :, None, None], self.conv.view(8, 32, 1, 1))  # (B, 8, 1, 1)
        return (y - 0.5).square().mean()


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_unquantized_matches_came_pytorch(weight_decay):
    from came_pytorch import CAME as Reference

    ours, ref = _Tiny(conv_4d=True), _Tiny(conv_4d=False)
    opt_ours = CAME(ours.parameters(), lr=1e-2, weight_decay=weight_decay)
    opt_ref = Reference(ref.parameters(), lr=1e-2, weight_decay=weight_decay)
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(1))
    for _ in range(20):
        for model, opt in ((ours, opt_ours), (ref, opt_ref)):
            opt.zero_grad()
            model(x).backward()
            opt.step()
    for a, b in zip(ours.parameters(), ref.parameters()):
        # Tolerance: 1e-6 relative (atol for entries near zero); in practice the two are bit-identical.
        torch.testing.assert_close(a.detach().view_as(b), b.detach(), rtol=1e-6, atol=1e-9)
    assert "exp_avg_sq_row" in opt_ours.state[ours.conv]  # the 1x1 conv was factored


# --------------------------------------------------------------------------------------------
# The 8-bit first moment
# --------------------------------------------------------------------------------------------


def test_quantization_round_trip_error_and_constant_blocks():
    block = 64
    x = torch.cat([torch.randn(1000) * 3, torch.full((200,), 0.25), torch.randn(37) * 1e-4])  # (1237,)
    nb = -(-x.numel() // block)
    codes, lo, scale = torch.empty(nb, block, dtype=torch.uint8), torch.empty(nb), torch.empty(nb)
    quantize_blocks(x, codes, lo, scale)
    y = dequantize_blocks(codes, lo, scale, x.numel())
    step = scale.repeat_interleave(block)[: x.numel()]
    # At most half a quantization step per element (plus fp32 rounding of the dequantization).
    assert torch.all((y - x).abs() <= 0.5 * step * (1 + 1e-4) + 1e-7 * x.abs())
    constant = (scale == 0).nonzero().flatten()
    assert len(constant) >= 2  # the 0.25 stretch fills whole blocks
    for i in constant.tolist():
        sl = slice(i * block, min((i + 1) * block, x.numel()))
        assert torch.equal(y[sl], x[sl])  # exact, and no NaN from the zero scale
    assert not torch.isnan(y).any()


def test_row_blocks_quantize_the_same_under_any_row_split():
    """Blocks lie within rows: quantizing rows in pieces (as FSDP ranks do) gives the whole's codes."""
    x = torch.randn(13, 25, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 1, 25)  # (13, 25)
    nb, block = row_blocks(25, 10)
    assert (nb, block) == (3, 9)  # 3 equal blocks, 2 padded codes per row
    whole = (torch.empty(13, nb, block, dtype=torch.uint8), torch.empty(13, nb), torch.empty(13, nb))
    quantize_blocks(x, *whole)
    for split in (13, 7, 4, 1):  # torch.chunk row pieces of 1, 2, 4 and 13 ranks
        for rows in torch.arange(13).split(split):
            piece = tuple(torch.empty(len(rows), *t.shape[1:], dtype=t.dtype) for t in whole)
            quantize_blocks(x[rows], *piece)
            for p, w in zip(piece, whole):
                assert torch.equal(p, w[rows])
    y = dequantize_blocks(*whole, 25)  # (13, 25)
    assert y.shape == x.shape and torch.all((y - x).abs() <= 0.5 * whole[2].repeat_interleave(block, 1)[:, :25] + 1e-6)


def test_old_per_rank_8bit_layout_is_refused_with_a_clear_message():
    w = nn.Parameter(torch.randn(13, 16))
    opt = CAME([w], quantize=True, block_size=10, min_8bit_size=0)
    w.grad = torch.randn_like(w)
    opt.step()
    sd = opt.state_dict()
    state = sd["state"][0]
    # What the per-rank layout stored for 13x16 on one rank: ceil(208 / 10) flat blocks of 10.
    state["exp_avg_q"], state["exp_avg_min"], state["exp_avg_scale"] = (
        torch.zeros(21, 10, dtype=torch.uint8), torch.zeros(21), torch.zeros(21))
    with pytest.raises(ValueError, match="older version"):
        CAME([w], quantize=True, block_size=10, min_8bit_size=0).load_state_dict(sd)


def test_8bit_state_is_about_one_byte_per_element():
    shapes = state_shapes((1152, 4608), quantize=True, block_size=2048, min_8bit_size=16384)
    nbytes = sum(torch.Size(s).numel() * d.itemsize for s, d, _ in shapes.values())
    assert shapes["exp_avg_q"][1] == torch.uint8 and nbytes / (1152 * 4608) < 1.1
    # SANA-1.5: matrices of 16K elements or more
    assert not is_8bit((127, 129), 16384) and is_8bit((128, 128), 16384) and is_8bit((256, 64, 1, 1), 16384)
    assert not is_8bit((256, 64, 3, 3), 0)  # only matrices and 1x1 convs


def _regression_run(quantize: bool, steps: int = 200) -> tuple[list[float], torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 128), nn.Tanh(), nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, 8))
    opt = CAME(model.parameters(), lr=1e-3, weight_decay=0.01, quantize=quantize, block_size=256, min_8bit_size=1000)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(32, 8, generator=g)
    losses = []
    for _ in range(steps):
        x = torch.randn(64, 32, generator=g)
        opt.zero_grad()
        loss = F.mse_loss(model(x), torch.tanh(x @ w / 32**0.5))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert quantize == ("exp_avg_q" in opt.state[model[2].weight])
    return losses, torch.cat([p.detach().flatten() for p in model.parameters()])


def test_8bit_trajectory_follows_unquantized():
    ref_losses, ref_params = _regression_run(quantize=False)
    q_losses, q_params = _regression_run(quantize=True)
    ref_end, q_end = sum(ref_losses[-20:]) / 20, sum(q_losses[-20:]) / 20
    assert ref_end < 0.02 * ref_losses[0]  # both actually train
    # Stated tolerance: the last-20-step mean loss within 10%, weights within 10% (relative L2).
    assert abs(q_end - ref_end) <= 0.1 * ref_end
    assert (q_params - ref_params).norm() <= 0.1 * ref_params.norm()


# --------------------------------------------------------------------------------------------
# Checkpoints on one process
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("quantize", [False, True])
def test_state_dict_round_trip_continues_the_trajectory(tmp_path, quantize):
    model = build_model()
    opt = CAME(model.parameters(), quantize=quantize, **OPT_KW)
    train_steps(model, opt, 0, STEPS)
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, tmp_path / "ckpt.pt")
    train_steps(model, opt, STEPS, STEPS)

    resumed = build_model()
    opt2 = CAME(resumed.parameters(), quantize=quantize, **OPT_KW)
    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    resumed.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["optim"])
    for a, b in zip(opt.state.values(), opt2.state.values()):
        assert {k: v.dtype for k, v in a.items()} == {k: v.dtype for k, v in b.items()}
    train_steps(resumed, opt2, STEPS, STEPS)
    for a, b in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


def test_bf16_weights_keep_fp32_and_uint8_state_through_a_round_trip():
    w = nn.Parameter(torch.randn(200, 100, dtype=torch.bfloat16))
    opt = CAME([w], lr=1e-2, quantize=True, min_8bit_size=0)
    w.grad = torch.randn_like(w)
    opt.step()
    opt2 = CAME([w], lr=1e-2, quantize=True, min_8bit_size=0)
    opt2.load_state_dict(opt.state_dict())
    dtypes = {k: v.dtype for k, v in opt2.state[w].items()}
    assert dtypes.pop("exp_avg_q") == torch.uint8 and set(dtypes.values()) == {torch.float32}
    for k, v in opt.state[w].items():
        assert torch.equal(v, opt2.state[w][k]), k
    assert w.dtype == torch.bfloat16 and torch.isfinite(w.float()).all()


class _Together:
    """Several optimizers stepped as one (the reference for parameter groups)."""

    def __init__(self, *opts: torch.optim.Optimizer) -> None:
        self.opts = opts

    def zero_grad(self) -> None:
        for o in self.opts:
            o.zero_grad()

    def step(self) -> None:
        for o in self.opts:
            o.step()


def test_per_group_settings_act_like_each_groups_own_optimizer():
    """Group lr / weight_decay override the defaults for that group only: one CAME with two groups trains exactly
    as two CAMEs, each built with its group's settings as defaults; and the settings matter (all-default differs)."""
    kw = dict(quantize=True, min_8bit_size=0, block_size=64)

    def split(model: nn.Module) -> tuple[list, list]:
        return [p for p in model.parameters() if p.dim() > 1], [p for p in model.parameters() if p.dim() == 1]

    model = build_model()
    decay, no_decay = split(model)
    opt = CAME([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "lr": 1e-3}], lr=1e-2, **kw)
    train_steps(model, opt, 0, 3)
    ref = build_model()
    ref_decay, ref_no_decay = split(ref)
    train_steps(ref, _Together(CAME(ref_decay, lr=1e-2, weight_decay=0.1, **kw), CAME(ref_no_decay, lr=1e-3, **kw)), 0, 3)
    for got, want in zip(model.parameters(), ref.parameters()):
        assert torch.equal(got, want)
    plain = build_model()
    train_steps(plain, CAME(plain.parameters(), lr=1e-2, **kw), 0, 3)
    assert not all(torch.equal(a, b) for a, b in zip(model.parameters(), plain.parameters()))
    assert "exp_avg_q" in opt.state[decay[0]] and "exp_avg_sq" in opt.state[no_decay[0]]


# --------------------------------------------------------------------------------------------
# FSDP2 on 2 CPU processes (gloo) against one process
# --------------------------------------------------------------------------------------------


def _launch(out: Path, world: int, name: str, tasks: list[str]) -> dict:
    """Run tests/workers/came_fsdp.py on `world` gloo processes (torchrun's ranks, tests/zygote.py); rank 0's results."""
    env = {**os.environ, "TMPDIR": str(out), "OMP_NUM_THREADS": "1"}
    proc = torchrun(world, "tests.workers.came_fsdp", str(out), name, *tasks, env=env, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return torch.load(out / f"{name}_rank0.pt", weights_only=False)


@pytest.fixture(scope="module")
def fsdp_results(tmp_path_factory) -> dict:
    """The 2-rank runs, and CAME-8bit checkpoints saved on 1 rank and 2 ranks, each resumed on the other.

    Keys: came, came8bit (2 ranks); save_w1, save_w2 (trained, saved, continued uninterrupted);
    load_w2 (2 ranks resumed from the 1-rank checkpoint); load_w1 (1 rank from the 2-rank one).
    """
    out = tmp_path_factory.mktemp("came_fsdp")
    w1 = _launch(out, 1, "w1_save", ["save"])
    w2 = _launch(out, 2, "w2", ["came", "came8bit", "save", "load:1"])
    w1_load = _launch(out, 1, "w1_load", ["load:2"])
    return {"came": w2["came"], "came8bit": w2["came8bit"], "save_w1": w1["save"], "save_w2": w2["save"],
            "load_w2": w2["load:1"], "load_w1": w1_load["load:2"]}


def _single_process(quantize: bool) -> dict[str, torch.Tensor]:
    model = build_model()
    train_steps(model, CAME(model.parameters(), quantize=quantize, **OPT_KW), 0, STEPS)
    return {k: v.detach() for k, v in model.named_parameters()}


@pytest.mark.slow
def test_fsdp_unquantized_matches_single_process(fsdp_results):
    single = _single_process(quantize=False)
    for k, v in fsdp_results["came"]["first"].items():
        # Float tolerance: gradients are averaged in another order across 2 ranks (observed ~1e-6).
        torch.testing.assert_close(v, single[k], rtol=1e-5, atol=1e-5, msg=k)


def test_fsdp_8bit_differs_only_by_quantization(fsdp_results):
    came, came8 = _single_process(quantize=False), _single_process(quantize=True)
    for k, v in fsdp_results["came8bit"]["first"].items():
        # Blocks lie within rows, so 2 ranks quantize the very blocks one process does: the runs
        # differ by float summation order only (observed 6e-7; the unquantized test allows 1e-5).
        torch.testing.assert_close(v, came8[k], rtol=1e-5, atol=1e-5, msg=k)
        # The gap to fp32 CAME is that of 8-bit vs fp32 on one process (and far below the movement).
        moved = (came[k] - build_model().state_dict()[k]).abs().max()
        gap = (v - came[k]).abs().max()
        assert gap <= max(3 * (came8[k] - came[k]).abs().max(), 1e-6) and gap <= 0.25 * moved + 1e-6, k


@pytest.mark.parametrize("tag", ["came", "came8bit"])
@pytest.mark.parametrize("kind", ["dcp", "full"])
def test_fsdp_checkpoint_resume_continues_the_trajectory(fsdp_results, tag, kind):
    """DCP (sharded) and single-file full checkpoints resume to exactly the uninterrupted run."""
    for k, v in fsdp_results[tag][kind].items():
        assert torch.equal(v, fsdp_results[tag]["continuous"][k]), k


def test_8bit_state_has_the_same_global_shapes_on_1_and_2_ranks(fsdp_results):
    one, two = fsdp_results["save_w1"]["saved_state"], fsdp_results["save_w2"]["saved_state"]
    assert {k: v.shape for k, v in one.items()} == {k: v.shape for k, v in two.items()}
    # And the same content up to float summation order (~1e-7): a code may at most round the other way.
    for k, v in one.items():
        if v.dtype == torch.uint8:
            assert (v.int() - two[k].int()).abs().max() <= 1, k
        else:
            torch.testing.assert_close(v, two[k], rtol=1e-5, atol=1e-6, msg=k)
    # Both 13x16 and 7x13 matrices are in 8 bits (rows split 7/6 and 4/3 on 2 ranks); 7->1 is not.
    assert one["0.weight.exp_avg_q"].shape == (13, 2, 8) and one["2.weight.exp_avg_q"].shape == (7, 2, 7)
    assert "4.weight.exp_avg" in one and "4.weight.exp_avg_q" not in one


@pytest.mark.parametrize("saved, resumed", [(1, 2), (2, 1)])
def test_8bit_checkpoint_resumes_on_another_world_size(fsdp_results, saved, resumed):
    """A DCP checkpoint of CAME-8bit saved on `saved` ranks continues on `resumed` ranks."""
    before = fsdp_results[f"save_w{saved}"]
    after = fsdp_results[f"load_w{resumed}"]
    # The state arrives exactly as it was saved: same global tensors, codes included.
    assert before["saved_state"].keys() == after["loaded_state"].keys()
    for k, v in before["saved_state"].items():
        assert torch.equal(v, after["loaded_state"][k]), k
    # Then STEPS more steps on the other world size follow the uninterrupted run on the saving one.
    # Tolerance 1e-6: gradients and column statistics are summed in another order on 1 and 2 ranks;
    # observed at most 2.4e-7 on weights of size ~1 (a code rounding the other way would cost ~4e-5).
    for k, v in after["resumed"].items():
        torch.testing.assert_close(v, before["continuous"][k], rtol=1e-6, atol=1e-6, msg=k)


# --------------------------------------------------------------------------------------------
# The config group and a short training run
# --------------------------------------------------------------------------------------------


def _compose(overrides: list[str]):
    from hydra import compose, initialize_config_dir

    from framework import config as config_lib

    config_lib.register()
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=overrides)


def test_hydra_composes_came8bit():
    from framework import config as config_lib

    cfg = config_lib.to_object(_compose(["optimizer=came8bit", "optimizer.settings.clip_threshold=0.5",
                                         "optimizer.settings.eps=[1e-29,1e-15]", "optimizer.settings.block_size=64",
                                         "optimizer.settings.min_8bit_size=100", "data.prepare=null"]))
    assert cfg.optimizer.name == "came8bit" and list(cfg.optimizer.betas) == [0.9, 0.999, 0.9999]
    assert isinstance(cfg.optimizer.settings, CameSettings)
    # Every setting reaches the optimizer the run builds.
    opt = build_optimizer([torch.nn.Parameter(torch.zeros(4, 8))], cfg.optimizer)
    group = opt.param_groups[0]
    assert (group["clip_threshold"], group["eps"], group["block_size"], group["min_8bit_size"], group["quantize"]) == \
        (0.5, (1e-29, 1e-15), 64, 100, True)
    came = config_lib.to_object(_compose(["optimizer=came", "data.prepare=null"])).optimizer
    assert came.name == "came" and came.settings == CameSettings()
    with pytest.raises(ValueError, match="optimizer.betas"):
        config_lib.to_object(_compose(["optimizer=came8bit", "optimizer.betas=[0.9,0.999]", "data.prepare=null"]))
    with pytest.raises(ValueError, match="clip_threshld"):  # a misspelled setting, at composition
        config_lib.to_object(_compose(["optimizer=came8bit", "+optimizer.settings.clip_threshld=0.5", "data.prepare=null"]))
    with pytest.raises(ValueError, match=r"optimizer.settings.block_size=0 must be > 0"):
        config_lib.to_object(_compose(["optimizer=came8bit", "optimizer.settings.block_size=0", "data.prepare=null"]))
    with pytest.raises(ValueError, match="adamw has no settings of its own"):
        config_lib.to_object(_compose(["+optimizer.settings.eps=[1e-30,1e-16]", "data.prepare=null"]))


def test_short_training_run_with_came8bit(tmp_path, digits_shards):
    from framework.train import train

    run = tmp_path / "run"
    cfg = _compose([
        "optimizer=came8bit", f"run.dir={run}", f"data.path={digits_shards}", f"data.local={run / 'cache'}",
        "data.batch_size=16", "trainer.max_steps=10", "trainer.log_every_n_steps=1",
        "trainer.enable_progress_bar=false", "eval.at_end=false", "sample.per_prompt=1", "sample.steps=2",
        "sample.prompts=[a handwritten 3]", "optimizer.warmup_steps=0",
    ])
    train(cfg)
    assert "name: came8bit" in (run / "config.yaml").read_text()
    with open(run / "metrics.csv", newline="") as f:
        losses = [float(r["train/loss"]) for r in csv.DictReader(f) if r.get("train/loss")]
    assert len(losses) >= 5 and all(torch.isfinite(torch.tensor(losses)))


@pytest.mark.parametrize("optimizer", ["adamw", "came", "came8bit"])
def test_the_memory_plan_counts_the_state_the_optimizer_holds_after_a_step(optimizer):
    """The run's predicted optimizer memory is the bytes of every state tensor the optimizer holds after its first
    step on the same model (the debug PixArt: its 128 x 128 matrices are 8-bit, exactly 16K elements; its biases and
    norms fp32)."""
    from framework.config import to_object
    from framework.models.backbones import build_denoiser, to_model_config
    from framework.training.memory import plan_run
    from framework.training.optim import build_optimizer
    from tests.helpers import compose_cfg

    betas = ["optimizer.betas=[0.9,0.999,0.9999]"] if optimizer != "adamw" else []
    cfg = to_object(compose_cfg([f"optimizer={optimizer}", *betas, "model.in_channels=1", "model.sample_size=8",
                                 "model.text_dim=384"]))
    model = build_denoiser(to_model_config(cfg.model))
    opt = build_optimizer(model.parameters(), cfg.optimizer)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    held = sum(v.numel() * v.element_size() for state in opt.state.values() for k, v in state.items()
               if torch.is_tensor(v) and k != "step")
    assert plan_run(cfg, 1, "32-true").parts["optimizer"] == held
