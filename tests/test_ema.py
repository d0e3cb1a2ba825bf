"""plugins=[ema]: values against a hand-computed reference, nothing before the start, exact resume,
exact swaps, and 2-process ddp / fsdp runs against the single-process run of the same global batch."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from framework import train as train_lib
from framework.training.registry import WeightAverager, averaged_weights
from plugins.ema import EMA, EMAConfig
from tests.helpers import ROOT, cheap, compose_cfg, losses
from tests.zygote import lightning_ranks

# ema.lerp_(w, 1 - d**k) against d**k * ema + (1 - d**k) * w: a few float32 roundings apart.
REF_TOL = dict(rtol=1e-5, atol=1e-6)


class Recorder(pl.Callback):
    """Keeps the trainer, the module and the training weights after every optimizer step."""

    def __init__(self) -> None:
        self.weights: dict[int, dict[str, torch.Tensor]] = {}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.trainer, self.module = trainer, pl_module
        self._record(trainer, pl_module)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self._record(trainer, pl_module)

    def _record(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.weights[trainer.global_step] = {n: p.detach().clone() for n, p in pl_module.model.named_parameters()}

    @property
    def ema(self) -> EMA:
        return next(cb for cb in self.trainer.callbacks if isinstance(cb, EMA))


@pytest.fixture
def recorder(monkeypatch) -> Recorder:
    rec = Recorder()
    build = train_lib.build_callbacks
    monkeypatch.setattr(train_lib, "build_callbacks", lambda cfg, run_dir: [*build(cfg, run_dir), rec])
    return rec


def ema_plugin(**fields: Any) -> list[str]:
    return ["plugins=[ema]", *(f"plugins.ema.{k}={v}" for k, v in fields.items())]


def load(path: str) -> dict[str, Any]:
    return torch.load(path, map_location="cpu", weights_only=True)


# --------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------


def test_plugin_fields_compose_under_plugins_ema():
    from framework import config as config_lib

    cfg = config_lib.to_object(compose_cfg(ema_plugin(half_life=500, decay="null", every=4, start=0.9)))
    assert cfg.plugins["ema"]["every"] == 4
    ema = EMAConfig(**cfg.plugins["ema"])
    assert ema.step_decay == pytest.approx(0.5 ** (1 / 500)) and ema.start_step(1000) == 900


@pytest.mark.parametrize("fields,message", [
    ({"half_life": 100}, "add plugins.ema.decay=null"),
    ({"decay": 1.0}, "plugins.ema.decay=1.0"),
    ({"every": 0}, "plugins.ema.every=0"),
    ({"start": 2.5}, "plugins.ema.start=2.5"),
])
def test_bad_fields_name_the_key(fields, message):
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        EMAConfig(**fields)


class OtherAverager(pl.Callback):
    """Any callback with an `averaged_weights(pl_module)` context manager is a WeightAverager."""

    def averaged_weights(self, pl_module: pl.LightningModule) -> Any:
        return contextlib.nullcontext()


def test_the_ema_is_the_weight_averager_the_framework_asks_for():
    assert isinstance(EMA(EMAConfig()), WeightAverager) and isinstance(OtherAverager(), WeightAverager)
    assert not isinstance(Recorder(), WeightAverager)
    # Two averagers would make grids and evaluation ambiguous: refused, naming them.
    trainer = pl.Trainer(callbacks=[EMA(EMAConfig()), OtherAverager()], logger=False, enable_checkpointing=False)
    with pytest.raises(ValueError, match="EMA, OtherAverager each keep averaged weights"):
        averaged_weights(trainer, None)


def test_buffers_false_averages_only_the_parameters():
    """plugins.ema.buffers: with it a BatchNorm's running statistics are averaged too, without it only the weights."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.BatchNorm1d(3))
    kept = {}
    for buffers in (True, False):
        ema = EMA(EMAConfig(buffers=buffers))
        ema._begin(model, step=0)
        kept[buffers] = set(ema.ema)
    assert kept[False] == {"0.weight", "0.bias", "1.weight", "1.bias"}
    assert kept[True] == kept[False] | {"1.running_mean", "1.running_var"}


