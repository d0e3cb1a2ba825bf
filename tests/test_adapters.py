"""adapter=lora|lokr|loha: a frozen base, a trained adapter, adapter-sized checkpoints that resume exactly, and exports.

The base is a 2-step digits run; each adapter run fine-tunes it for a few steps (init_from). References: the base's own
tensors (what must not move), LoRA's update W + (alpha / r) B A computed here from the checkpoint's tensors, the
adapted model before merging (what merging must not change) and an uninterrupted run (what a resume must give).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from framework.inference.checkpoint import CKPT_KEY, build_model, read_checkpoint
from framework.models.adapters import AdapterConfig, add_adapter, adapter_state, is_adapter_key, merge_adapter
from framework.models.backbones import ModelConfig, build_denoiser, load_weights
from tests import zygote
from tests.helpers import cheap, compose_cfg, crash_and_resume

ROOT = Path(__file__).resolve().parents[1]
FIT = ["model.in_channels=1", "model.sample_size=8", "model.text_dim=384", "logger=none"]


@pytest.fixture(scope="module")
def base(tmp_path_factory, digits_shards) -> Path:
    from framework.train import train

    tmp = tmp_path_factory.mktemp("adapter_base")
    return Path(train(compose_cfg(cheap(tmp, digits_shards, *FIT, "sample.every_n_steps=0", steps=2)))["checkpoint"])


def _tune(tmp_path: Path, data: Path, base: Path, *extra: str, steps: int = 3, run: str = "run") -> Path:
    from framework.train import train

    args = cheap(tmp_path, data, *FIT, f"init_from={base}", "sample.every_n_steps=0", *extra, steps=steps, run=run)
    return Path(train(compose_cfg(args))["checkpoint"])


# The module's adapter runs on the base, each trained once (3 steps) when a test first reads it.
RUNS = {
    "lora": ["adapter=lora", "adapter.rank=4"],
    "lokr": ["adapter=lokr", "adapter.rank=4"],
    "loha": ["adapter=loha", "adapter.rank=4"],
    # rank 2, alpha 6 (scale 3), on the self-attention queries alone
    "lora_q": ["adapter=lora", "adapter.rank=2", "adapter.alpha=6", "adapter.targets=[attn1.to_q]"],
}


@pytest.fixture(scope="module")
def tuned(tmp_path_factory, digits_shards, base):
    root, made = tmp_path_factory.mktemp("adapter_runs"), {}

    def get(name: str) -> Path:
        if name not in made:
            made[name] = _tune(root, digits_shards, base, *RUNS[name], run=name)
        return made[name]

    return get


def _inputs() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 1, 8, 8, generator=g)  # (B, C, h, w)
    text = torch.randn(2, 5, 384, generator=g)  # (B, L, D)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    return x, torch.tensor([10.0, 700.0]), text, mask


def _base_model(base: Path):
    ckpt = read_checkpoint(base)
    return load_weights(build_denoiser(ModelConfig(**ckpt[CKPT_KEY]["config"]["model"])), base).eval()


def _adapted(base: Path, ckpt: Path, cfg: AdapterConfig):
    """The base with the checkpoint's adapter on it, unmerged."""
    model = _base_model(base)
    add_adapter(model, cfg)
    state = read_checkpoint(ckpt)["state_dict"]
    model.load_state_dict({k[len("model."):]: v for k, v in state.items()}, strict=False)
    return model.eval()


@pytest.mark.parametrize("kind", ["lora", "lokr", "loha"])
def test_only_the_adapter_trains_and_the_checkpoint_holds_it_alone(tuned, base, kind):
    """The checkpoint's weights are the adapter's tensors, every one of them; merged onto the base (what sample, eval
    and export read), every tensor outside the targets is the base's bit for bit, the targets have moved, and the
    merged model computes what the adapted one did."""
    ckpt = tuned(kind)
    cfg = AdapterConfig(kind=kind, rank=4)
    stored = read_checkpoint(ckpt)["state_dict"]
    adapted = _adapted(base, ckpt, cfg)
    assert {f"model.{k}" for k in adapter_state(adapted)} == set(stored)
    assert all(is_adapter_key(k) for k in stored)
    assert os.path.getsize(ckpt) < os.path.getsize(base) / 5

    merged, before = build_model(read_checkpoint(ckpt), "train").eval(), _base_model(base).state_dict()
    after = merged.state_dict()
    assert after.keys() == before.keys()
    targets = [k for k in before if any(f".{t}.weight" in k for t in ("to_q", "to_k", "to_v", "to_out.0"))]
    assert len(targets) == 4 * 2 * merged.cfg.num_layers  # 4 projections x self- and cross-attention x the blocks
    moved = [k for k in before if not torch.equal(before[k], after[k])]
    assert sorted(moved) == sorted(targets)
    with torch.no_grad():
        torch.testing.assert_close(merged(*_inputs()), adapted(*_inputs()), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["lokr", "loha"])
