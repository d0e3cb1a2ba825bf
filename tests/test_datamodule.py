"""framework.data.datamodule: batches, scaling once, caption dropout, start-up checks, ranks, loader state and resume."""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Optional

import lightning as L
import numpy as np
import pytest
import torch

import framework.data.shards
from data_prep.encoders import load_image_codec
from data_prep.precompute import load_pixels, precompute
from data_prep.sources.digits import DIGIT_WORDS, load_digits
from framework.bench.suite_data import measure_loader_throughput
from framework.data.datamodule import DataConfig, LatentDataModule, check_compatible, read_dataset_info
from framework.models.conditioning import drop_captions
from framework.data.shards import check_shards
from tests.helpers import make_image_folder, torchrun
from tests import zygote

REPO = Path(__file__).resolve().parents[1]


def module(path, tmp_path, name="cache", **kw) -> LatentDataModule:
    dm = LatentDataModule(DataConfig(path=str(path), local=str(tmp_path / name), **kw), seed=0)
    dm.setup("fit")
    return dm


# ---------------------------------------------------------------------------------------------
# Batches
# ---------------------------------------------------------------------------------------------


def test_digits_batches(digits_shards, tmp_path):
    dm = module(digits_shards, tmp_path, batch_size=16)
    assert dm.info.num_classes == 10 and dm.info.empty_text_embeds.shape[1] == 384
    batch = next(iter(dm.train_dataloader()))
    assert batch["latents"].shape == (16, 1, 8, 8) and batch["latents"].dtype == torch.float32
    B, L, D = batch["text_embeds"].shape
    assert (B, D) == (16, 384) and batch["text_mask"].shape == (16, L) and batch["text_mask"].dtype == torch.bool
    assert batch["text_embeds"].dtype == torch.float16  # as stored: converted on the device by the training step
    assert batch["text_mask"].sum(1).max() == L  # padded to the longest caption, no further
    assert (batch["text_embeds"][~batch["text_mask"]] == 0).all()
    assert batch["label"].dtype == torch.int64
    images, labels = load_digits("train")
    for i in range(B):
        idx = int(batch["key"][i].split("-")[2].split("#")[0])
        expect = torch.from_numpy(np.round(images[idx] * 255.0 / 16)).float() / 127.5 - 1  # pixel codec
        torch.testing.assert_close(batch["latents"][i, 0], expect, atol=1e-3, rtol=1e-3)  # fp16 storage
        assert int(batch["label"][i]) == labels[idx]
        assert str(labels[idx]) in batch["caption"][i] or DIGIT_WORDS[labels[idx]] in batch["caption"][i]


def test_vae_latents_scaled_exactly_once(tmp_path, tiny_vae_dir, tiny_text_encoder_dir):
    src = make_image_folder(tmp_path / "imgs", n=4)
    out = precompute({"source": {"name": "folder", "path": str(src)}, "vae": str(tiny_vae_dir),
                      "text_encoder": str(tiny_text_encoder_dir), "resolution": 16, "out": str(tmp_path / "ds"),
                      "progress": False}, rank=0, world_size=1)
    dm = module(out, tmp_path, batch_size=4, shuffle=False)
    batch = next(iter(dm.train_dataloader()))
    assert "label" not in batch and batch["latents"].shape == (4, 4, 8, 8)
    codec = load_image_codec(str(tiny_vae_dir))
    for i, key in enumerate(batch["key"]):
        raw = codec.encode(load_pixels(src / key.split("#")[0], "RGB", 16)[None])[0]  # unscaled
        torch.testing.assert_close(batch["latents"][i], (raw - 0.1) * 0.5, atol=2e-3, rtol=1e-3)


def test_prepare_data_builds_missing_dataset(tmp_path, tiny_text_encoder_dir):
    src = make_image_folder(tmp_path / "imgs", n=3)
    prepare = {"source": {"name": "folder", "path": str(src)}, "text_encoder": str(tiny_text_encoder_dir),
               "resolution": 8, "progress": False}
    dm = LatentDataModule(DataConfig(path=str(tmp_path / "ds"), batch_size=2, prepare=prepare))
    dm.prepare_data()
    dm.setup("fit")
    assert dm.info.num_samples == 3 and len(list(dm.train_dataloader())) == 1  # drop_last


# ---------------------------------------------------------------------------------------------
# Caption dropout and compatibility
# ---------------------------------------------------------------------------------------------