# --------------------------------------------------------------------------------------------
# Values, schedule, checkpoint
# --------------------------------------------------------------------------------------------


def test_ema_equals_hand_computed_reference(tmp_path, digits_shards, recorder):
    from framework.inference.checkpoint import model_weights

    # start=0.25 of 6 steps -> step 1 (rounded down); every 2 -> updates after steps 3 and 5, not 6.
    out = train_lib.train(compose_cfg(cheap(tmp_path, digits_shards, *ema_plugin(decay=0.8, every=2, start=0.25), steps=6)))
    w, d = recorder.weights, 0.8**2
    ref = {n: t.clone() for n, t in w[1].items()}
    for step in (3, 5):
        ref = {n: d * ref[n] + (1 - d) * w[step][n] for n in ref}
    ckpt = load(out["checkpoint"])
    ema = model_weights(ckpt)  # what framework.sample / eval / export load by default
    for n in ref:
        torch.testing.assert_close(ema[n], ref[n], **REF_TOL)
    assert not torch.equal(ema["net.proj_out.weight"], w[6]["net.proj_out.weight"])
    raw = model_weights(ckpt, "train")
    assert set(raw) == set(ema) and all(torch.equal(raw[n], w[6][n]) for n in w[6])
    assert ckpt["callbacks"]["EMA"] == {"start": 1, "last_step": 5, "num_updates": 2, "started": True,
                                             "step_decay": 0.8, "every": 2}


def test_nothing_is_allocated_before_the_start(tmp_path, digits_shards, recorder):
    out = train_lib.train(compose_cfg(cheap(tmp_path, digits_shards, *ema_plugin(start=100), steps=3)))
    assert recorder.ema.ema is None
    ckpt = load(out["checkpoint"])
    assert "ema_state" not in ckpt["latentforge"]
    assert ckpt["callbacks"]["EMA"]["started"] is False
    with averaged_weights(recorder.trainer, recorder.module):  # a no-op: grids and eval use the training weights
        assert all(torch.equal(p, recorder.weights[3][n]) for n, p in recorder.module.model.named_parameters())


@pytest.mark.slow
def test_crash_and_resume_gives_the_ema_of_an_uninterrupted_run(tmp_path, digits_shards):
    # start 3, every 2: the crash at step 4 falls between two updates (3 and 5).
    fields = ema_plugin(decay=0.7, every=2, start=3)
    full = train_lib.train(compose_cfg(cheap(tmp_path, digits_shards, *fields, steps=8, run="full")))
    common = [*fields, "trainer.checkpoint_every_n_steps=4", "resume=auto"]
    train_lib.train(compose_cfg(cheap(tmp_path, digits_shards, *common, steps=4, run="split")))
    resumed = train_lib.train(compose_cfg(cheap(tmp_path, digits_shards, *common, steps=8, run="split")))
    ef, er = load(full["checkpoint"])["latentforge"]["ema_state"], load(resumed["checkpoint"])["latentforge"]["ema_state"]
    assert set(ef) == set(er)
    for n in ef:
        torch.testing.assert_close(er[n], ef[n], rtol=0, atol=0)


def test_swapping_in_and_out_leaves_training_bit_identical(tmp_path, digits_shards, recorder):
    # Grids every 2 steps swap the EMA in and out mid-training: the losses must not move at all.
    grids = ["sample.every_n_steps=2"]
    plain = train_lib.train(compose_cfg(cheap(tmp_path, digits_shards, *grids, steps=5, run="plain")))
    with_ema = train_lib.train(compose_cfg(cheap(tmp_path, digits_shards, *grids, *ema_plugin(decay=0.5), steps=5, run="ema")))
    assert losses(Path(with_ema["run_dir"])) == losses(Path(plain["run_dir"]))
    assert len(with_ema["samples"]) == 3  # steps 2, 4 and the end
    model, ema = recorder.module.model, recorder.ema
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    averaged = {n: t.clone() for n, t in ema.ema.items()}
    with averaged_weights(recorder.trainer, recorder.module):
        for n, p in model.named_parameters():
            assert torch.equal(p, averaged[n])
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]) and torch.equal(ema.ema[n], averaged[n])