def test_lokr_and_loha_compute_what_stock_peft_computes_with_the_trained_tensors(tuned, base, kind):
    """The trained LoKr / LoHa tensors loaded into the base through peft's own config, written here (rank 4, alpha
    = rank: scale 1, the four attention projections): every stored tensor has its place, and the merged model that
    sample, eval and export read computes what that stock peft model computes. adapter.dropout is peft's module
    dropout."""
    from peft import LoHaConfig, LoKrConfig, inject_adapter_in_model

    stock_config = {"lokr": LoKrConfig, "loha": LoHaConfig}[kind]
    stock = _base_model(base)
    inject_adapter_in_model(stock_config(r=4, alpha=4.0, target_modules=["to_q", "to_k", "to_v", "to_out.0"]),
                            stock.net)
    stored = {k[len("model."):]: v for k, v in read_checkpoint(tuned(kind))["state_dict"].items()}
    assert all({"lokr": ".lokr_w", "loha": ".hada_w"}[kind] in k for k in stored)  # lokr_w1 ... / hada_w1_a ...
    missing, unexpected = stock.load_state_dict(stored, strict=False)
    assert unexpected == [] and set(stored) <= set(stock.state_dict())
    merged = build_model(read_checkpoint(tuned(kind)), "train").eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(*_inputs()), stock.eval()(*_inputs()), rtol=1e-5, atol=1e-5)
    dropped = _base_model(base)
    add_adapter(dropped, AdapterConfig(kind=kind, rank=4, dropout=0.25))
    layer = next(m for m in dropped.net.modules() if hasattr(m, "module_dropout"))
    assert layer.module_dropout["default"] == 0.25


def test_lora_update_is_alpha_over_rank_times_b_a_on_the_chosen_layers(tuned, base):
    """adapter.rank, adapter.alpha and adapter.targets as LoRA defines them: only to_q layers carry an adapter of rank
    2, and the merged weight is W + (alpha / r) B A with alpha 6 (scale 3), computed here from the stored A and B."""
    ckpt = tuned("lora_q")
    stored = {k[len("model."):]: v for k, v in read_checkpoint(ckpt)["state_dict"].items()}
    layers = sorted({k.split(".lora_")[0] for k in stored})
    before, merged = _base_model(base).state_dict(), build_model(read_checkpoint(ckpt), "train")
    after = merged.state_dict()
    assert layers == [f"net.transformer_blocks.{i}.attn1.to_q" for i in range(merged.cfg.num_layers)]
    for layer in layers:
        a, b = stored[f"{layer}.lora_A.default.weight"], stored[f"{layer}.lora_B.default.weight"]
        assert a.shape[0] == 2 and b.shape[1] == 2 and b.abs().max() > 0  # rank 2; B left zero would mean no training
        torch.testing.assert_close(after[f"{layer}.weight"], before[f"{layer}.weight"] + 3.0 * b @ a, rtol=1e-6, atol=1e-7)


def test_adapter_dropout_changes_what_the_adapter_learns(tmp_path, digits_shards, base, tuned):
    """adapter.dropout drops the adapter's inputs in training: the same run with dropout 0.5 learns other tensors."""
    plain = read_checkpoint(tuned("lora"))
    dropped = read_checkpoint(_tune(tmp_path, digits_shards, base, *RUNS["lora"], "adapter.dropout=0.5", run="b"))
    assert plain["state_dict"].keys() == dropped["state_dict"].keys()
    assert any(not torch.equal(plain["state_dict"][k], dropped["state_dict"][k]) for k in plain["state_dict"])