def test_drop_captions():
    text, mask = torch.randn(16, 3, 5), torch.tensor([[1, 1, 0]] * 16, dtype=torch.bool)
    empty = torch.randn(4, 5)  # longer than the batch's captions
    text0, mask0 = text.clone(), mask.clone()
    same = drop_captions(text, mask, empty, torch.zeros(16, dtype=torch.bool))
    assert same[0] is text and same[1] is mask
    t, m = drop_captions(text, mask, empty, torch.ones(16, dtype=torch.bool))
    assert t.shape == (16, 4, 5) and (t == empty).all() and m.all()
    drop = torch.arange(16) % 2 == 0
    t, m = drop_captions(text, mask, empty, drop)
    assert (t[drop] == empty).all() and m[drop].all()
    # Kept rows: their caption, zero-padded to the empty caption's length, and their mask.
    assert torch.equal(t[~drop, :3], text[~drop]) and (t[~drop, 3:] == 0).all()
    assert torch.equal(m[~drop, :3], mask[~drop]) and not m[~drop, 3:].any()
    assert torch.equal(text, text0) and torch.equal(mask, mask0)  # the inputs are untouched
    # inplace=True (the training step's own float32 copy): the dropped rows written into that very tensor, as above
    short = torch.randn(2, 5)  # no longer than the captions: no padding
    expected, expected_mask = drop_captions(text, mask, short, drop)
    own = text.clone()
    t, m = drop_captions(own, mask, short, drop, inplace=True)
    assert t is own and torch.equal(t, expected) and torch.equal(m, expected_mask)
    assert torch.equal(t[drop, :2], short.expand(8, 2, 5)) and (t[drop, 2:] == 0).all() and torch.equal(t[~drop], text[~drop])
    assert torch.equal(mask, mask0)  # the mask is never written in place


def test_check_compatible(digits_shards):
    info = read_dataset_info(str(digits_shards))
    check_compatible(info, in_channels=1, latent_hw=(8, 8), text_dim=384)
    check_compatible(info, in_channels=1, latent_hw=(8, 8), text_dim=None)  # class-conditional model
    with pytest.raises(ValueError, match=r"dataset\.json: model\.in_channels=4 but the latents have 1 channels") as err:
        check_compatible(info, in_channels=4, latent_hw=(8, 8), text_dim=384)
    assert str(digits_shards / "dataset.json") in str(err.value)
    with pytest.raises(ValueError, match=r"model\.sample_size=32"):
        check_compatible(info, in_channels=1, latent_hw=(32, 32), text_dim=384)
    with pytest.raises(ValueError, match=r"model\.sample_size=8 model\.sample_width=16 but the latents are 8x8"):
        check_compatible(info, in_channels=1, latent_hw=(8, 16), text_dim=384)
    with pytest.raises(ValueError, match=r"model\.text_dim=768.*384"):
        check_compatible(info, in_channels=1, latent_hw=(8, 8), text_dim=768)


# ---------------------------------------------------------------------------------------------
# Start-up failures
# ---------------------------------------------------------------------------------------------


