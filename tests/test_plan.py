"""The run plan (framework/training/plan.py): a run's batch and lr decided once, against figures worked out by hand,
and a training run that reads them without writing to its config."""

from __future__ import annotations

import math

import lightning.pytorch as pl
import pytest

from framework import config as config_lib
from framework.train import train
from framework.training.plan import resolve
from tests.helpers import cheap, compose_cfg, with_callback


def _cfg(*overrides: str):
    return config_lib.to_object(compose_cfg([*overrides, "data.prepare=null", "data.path=DIR"]))


def test_a_global_batch_splits_over_the_data_parallel_ranks_as_worked_out_by_hand():
    """48 samples a step on 8 ranks in sequence-parallel pairs: 4 data-parallel ranks take 12 each; at most 5 a
    device, the fewest micro-batches that split 12 evenly are 3 of 4. sqrt scaling from 16: lr x sqrt(3)."""
    cfg = _cfg("data.global_batch_size=48", "data.batch_size=5", "optimizer.lr=1e-4", "optimizer.lr_scaling=sqrt",
               "optimizer.lr_reference_batch=16")
    cfg.strategy.sequence_parallel = 2  # the mesh check of validate() needs 2 ranks a node: not the subject here
    plan = resolve(cfg, 8)
    assert (plan.data_parallel, plan.micro_batch, plan.accumulation, plan.global_batch) == (4, 4, 3, 48)
    assert math.isclose(plan.lr, 1e-4 * math.sqrt(3), rel_tol=1e-12)
    text = plan.describe()
    assert text.splitlines()[0] == ("run: 8 rank(s) = 4 data-parallel x 2 sequence-parallel; global batch 48 = 4 per "
                                    "device x 4 x 3 micro-batch(es); peak lr 0.0001732")
    assert "data.global_batch_size=48 on 4 data-parallel rank(s)" in text and "optimizer.lr_scaling=sqrt" in text


def test_without_a_global_batch_the_plan_is_the_batch_and_accumulation_given():
    cfg = _cfg("data.batch_size=6", "trainer.accumulate_grad_batches=2", "optimizer.lr=3e-4",
               "optimizer.lr_scaling=linear", "optimizer.lr_reference_batch=8")
    plan = resolve(cfg, 2)
    assert (plan.micro_batch, plan.accumulation, plan.global_batch) == (6, 2, 24)
    assert math.isclose(plan.lr, 3e-4 * 24 / 8, rel_tol=1e-12)
    assert resolve(_cfg("optimizer.lr=3e-4"), 2).lr == 3e-4 and resolve(_cfg(), 2).why == ()


def test_a_global_batch_the_job_cannot_split_is_refused_naming_the_key():
    with pytest.raises(ValueError, match=r"data.global_batch_size=10 does not divide over 4 data-parallel ranks"):
        resolve(_cfg("data.global_batch_size=10"), 4)
    with pytest.raises(ValueError, match=r"data.global_batch_size=10 does not divide over 4"):  # known at compose time
        _cfg("data.global_batch_size=10", "strategy=ddp", "trainer.devices=4")


def test_a_run_reads_its_plan_and_leaves_the_config_as_composed(tmp_path, digits_shards, monkeypatch, capsys):
    """data.global_batch_size=12 with data.batch_size=5 on one device: the loader yields batches of 4, the trainer
    accumulates 3, each step counts 12 samples, the plan is printed once, and the config keeps data.batch_size=5.
    The data module takes Streaming's partitions from the plan (here changed to 6), not from the config."""
    import dataclasses

    import framework.train as train_mod

    seen: dict = {}

    class Probe(pl.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            seen.setdefault("rows", set()).add(batch["latents"].shape[0])
            seen["accumulate"] = trainer.accumulate_grad_batches
            seen["partitions"] = trainer.datamodule.dataset.num_canonical_nodes

    with_callback(monkeypatch, Probe())
    planned = train_mod.resolve
    monkeypatch.setattr(train_mod, "resolve", lambda *a, **k: dataclasses.replace(planned(*a, **k), num_canonical_nodes=6))
    dcfg = compose_cfg(cheap(tmp_path, digits_shards, "data.global_batch_size=12", "data.batch_size=5", steps=2))
    out = train(dcfg)
    printed = capsys.readouterr().out
    assert seen == {"rows": {4}, "accumulate": 3, "partitions": 6}
    assert dcfg.data.batch_size == 5 and dcfg.trainer.accumulate_grad_batches == 1
    assert printed.count("run: 1 rank(s)") == 1 and "global batch 12 = 4 per device x 1 x 3" in printed
    import torch

    from framework.inference.checkpoint import CKPT_KEY

    extra = torch.load(out["checkpoint"], map_location="cpu", weights_only=True)[CKPT_KEY]
    assert (extra["global_batch"], extra["images_seen"]) == (12, 24)
    assert extra["config"]["data"]["batch_size"] == 5


def test_the_data_partitions_fit_the_job_s_node_count_or_the_plan_refuses_it():
    """data=shards (num_canonical_nodes=auto) on the 4,314 digits: 960 partitions, which 16, 32 and 64 nodes divide
    (the plan says so); 7 nodes cannot start with 960 nor 128 nodes with an explicit 840, each refused before any
    model is built, naming the node counts that can and the key. Streaming itself agrees on every case."""
    from streaming.base.partition import get_partitions

    cfg = _cfg("data=shards", "strategy=ddp", "trainer.devices=1")
    for nodes in (1, 16, 32, 64):
        plan = resolve(cfg, nodes, nodes=nodes, num_samples=4314)
        assert ("data.num_canonical_nodes=auto: 960 for 4314 samples (at least 4 a partition); node counts it fits: "
                "1, 2, 3, 4, 5, 6, 8, 10, 12, 15, 16, 20, ... 240") in plan.why
        get_partitions("orig", 4314, 960, nodes, 1, 1, 8)
    with pytest.raises(ValueError, match=r"data.num_canonical_nodes=960 \(auto chose it for 4314 samples\) cannot start "
                                         r"a job of 7 nodes: .* Run on 4, 5, 6 or 8 nodes, or set "
                                         r"data.num_canonical_nodes to a number 7 divides \(e.g. 959\)"):
        resolve(cfg, 7, nodes=7, num_samples=4314)
    with pytest.raises(ValueError, match="evenly divisible"):
        get_partitions("orig", 4314, 960, 7, 1, 1, 8)
    cfg.data.num_canonical_nodes = 840
    with pytest.raises(ValueError, match=r"=840 \(as set\) cannot start a job of 128 nodes"):
        resolve(cfg, 128, nodes=128, num_samples=100_000)
    assert resolve(cfg, 8, nodes=8, num_samples=100_000).why == ()  # a value as set: nothing chosen