def test_lora_dropout_drops_the_adapters_input_in_training_only():
    """adapter.dropout=0.5 on LoRA, by hand: in training a target layer computes W x + (alpha / r) B A drop(x), with the
    base term undropped and drop torch's own dropout at rate 0.5 from the same seed; in eval mode (grids, sampling)
    W x + (alpha / r) B A x. Dropout at inference, on the base or at another rate fails here."""
    import torch.nn.functional as F

    model = build_denoiser(ModelConfig(family="pixart", num_layers=1, num_heads=2, head_dim=8, sample_size=8,
                                       in_channels=1, text_dim=16))
    add_adapter(model, AdapterConfig(kind="lora", rank=2, alpha=6, dropout=0.5, targets=["attn1.to_q"]))
    layer = model.net.transformer_blocks[0].attn1.to_q
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    with torch.no_grad():
        b.normal_()  # LoRA's B starts at zero, which would hide the adapter's term
        x = torch.randn(3, 5, a.shape[1])  # (B, N, D)
        base = F.linear(x, layer.base_layer.weight, layer.base_layer.bias)
        model.train()
        torch.manual_seed(7)
        trained = layer(x)
        torch.manual_seed(7)
        torch.testing.assert_close(trained, base + 3.0 * F.dropout(x, 0.5, training=True) @ a.T @ b.T)
        model.eval()
        torch.testing.assert_close(layer(x), base + 3.0 * x @ a.T @ b.T)


def test_an_adapter_run_with_ema_resumes_exactly(tmp_path, digits_shards, base, monkeypatch):
    """Crashed after step 3 and resumed from its step-2 checkpoint (the adapter and its EMA alone), the run logs the
    uninterrupted run's losses and ends with its adapter; the EMA is the adapter's, and sample reads it."""
    full, resumed = crash_and_resume(tmp_path, digits_shards, [*FIT, "logger=csv", f"init_from={base}", "adapter=lora",
                                                               "adapter.rank=4", "plugins=[ema]", "plugins.ema.decay=0.5",
                                                               "sample.every_n_steps=0"], monkeypatch)
    for run in (full, resumed):
        ckpt = read_checkpoint(run["checkpoint"])
        ema = ckpt[CKPT_KEY]["ema_state"]
        assert ema and all(is_adapter_key(k) for k in ema)
        assert any(not torch.equal(ema[k], ckpt["state_dict"][f"model.{k}"]) for k in ema)
    a, b = read_checkpoint(full["checkpoint"]), read_checkpoint(resumed["checkpoint"])
    assert all(torch.equal(a[CKPT_KEY]["ema_state"][k], b[CKPT_KEY]["ema_state"][k]) for k in a[CKPT_KEY]["ema_state"])
    # what sample reads (weights=ema): the base's W plus the EMA's B A (alpha = rank: scale 1), by hand
    ema, base_w = a[CKPT_KEY]["ema_state"], _base_model(base).state_dict()
    layer = "net.transformer_blocks.0.attn1.to_q"
    by_hand = base_w[f"{layer}.weight"] + ema[f"{layer}.lora_B.default.weight"] @ ema[f"{layer}.lora_A.default.weight"]
    sampled, trained = (build_model(a, kind).state_dict()[f"{layer}.weight"] for kind in ("ema", "train"))
    torch.testing.assert_close(sampled, by_hand, rtol=1e-6, atol=1e-7)
    assert not torch.allclose(sampled, trained, rtol=0, atol=1e-7)


def test_resuming_with_another_adapter_is_refused(tmp_path, digits_shards, base, tuned):
    ckpt = tuned("lora")
    for run, extra in (("r8", ["adapter=lora", "adapter.rank=8"]), ("full", [])):
        with pytest.raises(Exception) as refused:
            _tune(tmp_path, digits_shards, base, *extra, f"resume={ckpt}", steps=4, run=run)
        assert "Resume with the adapter settings it was trained with" in str(refused.value)


@pytest.mark.parametrize("overrides, message", [
    (["adapter=lora"], "give them with init_from="),
    (["adapter=lora", "init_from=X", "plugins=[growth]", "plugins.growth.ckpt=X"], "growth plugin replaces the weights"),
    (["adapter=lora", "adapter.rank=0"], "adapter.rank=0 must be >= 1"),
    (["adapter=loha", "adapter.dropout=1.0"], r"adapter.dropout=1.0 must be in \[0, 1\)"),
    (["adapter=lora", "init_from=X", "adapter.base_dtype=int8", "strategy=fsdp"], "cannot be sharded by fully_shard"),
    (["adapter=lora", "init_from=X", "adapter.base_dtype=fp4"], "expected one of fp32, bf16, int8, fp8"),
])
def test_bad_adapter_settings_are_refused(overrides, message):
    import plugins  # noqa: F401  (registers growth)
    from framework.config import to_object

    with pytest.raises(ValueError, match=message):
        to_object(compose_cfg(overrides))


