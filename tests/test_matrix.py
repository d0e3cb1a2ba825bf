"""The combinations a user tries, each through the real command, `python -m framework.train`.

Every strategy on 1 and 2 devices, every logger, the plugins and the 8-bit optimizer under fsdp,
background checkpoint saves and a named W&B run: a few steps each, with a sample grid mid-run and the
final evaluation on, so a crash anywhere (start-up, a grid, a checkpoint, the evaluation, closing the
logger, exporting the result) fails here. Each row also
checks what that combination must leave behind. One more combination starts at the data: precompute as two
srun tasks, then training on what they wrote.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from tests import zygote
from tests.helpers import S3_BUCKET, history, losses, read_rows, run_ids, run_record, wait_for_exit

ROOT = Path(__file__).resolve().parents[1]
STEPS = 4

# (id, strategy, devices, logger, extra overrides)
MATRIX = [
    ("single-1-csv", "single", 1, "csv", []),
    # The W&B run named by the run's top-level name (no logger.name), in the project and entity given.
    ("single-1-wandb", "single", 1, "wandb", ["name=matrix-single", "logger.project=lf-matrix", "logger.entity=lf-team"]),
    ("single-1-none", "single", 1, "none", []),
    ("ddp-1-wandb", "ddp", 1, "wandb", []),
    # The digit-pairs benchmark (8x16 latents): the 2-rank evaluation picks best-of-3 by the pair judge.
    ("ddp-2-csv-pairs-bestof", "ddp", 2, "csv", ["experiment=pairs", "eval.best_of=3"]),
    # One sequence-parallel group of both ranks (framework/distributed/sequence.py): grids and evaluations sample split too;
    # rank 0 writes TensorBoard's events.
    ("ddp-2-tensorboard-sequence_parallel", "ddp", 2, "tensorboard",
     ["trainer.accumulate_grad_batches=2", "eval.every_n_steps=2", "strategy.sequence_parallel=2"]),
    # The reference code's initialisation, drawn on the sharded meta-device build.
    ("fsdp-1-none", "fsdp", 1, "none", ["model.init=reference"]),
    # Checkpoints saved in the background; the W&B run named, grouped and tagged from the config; then exported.
    ("fsdp-2-wandb", "fsdp", 2, "wandb", ["strategy.sharding=FULL_SHARD", "eval.best_of=2", "eval.selection=tournament",
                                          "strategy.async_save=true", "logger.name=matrix-fsdp", "logger.group=matrix",
                                          "logger.tags=[fsdp,async]"]),
    # Growth from a 4-block checkpoint ({growth_source}, a tiny trained run) to 6 blocks, with an EMA of the grown weights.
    ("ddp-2-wandb-growth-ema", "ddp", 2, "wandb",
     ["plugins=[growth,ema]", "plugins.growth.ckpt={growth_source}", "plugins.growth.init=cyclic", "model.num_layers=6"]),
    # The cache-router stage on the same source (frozen backbone), its final evaluation sampling with the learned schedule.
    ("ddp-2-wandb-cache_router", "ddp", 2, "wandb",
     ["experiment=cache_router", "init_from={growth_source}", "plugins.cache_router.steps=2"]),
    # Shards on S3-compatible storage ({s3}: the loopback server of tests/conftest.py) through a node-local cache,
    # checkpoints uploaded to it as well, hybrid sharding (one node: the replicate dim has size 1) and a process-group
    # timeout.
    ("fsdp-2-csv-s3-hybrid", "fsdp", 2, "csv", ["{s3}", "strategy.sharding=HYBRID_SHARD", "strategy.timeout_s=300",
                                                f"trainer.checkpoint_dir=s3://{S3_BUCKET}/matrix-checkpoints"]),
    # One's own RGB data ({own}: tests/test_own_data.py's images, VAE and text encoder, the encoders moved to
    # another folder) evaluated at the end against held-out images (FID, CLIP score) on both ranks; mirrored latents.
    ("ddp-2-csv-own_data-real", "ddp", 2, "csv", ["{own}", "data.batch_size=4", "eval.bootstrap=10", "data.hflip=true"]),
    # The global batch of 32 given (2 micro-batches of 8 per rank derived) and the lr scaled to it from 256.
    ("fsdp-2-csv-came8bit-ema-norms", "fsdp", 2, "csv",
     ["optimizer=came8bit", "plugins=[ema,low_precision_norm]", "plugins.ema.start=1", "trainer.precision=bf16-mixed",
      "data.global_batch_size=32", "optimizer.lr_scaling=sqrt"]),
    # Video ({video}: the moving digits' 8-frame clips): Latte grown from a 2-layer run ({latte_source}) to 3 layers
    # (its spatial and temporal blocks checkpointed), in bf16 with low-precision norms; its grids frame strips, its
    # evaluation the clips' digits and directions.
    ("single-1-csv-latte-norms-growth", "single", 1, "csv",
     ["{video}", "model=latte_debug", "strategy.activation_checkpointing=true", "plugins=[low_precision_norm,growth]",
      "plugins.growth.ckpt={latte_source}", "model.num_layers=3", "trainer.precision=bf16-mixed"]),
    # Wan's 3D attention sharded and split over both ranks (sequence parallelism: each rank's RoPE band), from the
    # reference init, with an EMA and the 8-bit optimizer; its grids and evaluation sample split too.
    ("fsdp-2-csv-wan-ema-came8bit-sequence_parallel", "fsdp", 2, "csv",
     ["{video}", "model=wan_debug", "model.init=reference", "plugins=[ema]", "plugins.ema.start=1", "optimizer=came8bit",
      "strategy.sequence_parallel=2"]),
    # A LoRA with an EMA of it on the 2-layer Latte ({latte_source}, frozen, its linear weights in int8 and its blocks
    # offloaded), its blocks checkpointed, in bf16-mixed; exported merged into its base.
    ("ddp-2-wandb-latte-lora-int8-offload-ema", "ddp", 2, "wandb",
     ["{video}", "model=latte_debug", "init_from={latte_source}", "adapter=lora", "adapter.rank=4", "plugins=[ema]",
      "plugins.ema.decay=0.5", "strategy.activation_checkpointing=true", "trainer.precision=bf16-mixed",
      "adapter.base_dtype=int8", "adapter.offload_blocks=true"]),
]

pytestmark = pytest.mark.slow  # multi-process runs: not in the fast tier (pytest -m "not slow")


def run_command(run_dir: Path, data: Path | str, strategy: str, devices: int, logger: str, extra: list[str],
                launcher: bool = True, env_extra: dict[str, str] | None = None) -> str:
    """`python -m framework.train ...` for one row. launcher: Lightning starts the other ranks (as for a user
    on one machine); else all ranks start at once as under srun or torchrun. env_extra: more environment (an S3
    endpoint and credentials)."""
    tmp = run_dir.parent / f"{run_dir.name}_tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    defaults = [
        f"run.dir={run_dir}", f"data.path={data}", f"data.local={tmp / 'cache'}",
        f"strategy={strategy}", f"trainer.devices={devices}", f"logger={logger}", "trainer.accelerator=cpu",
        f"data.batch_size={16 // devices}", f"trainer.max_steps={STEPS}", "trainer.log_every_n_steps=1",
        "trainer.checkpoint_every_n_steps=2", "trainer.enable_progress_bar=false",
        "sample.every_n_steps=2", "sample.per_prompt=1", "sample.steps=2", "sample.prompts=[a handwritten 3,a handwritten 7]",
        "eval.at_end=true", "eval.seeds=1", "eval.phrasings=1", "eval.steps=2",
    ]
    chosen = {e.split("=", 1)[0] for e in extra}  # a row's own value of a key replaces the default
    cmd = [sys.executable, "-m", "framework.train", *(d for d in defaults if d.split("=", 1)[0] not in chosen), *extra]
    env = {**os.environ, "TMPDIR": str(tmp), "HOME": str(tmp / "home"), "WANDB_SILENT": "true", **(env_extra or {})}
    for k in [k for k in env if k.startswith("WANDB_") and k != "WANDB_SILENT"]:
        env.pop(k)  # offline: no API key
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT"):
        env.pop(k, None)
    if devices == 1 or launcher:
        # rank 0 forked from the test zygote (tests/zygote.py): the command itself, Lightning starts the other ranks
        proc = zygote.run(cmd, env=env, timeout=600)
    else:  # every rank at once, with the variables srun / torchrun set (Lightning then starts none)
        results = zygote.lightning_ranks("framework.train", cmd[3:], devices, env, tmp, timeout=600)
        ordered = results[1:] + results[:1]  # rank 0's output last, where the summary is read
        proc = zygote.Result(zygote.job_code([r.returncode for r in results]), "".join(r.stdout for r in ordered),
                             "".join(r.stderr for r in ordered))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc.stdout


@pytest.fixture(scope="module")
def growth_source(tmp_path_factory, digits_shards) -> Path:
    """A 4-block quickstart model after 2 steps: the source of the growth row."""
    from framework.train import train
    from tests.helpers import cheap, compose_cfg

    return Path(train(compose_cfg(cheap(tmp_path_factory.mktemp("source"), digits_shards, steps=2)))["checkpoint"])


@pytest.fixture(scope="module")
def latte_source(tmp_path_factory, moving_shards) -> Path:
    """A 2-layer Latte after 2 steps on the moving digits: the source of the video growth row."""
    from framework.train import train
    from tests.helpers import cheap, compose_cfg

    return Path(train(compose_cfg(cheap(tmp_path_factory.mktemp("latte_source"), moving_shards, "model=latte_debug",
                                        steps=2)))["checkpoint"])


# Rows whose final checkpoint also goes through `python -m framework.export` (a sharded folder; a grown model's EMA).
EXPORTED = {"fsdp-2-wandb", "ddp-2-wandb-growth-ema", "ddp-2-wandb-latte-lora-int8-offload-ema"}


def m_id(request: pytest.FixtureRequest) -> str:
    return request.node.callspec.id


def check_export(ckpt: Path, out: Path) -> None:
    """framework.export (the command) writes the checkpoint's denoiser weights, tensor for tensor: the EMA when present
    and caught up, else the trained ones (a 4-step run's EMA at decay 0.9999 has not: the export says so); an adapter
    run's merged into its base."""
    from safetensors.torch import load_file

    from framework.inference.checkpoint import build_model, read_checkpoint, weights_used

    proc = zygote.run([sys.executable, "-m", "framework.export", f"ckpt={ckpt}", f"out={out}"], timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    ckpt_dict = read_checkpoint(ckpt)
    used = weights_used(ckpt_dict)
    early_ema = used == "train" and ckpt_dict["latentforge"].get("ema_progress") is not None
    assert early_ema == ("using the trained weights" in proc.stdout)
    exported, want = load_file(str(out)), build_model(ckpt_dict, used).state_dict()
    assert exported.keys() == {k[len("net."):] for k in want}
    for k, v in want.items():
        assert exported[k[len("net."):]].equal(v), k


def check_merged_by_hand(ckpt: Path, source: Path, exported: Path) -> None:
    """The exported weights of a LoRA run (rank 4, alpha 4) against W + B A from the source checkpoint's fp32 W and
    the run's stored A and B (its EMA's when the export used it): every adapted layer, and every other tensor the
    source's bit for bit, whatever the int8 base and offloading did during training."""
    import torch
    from safetensors.torch import load_file

    from framework.inference.checkpoint import model_weights, read_checkpoint, weights_used

    run, base = read_checkpoint(ckpt), read_checkpoint(source)
    lora, out = model_weights(run, weights_used(run)), load_file(str(exported))
    w = {k[len("model.net."):]: v for k, v in base["state_dict"].items() if k.startswith("model.net.")}
    layers = sorted({k[len("net."):].split(".lora_")[0] for k in lora if ".lora_A." in k})
    assert layers and out.keys() == w.keys()
    for name, v in w.items():
        layer = name.removesuffix(".weight")
        if layer in layers:
            a, b = lora[f"net.{layer}.lora_A.default.weight"], lora[f"net.{layer}.lora_B.default.weight"]
            torch.testing.assert_close(out[name], v + b @ a, rtol=1e-6, atol=1e-7)
        else:
            assert torch.equal(out[name], v), name


def eval_alone(ckpt: Path, metrics: dict, out: Path, devices: int, *args: str) -> dict:
    """framework.eval's metrics in one process on `ckpt` with the rows' settings (seeds=1, steps=2) and `args`. It
    draws in batches of one rank's share: a matmul's rounding depends on its row count, and images 1e-6 apart can
    round to different 8-bit pixels, which the metric networks read."""
    share = -(-metrics.get("num_images", metrics.get("num_clips", 0)) // devices)
    proc = zygote.run([sys.executable, "-m", "framework.eval", f"ckpt={ckpt}", f"out={out}", "seeds=1", "steps=2",
                       "device=cpu", f"batch_size={share}", *args], timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def check_own_eval(ckpt: Path, extra: list[str], metrics: dict, out: Path, devices: int) -> None:
    """framework.eval in one process, with the row's encoders, held-out images, metric networks and settings, gives the
    run's own metrics exactly."""
    keys = ("sample.vae", "sample.text_encoder", "eval.real", "eval.inception", "eval.clip", "eval.bootstrap")
    given = [e.split(".", 1)[1] for e in extra if e.split("=", 1)[0] in keys]
    alone = eval_alone(ckpt, metrics, out, devices, *given)
    for key in ("fid", "fid_interval", "clip_score", "clip_score_interval", "num_images", "num_real"):
        assert alone[key] == metrics[key], (key, alone, metrics)


# Rows whose end-of-training evaluation is checked against framework.eval in one process on the final checkpoint
# (the own-data row's, with its metric networks, in check_own_eval), with fd's relative tolerance: sequence-parallel
# sampling rounds its split attention differently (1e-4); under fsdp with bf16-mixed the run samples through FSDP2's
# bf16 parameter gathers while framework.eval computes in fp32 (fd 76.46 against 76.37 when measured: 5e-3).
# The 2-rank rows' evaluations against framework.eval in one process too: best-of-N by the pair judge, a sharded
# model's tournament, a grown model's EMA, the learned cache schedule, hybrid sharding over S3 shards (fd to 1e-5:
# the 2 ranks sample in batches of their share, which framework.eval follows, but reduce in another order); and Wan's
# clips split over 2 ranks.
EVALUATED = {"ddp-2-tensorboard-sequence_parallel": 1e-4, "fsdp-2-csv-came8bit-ema-norms": 5e-3,
             "ddp-2-csv-pairs-bestof": 1e-5, "fsdp-2-wandb": 1e-5, "ddp-2-wandb-growth-ema": 1e-5,
             "ddp-2-wandb-cache_router": 1e-5, "fsdp-2-csv-s3-hybrid": 1e-5,
             "fsdp-2-csv-wan-ema-came8bit-sequence_parallel": 1e-4}
# A row's eval.* keys that framework.eval takes under their own names (the cache schedule: the run's file).
EVAL_KEYS = ("eval.best_of", "eval.selection", "eval.pick", "eval.judge")


def check_eval(ckpt: Path, metrics: dict, out: Path, devices: int, rel: float, extra: list[str]) -> None:
    """framework.eval in one process on the run's final checkpoint, with the row's evaluation settings, gives the
    run's accuracies and image count exactly and its fd to `rel`."""
    given = [e.split(".", 1)[1] for e in extra if e.split("=", 1)[0] in EVAL_KEYS]
    if metrics.get("cache_schedule") == "learned":
        given.append(f"cache_schedule={ckpt.parent.parent / 'cache_schedule.json'}")
    alone = eval_alone(ckpt, metrics, out, devices, "phrasings=1", *given)
    exact = [k for k in metrics if k.endswith("accuracy") and not k.startswith("classifier")]
    exact += [k for k in ("num_images", "num_clips") if k in metrics]
    assert len(exact) >= 3, metrics
    for key in exact:
        assert alone[key] == metrics[key], (key, alone, metrics)
    assert alone["fd"] == pytest.approx(metrics["fd"], rel=rel, abs=0), (alone, metrics)


# 2-rank rows whose other rank Lightning's launcher starts, as on a user's machine; the other 2-rank rows start
# both ranks at once (as srun / torchrun do), which spares one interpreter start in turn.
LIGHTNING_LAUNCHER = {"ddp-2-tensorboard-sequence_parallel", "fsdp-2-wandb"}


@pytest.mark.parametrize("strategy,devices,logger,extra,launcher", [(*m[1:], m[0] in LIGHTNING_LAUNCHER) for m in MATRIX],
                         ids=[m[0] for m in MATRIX])
def test_combination_trains_samples_and_ends_with_the_evaluation(tmp_path, request, strategy, devices, logger, extra,
                                                                launcher):
    pairs = "experiment=pairs" in extra
    run_dir = tmp_path / "run"
    for name in ("growth_source", "latte_source"):
        if any(f"{{{name}}}" in e for e in extra):
            source = request.getfixturevalue(name)
            extra = [e.replace(f"{{{name}}}", str(source)) for e in extra]
    data, env_extra = request.getfixturevalue("pairs_shards" if pairs else "digits_shards"), None
    video = "{video}" in extra
    if video:
        data, extra = request.getfixturevalue("moving_shards"), [e for e in extra if e != "{video}"]
    own = "{own}" in extra
    if own:
        own_data, nets = request.getfixturevalue("own_data"), request.getfixturevalue("metric_nets")
        data = own_data["data"]
        extra = [e for e in extra if e != "{own}"] + [
            f"sample.vae={own_data['vae']}", f"sample.text_encoder={own_data['text']}", f"eval.real={nets['real']}",
            f"eval.inception={nets['inception']}", f"eval.clip={nets['clip']}"]
    if "{s3}" in extra:
        data, env_extra = f"s3://{S3_BUCKET}/digits", request.getfixturevalue("s3")
        extra = [e for e in extra if e != "{s3}"]
    stdout = run_command(run_dir, data, strategy, devices, logger, extra, launcher, env_extra)

    # One summary, from rank 0, ending with the metrics line.
    last = stdout.strip().splitlines()[-1]
    metrics = json.loads(last)
    assert json.loads((run_dir / "eval" / "metrics.json").read_text()) == metrics
    if own:  # the 2-rank evaluation equals framework.eval's in one process on the final checkpoint
        assert (metrics["num_real"], metrics["num_images"]) == (10, 10) and metrics["fid"] >= 0
        check_own_eval(run_dir / "checkpoints" / "last.ckpt", extra, metrics, tmp_path / "eval1", devices)
    elif video:  # every digit in every direction, in one training and two held-out phrasings
        assert 0.0 <= metrics["digit_accuracy"] <= 1.0 and 0.0 <= metrics["direction_accuracy"] <= 1.0
        assert metrics["num_clips"] == 10 * 4 * 3 and metrics["fd"] >= 0.0
        assert sum(line.startswith("digit_accuracy ") for line in stdout.splitlines()) == 1
        assert (run_dir / "eval" / "judged.png").is_file()
        if m_id(request) in EVALUATED:
            check_eval(run_dir / "checkpoints" / "last.ckpt", metrics, tmp_path / "eval1", devices,
                       EVALUATED[m_id(request)], extra)
    else:
        headline = "pair_accuracy" if pairs else "prompt_accuracy"
        assert 0.0 <= metrics[headline] <= 1.0 and metrics["fd"] >= 0.0
        assert metrics["num_images"] == (100 if pairs else 10 + 30)  # every ordered pair; digits + held-out phrasings
        assert sum(line.startswith(f"{headline} ") for line in stdout.splitlines()) == 1
        assert (run_dir / "eval" / "judged.png").is_file()
        if m_id(request) in EVALUATED:
            check_eval(run_dir / "checkpoints" / "last.ckpt", metrics, tmp_path / "eval1", devices,
                       EVALUATED[m_id(request)], extra)
    assert sorted(p.name for p in (run_dir / "samples").glob("*.png")) == ["step0000002.png", "step0000004.png"]
    last_ckpt = run_dir / "checkpoints" / "last.ckpt"
    assert last_ckpt.exists()
    assert last_ckpt.is_dir() == (strategy == "fsdp"), "fsdp writes a sharded folder, the others one file"
    if "model.num_layers=6" in extra:  # the grown model, with its EMA, is what was trained and saved
        import torch

        ckpt = torch.load(last_ckpt, weights_only=True)
        assert {k.split(".")[3] for k in ckpt["state_dict"] if k.startswith("model.net.transformer_blocks.")} == set("012345")
        assert "net.transformer_blocks.5.ff.net.2.weight" in ckpt["latentforge"]["ema_state"]
    if "adapter=lora" in extra:  # the checkpoint and its EMA hold the adapter alone, and the EMA was swapped in
        import torch

        from framework.models.adapters import is_adapter_key

        ckpt = torch.load(last_ckpt, weights_only=True)
        assert ckpt["state_dict"] and all(is_adapter_key(k) for k in ckpt["state_dict"])
        assert all(is_adapter_key(k) for k in ckpt["latentforge"]["ema_state"])
    if "experiment=cache_router" in extra:  # only the router trained; the evaluation used its schedule
        import torch

        trained, source = (torch.load(p, weights_only=True)["state_dict"]
                           for p in (last_ckpt, request.getfixturevalue("growth_source")))
        assert all(torch.equal(trained[k], v) for k, v in source.items())
        assert trained.keys() - source.keys() == {"router.logits", "router.cost"}
        assert metrics["cache_schedule"] == "learned" and (run_dir / "cache_schedule.png").is_file()

    if "strategy.async_save=true" in extra:  # the background saves completed: last.ckpt is step 4, nothing half-written
        from framework.training.checkpointing import checkpoint_step

        assert checkpoint_step(last_ckpt) == STEPS and not list(run_dir.rglob("*.tmp"))
    if any(e.startswith("trainer.checkpoint_dir=") for e in extra):  # the final checkpoint, file for file, on S3
        import boto3

        client = boto3.client("s3", endpoint_url=env_extra["S3_ENDPOINT_URL"], region_name="us-east-1",
                              aws_access_key_id=env_extra["AWS_ACCESS_KEY_ID"],
                              aws_secret_access_key=env_extra["AWS_SECRET_ACCESS_KEY"])
        name = client.get_object(Bucket=S3_BUCKET, Key="matrix-checkpoints/latest")["Body"].read().decode()
        listed = client.list_objects_v2(Bucket=S3_BUCKET, Prefix=f"matrix-checkpoints/{name}/")["Contents"]
        local = {str(f.relative_to(last_ckpt)): f.stat().st_size for f in last_ckpt.rglob("*") if f.is_file()}
        assert name == f"step{STEPS:07d}.ckpt" and {o["Key"].split("/", 2)[2]: o["Size"] for o in listed} == local
    if m_id(request) in EXPORTED:  # the checkpoint this combination wrote exports to the weights it holds
        check_export(last_ckpt, tmp_path / "exported.safetensors")
    if "adapter=lora" in extra:  # by hand: each exported target is the fp32 source's W + B A (alpha = rank: scale 1)
        check_merged_by_hand(last_ckpt, request.getfixturevalue("latte_source"), tmp_path / "exported.safetensors")

    if logger == "csv":
        assert sorted(losses(run_dir)) == list(range(STEPS))
    else:
        assert not (run_dir / "metrics.csv").exists()
    if "optimizer.lr_scaling=sqrt" in extra:  # by hand: 32 samples a step (2 ranks x 2 micro-batches of 8) and the
        # quickstart's lr 5e-4 scaled by sqrt(32 / 256), in its 100-step warm-up: (step + 1) / 100 of it
        with open(run_dir / "metrics.csv", newline="") as f:
            logged = list(csv.DictReader(f))
        seen = {int(r["step"]): float(r["trainer/images_seen"]) for r in logged if r.get("trainer/images_seen")}
        assert seen == {s: 32.0 * (s + 1) for s in range(STEPS)}, seen
        lrs = [(int(r["step"]), float(v)) for r in logged for k, v in r.items() if k.startswith("lr-") and v]
        assert sorted({s for s, _ in lrs}) == list(range(STEPS)), lrs
        assert [v for _, v in lrs] == pytest.approx([5e-4 * (32 / 256) ** 0.5 * (s + 1) / 100 for s, _ in lrs],
                                                    rel=1e-6), lrs
    if logger == "wandb":
        (log,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")  # one W&B run, from rank 0
        wait_for_exit(log)
        assert run_ids(log) == [(run_dir / "wandb_id.txt").read_text().strip()]
        rows = history(log)
        assert sorted(r["trainer/global_step"] for r in rows if "train/loss" in r) == list(range(STEPS))
        # the gradient norm (DTensor shards under fsdp, a frozen backbone's router alone, ...) at every logged step
        assert sorted(r["trainer/global_step"] for r in rows if r.get("train/grad_norm", 0) > 0) == list(range(STEPS))
        assert any(("eval/digit_accuracy" if video else "eval/prompt_accuracy") in r for r in rows)
        if "name=matrix-single" in extra:
            run = run_record(log)
            assert (run.display_name, run.project, run.entity) == ("matrix-single", "lf-matrix", "lf-team")
        if "logger.name=matrix-fsdp" in extra:
            run = run_record(log)
            assert (run.display_name, run.run_group, list(run.tags)) == ("matrix-fsdp", "matrix", ["fsdp", "async"])
        assert sum(r.get("samples/_type") == "images/separated" for r in rows) == 2
    else:
        assert not (run_dir / "wandb").exists()


@pytest.mark.parametrize("storage", ["fp16", "int8-filtered-per_image"])
def test_precompute_on_two_slurm_tasks_then_train(tmp_path, digits_shards, storage):
    """`python -m data_prep.precompute` as two srun tasks would start it (SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID,
    no RANK or WORLD_SIZE), each encoding one of the digits' two parts; then two training steps on the result. fp16: the
    config is digits_shards' own, so the dataset must be that one-process dataset: same fingerprint, same parts.
    int8-filtered-per_image: int8 text with its scale column, through filters that keep every digit (8 x 8, square),
    a row per image with its 3 captions (training draws one per sample and step)."""
    tmp, out = tmp_path / "tmp", tmp_path / "digits"
    tmp.mkdir()
    per_image = storage.endswith("per_image")
    extra = ["text_storage=int8", "min_size=8", "max_aspect=1.5", "caption_layout=per_image"] if per_image else []
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    ranks = [zygote.popen([sys.executable, "-m", "data_prep.precompute", "source=digits", "vae=pixel",
                           "text_encoder=minilm", "resolution=8", f"out={out}", "progress=false", *extra,
                           f"hydra.run.dir={tmp / f'hydra{r}'}"],
                          env={**env, "TMPDIR": str(tmp), "SLURM_PROCID": str(r), "SLURM_NTASKS": "2",
                               "SLURM_LOCALID": str(r)}) for r in range(2)]
    logs = [p.communicate(timeout=300)[0] for p in ranks]
    assert [p.returncode for p in ranks] == [0, 0], [log[-3000:] for log in logs]
    for r, log in enumerate(logs):
        assert f"rank {r} of 2: " in log and ", 1 to encode here" in log, log[-3000:]
    got, want = (json.loads((d / "dataset.json").read_text()) for d in (out, digits_shards))
    assert (got["num_samples"], got["world_size"]) == (want["num_images" if per_image else "num_samples"], 2)
    assert (got["fingerprint"] == want["fingerprint"]) is not per_image
    assert (got.get("text_storage", "fp16"), got["caption_layout"]) == (("int8", "per_image") if per_image else
                                                                         ("fp16", "per_caption"))
    parts = lambda d: [(s["raw_data"]["basename"], s["samples"]) for s in json.loads((d / "index.json").read_text())["shards"]]
    per_part = [(b.split("/")[0], n) for b, n in parts(out)]
    assert per_part == [(b.split("/")[0], n // 3 if per_image else n) for b, n in parts(digits_shards)]
    assert {b for b, _ in per_part} == {"part_000000", "part_000001"}
    # (read from a copy: Streaming decompresses a shard read in place beside it, which would change the shared fixture)
    rows, reference = read_rows(out), read_rows(Path(shutil.copytree(digits_shards, tmp_path / "reference")))
    if per_image:  # every image once, its pixels those of the one-process dataset's rows of that image
        assert sorted(r["latents"].tobytes() for r in rows) == sorted({r["latents"].tobytes() for r in reference})
    else:  # the one-process dataset, row for row (text to fp16 rounding: another process's encoder threads)
        assert [(r["key"], r["latents"].tobytes(), r["caption"]) for r in rows] == \
            [(r["key"], r["latents"].tobytes(), r["caption"]) for r in reference]
        for got_row, want_row in zip(rows, reference):
            np.testing.assert_allclose(got_row["text_embeds"].astype(np.float32),
                                       want_row["text_embeds"].astype(np.float32), rtol=0, atol=2e-3)

    run_dir = tmp_path / "run"
    run_command(run_dir, out, "single", 1, "csv", ["trainer.max_steps=2", "eval.at_end=false", "sample.every_n_steps=0"])
    assert sorted(losses(run_dir)) == [0, 1]


def test_a_watching_evaluation_follows_a_sharded_two_rank_run(tmp_path, digits_shards):
    """`framework.eval watch=RUN_DIR` beside a 2-rank FSDP2 run whose checkpoints are sharded folders: it scores steps
    2 and 4 as they are completed and ends with the run; step 4's metrics are what `framework.eval ckpt=` gives for
    that folder afterwards."""
    run_dir, settings = tmp_path / "run", ["seeds=1", "phrasings=1", "steps=2", "device=cpu"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    watcher = zygote.popen([sys.executable, "-m", "framework.eval", f"watch={run_dir}", "watch_poll_s=0.2",
                            "watch_idle_s=600", *settings], env={**env, "TMPDIR": str(tmp_path)})
    run_command(run_dir, digits_shards, "fsdp", 2, "csv", ["eval.at_end=false", "sample.every_n_steps=0"])
    out, _ = watcher.communicate(timeout=300)
    assert watcher.returncode == 0, out[-3000:]
    watched = json.loads((run_dir / "eval" / "watched.json").read_text())
    assert sorted(watched) == ["2", "4"], out[-3000:]
    alone = zygote.run([sys.executable, "-m", "framework.eval", f"ckpt={run_dir / 'checkpoints' / 'step0000004.ckpt'}",
                        f"out={tmp_path / 'alone'}", *settings], env={**env, "TMPDIR": str(tmp_path)}, timeout=300)
    assert alone.returncode == 0, alone.stdout[-3000:] + alone.stderr[-3000:]
    timeless = lambda m: {k: v for k, v in m.items() if k != "images_per_s"}  # noqa: E731
    assert timeless(watched["4"]) == timeless(json.loads((tmp_path / "alone" / "metrics.json").read_text()))


@pytest.mark.parametrize("codes,expected", [([0, 0], 0), ([0, -9], -9), ([1, 0], 1), ([-15, 2], -15)])
def test_a_job_fails_when_any_rank_fails_a_signal_included(codes, expected):
    assert zygote.job_code(codes) == expected