def test_an_ema_that_has_not_caught_up_is_not_used_silently(tmp_path, digits_shards, recorder, capsys):
    """decay 0.99 over 4 steps has moved 3.9% of the way: the final evaluation, sampling and export use the trained
    weights and say so; the checkpoint still holds the EMA and its progress."""
    from framework.export import ExportCommand, export
    from framework.inference.checkpoint import model_weights, read_checkpoint, weights_used
    from safetensors.torch import load_file

    out = train_lib.train(compose_cfg(cheap(tmp_path, digits_shards, *ema_plugin(decay=0.99, start=0), "eval.at_end=true",
                                            "eval.seeds=1", "eval.phrasings=1", "eval.steps=1", steps=4)))
    ckpt = read_checkpoint(out["checkpoint"])
    assert ckpt["latentforge"]["ema_progress"] == pytest.approx(1 - 0.99**4)
    assert weights_used(ckpt, "ema") == "train" and "moved only 3.9%" in capsys.readouterr().out
    trained = model_weights(ckpt, "train")
    assert not torch.equal(model_weights(ckpt, "ema")["net.proj_out.weight"], trained["net.proj_out.weight"])
    exported = load_file(str(export(ExportCommand(ckpt=out["checkpoint"], out=str(tmp_path / "w.safetensors")))))
    assert all(torch.equal(exported[k[len("net."):]], v) for k, v in trained.items() if k.startswith("net."))


def test_grids_and_the_final_evaluation_use_the_averaged_weights(tmp_path, digits_shards, recorder, monkeypatch):
    """What the sampler sees when the final grid and the end-of-training evaluation run: the EMA weights
    (the checkpoint's ema_state), not the training weights, which are back in the model afterwards."""
    from framework.evaluation import evaluate as eval_lib
    from framework.inference.pipeline import Pipeline

    seen: list[tuple[str, dict[str, torch.Tensor]]] = []

    def snapshot(tag: str, model: torch.nn.Module) -> None:
        seen.append((tag, {n: p.detach().clone() for n, p in model.named_parameters()}))

    generate, evaluate = Pipeline.generate, eval_lib.evaluate

    def recording_generate(self, *args: Any, **kwargs: Any) -> Any:
        snapshot("generate", self.model)
        return generate(self, *args, **kwargs)

    def recording_evaluate(pipe: Any, *args: Any, **kwargs: Any) -> Any:
        snapshot("evaluate", pipe.model)
        return evaluate(pipe, *args, **kwargs)

    monkeypatch.setattr(Pipeline, "generate", recording_generate)
    monkeypatch.setattr(eval_lib, "evaluate", recording_evaluate)
    # A slow average (decay 0.8 from step 0: 59% of the way after 4 steps) at lr 1e-3: the EMA is far from the
    # trained weights.
    fields = [*ema_plugin(decay=0.8, start=0), "optimizer.lr=1e-3", "optimizer.warmup_steps=0", "eval.at_end=true",
              "eval.seeds=1", "eval.phrasings=1", "eval.steps=1"]
    out = train_lib.train(compose_cfg(cheap(tmp_path, digits_shards, *fields, steps=4)))
    assert [tag for tag, _ in seen][:2] == ["generate", "evaluate"], [tag for tag, _ in seen]  # the final grid, then eval
    ema, trained = load(out["checkpoint"])["latentforge"]["ema_state"], recorder.weights[4]
    assert not torch.equal(ema["net.proj_out.weight"], trained["net.proj_out.weight"])
    for tag, weights in seen[:2]:
        for n, w in weights.items():
            assert torch.equal(w, ema[n]), f"the {tag} at the end used {n} of the training weights, not the EMA"
    for n, p in recorder.module.model.named_parameters():
        assert torch.equal(p, trained[n]), "the training weights are back after sampling"


# --------------------------------------------------------------------------------------------
# Two processes (gloo, CPU) against one
# --------------------------------------------------------------------------------------------