def test_targets_that_match_nothing_are_refused_naming_the_layers():
    model = build_denoiser(ModelConfig(family="pixart", num_layers=1, num_heads=2, head_dim=8, sample_size=8,
                                       in_channels=1, text_dim=16))
    with pytest.raises(ValueError, match=r"matches no linear layer.*named like"):
        add_adapter(model, AdapterConfig(kind="lora", targets=["qkv"]))


def _export(tmp_path: Path, ckpt: Path, out: Path, *extra: str) -> str:
    proc = zygote.run([sys.executable, "-m", "framework.export", f"ckpt={ckpt}", f"out={out}", *extra,
                       f"hydra.run.dir={tmp_path / 'hydra'}"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def test_lora_exports_as_diffusers_lora_file_merged_pipeline_and_merged_weights(tmp_path, base, tuned):
    """format=lora: diffusers' LoRA file (transformer.* keys, the LoraConfig in its metadata), which peft puts on the
    base transformer to compute what the checkpoint computes; merge=true: a pipeline whose transformer is the merged
    model; format=safetensors: the merged weights, which init_from loads. LoKr is refused by format=lora."""
    from diffusers import PixArtTransformer2DModel
    from peft import LoraConfig, inject_adapter_in_model, set_peft_model_state_dict
    from safetensors import safe_open

    from framework.export import ExportCommand, export

    ckpt = tuned("lora_q")  # rank 2, alpha 6, on attn1.to_q
    expected_model = build_model(read_checkpoint(ckpt), "train").eval()
    with torch.no_grad():
        expected = expected_model(*_inputs())

    said = _export(tmp_path, ckpt, tmp_path / "lora", "format=lora")
    assert "no LoRA loader" in said
    with safe_open(str(tmp_path / "lora" / "pytorch_lora_weights.safetensors"), "pt") as f:
        keys, metadata = list(f.keys()), f.metadata()
        file_state = {k[len("transformer."):]: f.get_tensor(k) for k in keys}
    assert keys and all(k.startswith("transformer.") and (".lora_A.weight" in k or ".lora_B.weight" in k) for k in keys)
    assert '"transformer.lora_alpha": 6.0' in metadata["lora_adapter_metadata"]
    model = _base_model(base)  # the base's transformer, with the file put on it by peft
    inject_adapter_in_model(LoraConfig(r=2, lora_alpha=6, target_modules=["attn1.to_q"]), model.net)
    result = set_peft_model_state_dict(model.net, file_state)
    assert not result.unexpected_keys
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(*_inputs()), expected, rtol=1e-5, atol=1e-5)

    export(ExportCommand(ckpt=str(ckpt), out=str(tmp_path / "merged"), format="lora", merge=True))  # in-process
    assert (tmp_path / "merged" / "model_index.json").is_file()  # a pipeline folder
    got = build_denoiser(expected_model.cfg).eval()
    got.net = PixArtTransformer2DModel.from_pretrained(tmp_path / "merged" / "transformer").eval()
    export(ExportCommand(ckpt=str(ckpt), out=str(tmp_path / "m.safetensors"), format="safetensors"))
    loaded = load_weights(build_denoiser(expected_model.cfg), tmp_path / "m.safetensors").eval()
    with torch.no_grad():
        torch.testing.assert_close(got(*_inputs()), expected, rtol=0, atol=0)
        torch.testing.assert_close(loaded(*_inputs()), expected, rtol=0, atol=0)

    lokr = tuned("lokr")
    with pytest.raises(ValueError, match="diffusers' LoRA loaders read LoRA alone"):
        export(ExportCommand(ckpt=str(lokr), out=str(tmp_path / "x"), format="lora"))


def test_merge_adapter_puts_the_plain_layers_back():
    model = build_denoiser(ModelConfig(family="pixart", num_layers=1, num_heads=2, head_dim=8, sample_size=8,
                                       in_channels=1, text_dim=16))
    keys = set(model.state_dict())
    add_adapter(model, AdapterConfig(kind="loha", rank=2))
    assert set(model.state_dict()) != keys and not any(p.requires_grad for n, p in model.named_parameters()
                                                       if not is_adapter_key(n))
    merge_adapter(model)
    assert set(model.state_dict()) == keys and all(type(m).__module__.startswith("torch") for m in model.net.modules()
                                                   if isinstance(m, torch.nn.Linear))


def test_a_bf16_base_is_held_in_bf16_and_the_memory_prediction_counts_it_so():
    """adapter.base_dtype=bf16: every frozen weight in bf16, the adapter in fp32; the prediction framework.train prints
    counts 2 bytes a frozen weight and 4 a trained one (fp32 base: 4 each)."""
    from framework.config import to_object
    from framework.training.memory import plan_run

    model = build_denoiser(ModelConfig(family="pixart", num_layers=1, num_heads=2, head_dim=8, sample_size=8,
                                       in_channels=1, text_dim=16))
    add_adapter(model, AdapterConfig(kind="lora", rank=2, base_dtype="bf16"))
    for name, p in model.named_parameters():
        assert p.dtype == (torch.float32 if is_adapter_key(name) else torch.bfloat16), name
    weights = {}
    for dtype in ("fp32", "bf16"):
        cfg = to_object(compose_cfg(["adapter=lora", "adapter.rank=4", f"adapter.base_dtype={dtype}", "init_from=X",
                                     "trainer.precision=bf16-mixed", "model.in_channels=1", "model.sample_size=8",
                                     "model.text_dim=384"]))
        weights[dtype] = plan_run(cfg, 1, "bf16-mixed").parts["weights"]
    reference = build_denoiser(ModelConfig(family="pixart", name="pixart_debug", **{
        k: v for k, v in compose_cfg(["model.in_channels=1", "model.sample_size=8", "model.text_dim=384"]).model.items()
        if k != "name" and k != "family"}))
    base = sum(p.numel() for p in reference.parameters())
    trained = add_adapter(reference, AdapterConfig(kind="lora", rank=4))
    assert weights["fp32"] == 4 * (base + trained)
    assert weights["bf16"] == 2 * base + 4 * trained


def test_bf16_base_needs_mixed_precision(tmp_path, digits_shards):
    """Refused when the config names another precision, and by framework.train when the precision is the CPU's
    default (fp32), before anything is written in run.dir."""
    from framework.config import to_object
    from framework.train import train

    with pytest.raises(ValueError, match="use trainer.precision=bf16-mixed"):
        to_object(compose_cfg(["adapter=lora", "adapter.base_dtype=bf16", "init_from=X", "trainer.precision=32-true"]))
    with pytest.raises(ValueError, match="the bf16 base computes under mixed precision's autocast"):
        train(compose_cfg(["adapter=lora", "adapter.base_dtype=bf16", "init_from=X", f"data.path={digits_shards}",
                           f"run.dir={tmp_path / 'run'}"]))
    assert not (tmp_path / "run").exists()


def _tiny() -> torch.nn.Module:
    torch.manual_seed(0)
    return build_denoiser(ModelConfig(family="pixart", num_layers=2, num_heads=2, head_dim=8, sample_size=8,
                                      in_channels=1, text_dim=16))


def _tiny_inputs() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(1)
    return (torch.randn(2, 1, 8, 8, generator=g), torch.tensor([10.0, 700.0]), torch.randn(2, 5, 16, generator=g),
            torch.ones(2, 5, dtype=torch.bool))


def test_an_int8_base_computes_with_per_row_int8_weights_and_the_prediction_counts_a_byte_each():
    """adapter.base_dtype=int8 (torchao): the adapted model computes what the fp32 model computes with every linear
    weight W replaced by round(W / s) s in [-128 s, 127 s], s = max |W_row| / 127.5 (done here by hand; the division
    as a product with 1 / s, as torchao rounds the row's largest weight); the adapter's weights stay fp32 and
    alone trainable. The memory prediction counts the base as held: a byte a quantized weight plus an fp32 scale a
    row, 4 bytes every other frozen weight, 4 a trained one. fp8 holds the same weights in a byte too."""
    from framework.config import to_object
    from framework.training.memory import plan_run

    model, by_hand = _tiny(), _tiny()
    with torch.no_grad():
        for layer in by_hand.modules():
            if isinstance(layer, torch.nn.Linear):
                scale = layer.weight.abs().amax(dim=1, keepdim=True) / 127.5  # [-128, 127] over the row's range
                layer.weight.copy_(torch.round(layer.weight * (1 / scale)).clamp(-128, 127) * scale)
    torch.manual_seed(1)  # the same adapter initialisation on both
    add_adapter(model, AdapterConfig(kind="lora", rank=2, base_dtype="int8"))
    torch.manual_seed(1)
    add_adapter(by_hand, AdapterConfig(kind="lora", rank=2))
    quantized = [n for n, p in model.named_parameters() if type(p.data).__name__ == "Int8Tensor"]
    linear = [f"{n}.weight" for n, m in by_hand.named_modules() if isinstance(m, torch.nn.Linear) and not is_adapter_key(n)]
    assert quantized == linear and len(quantized) > 10
    assert all(p.requires_grad == is_adapter_key(n) and (not p.requires_grad or p.dtype == torch.float32)
               for n, p in model.named_parameters())
    with torch.no_grad():
        plain = _tiny().eval()(*_tiny_inputs())
    saved, differentiated = [], []  # what autograd keeps for the backward: the int8 weights, not fp32 copies of them
    for name in quantized:
        model.get_submodule(name[:-len(".weight")]).register_forward_pre_hook(
            lambda module, args: differentiated.append(args[0].requires_grad))
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(type(t).__name__) or t, lambda t: t):
        got = model.eval()(*_tiny_inputs())
    expected = by_hand.eval()(*_tiny_inputs())
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert (got - plain).abs().max() > 1e-4  # the rounding is visible: the comparison can fail
    assert saved.count("Int8Tensor") == sum(differentiated) > 0  # once for each layer whose input needs a gradient
    got.square().mean().backward()
    expected.square().mean().backward()
    for (name, p), (_, q) in zip(model.named_parameters(), by_hand.named_parameters()):
        if p.requires_grad:  # the adapter's gradients: through the int8 weights as through their values by hand
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)

    fp8 = _tiny()
    add_adapter(fp8, AdapterConfig(kind="lora", rank=2, base_dtype="fp8"))
    assert [n for n, p in fp8.named_parameters() if type(p.data).__name__ == "Float8Tensor"] == linear
    with torch.no_grad():
        torch.testing.assert_close(fp8.eval()(*_tiny_inputs()), plain, rtol=0, atol=0.1)

    weights = {}
    for dtype in ("fp32", "int8", "fp8"):
        cfg = to_object(compose_cfg(["adapter=lora", "adapter.rank=4", f"adapter.base_dtype={dtype}", "init_from=X",
                                     "model.in_channels=1", "model.sample_size=8", "model.text_dim=384"]))
        weights[dtype] = plan_run(cfg, 1, "32-true").parts["weights"]
    reference = build_denoiser(ModelConfig(family="pixart", name="pixart_debug", **{
        k: v for k, v in compose_cfg(["model.in_channels=1", "model.sample_size=8", "model.text_dim=384"]).model.items()
        if k != "name" and k != "family"}))
    trained = add_adapter(reference, AdapterConfig(kind="lora", rank=4))
    rows = {f"{n}.weight": m.out_features for n, m in reference.named_modules()
            if isinstance(m, torch.nn.Linear) and not is_adapter_key(n)}
    held = sum(p.numel() + 4 * rows[n] if n in rows else 4 * p.numel()
               for n, p in reference.named_parameters() if not p.requires_grad)
    assert weights["int8"] == weights["fp8"] == 4 * trained + held
    assert weights["fp32"] > 3 * weights["int8"] - 4 * 4 * trained  # the linear weights dominate the base