def test_missing_dataset_and_corrupt_shards(digits_shards, tmp_path):
    with pytest.raises(FileNotFoundError, match="not a LatentForge dataset.*data_prep.precompute"):
        read_dataset_info(str(tmp_path / "nothing"))
    copy = Path(shutil.copytree(digits_shards, tmp_path / "copy"))
    shard = min(copy.glob("part_*/shard.*.mds.zstd"))  # a fresh dataset holds only compressed shards
    data = shard.read_bytes()
    shard.write_bytes(data[:-10])  # truncated
    with pytest.raises(ValueError, match=f"shard {shard} is corrupt: {len(data) - 10} bytes on disk.*precompute"):
        LatentDataModule(DataConfig(path=str(copy), validate="size")).setup("fit")
    shard.write_bytes(flip(data, len(data) // 2))  # same size, different bytes: only the hash sees it
    LatentDataModule(DataConfig(path=str(copy), validate="size")).setup("fit")  # (nothing read yet)
    with pytest.raises(ValueError, match=f"shard {shard} is corrupt: its xxh64 hash differs.*precompute"):
        LatentDataModule(DataConfig(path=str(copy))).setup("fit")  # validate=auto hashes a dataset this small
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=f"shard {shard} listed in .* is missing"):
        LatentDataModule(DataConfig(path=str(copy))).setup("fit")
    (copy / "dataset.json").write_text("{not json")
    with pytest.raises(ValueError, match="dataset.json is corrupt"):
        read_dataset_info(str(copy))


def flip(data: bytes, at: int) -> bytes:
    out = bytearray(data)
    out[at] ^= 0xFF
    return bytes(out)


def read_batch(path: Path, local: Optional[Path] = None, **kw) -> dict:
    """One batch through a fresh data module, so Streaming decompresses (or copies) the shard."""
    dm = LatentDataModule(DataConfig(path=str(path), local=str(local) if local else None, batch_size=16,
                                     shuffle=False, **kw), seed=0)
    dm.setup("fit")
    return next(iter(dm.train_dataloader()))


def test_corrupt_decompressed_shard_fails_at_setup(digits_shards, tmp_path):
    """Streaming decompresses shard.00000.mds.zstd into shard.00000.mds beside it and then reads the .mds
    unchecked; a flipped byte in it used to end training mid-epoch with an IndexError from Streaming."""
    copy = Path(shutil.copytree(digits_shards, tmp_path / "copy"))
    expected = read_batch(copy)["key"]
    mds = min(copy.glob("part_*/shard.*.mds"))  # written by Streaming just now
    intact = mds.read_bytes()
    mds.write_bytes(flip(intact, len(intact) // 2))
    with pytest.raises(ValueError, match=f"shard {mds} is corrupt: its xxh64 hash differs from the one in "
                                         f"{copy / 'index.json'}.*Delete it: Streaming decompresses it again"):
        LatentDataModule(DataConfig(path=str(copy))).setup("fit")
    mds.unlink()  # the advice works: the .mds is rebuilt from the intact .zstd
    assert read_batch(copy)["key"] == expected and mds.read_bytes() == intact
    Path(f"{mds}.zstd").unlink()  # reading in place, Streaming would delete the .mds and skip the shard
    with pytest.raises(FileNotFoundError, match=f"shard {mds}.zstd listed in .* is missing \\(the {mds.name} "):
        LatentDataModule(DataConfig(path=str(copy))).setup("fit")


def test_corrupt_cache_shard_fails_at_setup(digits_shards, tmp_path):
    cache = tmp_path / "cache"
    expected = read_batch(digits_shards, cache)["key"]
    mds = min(cache.glob("part_*/shard.*.mds"))  # copied and decompressed by Streaming
    mds.write_bytes(flip(mds.read_bytes(), 20_000))
    with pytest.raises(ValueError, match=f"shard {mds} is corrupt: its xxh64.*Delete it: Streaming fetches it "
                                         f"again from {digits_shards}"):
        LatentDataModule(DataConfig(path=str(digits_shards), local=str(cache))).setup("fit")
    with pytest.raises(ValueError, match=f"shard {mds} is corrupt"):  # a remote dataset's cache is checked too
        check_shards(None, cache, "s3://bucket/digits", "hash")
    mds.unlink()
    assert read_batch(digits_shards, cache)["key"] == expected


def test_size_check_reads_mds_header(digits_shards, tmp_path, monkeypatch):
    """validate=size (and auto above its limit) compares sizes and the .mds header with index.json:
    it catches truncation and a damaged offset table, not bytes flipped inside sample data."""
    copy = Path(shutil.copytree(digits_shards, tmp_path / "copy"))
    read_batch(copy)
    mds = min(copy.glob("part_*/shard.*.mds"))
    intact = mds.read_bytes()
    samples = next(s["samples"] for s in json.loads((copy / "index.json").read_text())["shards"]
                   if s["raw_data"]["basename"] == mds.relative_to(copy).as_posix())
    mds.write_bytes(intact[:-100])
    with pytest.raises(ValueError, match=f"shard {mds} is corrupt: {len(intact) - 100} bytes on disk"):
        LatentDataModule(DataConfig(path=str(copy), validate="size")).setup("fit")
    mds.write_bytes(flip(intact, 4 + 4 * 100 + 3))  # the high byte of sample 100's offset
    with pytest.raises(ValueError, match=f"shard {mds} is corrupt: its table of sample offsets is damaged"):
        LatentDataModule(DataConfig(path=str(copy), validate="size")).setup("fit")
    mds.write_bytes(flip(intact, 4 + 4 * samples + 3))  # the high byte of the end-of-data offset
    with pytest.raises(ValueError, match=f"shard {mds} is corrupt: its offset table ends at byte .* has {len(intact)}"):
        LatentDataModule(DataConfig(path=str(copy), validate="size")).setup("fit")
    mds.write_bytes(flip(intact, 0))  # the sample count
    with pytest.raises(ValueError, match=f"shard {mds} is corrupt: its header counts .* samples, .* {samples}"):
        LatentDataModule(DataConfig(path=str(copy), validate="size")).setup("fit")
    mds.write_bytes(flip(intact, len(intact) // 2))
    LatentDataModule(DataConfig(path=str(copy), validate="size")).setup("fit")  # sizes and header are intact
    monkeypatch.setattr(framework.data.shards, "AUTO_HASH_LIMIT", len(intact))  # below this dataset's ~24 MB
    LatentDataModule(DataConfig(path=str(copy), validate="auto")).setup("fit")


def test_cache_of_another_dataset_fails(digits_shards, tmp_path):
    cache = tmp_path / "cache"
    read_batch(digits_shards, cache)
    index = json.loads((cache / "index.json").read_text())
    index["shards"][0]["samples"] -= 1  # stands for any other dataset's index
    (cache / "index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=f"the cache {cache} \\(data.local\\) holds another dataset.*Delete {cache}"):
        LatentDataModule(DataConfig(path=str(digits_shards), local=str(cache))).setup("fit")


def test_a_later_start_checks_only_the_shard_files_changed_since_the_last_check(digits_shards, tmp_path):
    """A requeue or a resume starts on the shards the job's first start checked: their verdict is kept (per index,
    host, mode and folders) and only files written since are read again."""
    copy = Path(shutil.copytree(digits_shards, tmp_path / "copy"))
    files = len(list(copy.glob("part_*/shard.*.mds.zstd")))
    assert check_shards(copy, None, str(copy), "hash", verdicts=True) == files
    assert check_shards(copy, None, str(copy), "hash", verdicts=True) == 0
    assert check_shards(copy, None, str(copy), "size", verdicts=True) == files  # another mode, its own verdict
    assert check_shards(copy, None, str(copy), "hash") == files  # (without verdicts every file is read)
    shard = min(copy.glob("part_*/shard.*.mds.zstd"))
    intact = shard.read_bytes()
    stat = shard.stat()
    shard.write_bytes(flip(intact, len(intact) // 2))  # same size, mtime set back: its ctime still moves
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    with pytest.raises(ValueError, match=f"shard {shard} is corrupt: its xxh64 hash differs"):
        check_shards(copy, None, str(copy), "hash", verdicts=True)
    shard.write_bytes(intact)
    assert check_shards(copy, None, str(copy), "hash", verdicts=True) == 1
    read_batch(copy)  # Streaming decompresses a shard beside its .zstd: the new .mds is checked
    assert check_shards(copy, None, str(copy), "hash", verdicts=True) == 1


def test_the_ranks_of_a_job_receive_rank_0s_shard_verdict(digits_shards, tmp_path):
    """Rank 0 checks the dataset folder and the others wait for its verdict, so a start of 256 ranks reads the
    shard files once, and every rank stops with the same error."""
    copy = Path(shutil.copytree(digits_shards, tmp_path / "copy"))
    shard = min(copy.glob("part_*/shard.*.mds.zstd"))
    shard.write_bytes(flip(shard.read_bytes(), 100))
    out = tmp_path / "ranks"
    proc = torchrun(2, "-m", "tests.workers.shard_check", str(copy), str(out), tmp=tmp_path, fork=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    r0, r1 = (json.loads(Path(f"{out}.{r}.json").read_text()) for r in range(2))
    assert r0["read"][-1] == shard.name and r1["read"] == []  # rank 0 read up to the corrupt file, rank 1 none
    assert r0["error"].startswith(f"ValueError: shard {shard} is corrupt: its xxh64 hash differs")
    assert r1["error"] == f"{r0['error']} (found by rank 0 on {socket.gethostname()})"


# ---------------------------------------------------------------------------------------------
# Ranks and loader state
# ---------------------------------------------------------------------------------------------

RANK_SCRIPT = textwrap.dedent("""
    import json, sys
    from framework.data.datamodule import DataConfig, LatentDataModule
    dm = LatentDataModule(DataConfig(path=sys.argv[1], local=sys.argv[2], batch_size=50, drop_last=False))
    dm.setup("fit")
    keys = [k for batch in dm.train_dataloader() for k in batch["key"]]
    json.dump(keys, open(sys.argv[3], "w"))
""")


def test_two_ranks_read_disjoint_cover(digits_shards, tmp_path):
    # Streaming itself opens a short-lived gloo group when WORLD_SIZE > 1 and none exists (under
    # Lightning DDP one already does), so the two processes need a rendezvous address.
    procs, port = [], str(zygote.free_port())
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
               "LOCAL_WORLD_SIZE": "2", "PYTHONPATH": str(REPO), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        cmd = [sys.executable, "-c", RANK_SCRIPT, str(digits_shards), str(tmp_path / "cache"),
               str(tmp_path / f"keys{rank}.json")]
        procs.append(zygote.popen(cmd, env=env))
    for p in procs:
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0, out[-2000:]
    k0, k1 = (set(json.loads((tmp_path / f"keys{r}.json").read_text())) for r in range(2))
    assert not k0 & k1 and len(k0 | k1) == 1438 * 3 and abs(len(k0) - len(k1)) <= 50


def test_loader_state_resumes_at_same_sample(digits_shards, tmp_path):
    dm = module(digits_shards, tmp_path, "a", batch_size=32)
    loader = dm.train_dataloader()
    it = iter(loader)
    for _ in range(5):
        next(it)
    state = loader.state_dict()
    expected = [next(it)["key"] for _ in range(3)]
    fresh = module(digits_shards, tmp_path, "b", batch_size=32)
    loader2 = fresh.train_dataloader()
    loader2.load_state_dict(state)
    it2 = iter(loader2)
    assert [next(it2)["key"] for _ in range(3)] == expected


class KeyRecorder(L.LightningModule):
    """Records the sample keys of every training step; the loss only needs a gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.seen: list[list[str]] = []

    def training_step(self, batch, batch_idx):
        self.seen.append(batch["key"])
        return (self.w * batch["latents"].mean()).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(digits_shards, tmp_path, cache: str, max_steps: int, ckpt_in=None, ckpt_out=None) -> list:
    dm = LatentDataModule(DataConfig(path=str(digits_shards), local=str(tmp_path / cache), batch_size=64))
    model = KeyRecorder()
    trainer = L.Trainer(max_steps=max_steps, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                        enable_checkpointing=False, enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(model, dm, ckpt_path=ckpt_in)
    if ckpt_out:
        trainer.save_checkpoint(ckpt_out)
    return model.seen


def test_lightning_resume_continues_mid_epoch(digits_shards, tmp_path):
    """Lightning 2.6 saves the StreamingDataLoader's state under loops.fit_loop.state_dict.combined_loader
    and restores it on resume: a run cut at step 30 (epoch 1 = 67 steps of 64) continues where it stopped."""
    full = _fit(digits_shards, tmp_path, "full", 90)
    first = _fit(digits_shards, tmp_path, "first", 30, ckpt_out=tmp_path / "cut.ckpt")
    ckpt = torch.load(tmp_path / "cut.ckpt", weights_only=False)
    assert ckpt["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]["sample_in_epoch"] == 30 * 64
    second = _fit(digits_shards, tmp_path, "second", 90, ckpt_in=tmp_path / "cut.ckpt")
    assert first == full[:30]
    assert second == full[30:]  # includes the epoch boundary at step 67


def test_measure_loader_throughput(digits_shards, tmp_path):
    res = measure_loader_throughput(str(digits_shards), batch_size=32, num_batches=5, local=str(tmp_path / "c"))
    assert res["samples"] == 5 * 32 and res["samples_per_s"] > 0


def test_shared_memory_left_by_a_dead_dataset_is_not_reused(digits_shards, tmp_path):
    """A killed job can leave Streaming segments behind without their `_locals`. Streaming picks the
    next prefix per segment name and takes the largest, so after a leftover `_locals` (the dead job's
    registration) the chosen prefix can hold a leftover barrier: the new dataset then fails to create
    its own there (or, for segments it creates-or-attaches, shares the dead one's state and can wait on it
    forever). setup() removes such orphans first."""
    import tempfile
    from multiprocessing import resource_tracker
    from multiprocessing.shared_memory import SharedMemory

    from streaming.base.constant import SHM_TO_CLEAN

    shm_dir = Path("/dev/shm")
    if not shm_dir.is_dir():
        pytest.skip("no /dev/shm on this system")

    def taken(i: int, name: str) -> bool:  # as Streaming's search sees prefix i for the segment `name`
        locks = [Path(tempfile.gettempdir(), f"{i:06d}_{k}_filelock") for k in ("barrier", "cache")]
        return (shm_dir / f"{i:06d}_{name}").exists() or any(p.exists() for p in locks)

    def leftover(name: str, size: int) -> str:  # a dead job's segment: nobody will clean it up
        shm = SharedMemory(name, create=True, size=size)
        resource_tracker.unregister(shm._name, "shared_memory")
        shm.close()
        return name

    # The node's prefix lock is held from the choice of q to the dataset's registration, as a job of this
    # framework holds it: another xdist worker opening a dataset meanwhile would take q itself, or remove the
    # leftovers as orphans and take q + 1. The data module's own take of the lock is the one held here. Streaming's
    # file locks go to a fresh temporary folder: this worker's earlier datasets left theirs in its TMPDIR, and a lock
    # at q + 1 would send the search past it.
    (tmp_path / "locks").mkdir()
    with framework.data.shards.prefix_lock(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(framework.data.shards, "prefix_lock", contextlib.nullcontext)
        mp.setattr(tempfile, "tempdir", str(tmp_path / "locks"))
        def choice() -> int:  # the prefix Streaming's search would take now
            return max(next(i for i in range(10**6) if not taken(i, n)) for n in SHM_TO_CLEAN)

        dead, dm = [], None
        try:  # the dead segments go at the end whatever happens (the dead barrier, if the dataset never removed it)
            q = choice()
            dead.append(leftover(f"{q:06d}_locals", 64))
            # The prefix the search now takes, past the dead registration: q + 1 on a quiet node, further on where
            # another process's live datasets hold the next prefixes (a second pytest beside this one). The dead
            # barrier goes there.
            q2 = choice()
            dead.append(leftover(f"{q2:06d}_barrier", 4096))  # a real barrier: bytes
            # With the dead barrier removed, the search takes q2 unless another live dataset holds a segment there.
            want = max(next(i for i in range(10**6) if not taken(i, n) or f"{i:06d}_{n}" == dead[1])
                       for n in SHM_TO_CLEAN)
            try:
                dm = module(digits_shards, tmp_path, batch_size=16)
            except FileExistsError as err:  # Streaming's own barrier could not be created where the dead one is
                pytest.fail(f"the new dataset ran into the dead job's segment: {err}")
        finally:
            for name in dead[: 1 if dm is not None else 2]:
                (shm_dir / name).unlink(missing_ok=True)
    assert dm.dataset._shm_prefix_int == want
    if want == q2:
        assert (shm_dir / dead[1]).stat().st_size < 4096, "the dataset made its own barrier"
    else:
        assert not (shm_dir / dead[1]).exists(), "the dead barrier was removed"
    assert next(iter(dm.train_dataloader()))["latents"].shape == (16, 1, 8, 8)


def test_each_dataset_opened_holds_descriptors_only_on_its_own_shared_memory(digits_shards):
    """Opening a dataset searches every prefix before it for a free one. Streaming's search kept each segment it
    looked at open until the process exited, so the descriptors on /dev/shm grew with the square of the datasets a
    process opened (a single test worker reached its limit of 20,000, and then moto's server could not open its
    socket). Now each dataset adds what the first one added, its own segments, whatever came before it."""
    import gc

    from streaming import StreamingDataset

    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm on this system")

    def on_shm() -> int:  # this process's descriptors on shared-memory segments
        links = []
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                links.append(os.readlink(f"/proc/self/fd/{fd}"))
        return sum(link.startswith("/dev/shm/") for link in links)

    gc.collect()  # an earlier test's garbage holding a segment is not counted as this test's
    before, counts = on_shm(), []
    for _ in range(8):  # opened and dropped one after another, as a notebook or one test worker does
        dataset = framework.data.shards.open_streaming(
            lambda: StreamingDataset(local=str(digits_shards), shuffle=False, batch_size=1))
        del dataset
        gc.collect()
        counts.append(on_shm() - before)
    first = counts[0]
    assert first > 0, "a dataset holds its own segments"
    assert counts == [first * (i + 1) for i in range(8)], f"descriptors on /dev/shm after each dataset: {counts}"


# ---------------------------------------------------------------------------------------------
# Streaming's background threads (framework.data.shards.ShardDataset)
# ---------------------------------------------------------------------------------------------


def epoch_threads(dataset) -> list[str]:
    """The threads now inside one of the dataset's epoch loops (Streaming's prepare and ready threads)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    found = []
    for ident, frame in sys._current_frames().items():
        while frame is not None:
            if frame.f_code.co_name in ("_prepare_thread", "_ready_thread") and frame.f_locals.get("self") is dataset:
                found.append(names.get(ident, str(ident)))
                break
            frame = frame.f_back
    return found


def wait_for(condition, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_dropped_loader_stops_its_threads(digits_shards, tmp_path):
    """Streaming prepares shards (copies them into the cache, decompresses them) in a thread that runs ahead
    of the batches, and stopped it only at the end of the epoch or when the same dataset started another. A
    loader dropped mid-epoch (`next(iter(loader))`, a run stopped at max_steps) left it running for the rest
    of the process: a .mds deleted meanwhile was decompressed again, into the same .tmp file as by the next
    data module over that folder, whose thread then failed and whose epoch ended empty
    (test_corrupt_decompressed_shard_fails_at_setup, one run in three)."""
    copy = Path(shutil.copytree(digits_shards, tmp_path / "copy"))
    dm = LatentDataModule(DataConfig(path=str(copy), batch_size=16, shuffle=False), seed=0)
    dm.setup("fit")
    assert len(next(iter(dm.train_dataloader()))["key"]) == 16  # the loader's iterator is dropped here
    # (they may take a moment to return after they stopped; Streaming's own threads never returned)
    assert wait_for(lambda: not epoch_threads(dm.dataset), 5.0), \
        f"the dropped epoch's threads still run: {epoch_threads(dm.dataset)}"


def test_failed_shard_preparation_raises_instead_of_ending_the_epoch(digits_shards, tmp_path):
    """When its background thread fails to prepare a shard, Streaming logs the error and ends the epoch as if
    it had no more samples: the loader yielded nothing and nothing was raised. The data module raises it."""
    copy = Path(shutil.copytree(digits_shards, tmp_path / "copy"))
    dm = module(copy, tmp_path, batch_size=16, shuffle=False)  # with a cache: the thread copies the shard into it
    shard = min(copy.glob("part_*/shard.*.mds.zstd"))
    shard.unlink()  # after the start-up check: the copy fails
    message = (f"Streaming failed to prepare a shard of {re.escape(str(copy))} .*: FileNotFoundError: .*"
               f"{re.escape(str(shard))}.*would have ended the epoch here without an error")
    # next(..., None): an epoch that ends silently is a failed check ("did not raise"), not a StopIteration.
    with pytest.raises(RuntimeError, match=message):
        next(iter(dm.train_dataloader()), None)
    with pytest.raises(RuntimeError, match=message):  # and again at the next epoch
        next(iter(dm.train_dataloader()), None)


def test_failed_shard_preparation_releases_the_shard(digits_shards, tmp_path, monkeypatch):
    """A reader that needs a shard another thread is preparing waits until it is ready. When that preparation
    failed (say it lost the race for the .tmp file above), Streaming left the shard marked as being prepared
    and the reader (the main thread, in get_item) waited forever. Now the shard can be prepared again."""
    from streaming.base.dataset import _ShardState

    copy = Path(shutil.copytree(digits_shards, tmp_path / "copy"))
    for mds in copy.glob("part_*/shard.*.mds"):  # an earlier in-place reader's: shard 0 must still need preparing
        mds.unlink()
    dm = LatentDataModule(DataConfig(path=str(copy), batch_size=16, shuffle=False), seed=0)
    dm.setup("fit")
    dataset, stream = dm.dataset, dm.dataset.streams[0]
    release = threading.Event()

    def failing_prepare(shard):  # a decompression that fails half-way, once released
        release.wait(10)
        raise FileNotFoundError("shard.00000.mds.tmp")

    monkeypatch.setattr(stream, "prepare_shard", failing_prepare)
    failures = []

    def prepare(blocking: bool) -> None:
        try:
            dataset.prepare_shard(0, blocking)
        except FileNotFoundError as err:
            failures.append(err)

    preparer = threading.Thread(target=prepare, args=(False,), daemon=True)
    preparer.start()
    assert wait_for(lambda: dataset._shard_states[0] == _ShardState.PREPARING, 10.0)
    reader = threading.Thread(target=prepare, args=(True,), daemon=True)  # waits for the shard being prepared
    reader.start()
    release.set()
    preparer.join(10)
    reader.join(10)
    assert not reader.is_alive(), "the reader still waits for a shard whose preparation failed"
    assert failures
    monkeypatch.undo()
    dataset.prepare_shard(0)  # prepared again: decompressed from the intact .zstd
    assert min(copy.glob("part_*/shard.*.mds")).is_file()
    assert len(next(iter(dm.train_dataloader()))["key"]) == 16


# ---------------------------------------------------------------------------------------------
# Streaming's scale knobs
# ---------------------------------------------------------------------------------------------


def test_streaming_scale_keys_reach_the_dataset(digits_shards, tmp_path):
    dm = module(digits_shards, tmp_path, batch_size=8, num_canonical_nodes=2, shuffle_algo="py1s",
                shuffle_block_size=500, download_retry=5, download_timeout=7.5)
    ds = dm.dataset
    assert (ds.num_canonical_nodes, ds.shuffle_algo, ds.shuffle_block_size) == (2, "py1s", 500)
    assert (ds.streams[0].download_retry, ds.streams[0].download_timeout) == (5, 7.5)
    with pytest.raises(ValueError, match="not more than data.num_canonical_nodes=100000"):
        module(digits_shards, tmp_path, name="c2", num_canonical_nodes=100_000)
    for bad, match in (({"shuffle_algo": "py9"}, "data.shuffle_algo='py9'"), ({"num_canonical_nodes": 0}, ">= 1"),
                       ({"num_canonical_nodes": "many"}, "'many'.*auto"), ({"download_timeout": 0}, "download_timeout")):
        with pytest.raises(ValueError, match=match):
            DataConfig(path=str(digits_shards), **bad)


def test_the_shipped_canonical_node_count_partitions_cleanly_on_other_node_counts(digits_shards, tmp_path):
    """The real-data config's canonical node count (auto: 3,840 for a dataset of 15,360 samples or more) partitions
    evenly over every node count a job of 1 to 256 nodes is likely to have (powers of two, and 3, 5, 6, 10, 12, 24,
    48, 96 ...), so a job starts on any of them and a resume on another keeps Streaming's per-node partition; with
    Streaming's default (the first run's 4 nodes) that partition refuses 3 nodes. A small dataset gets fewer
    partitions, at least 4 samples each, instead of a refusal (72 captioned images: 12): here the 4,314 digits rows
    get 960, which 16, 32 and 64 nodes divide (840, the earlier choice, refused them)."""
    from omegaconf import OmegaConf
    from streaming.base.partition import get_partitions

    from framework.data.datamodule import canonical_nodes

    shipped = OmegaConf.load(Path(__file__).parents[1] / "conf" / "data" / "shards.yaml").num_canonical_nodes
    assert shipped == "auto"
    assert canonical_nodes(shipped, 100_000) == 15360 and canonical_nodes(shipped, 30_719) == 3840
    for nodes in (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 48, 64, 96, 128, 256):
        get_partitions("orig", 100_000, 3840, nodes, 8, 2, 32)
    for nodes in (16, 32, 64):  # the first run: 840 raised here
        get_partitions("relaxed", 10_000_000, canonical_nodes("auto", 4314), nodes, 8, 8, 32)
    assert [canonical_nodes("auto", n) for n in (72, 100, 479, 480, 3359, 3360, 3)] == [12, 24, 48, 120, 480, 480, 1]
    assert canonical_nodes(7, 72) == 7 and canonical_nodes(None, 72) is None
    dm = module(digits_shards, tmp_path, batch_size=8, num_canonical_nodes="auto")
    assert dm.dataset.num_canonical_nodes == 960
    with pytest.raises(ValueError, match="evenly divisible"):
        get_partitions("orig", 100_000, 4, 3, 8, 2, 32)


def test_a_shared_memory_prefix_taken_by_another_job_at_the_same_moment_is_retried(digits_shards, tmp_path, monkeypatch,
                                                                                      caplog):
    """Two jobs starting together on one node can both pick Streaming's first free shared-memory prefix; the second
    to create its `NNNNNN_locals` gets FileExistsError (seen in CI: the Slurm sweep's two array jobs). A process
    that is its node's only rank retries with the next prefix; inside a multi-rank job the error is raised."""

    real, calls = framework.data.shards.ShardDataset, []

    def racing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise FileExistsError("[Errno 17] File exists: '/000001_locals'")
        return real(*args, **kwargs)

    monkeypatch.setattr(framework.data.shards, "ShardDataset", racing)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    dm = LatentDataModule(DataConfig(path=str(digits_shards), local=str(tmp_path / "cache"), batch_size=8), seed=0)
    with caplog.at_level("WARNING"):
        dm.setup("fit")
    assert len(calls) == 2 and dm.dataset is not None and "trying the next one" in caplog.text
    calls.clear()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(FileExistsError, match="_locals"):
        framework.data.shards.open_racing_other_jobs(lambda: racing())
    assert len(calls) == 1


def test_two_jobs_opening_their_datasets_together_take_their_prefixes_in_turn(digits_shards, monkeypatch):
    """Streaming chooses its shared-memory prefix on every rank, then creates `NNNNNN_locals` two barriers later:
    two jobs in between both choose the first free one (CI: two 2-rank jobs under pytest-xdist, FileExistsError on
    `_locals`). Here each job stops after its search until the other has searched too, for at most 3 s: under the
    node's prefix lock the second job cannot search before the first has registered, so they never meet, and they
    end on different prefixes without the retry."""
    import threading

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    real, first_search, met = framework.data.shards.first_free_prefix, {}, []
    both = threading.Barrier(2, timeout=3)

    def search(*args, **kwargs):
        found = real(*args, **kwargs)
        me = threading.current_thread().name
        if me not in first_search:
            first_search[me] = found
            try:
                both.wait()
                met.append(found)
            except threading.BrokenBarrierError:
                pass
        return found

    monkeypatch.setattr(framework.data.shards, "first_free_prefix", search)
    modules = [LatentDataModule(DataConfig(path=str(digits_shards), batch_size=8), seed=0) for _ in range(2)]
    errors: list[BaseException] = []

    def open_one(dm):
        try:
            dm.setup("fit")
        except BaseException as err:  # noqa: BLE001 - reported by the assertion below
            errors.append(err)

    jobs = [threading.Thread(target=open_one, args=(dm,), name=f"job{i}") for i, dm in enumerate(modules)]
    for j in jobs:
        j.start()
    for j in jobs:
        j.join(60)
    assert not errors, errors
    assert met == [], f"both jobs searched before either registered, and both found prefix {met}"
    # (Streaming's prefix is the largest first-free one over several segment names, so other live datasets on the
    # node can make it larger than this first search found: only the two jobs' prefixes are compared.)
    prefixes = [dm.dataset._shm_prefix_int for dm in modules]
    assert prefixes[0] != prefixes[1] and len(first_search) == 2


def test_a_temp_folder_too_deep_for_the_workers_socket_is_refused(tmp_path, digits_shards, monkeypatch):
    """Workers hand batches over a Unix socket at TMPDIR/pymp-XXXXXXXX/listener-XXXXXXXX (at most 107 characters):
    a 75-character TMPDIR is the deepest that works, and real workers deliver a batch from it; at 76 characters the
    loader is refused with the fix, instead of the main process waiting forever for a batch the worker dropped."""
    import multiprocessing
    import tempfile

    def tmpdir_of(length: int) -> str:
        path = tmp_path / "t"
        path = Path(str(path) + "x" * (length - len(str(path))))
        path.mkdir(exist_ok=True)
        assert len(str(path)) == length
        return str(path)

    dm = LatentDataModule(DataConfig(path=str(digits_shards), local=str(tmp_path / "cache"), batch_size=8,
                                     num_workers=1), seed=0)
    dm.setup("fit")
    monkeypatch.setattr(tempfile, "tempdir", tmpdir_of(76))
    with pytest.raises(ValueError, match="is 76 characters long.*at most 75 characters, or data.num_workers=0"):
        dm.train_dataloader()
    monkeypatch.setattr(tempfile, "tempdir", tmpdir_of(75))
    monkeypatch.delitem(multiprocessing.current_process()._config, "tempdir", raising=False)  # not the cached one
    batch = next(iter(dm.train_dataloader()))
    assert batch["latents"].shape[0] == 8


def test_shuffle_seed_predownload_cache_limit_and_persistent_workers_reach_the_loader(digits_shards, tmp_path):
    """data.shuffle_seed (null: the run's seed), data.predownload, data.cache_limit reach the Streaming dataset and
    data.persistent_workers the DataLoader (built, never iterated: no worker starts)."""
    ds = module(digits_shards, tmp_path, batch_size=8, shuffle_seed=11, predownload=16, cache_limit="1gb").dataset
    assert (ds.shuffle_seed, ds.predownload, ds.cache_limit) == (11, 16, 1 << 30)
    assert module(digits_shards, tmp_path, name="c2", batch_size=8).dataset.shuffle_seed == 0  # the module's seed
    dm = module(digits_shards, tmp_path, name="c3", batch_size=8, num_workers=1, persistent_workers=True)
    assert dm.train_dataloader().persistent_workers


def test_a_nodes_ranks_take_their_leaders_shared_memory_prefix(tmp_path, digits_shards):
    """Streaming's ranks each searched for the first free shared-memory prefix at their own moment; a segment freed in
    between by another process made them disagree, and rank 1 failed ("prefix=N was not registered by local leader",
    once in CI). Here rank 1's own search is made to find another prefix: it takes its leader's, and both read."""
    out = tmp_path / "prefixes.json"
    proc = torchrun(2, "-m", "tests.workers.shm_prefix", str(digits_shards), str(tmp_path / "cache"), str(out),
                    tmp=tmp_path, fork=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["prefixes"][0] == got["prefixes"][1] and got["samples"][0] == got["samples"][1] > 0