def _two_ranks(tmp_path: Path, data: Path, run: str, *extra: str, steps: int) -> Path:
    args = cheap(tmp_path, data, "data.batch_size=8", "trainer.accelerator=cpu", "trainer.devices=2",
                 "logger=none", "sample.every_n_steps=0", *extra, steps=steps, run=run)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    results = lightning_ranks("tests.workers.ema_dist_train", args, 2, env, tmp_path, timeout=300)  # tests/zygote.py
    assert all(r.returncode == 0 for r in results), "".join(r.stderr[-3000:] for r in results)
    return tmp_path / run


# A constant lr of 1e-3 from the first step: four steps move the weights, and so the EMA, by ~1e-3, far beyond the
# tolerance (an EMA that missed an update or a rank's shard fails; warm-up's lr of 1e-5 would hide it).
DIST_EMA = [*ema_plugin(decay=0.6, start=1), "optimizer.lr=1e-3", "optimizer.warmup_steps=0", "optimizer.schedule=constant"]
# Same global batch (16) on one rank and on two: gradients differ only in summation order, and
# four AdamW steps amplify that to a few 1e-6 of the weights.
DIST_TOL = dict(rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def single_process_ema(tmp_path_factory, digits_shards) -> dict[str, torch.Tensor]:
    tmp = tmp_path_factory.mktemp("ema_single")
    out = train_lib.train(compose_cfg(cheap(tmp, digits_shards, "data.batch_size=16", "logger=none", *DIST_EMA, steps=4)))
    return load(out["checkpoint"])["latentforge"]["ema_state"]


def test_ddp_two_ranks_keep_the_full_ema_equal_to_one_process(tmp_path, digits_shards, single_process_ema):
    run = _two_ranks(tmp_path, digits_shards, "ddp", "strategy=ddp", *DIST_EMA, steps=4)
    ema = load(str(run / "checkpoints" / "last.ckpt"))["latentforge"]["ema_state"]
    for n, ref in single_process_ema.items():
        torch.testing.assert_close(ema[n], ref, **DIST_TOL)
    for r in (0, 1):
        probe = json.loads((run / f"ema_probe_rank{r}.json").read_text())
        assert all(not t["dtensor"] and t["local_numel"] == t["numel"] for t in probe["tensors"].values())


@pytest.mark.slow
def test_fsdp_ema_is_sharded_and_resumes_to_the_single_process_ema(tmp_path, digits_shards, single_process_ema):
    from framework.inference.checkpoint import is_sharded, read_sharded

    # Crash after step 2 (sharded checkpoint folder), resume on 2 ranks to step 4.
    common = ["strategy=fsdp", "trainer.checkpoint_every_n_steps=2", "resume=auto", *DIST_EMA]
    _two_ranks(tmp_path, digits_shards, "fsdp", *common, steps=2)
    run = _two_ranks(tmp_path, digits_shards, "fsdp", *common, steps=4)
    last = run / "checkpoints" / "last.ckpt"
    assert is_sharded(last)
    state = read_sharded(last)["state_dict"]
    averaged = [k.removeprefix("ema_state.") for k in state if k.startswith("ema_state.")]
    assert averaged and set(averaged) <= set(single_process_ema)
    for n in averaged:
        torch.testing.assert_close(state[f"ema_state.{n}"], single_process_ema[n], **DIST_TOL)
    # In memory each rank holds only its shards: DTensors, about half the elements, no full copy.
    probes = [json.loads((run / f"ema_probe_rank{r}.json").read_text()) for r in (0, 1)]
    for probe in probes:
        tensors = probe["tensors"]
        assert all(t["dtensor"] for t in tensors.values())
        assert sum(t["local_numel"] for t in tensors.values()) <= 0.55 * sum(t["numel"] for t in tensors.values())
    # And on disk each EMA tensor is written in two chunks, one per rank.
    import torch.distributed.checkpoint as dcp

    meta = dcp.FileSystemReader(str(last)).read_metadata().state_dict_metadata
    assert len(meta["state_dict.ema_state.net.proj_out.weight"].chunks) == 2