class _CopyProbe:
    """Records, in a block's first target layer, whether its base weight during each call is the tensor the module
    holds between calls (not offloaded) or another one (a copy), and whether the call computes gradients."""

    def __init__(self) -> None:
        self.calls: list[tuple[bool, bool]] = []  # (training, copied)

    def attach(self, layer: torch.nn.Module) -> None:
        held = layer.weight

        def hook(module: torch.nn.Module, args: object) -> None:
            self.calls.append((torch.is_grad_enabled(), module.weight is not held))

        layer.register_forward_pre_hook(hook)


def test_offloaded_blocks_train_the_same_adapter_from_copies_made_for_each_forward_and_recomputation(
        tmp_path, digits_shards, base, monkeypatch):
    """adapter.offload_blocks=true (with activation checkpointing, on an int8 base): the blocks' frozen weights are
    held on the host and each call of a block (its forward, its recomputation in backward, the final grid's sampling)
    computes with a fresh copy; the adapter learned is the one the run without offloading learns, bit for bit."""
    import lightning.pytorch as pl

    from framework.train import train

    probe = _CopyProbe()

    class Attach(pl.Callback):
        def on_train_start(self, trainer, module) -> None:
            probe.attach(module.model.net.transformer_blocks[0].attn1.to_q.base_layer)

    common = [*FIT, f"init_from={base}", "adapter=lora", "adapter.rank=4", "adapter.base_dtype=int8",
              "strategy.activation_checkpointing=true", "sample.every_n_steps=0"]
    plain = train(compose_cfg(cheap(tmp_path, digits_shards, *common, run="plain")))
    offloaded = train(compose_cfg(cheap(tmp_path, digits_shards, *common, "adapter.offload_blocks=true", run="off")),
                      extra_callbacks=[Attach()])
    training = [copied for grad, copied in probe.calls if grad]
    sampling = [copied for grad, copied in probe.calls if not grad]  # the final grid
    assert len(training) == 2 * 3 and all(training) and sampling and all(sampling), probe.calls  # forward + recomputation
    a, b = read_checkpoint(plain["checkpoint"])["state_dict"], read_checkpoint(offloaded["checkpoint"])["state_dict"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(v, torch.zeros_like(v)) for k, v in a.items() if "lora_B" in k)  # it trained


