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


def test_bf16_base_needs_mixed_precision():
    from framework.config import to_object

    with pytest.raises(ValueError, match="use trainer.precision=bf16-mixed"):
        to_object(compose_cfg(["adapter=lora", "adapter.base_dtype=bf16", "init_from=X", "trainer.precision=32-true"]))
