"""Shards on S3-compatible object storage: a real S3 server on loopback (moto's server mode, started and stopped
by the `s3` fixture of tests/conftest.py), the digits shards uploaded to it, and training that reads
`data.path=s3://...` through a node-local cache.
"""

from __future__ import annotations

import shutil
import signal
import time

import pytest
import torch

from tests.helpers import cheap, compose_cfg, losses, run_train, S3_BUCKET as BUCKET



@pytest.fixture
def s3_env(s3, monkeypatch) -> dict[str, str]:
    for k, v in s3.items():
        monkeypatch.setenv(k, v)
    return s3


def test_start_up_reads_the_index_and_no_shard(s3_env, tmp_path):
    """The data module's start-up (dataset.json, the shard check, Streaming's index) downloads the small metadata
    files only: no shard reaches the node-local cache before the first batch is asked for."""
    from framework.data.datamodule import DataConfig, LatentDataModule

    dm = LatentDataModule(DataConfig(path=f"s3://{BUCKET}/digits", local=str(tmp_path / "cache")))
    dm.setup("fit")
    files = [p for p in (tmp_path / "cache").rglob("*") if p.is_file()]
    assert {"dataset.json", "index.json"} <= {p.name for p in files}
    assert not [p for p in files if p.name.startswith("shard.")], files
    assert dm.info.num_samples == 4314
    batch = next(iter(dm.train_dataloader()))  # the first batch fetches its shard
    assert batch["latents"].shape[1:] == (1, 8, 8)
    assert list((tmp_path / "cache").rglob("shard.*"))


@pytest.mark.parametrize("case,match", [
    ("bucket", "does not exist: check data.path"),
    ("credentials", "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"),
    ("endpoint", "could not reach the object store .* check S3_ENDPOINT_URL"),
])
def test_a_bad_remote_fails_at_start_up_naming_what_to_fix(s3_env, tmp_path, monkeypatch, digits_shards, case, match):
    from framework.train import train

    path = f"s3://{BUCKET}/digits"
    if case == "bucket":
        path = "s3://no-such-bucket/digits"
    elif case == "credentials":
        for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            monkeypatch.delenv(k)
        monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
        monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    else:
        monkeypatch.setenv("S3_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens on the discard port
    t0 = time.monotonic()
    with pytest.raises(Exception, match=match):
        train(compose_cfg(cheap(tmp_path, digits_shards, f"data.path={path}", f"data.local={tmp_path / 'cache'}")))
    assert time.monotonic() - t0 < 60, "a bad remote must fail at start-up, not after retries"


def test_training_from_s3_killed_and_resumed_follows_the_uninterrupted_local_run(s3, tmp_path, digits_shards):
    """Train from s3:// with a local cache, kill -9 the run at step 3 (last checkpoint: step 2), resume it: the
    losses of every step equal those of an uninterrupted run on the local copy of the same shards."""
    common = ["data.batch_size=16", "trainer.checkpoint_every_n_steps=2", "trainer.max_steps=4"]
    remote = [f"data.path=s3://{BUCKET}/digits", *common]
    run = tmp_path / "s3"
    proc = run_train(run, digits_shards, *remote, env={**s3, "PROBE_PAUSE_AT": "3"}, wait=False)
    deadline = time.time() + 240
    while not (run / "paused_rank0").exists():
        assert time.time() < deadline and proc.poll() is None, "the run from s3:// did not reach step 3"
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    from framework.training.checkpointing import checkpoint_step

    assert checkpoint_step(run / "checkpoints" / "last.ckpt") == 2
    run_train(run, digits_shards, *remote, env=s3)
    local = tmp_path / "local"
    run_train(local, digits_shards, *common)
    got, want = losses(run), losses(local)
    assert sorted(got) == list(range(4))
    assert [got[s] for s in range(4)] == [want[s] for s in range(4)]
    wg = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    wl = torch.load(local / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    for k in wl:
        torch.testing.assert_close(wg[k], wl[k], rtol=0, atol=0)


def test_checkpoints_on_s3_resume_a_run_whose_run_dir_is_gone_like_the_uninterrupted_run(s3_env, tmp_path,
                                                                                         digits_shards):
    """trainer.checkpoint_dir=s3://... on 2 fsdp ranks: each sharded checkpoint is uploaded once complete, `latest`
    names the newest, keep_checkpoints=1 leaves one remote. The run folder is then deleted; the same command with
    resume=auto downloads the remote checkpoint (global rank 0; rank 1 waits for it) and trains on with the losses
    and final weights of a run never stopped."""
    import boto3

    from tests.helpers import fsdp, weights

    s3 = s3_env  # (set in this process too, for the in-process run at the end)
    url = f"s3://{BUCKET}/ckpt"
    common = [*fsdp(devices=2, batch=8), "trainer.keep_checkpoints=1"]
    client = boto3.client("s3", endpoint_url=s3["S3_ENDPOINT_URL"], aws_access_key_id=s3["AWS_ACCESS_KEY_ID"],
                          aws_secret_access_key=s3["AWS_SECRET_ACCESS_KEY"], region_name="us-east-1")

    def remote() -> tuple[str, list[str]]:
        keys = [o["Key"] for o in client.list_objects_v2(Bucket=BUCKET, Prefix="ckpt/").get("Contents", [])]
        latest = client.get_object(Bucket=BUCKET, Key="ckpt/latest")["Body"].read().decode()
        return latest, sorted({k.split("/")[1] for k in keys if k.split("/")[1] != "latest"})

    run = tmp_path / "run"
    run_train(run, digits_shards, *common, f"trainer.checkpoint_dir={url}", "trainer.max_steps=3", env=s3)
    assert remote() == ("step0000003.ckpt", ["step0000003.ckpt"])  # step 2 was uploaded, then pruned
    shutil.rmtree(run)
    out = run_train(run, digits_shards, *common, f"trainer.checkpoint_dir={url}", "trainer.max_steps=6", env=s3)
    assert f"resume=auto: {url}/step0000003.ckpt is newer than run.dir's checkpoints" in out.stdout, out.stdout[-3000:]
    assert remote() == ("step0000006.ckpt", ["step0000006.ckpt"])
    ref = tmp_path / "ref"
    run_train(ref, digits_shards, *common, "trainer.max_steps=6")
    got, want = losses(run), losses(ref)
    assert sorted(got) == [3, 4, 5] and all(got[s] == want[s] for s in got), (got, want)
    resumed, uninterrupted = (weights(r / "checkpoints" / "last.ckpt") for r in (run, ref))
    for k in uninterrupted:
        torch.testing.assert_close(resumed[k], uninterrupted[k], rtol=0, atol=0)
    # a run started afresh on that prefix (resume=null) is refused before it trains: its checkpoints would not be
    # uploaded until step 6, and `latest` would name the other run's
    from framework.train import train

    with pytest.raises(ValueError, match=rf"trainer.checkpoint_dir={url} holds a run's checkpoints up to step 6 "
                                         r"\(latest: step0000006.ckpt\) and this run starts at step 0: resume=auto"):
        train(compose_cfg(cheap(tmp_path, digits_shards, f"trainer.checkpoint_dir={url}", "resume=null", run="fresh")))
    assert remote() == ("step0000006.ckpt", ["step0000006.ckpt"])


def test_a_checkpoint_dir_that_is_no_object_store_url_is_refused():
    from framework.config import TrainerConfig

    with pytest.raises(ValueError, match="trainer.checkpoint_dir='/data/ckpt': give an object-store URL"):
        TrainerConfig(checkpoint_dir="/data/ckpt")