def test_offloading_needs_activation_checkpointing_and_no_fsdp_and_is_predicted_as_one_block_on_a_gpu():
    """Refused without activation checkpointing and under fsdp; on a GPU run the prediction counts the frozen weights
    outside the blocks and one block's (the copy being computed), by hand here; on a CPU run all of them."""
    from framework.config import to_object
    from framework.distributed.fsdp import shard_units
    from framework.models.adapters import held_bytes
    from framework.training.memory import plan_run

    for extra in (["strategy.activation_checkpointing=false"], ["strategy=fsdp", "strategy.activation_checkpointing=true"],
                  ["strategy.activation_checkpointing=true", "strategy.compile=true"],
                  ["strategy.activation_checkpointing=true", "model=sd2_unet_debug"]):
        with pytest.raises(ValueError, match="it needs strategy.activation_checkpointing=true"):
            to_object(compose_cfg(["adapter=lora", "adapter.offload_blocks=true", "init_from=X", *extra]))
    for extra in ("adapter.offload_blocks=true", "adapter.base_dtype=int8"):  # adapter=none: no frozen base to hold
        with pytest.raises(ValueError, match="this run has none"):
            to_object(compose_cfg([extra]))
    fit = ["model.in_channels=1", "model.sample_size=8", "model.text_dim=384"]
    cfg = to_object(compose_cfg(["adapter=lora", "adapter.rank=4", "adapter.offload_blocks=true", "init_from=X",
                                 "strategy.activation_checkpointing=true", *fit]))
    weights = {where: plan_run(cfg, 1, "32-true", on_gpu=where == "gpu").parts["weights"] for where in ("cpu", "gpu")}
    reference = build_denoiser(ModelConfig(family="pixart", name="pixart_debug", **{
        k: v for k, v in compose_cfg(fit).model.items() if k != "name" and k != "family"}))
    trained = add_adapter(reference, AdapterConfig(kind="lora", rank=4))
    blocks = [held_bytes(block, "fp32") for block in shard_units(reference)]
    everything = held_bytes(reference, "fp32")
    assert len(blocks) > 1 and weights["cpu"] == 4 * trained + everything
    assert weights["gpu"] == 4 * trained + everything - sum(blocks) + max(blocks)


def test_an_offloaded_block_computes_where_its_inputs_are():
    """The copies go to the device of the call's inputs, not only the training's: Lightning's teardown moves the module
    to the CPU before the final evaluation. Here the inputs are on the meta device, and so is the output; the module
    holds its host weights again afterwards."""
    from framework.models.adapters import offload_frozen_blocks

    block = torch.nn.Sequential(torch.nn.Linear(4, 4)).requires_grad_(False)
    offload_frozen_blocks([block], torch.device("cpu"))
    try:
        out = block(torch.randn(2, 4, device="meta"))
    except RuntimeError as error:  # weights on one device, inputs on another
        pytest.fail(f"the block's weights did not follow its inputs: {error}")
    assert out.is_meta and block[0].weight.device.type == "cpu"
