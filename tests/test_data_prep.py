"""data_prep: sources, encoders, the precompute app's guarantees (no-op re-run, refusal, restart, bad input)."""
from __future__ import annotations

import io
import json
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from data_prep.precompute import load_pixels, precompute
from data_prep.sources.digits import digit_captions, load_digits
from tests.helpers import (
    BUCKETS, MIXED_SIZES, as_jpeg, digits_config, folder_config, make_image_folder, make_mixed_folder, read_rows,
    write_gray_video, write_tars,
)
from tests import zygote

REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------
# digits
# ---------------------------------------------------------------------------------------------


def test_digits_split_is_fixed_and_disjoint():
    xtr, ytr = load_digits("train")
    xho, yho = load_digits("heldout")
    assert len(xtr) + len(xho) == 1797 and len(xho) == 359
    assert xtr.dtype == np.uint8 and xtr.shape[1:] == (8, 8) and xtr.max() <= 16 and ytr.dtype == np.int64
    train_rows = {x.tobytes() + bytes([y]) for x, y in zip(xtr, ytr)}
    assert not any(x.tobytes() + bytes([y]) in train_rows for x, y in zip(xho, yho))
    np.testing.assert_array_equal(load_digits("heldout")[0], xho)  # same split every call
    assert len(set(digit_captions(7))) >= 3 and "a handwritten 7" in digit_captions(7)


def test_digits_dataset_json_and_rows(digits_shards, capsys):
    info = json.loads((digits_shards / "dataset.json").read_text())
    assert info["num_samples"] == 1438 * 3 and info["num_classes"] == 10
    assert info["latent_channels"] == 1 and info["latent_size"] == [8, 8] and info["image_mode"] == "L"
    assert info["scaling_factor"] == 1.0 and info["shift_factor"] == 0.0 and info["text_dim"] == 384
    assert (digits_shards / info["empty_caption"]).is_file()
    # re-run: nothing to do, and it says so
    precompute(digits_config(digits_shards), rank=0, world_size=1)
    assert "nothing to do" in capsys.readouterr().out
    # a different config on the same folder is refused, naming the difference
    with pytest.raises(FileExistsError, match="resolution"):
        precompute(digits_config(digits_shards, resolution=16), rank=0, world_size=1)


# ---------------------------------------------------------------------------------------------
# folder / manifest / webdataset, tiny VAE + tiny text encoder
# ---------------------------------------------------------------------------------------------


def test_the_dataset_record_round_trips_and_refuses_what_it_cannot_read(digits_shards, tmp_path):
    """dataset.json is one typed record (data_prep/record.py): the file precompute wrote reads back and writes the
    same JSON; a record from a newer LatentForge, or one missing a field, is refused naming the file and the fix."""
    from data_prep.record import FORMAT_VERSION, DatasetRecord

    written = json.loads((digits_shards / "dataset.json").read_text())
    record = DatasetRecord.read(digits_shards)
    # fp16 text: still format 1, which LatentForge before text_storage reads too (format 2 adds the other storages,
    # format 3 a row per image with several captions, format 4 the posterior's std, format 5 video clips, format 6 a
    # video VAE's clips)
    assert (record.format_version, record.text_storage, FORMAT_VERSION) == (1, "fp16", 7)
    assert record.num_samples == 1438 * 3
    assert record.to_json() == written  # no field lost or added on the way through
    # optional fields stay out when a dataset has none
    assert not {"width", "buckets", "num_frames", "fps", "temporal_compression"} & set(written)
    record.write(tmp_path)
    assert json.loads((tmp_path / "dataset.json").read_text()) == written
    newer = {**written, "format_version": FORMAT_VERSION + 1}
    with pytest.raises(ValueError, match=f"format_version {FORMAT_VERSION + 1}.*reads up to {FORMAT_VERSION}"):
        DatasetRecord.from_json(newer, "somewhere/dataset.json")
    partial = {k: v for k, v in written.items() if k != "text_dim"}
    with pytest.raises(ValueError, match=r"somewhere/dataset.json lacks \['text_dim'\]"):
        DatasetRecord.from_json(partial, "somewhere/dataset.json")


def test_folder_with_vae_matches_diffusers_and_transformers(tmp_path, tiny_vae_dir, tiny_text_encoder_dir):
    """The stored latents are what diffusers itself gives for each image (its VaeImageProcessor's resize-and-crop,
    AutoencoderKL.encode's posterior mean, unscaled), and the text embeddings what transformers' model gives for
    the caption (last hidden states of its real tokens): references independent of data_prep's own code."""
    import torch
    from diffusers import AutoencoderKL
    from diffusers.image_processor import VaeImageProcessor
    from PIL import Image
    from transformers import AutoModel, AutoTokenizer

    src = make_image_folder(tmp_path / "imgs")
    out = precompute(folder_config(src, tmp_path / "ds", tiny_text_encoder_dir, vae=str(tiny_vae_dir),
                                   resolution=16), rank=0, world_size=1)
    info = json.loads((out / "dataset.json").read_text())
    assert info["latent_channels"] == 4 and info["latent_size"] == [8, 8] and info["downsample"] == 2
    assert info["scaling_factor"] == 0.5 and info["shift_factor"] == 0.1 and info["posterior"] == "mean"
    assert info["num_samples"] == 6 and info["num_classes"] is None and info["image_mode"] == "RGB"
    vae = AutoencoderKL.from_pretrained(tiny_vae_dir).eval()
    images = VaeImageProcessor(vae_scale_factor=2, resample="bicubic")
    tokenizer, bert = AutoTokenizer.from_pretrained(tiny_text_encoder_dir), AutoModel.from_pretrained(tiny_text_encoder_dir)
    rows = read_rows(out)
    assert len(rows) == 6
    for row in rows:
        name = row["key"].split("#")[0]
        with torch.no_grad():
            pixels = images.preprocess(Image.open(src / name).convert("RGB"), height=16, width=16, resize_mode="crop")
            expect = vae.encode(pixels).latent_dist.mean[0].numpy()  # (4, 8, 8)
            tokens = tokenizer(row["caption"], return_tensors="pt")
            emb = bert(**tokens).last_hidden_state[0].numpy()  # (L, 32)
        assert row["latents"].dtype == np.float16 and "label" not in row
        np.testing.assert_allclose(row["latents"].astype(np.float32), expect, atol=2e-3, rtol=1e-3)
        assert row["text_embeds"].shape == emb.shape  # trimmed to the real token count
        np.testing.assert_allclose(row["text_embeds"].astype(np.float32), emb, atol=5e-3, rtol=1e-3)
        assert row["caption"] == (src / name).with_suffix(".txt").read_text()


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_manifest(tmp_path, tiny_text_encoder_dir, fmt):
    if fmt == "parquet":
        pytest.importorskip("pyarrow", reason="parquet needs pyarrow (a declared dependency)")
    src = make_image_folder(tmp_path / "imgs", n=4)
    rows = [{"image": str(p.relative_to(tmp_path)), "caption": p.with_suffix(".txt").read_text(), "label": i}
            for i, p in enumerate(sorted(src.rglob("*.png")))]
    manifest = tmp_path / f"m.{fmt}"
    df = pd.DataFrame(rows)
    df.to_json(manifest, orient="records", lines=True) if fmt == "jsonl" else df.to_parquet(manifest)
    cfg = folder_config(manifest, tmp_path / "ds", tiny_text_encoder_dir)
    cfg["source"] = {"name": "manifest", "path": str(manifest)}
    out = precompute(cfg, rank=0, world_size=1)
    got = read_rows(out)
    assert sorted(r["label"] for r in got) == [0, 1, 2, 3]
    assert {r["caption"] for r in got} == {r["caption"] for r in rows}


def test_webdataset(tmp_path, tiny_text_encoder_dir):
    src = make_image_folder(tmp_path / "imgs", n=5)
    write_tars(sorted(src.rglob("*.png")), tmp_path / "wds", per_tar=5)
    cfg = folder_config(tmp_path / "wds", tmp_path / "ds", tiny_text_encoder_dir)
    cfg["source"] = {"name": "webdataset", "path": str(tmp_path / "wds")}
    out = precompute(cfg, rank=0, world_size=1)
    assert json.loads((out / "dataset.json").read_text())["num_samples"] == 5
    # Each sample's caption is its own .txt, and its pixels those of its own JPEG (the pixel codec stores them).
    pngs = sorted(src.rglob("*.png"))
    for row in read_rows(out):
        i = int(row["key"].split(":")[-1].split("#")[0])  # "00000.tar:000000003"
        assert row["caption"] == pngs[i].with_suffix(".txt").read_text(), row["key"]
        pixels = load_pixels(as_jpeg(pngs[i]), "RGB", 8).numpy()
        np.testing.assert_allclose(row["latents"].astype(np.float32), pixels, atol=1e-3)


# ---------------------------------------------------------------------------------------------
# Bad input, restarts, several ranks
# ---------------------------------------------------------------------------------------------


def test_bad_images_and_missing_captions(tmp_path, tiny_text_encoder_dir, capsys):
    src = make_image_folder(tmp_path / "imgs", n=6)
    data = (src / "img000.png").read_bytes()
    (src / "img000.png").write_bytes(data[: len(data) // 2])  # truncated
    (src / "img002.txt").unlink()  # missing caption
    with pytest.raises(RuntimeError, match=r"2 of 6 records unusable.*max_bad_fraction"):
        precompute(folder_config(src, tmp_path / "strict", tiny_text_encoder_dir), rank=0, world_size=1)
    assert not (tmp_path / "strict" / "dataset.json").exists()  # never looks complete
    out = precompute(folder_config(src, tmp_path / "lenient", tiny_text_encoder_dir, max_bad_fraction=0.5),
                     rank=0, world_size=1)
    info = json.loads((out / "dataset.json").read_text())
    assert info["num_samples"] == 4 and info["skipped"] == {"bad_images": 1, "missing_captions": 1}
    assert "img000.png: unreadable image" in capsys.readouterr().out
    # the refused folder, again with the higher limit: its encoded part is kept and only merged
    again = precompute(folder_config(src, tmp_path / "strict", tiny_text_encoder_dir, max_bad_fraction=0.5),
                       rank=0, world_size=1)
    assert "1 of 1 parts already done, 0 to encode here" in capsys.readouterr().out
    assert [r["key"] for r in read_rows(again)] == [r["key"] for r in read_rows(out)]


def test_wrong_encoder_paths(tmp_path, tiny_vae_dir, tiny_text_encoder_dir):
    src = make_image_folder(tmp_path / "imgs", n=2)
    with pytest.raises(ValueError, match="not a diffusers AutoencoderKL"):
        precompute(folder_config(src, tmp_path / "a", tiny_text_encoder_dir, vae=str(tiny_text_encoder_dir)),
                   rank=0, world_size=1)
    with pytest.raises(ValueError, match="not a transformers text encoder"):
        precompute(folder_config(src, tmp_path / "b", tiny_vae_dir), rank=0, world_size=1)
    with pytest.raises(ValueError, match="no config.json"):
        precompute(folder_config(src, tmp_path / "c", tmp_path), rank=0, world_size=1)


def marked_done_only_when_written(monkeypatch) -> list[Path]:
    """Check, as each done marker is written, that its part is already complete on disk: the part's index.json
    (which MDSWriter writes last, when it closes) counts the rows the marker claims. Returns the markers written."""
    from data_prep.location import Location

    written, write = [], Location.write_json

    def checked(self: Location, name: str, obj: dict) -> None:
        path = self.local(name)
        if path.parent.name == "done":
            index = path.parent.parent / path.stem / "index.json"
            assert index.is_file(), f"{path.name} written while its part has no index.json yet (writer still open)"
            assert sum(s["samples"] for s in json.loads(index.read_text())["shards"]) == obj["rows"]
            written.append(path)
        write(self, name, obj)

    monkeypatch.setattr(Location, "write_json", checked)
    return written


def test_interrupted_run_restarts_cleanly(tmp_path, tiny_text_encoder_dir, monkeypatch, capsys):
    """A crash mid-part: the finished part is kept as it is, the unfinished one is cleared and encoded again."""
    src = make_image_folder(tmp_path / "imgs", n=4)
    cfg = folder_config(src, tmp_path / "ds", tiny_text_encoder_dir, records_per_part=2)
    written = marked_done_only_when_written(monkeypatch)
    out = precompute(cfg, rank=0, world_size=1)
    assert [p.name for p in written] == ["part_000000.json", "part_000001.json"]
    first, rows = json.loads((out / "dataset.json").read_text()), read_rows(out)
    # simulate a crash mid-way: part 1 had not finished and dataset.json was never written
    (out / "dataset.json").unlink()
    (out / "done" / "part_000001.json").unlink()
    (out / "part_000001" / "junk.partial").write_text("half a shard")
    kept = (out / "done" / "part_000000.json").stat()
    with pytest.raises(FileNotFoundError, match="did not finish"):
        from framework.data.datamodule import read_dataset_info

        read_dataset_info(str(out))
    capsys.readouterr()
    precompute(cfg, rank=0, world_size=1)
    assert "1 of 2 parts already done, 1 to encode here" in capsys.readouterr().out
    assert json.loads((out / "dataset.json").read_text())["num_samples"] == first["num_samples"]
    assert not (out / "part_000001" / "junk.partial").exists()
    again = (out / "done" / "part_000000.json").stat()
    assert (again.st_ino, again.st_mtime_ns) == (kept.st_ino, kept.st_mtime_ns)  # part 0 was not encoded again
    assert [(r["key"], r["caption"]) for r in read_rows(out)] == [(r["key"], r["caption"]) for r in rows]
    # another source under the same folder is refused, naming the parts
    (src / "img009.png").write_bytes((src / "img000.png").read_bytes())
    (out / "dataset.json").unlink()
    with pytest.raises(FileExistsError, match="2 parts then, 3 now.*source or records_per_part changed"):
        precompute(cfg, rank=0, world_size=1)


@pytest.mark.parametrize("launcher", ["args", "torchrun", "srun"])
def test_two_ranks_merge(tmp_path, tiny_text_encoder_dir, monkeypatch, launcher):
    """Rank 1 encodes its part and returns; rank 0 encodes its own, then merges all three in the source's order. The
    rank and world size come from the arguments, from torchrun's RANK / WORLD_SIZE, or from srun's SLURM_PROCID /
    SLURM_NTASKS alone."""
    from data_prep.config import SourceConfig
    from data_prep.sources import get_source

    src = make_image_folder(tmp_path / "imgs", n=5)
    cfg = folder_config(src, tmp_path / "ds", tiny_text_encoder_dir, records_per_part=2)  # parts of 2, 2 and 1 images
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"):
        monkeypatch.delenv(k, raising=False)

    def as_rank(rank: int) -> Path:
        if launcher == "args":
            return precompute(cfg, rank=rank, world_size=2)
        names = ("RANK", "WORLD_SIZE", "LOCAL_RANK") if launcher == "torchrun" else ("SLURM_PROCID", "SLURM_NTASKS",
                                                                                    "SLURM_LOCALID")
        for name, value in zip(names, (rank, 2, rank)):
            monkeypatch.setenv(name, str(value))
        return precompute(cfg)

    as_rank(1)
    assert sorted(p.name for p in (tmp_path / "ds").glob("done/*.json")) == ["part_000001.json"]
    assert not (tmp_path / "ds" / "dataset.json").exists()
    out = as_rank(0)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"):
        monkeypatch.delenv(k, raising=False)  # the rows are read back by one process
    index = json.loads((out / "index.json").read_text())
    assert [s["raw_data"]["basename"].split("/")[0] for s in index["shards"]] == [f"part_{i:06d}" for i in range(3)]
    in_order = [f"{r.key}#0" for r in get_source(SourceConfig(name="folder", path=str(src))).records()]
    assert [r["key"] for r in read_rows(out)] == in_order and len(in_order) == 5


@pytest.mark.parametrize("kind", ["webdataset", "folder"])
def test_a_rank_opens_only_its_own_input_shards(tmp_path, tiny_text_encoder_dir, monkeypatch, kind):
    """Rank 1 of 2 reads the tars (or the images and captions) of parts 1 and 3 and nothing of parts 0 and 2; rank 0
    the others. Recorded where the source opens a tar or a caption file, and where precompute opens an image."""
    import data_prep.precompute as pre
    import data_prep.sources.folder as folder_source
    import data_prep.sources.webdataset as wds

    pngs = sorted(make_image_folder(tmp_path / "imgs", n=8).rglob("*.png"))
    cfg = folder_config(tmp_path / "imgs", tmp_path / "ds", tiny_text_encoder_dir, records_per_part=2)
    if kind == "webdataset":
        write_tars(pngs, tmp_path / "wds", per_tar=2)
        cfg["source"] = {"name": "webdataset", "path": str(tmp_path / "wds")}
        inputs = [[f"{t:05d}.tar"] for t in range(4)]
    else:
        inputs = [sorted(f"{p.stem}{ext}" for p in pngs[2 * t:2 * t + 2] for ext in (".png", ".txt")) for t in range(4)]
    log = tmp_path / "opened.txt"  # a file: the decode workers (other processes) open images and tars too

    def note(name: str) -> None:
        with open(log, "a") as f:
            f.write(name + "\n")

    def opened() -> set[str]:
        names = set(log.read_text().split()) - {"bytes"}
        log.unlink()
        return names

    tar_open, read_caption, open_image = wds.tarfile.open, folder_source.read_caption, pre.open_image
    monkeypatch.setattr(wds.tarfile, "open", lambda path, *a, **k: note(Path(path).name) or tar_open(path, *a, **k))
    monkeypatch.setattr(folder_source, "read_caption", lambda path: note(path.name) or read_caption(path))
    monkeypatch.setattr(pre, "open_image", lambda image, mode: note(getattr(image, "name", "bytes"))
                        or open_image(image, mode))
    precompute(cfg, rank=1, world_size=2)
    assert sorted(opened()) == sorted(inputs[1] + inputs[3])
    out = precompute(cfg, rank=0, world_size=2)
    assert sorted(opened()) == sorted(inputs[0] + inputs[2])
    assert len(read_rows(out)) == 8


# A rank of the killed run: precompute as `python -c`, ranks from RANK / WORLD_SIZE, each image slowed down so that
# the kill lands while some parts are done and others are being written.
SLOW_RANK = """
import json, sys, time
import data_prep.precompute as pre
to_tensor = pre.to_tensor
def slow(img):
    time.sleep(0.15)
    return to_tensor(img)
pre.to_tensor = slow
pre.precompute(json.loads(sys.argv[1]))
"""


def test_a_killed_run_resumes_on_another_number_of_ranks(tmp_path, tiny_text_encoder_dir, capsys):
    """Two ranks are SIGKILLed once a seeded number of parts is done; three ranks resume. Parts finished before the
    kill are not encoded again, the leftover is dealt evenly over the three, and the dataset equals one uninterrupted
    process's: the same rows in the same order (latents and captions exact; text embeddings up to float round-off,
    since the ranks' encoder ran with another thread count)."""
    from tests.helpers import train_env

    src = make_image_folder(tmp_path / "imgs", n=24)
    cfg = folder_config(src, tmp_path / "ds", tiny_text_encoder_dir, records_per_part=2)  # 12 parts
    reference = read_rows(precompute({**cfg, "out": str(tmp_path / "reference")}, rank=0, world_size=1))
    kill_after = int(np.random.default_rng(41).integers(2, 6))  # done markers seen before the kill
    done = tmp_path / "ds" / "done"
    ranks = []
    for r in range(2):
        (tmp_path / f"tmp{r}").mkdir()
        env = train_env(tmp_path / f"tmp{r}", {"RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": str(r)})
        ranks.append(zygote.popen([sys.executable, "-c", SLOW_RANK, json.dumps(cfg)], env=env))
    try:
        deadline = time.monotonic() + 120
        while len(list(done.glob("*.json"))) < kill_after:
            assert time.monotonic() < deadline and all(p.poll() is None for p in ranks), \
                [p.communicate()[0][-2000:] for p in ranks if p.poll() is not None]
            time.sleep(0.01)
    finally:
        for p in ranks:
            p.kill()
            p.wait(60)
    kept = {f.name: (f.stat().st_ino, f.stat().st_mtime_ns) for f in done.glob("*.json")}
    assert kill_after <= len(kept) < 12, kept
    assert not (tmp_path / "ds" / "dataset.json").exists()
    unfinished = next(i for i in range(12) if f"part_{i:06d}.json" not in kept)
    (tmp_path / "ds" / f"part_{unfinished:06d}").mkdir(exist_ok=True)
    (tmp_path / "ds" / f"part_{unfinished:06d}" / "junk.partial").write_text("half a shard")

    capsys.readouterr()
    for rank in (2, 1, 0):  # one after the other: ranks 1 and 0 find the markers rank 2 has just written
        out = precompute(cfg, rank=rank, world_size=3)
    log = capsys.readouterr().out
    assert f"rank 2 of 3: {len(kept)} of 12 parts already done" in log
    assert {f.name: (f.stat().st_ino, f.stat().st_mtime_ns) for f in done.glob("*.json") if f.name in kept} == kept
    assert not (tmp_path / "ds" / f"part_{unfinished:06d}" / "junk.partial").exists()
    markers = [json.loads(f.read_text()) for f in sorted(done.glob("*.json")) if f.name not in kept]
    assert {(m["round"], m["world"]) for m in markers} == {(2, 3)} and len(markers) == 12 - len(kept)
    per_rank = [sum(m["rank"] == r for m in markers) for r in range(3)]
    assert max(per_rank) - min(per_rank) <= 1, per_rank
    assert json.loads((out / "dataset.json").read_text())["num_samples"] == len(reference) == 24
    rows = read_rows(out)
    assert [(r["key"], r["latents"].tobytes(), r["caption"]) for r in rows] == \
        [(r["key"], r["latents"].tobytes(), r["caption"]) for r in reference]
    for got, want in zip(rows, reference):
        np.testing.assert_allclose(got["text_embeds"].astype(np.float32), want["text_embeds"].astype(np.float32),
                                   rtol=0, atol=2e-3)


def test_cli_hydra_app(tmp_path, tiny_text_encoder_dir):
    src = make_image_folder(tmp_path / "imgs", n=3)
    cmd = [sys.executable, "-m", "data_prep.precompute", "source=folder", f"source.path={src}", "vae=pixel",
           f"text_encoder={tiny_text_encoder_dir}", "resolution=8", f"out={tmp_path / 'ds'}", "progress=false",
           f"hydra.run.dir={tmp_path / 'hydra'}"]
    for expect in ("wrote 3 samples", "nothing to do"):
        res = zygote.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stderr[-2000:]
        assert expect in res.stdout


# ---------------------------------------------------------------------------------------------
# Aspect-ratio buckets
# ---------------------------------------------------------------------------------------------


def test_buckets_put_each_image_at_its_nearest_aspect_ratio_with_its_crop_recorded(tmp_path):
    """Each image lands in the bucket of nearest aspect ratio, its latents at that shape; the stored pixels are the
    image scaled to cover the bucket and centre-cropped (done here with PIL by hand), and the source size and the
    crop's corner are recorded; dataset.json lists the buckets and their counts; the digits keep their fingerprint."""
    from PIL import Image

    from data_prep.precompute import as_config, fingerprint
    from tests.helpers import digits_config

    src = make_mixed_folder(tmp_path / "imgs")
    out = precompute(folder_config(src, tmp_path / "ds", "minilm", buckets=BUCKETS), rank=0, world_size=1)
    info = json.loads((out / "dataset.json").read_text())
    # ratios h/w: 0.44 0.5 2 2.25 1 0.89 0.49 1 -> 8x16: 3 images, 12x12: 3, 16x8: 2
    assert [(b["size"], b["num_samples"], b["dir"]) for b in info["buckets"]] == [
        ([8, 16], 3, "bucket_8x16"), ([12, 12], 3, "bucket_12x12"), ([16, 8], 2, "bucket_16x8")]
    assert info["num_samples"] == 8 and info["latent_size"] == [12, 12]  # the square bucket's
    assert not (out / "index.json").exists()
    seen = 0
    for b in info["buckets"]:
        for row in read_rows(out / b["dir"]):
            i = int(row["key"].split("#")[0][3:6])
            h, w = MIXED_SIZES[i]
            assert list(row["original_size"]) == [h, w] and list(row["latents"].shape) == [3, *b["size"]]
            bh, bw = b["size"]
            s = max(bw / w, bh / h)
            scaled = Image.open(src / f"img{i:03d}.png").convert("RGB").resize((max(bw, round(w * s)), max(bh, round(h * s))),
                                                                              Image.BICUBIC)
            top, left = (scaled.size[1] - bh) // 2, (scaled.size[0] - bw) // 2
            assert list(row["crop_top_left"]) == [top, left]
            expect = np.asarray(scaled.crop((left, top, left + bw, top + bh)), dtype=np.float32).transpose(2, 0, 1) / 127.5 - 1
            np.testing.assert_allclose(row["latents"].astype(np.float32), expect, atol=1e-2)
            seen += 1
    assert seen == 8
    assert list(read_rows(out / "bucket_16x8")[0]["crop_top_left"]) in ([0, 0], [1, 0], [2, 0])
    # the same config again: nothing to do; a different bucket list is refused
    precompute(folder_config(src, tmp_path / "ds", "minilm", buckets=BUCKETS), rank=0, world_size=1)
    with pytest.raises(FileExistsError, match="buckets"):
        precompute(folder_config(src, tmp_path / "ds", "minilm", buckets=BUCKETS[:2]), rank=0, world_size=1)
    # datasets built without buckets keep their fingerprints (pinned before buckets existed)
    assert fingerprint(as_config(digits_config(tmp_path / "x")))["fingerprint"] == "932367f7a4550c03"


def test_buckets_refuse_bad_specs_and_know_the_presets():
    from data_prep.buckets import nearest_bucket, resolve_buckets, sdxl_sizes

    pixart = resolve_buckets("pixart_1024", 16)
    assert len(pixart) == 33 and (1024, 1024) in pixart and (512, 2048) in pixart and (2048, 512) in pixart
    assert all(abs(h * w / 1024**2 - 1) < 0.16 for h, w in pixart)
    sdxl = sdxl_sizes()
    for size in ((1024, 1024), (832, 1216), (1216, 832), (768, 1344), (576, 1664), (512, 2048)):  # in SDXL's table
        assert size in sdxl
    assert (832, 1280) not in sdxl and (640, 1472) not in sdxl  # more than 1024^2 pixels, fewer than 90% of it
    assert all(h % 64 == 0 and w % 64 == 0 and 0.25 <= h / w <= 4 for h, w in sdxl)
    assert nearest_bucket(1080, 1920, pixart) == pixart.index((768, 1344))  # 16:9 -> 0.57
    with pytest.raises(ValueError, match="not positive multiples of 16"):
        resolve_buckets([[256, 250]], 16)
    with pytest.raises(ValueError, match="use one of pixart_256"):
        resolve_buckets("pixart_2048", 16)


# ---------------------------------------------------------------------------------------------
# The caption cache
# ---------------------------------------------------------------------------------------------


class CountingEncoder:
    """A text encoder stand-in: caption i -> a (4, 8) embedding filled with its length; counts what it encodes."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    def encode(self, captions: list[str]) -> list:
        import torch

        self.seen += captions
        return [torch.full((4, 8), float(len(c))) for c in captions]


def test_the_caption_cache_keeps_the_most_recently_used_within_its_bytes():
    """Three embeddings' worth of room (3 x 64 bytes): a fourth caption drops the least recently used, which is
    encoded again when it comes back; a caption used meanwhile stays. Over 100k distinct captions the kept bytes
    never pass the limit."""
    from data_prep.precompute import CaptionCache

    enc = CountingEncoder()
    cache = CaptionCache(enc, batch_size=2, max_bytes=3 * 64)
    out = cache(["a", "bb", "a", "ccc"])
    assert [float(e[0, 0]) for e in out] == [1, 2, 1, 3] and enc.seen == ["a", "bb", "ccc"]
    cache(["a"])  # used again: now the most recent
    cache(["dddd"])  # drops "bb", the least recently used
    assert list(cache.table) == ["ccc", "a", "dddd"] and cache.bytes == 3 * 64
    cache(["bb", "a"])
    assert enc.seen == ["a", "bb", "ccc", "dddd", "bb"]  # "bb" encoded again, "a" not
    peak = 0
    for i in range(0, 100_000, 500):
        cache([f"caption {j}" for j in range(i, i + 500)])
        peak = max(peak, cache.bytes)
    assert peak <= 3 * 64 and len(cache.table) == 3 and cache.encoded == 5 + 100_000


CACHE_RSS = """
import sys
import torch
from data_prep import storage
from data_prep.precompute import CaptionCache
from framework.bench.fresh import peak_rss_bytes  # the process's peak resident set so far

class Encoder:  # per-token embeddings of 8 tokens x 512, as a rank's text encoder returns them
    def encode(self, captions):
        return [torch.full((8, 512), float(len(c) % 7 + 1)) for c in captions]

cache = CaptionCache(Encoder(), 256, 8 * 2**20)
cache.store = lambda emb: storage.encode_text(emb, sys.argv[1])  # as precompute keeps them
peaks = []
for i in range(0, 100_000, 1000):
    cache([f"caption {j}" for j in range(i, i + 1000)])
    if i + 1000 in (20_000, 100_000):
        peaks.append(peak_rss_bytes() // 2**20)
print(peaks[0], peaks[1], cache.encoded)
"""


@pytest.mark.parametrize("text_storage", ["fp16", "int8"])
def test_a_ranks_peak_memory_stays_flat_over_100k_distinct_captions(text_storage):
    """The caption cache in its own process, with the rows' text columns as precompute keeps them, over 100,000
    distinct captions of 8 x 512 tokens (8 KiB each in fp16, 800 MB kept without a bound): with 8 MiB of room, the
    process's peak resident memory after 100k captions is within 16 MiB of its peak after 20k."""
    res = zygote.run([sys.executable, "-c", CACHE_RSS, text_storage], timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    at_20k, at_100k, encoded = map(int, res.stdout.split()[-3:])
    assert encoded == 100_000
    assert at_100k - at_20k <= 16, f"peak RSS grew {at_100k - at_20k} MiB between 20k and 100k captions"


def test_precompute_bounds_its_caption_cache_by_caption_cache_mb(tmp_path, tiny_text_encoder_dir, monkeypatch):
    """caption_cache_mb reaches the rank's cache: 8 images with 2 distinct captions are 2 encoder inputs by default
    and 8 at caption_cache_mb=0 (nothing kept); the rows written from the cache are the rows encoded afresh, byte for
    byte (a cached embedding handed out and then trimmed or changed in place would differ)."""
    import data_prep.precompute as pre

    src = make_image_folder(tmp_path / "imgs", n=8)
    for i, txt in enumerate(sorted(src.rglob("*.txt"))):
        txt.write_text("a cat" if i % 2 else "a dog")
    caches = []

    class Recorded(pre.CaptionCache):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            caches.append(self)

    monkeypatch.setattr(pre, "CaptionCache", Recorded)
    precompute(folder_config(src, tmp_path / "kept", tiny_text_encoder_dir), rank=0, world_size=1)
    precompute(folder_config(src, tmp_path / "none", tiny_text_encoder_dir, caption_cache_mb=0), rank=0, world_size=1)
    kept, none = caches
    assert (kept.max_bytes, none.max_bytes) == (1024 * 2**20, 0)
    assert (kept.encoded, none.encoded) == (2, 8) and len(read_rows(tmp_path / "none")) == 8
    as_bytes = lambda rows: [{k: (v.tobytes() if isinstance(v, np.ndarray) else v) for k, v in r.items()}  # noqa: E731
                             for r in rows]
    assert as_bytes(read_rows(tmp_path / "kept")) == as_bytes(read_rows(tmp_path / "none"))


# ---------------------------------------------------------------------------------------------
# Text storage, size projection and filters (issue 41)
# ---------------------------------------------------------------------------------------------


def bf16_by_hand(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 -> float32 with integer arithmetic on the bits: the top 16 bits, rounded to nearest, ties to
    even (finite inputs)."""
    bits = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    kept = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return (kept << 16).astype(np.uint32).view(np.float32)


@pytest.mark.parametrize("storage", ["fp16", "bf16", "int8"])
def test_text_storage_round_trips_within_its_bound(storage):
    """Each storage's columns decode to the embedding within its bound: fp16 exactly numpy's float16; bf16 exactly the
    bits rounded by hand (relative error <= 2^-8); int8 within scale / 2 of each value, its scale max|x| / 127 per
    token. Tokens span six orders of magnitude and one is all zeros; a value of 1e6, beyond float16's range, is kept by
    bf16 and int8 and refused by fp16, naming the cure."""
    import torch

    from data_prep.storage import encode_text, nbytes, text_columns
    from framework.data.text_storage import decode_text

    rng = np.random.default_rng(0)
    x = rng.standard_normal((120, 64)).astype(np.float32) * np.logspace(-3, 3, 120, dtype=np.float32)[:, None]
    x[5] = 0.0
    x[9, 3] = 1e6
    if storage == "fp16":
        with pytest.raises(ValueError, match="beyond float16's range.*text_storage=bf16"):
            encode_text(torch.from_numpy(x), storage)
        x[9, 3] = 6e4  # within it
    cols = encode_text(torch.from_numpy(x), storage)
    assert {k: f"ndarray:{v.dtype}" for k, v in cols.items()} == text_columns(storage)
    got = decode_text(cols, storage)
    assert got.dtype == {"fp16": torch.float16, "bf16": torch.bfloat16, "int8": torch.float32}[storage]
    got = got.float().numpy()
    assert nbytes(cols) == {"fp16": 120 * 64 * 2, "bf16": 120 * 64 * 2, "int8": 120 * (64 + 4)}[storage]
    if storage == "fp16":
        np.testing.assert_array_equal(got, x.astype(np.float16).astype(np.float32))
        return
    assert np.isfinite(got).all() and (got[5] == 0).all()
    if storage == "bf16":
        np.testing.assert_array_equal(got, bf16_by_hand(x))
        assert (np.abs(got - x) <= 2**-8 * np.abs(x)).all()
    else:
        scale = cols["text_scale"]  # (L,)
        np.testing.assert_allclose(scale, np.abs(x).max(1) / 127, rtol=1e-7)
        # scale / 2, and float32's round-off on x / scale and q * scale (a few 1e-6 of the scale)
        assert (np.abs(got - x) <= scale[:, None] * (0.5 + 1e-5)).all()
        assert (np.abs(cols["text_embeds"]).max(1)[scale > 0] == 127).all()  # each token's largest value uses the range


def storage_bound(storage: str, ref: np.ndarray, row: dict) -> np.ndarray:
    """How far a storage's decoded value may be from the fp16 dataset's `ref`: its own bound from the encoder's float32
    output x (bf16: 2^-8 |x|; int8: scale / 2) plus the fp16 value's (2^-11 |x|, or float16's smallest half-step)."""
    fp16 = 2**-11 * np.abs(ref) + 2**-25
    if storage == "bf16":
        return 2**-8 * np.abs(ref) * (1 + 2**-10) + fp16
    if storage == "int8":
        return np.asarray(row["text_scale"], np.float32)[:, None] * (0.5 + 1e-5) + fp16
    return np.zeros_like(ref)


def test_each_text_storage_keeps_the_fp16_embeddings_within_its_bound_and_reads_back(tmp_path, tiny_text_encoder_dir,
                                                                                     monkeypatch):
    """The same images precomputed with text_storage=fp16, bf16 and int8: the same rows in the same order, each
    storage's columns and format version recorded, its embeddings within its bound of the fp16 dataset's, its bytes
    per sample as counted by hand, and the data module's batches equal to the rows decoded by hand. A dataset.json
    without text_storage (an older one) reads as fp16; a reader of format 1 reads the fp16 dataset and refuses the
    others; another text_storage over a finished folder is refused."""
    import shutil

    import torch

    import data_prep.record as record
    from framework.data.datamodule import DataConfig, LatentDataModule, read_dataset_info

    src = make_image_folder(tmp_path / "imgs", n=12)
    outs = {s: precompute(folder_config(src, tmp_path / s, tiny_text_encoder_dir, text_storage=s), rank=0, world_size=1)
            for s in ("fp16", "bf16", "int8")}
    infos = {s: json.loads((o / "dataset.json").read_text()) for s, o in outs.items()}
    rows = {s: read_rows(o) for s, o in outs.items()}
    assert [(i["text_storage"], i["format_version"]) for i in infos.values()] == [("fp16", 1), ("bf16", 2), ("int8", 2)]
    assert infos["int8"]["columns"] == ["latents", "text_embeds", "text_scale", "caption", "key"]
    assert infos["bf16"]["columns"] == infos["fp16"]["columns"] == ["latents", "text_embeds", "caption", "key"]
    ref = {r["key"]: r for r in rows["fp16"]}
    assert [r["key"] for r in rows["int8"]] == [r["key"] for r in rows["bf16"]] == list(ref)
    width = {"fp16": 2 * 32, "bf16": 2 * 32, "int8": 32 + 4}  # bytes per token, text dim 32
    for storage in ("bf16", "int8"):
        dtype = {"bf16": np.uint16, "int8": np.int8}[storage]
        for row in rows[storage]:
            want = ref[row["key"]]["text_embeds"].astype(np.float32)
            assert row["text_embeds"].dtype == dtype and row["text_embeds"].shape == want.shape
            if storage == "bf16":  # decoded by hand: the bits are float32's top half
                got = (row["text_embeds"].astype(np.uint32) << 16).view(np.float32)
            else:
                got = row["text_embeds"].astype(np.float32) * row["text_scale"][:, None]
            assert (np.abs(got - want) <= storage_bound(storage, want, row)).all(), row["key"]
    for storage, info in infos.items():
        tokens = sum(len(r["text_embeds"]) for r in rows[storage])
        assert info["size"]["per_sample"]["text"] == pytest.approx(tokens * width[storage] / 12)
        assert info["size"]["per_sample"]["latents"] == 3 * 8 * 8 * 2
    assert infos["int8"]["size"]["per_sample"]["text"] < 0.6 * infos["fp16"]["size"]["per_sample"]["text"]

    # The data module decodes each storage; an older dataset.json (no text_storage) is fp16.
    old = tmp_path / "older"
    shutil.copytree(outs["fp16"], old)
    (old / "dataset.json").write_text(json.dumps({k: v for k, v in infos["fp16"].items()
                                                  if k not in ("text_storage", "size")}))
    assert read_dataset_info(str(old)).text_storage == "fp16"
    for storage, path in (*outs.items(), ("fp16", old)):
        dm = LatentDataModule(DataConfig(path=str(path), local=str(tmp_path / f"cache_{path.name}"), batch_size=12,
                                         shuffle=False), seed=0)
        dm.setup("fit")
        batch = next(iter(dm.train_dataloader()))
        assert batch["text_embeds"].dtype == {"fp16": torch.float16, "bf16": torch.bfloat16, "int8": torch.float32}[storage]
        by_key = {r["key"]: r for r in rows[storage]}
        for i, key in enumerate(batch["key"]):
            row, n = by_key[key], int(batch["text_mask"][i].sum())
            if storage == "int8":
                want = torch.from_numpy(row["text_embeds"].astype(np.float32) * row["text_scale"][:, None])
            elif storage == "bf16":
                want = torch.from_numpy((row["text_embeds"].astype(np.uint32) << 16).view(np.float32))
            else:
                want = torch.from_numpy(row["text_embeds"].astype(np.float32))
            assert torch.equal(batch["text_embeds"][i, :n].float(), want) and not batch["text_embeds"][i, n:].any()

    # A LatentForge that reads format 1 only: the fp16 dataset is still its own, the others are refused.
    monkeypatch.setattr(record, "FORMAT_VERSION", 1)
    record.DatasetRecord.read(outs["fp16"])
    with pytest.raises(ValueError, match="format_version 2; this LatentForge reads up to 1"):
        record.DatasetRecord.read(outs["int8"])
    monkeypatch.undo()
    for done, other in (("fp16", "int8"), ("int8", "bf16")):  # the second pair has the same format version
        was = "None" if done == "fp16" else f"'{done}'"  # fp16, the default, is left out of the fingerprint
        with pytest.raises(FileExistsError, match=rf"'text_storage': \({was}, '{other}'\)"):
            precompute(folder_config(src, outs[done], tiny_text_encoder_dir, text_storage=other), rank=0, world_size=1)


def test_a_dataset_stored_in_int8_trains_on_its_dequantized_embeddings(tmp_path, tiny_text_encoder_dir, monkeypatch):
    """A few training steps of the quickstart config on a folder precomputed with text_storage=int8: every batch the
    model gets holds, for each row, its int8 values times its per-token scales (computed here from the stored rows),
    zeros after them; and the losses are finite."""
    import lightning.pytorch as pl
    import torch

    from framework.train import train
    from tests.helpers import cheap, compose_cfg, losses, with_callback

    src = make_image_folder(tmp_path / "imgs", n=32)
    data = precompute(folder_config(src, tmp_path / "int8", tiny_text_encoder_dir, text_storage="int8"), rank=0,
                      world_size=1)
    by_key = {r["key"]: r["text_embeds"].astype(np.float32) * r["text_scale"][:, None] for r in read_rows(data)}
    seen = []

    class Batches(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.append({k: batch[k] for k in ("text_embeds", "text_mask", "key")})

    with_callback(monkeypatch, Batches())
    out = train(compose_cfg(cheap(tmp_path, data, "logger=csv", "sample.every_n_steps=0", "data.batch_size=8",
                                  steps=3)))
    assert len(seen) == 3 and all(np.isfinite(v) for v in losses(Path(out["run_dir"])).values())
    for batch in seen:
        assert batch["text_embeds"].dtype == torch.float32
        for i, key in enumerate(batch["key"]):
            n = int(batch["text_mask"][i].sum())
            assert torch.equal(batch["text_embeds"][i, :n].cpu(), torch.from_numpy(by_key[key]))
            assert not batch["text_embeds"][i, n:].any()


@pytest.mark.parametrize("kind", ["folder", "webdataset"])
def test_the_size_projected_from_the_first_part_matches_the_output(tmp_path, tiny_text_encoder_dir, capsys, kind):
    """After its first part rank 0 says (and writes to projection.json) what the whole output will weigh: the samples
    the source will give (the folder's size(); a webdataset's tars times the part's records) times the part's bytes
    per sample on disk. Four parts of six images: the projection is within 3% of the shard files and index.json files
    the run then wrote, which dataset.json's `size` counts to the byte; and its text bytes per sample are the int8
    rows' (1 byte a value + a 4-byte scale a token)."""
    src = make_image_folder(tmp_path / "imgs", n=24)
    cfg = folder_config(src, tmp_path / "ds", tiny_text_encoder_dir, records_per_part=6, text_storage="int8")
    if kind == "webdataset":
        write_tars(sorted(src.rglob("*.png")), tmp_path / "wds", per_tar=6)
        cfg["source"] = {"name": "webdataset", "path": str(tmp_path / "wds")}
    out = precompute(cfg, rank=0, world_size=1)
    assert "projected output: 0.000 GB for 24 samples (24 records; 0.000 GB decompressed)" in capsys.readouterr().out
    estimate = json.loads((out / "projection.json").read_text())
    info = json.loads((out / "dataset.json").read_text())
    written = sum(f.stat().st_size for f in out.glob("part_*/*") if f.is_file())  # before any reader decompresses
    assert (estimate["samples"], estimate["from_part"], estimate["text_storage"]) == (24, 0, "int8")
    assert info["size"]["bytes"] == written
    assert estimate["bytes"] == pytest.approx(written, rel=0.03)
    assert estimate["raw_bytes"] == pytest.approx(info["size"]["raw_bytes"], rel=0.03)
    part0 = read_rows(out / "part_000000")  # the first part's own MDS folder
    assert len(part0) == 6
    assert estimate["bytes_per_sample"]["text"] == sum(len(r["text_embeds"]) * (32 + 4) for r in part0) / 6
    assert estimate["bytes_per_sample"]["latents"] == 3 * 8 * 8 * 2


# Thirteen img2dataset samples: each .json's values, and what the filters below make of it (None: kept). The JPEGs
# are 20x24 but the last, 300x400; img2dataset's original_height / original_width say how large the image was before it
# resized it.
WDS_METAS = [
    ({"punsafe": 0.1, "similarity": 0.3, "original_height": 512, "original_width": 768}, None),
    ({"punsafe": 0.9, "similarity": 0.3, "original_height": 512, "original_width": 768}, "punsafe.max"),
    ({"punsafe": 0.1, "similarity": 0.1, "original_height": 512, "original_width": 768}, "similarity.min"),
    ({"similarity": 0.3, "original_height": 512, "original_width": 768}, "punsafe.missing"),
    ({"punsafe": None, "similarity": 0.3, "original_height": 512, "original_width": 768}, "punsafe.missing"),
    ({"punsafe": 0.1, "similarity": 0.3, "original_height": 200, "original_width": 300}, "min_size"),
    ({"punsafe": 0.1, "similarity": 0.3, "original_height": 300, "original_width": 900}, "max_aspect"),
    ({"punsafe": 0.1, "similarity": 0.3}, "min_size"),  # no original size: the decoded 20x24 image's
    ({"punsafe": 0.1, "similarity": 0.3, "original_height": 300, "original_width": 600}, None),  # 2:1, 300 px: kept
    ({"punsafe": 0.5, "similarity": 0.28, "original_height": 512, "original_width": 512}, None),  # bounds inclusive
    ({"punsafe": 0.9, "similarity": 0.3, "original_height": 100, "original_width": 100}, "punsafe.max"),  # first fail
    ({"punsafe": 0.2, "similarity": 0.9, "status": "success", "original_height": 1024, "original_width": 1024}, None),
    ({"punsafe": 0.3, "similarity": 0.5}, None),  # no original size: the decoded 300x400 image's, large enough
]
WDS_FILTERS = {"min_size": 256, "max_aspect": 2.0, "filters": {"punsafe": {"max": 0.5}, "similarity": {"min": 0.28}}}


def test_webdataset_filters_drop_records_by_their_json_and_count_each_filter(tmp_path, tiny_text_encoder_dir, capsys):
    """min_size, max_aspect and thresholds on the .json's numbers: the filtered dataset is the unfiltered one less
    exactly the records WDS_METAS marks (same rows, same latents); each dropped record is counted once, under the first
    filter it fails, in each part's done marker, summed in dataset.json's skipped.filtered and printed. The size is
    img2dataset's original size when the .json has it, else the decoded image's; a record without a thresholded key
    (or with null) is dropped as <key>.missing. Other filter values over the folder are refused."""
    from PIL import Image

    src = make_image_folder(tmp_path / "imgs", n=12)
    Image.fromarray(np.random.default_rng(1).integers(0, 256, (300, 400, 3), dtype=np.uint8)).save(src / "zbig.png")
    (src / "zbig.txt").write_text("a large picture")
    pngs = sorted(src.rglob("*.png"))
    assert pngs[-1].name == "zbig.png"
    write_tars(pngs, tmp_path / "wds", per_tar=6, metas=[m for m, _ in WDS_METAS])  # 3 tars: 6, 6 and 1 samples
    base = folder_config(tmp_path / "wds", tmp_path / "all", tiny_text_encoder_dir)
    base["source"] = {"name": "webdataset", "path": str(tmp_path / "wds")}
    everything = read_rows(precompute(base, rank=0, world_size=1))
    capsys.readouterr()
    out = precompute({**base, "out": str(tmp_path / "kept"), **WDS_FILTERS}, rank=0, world_size=1)
    log = capsys.readouterr().out
    expect = {f"{i:09d}" for i, (_, why) in enumerate(WDS_METAS) if why is None}
    assert [(r["key"], r["latents"].tobytes()) for r in read_rows(out)] == \
        [(r["key"], r["latents"].tobytes()) for r in everything if r["key"].split(":")[1].split("#")[0] in expect]
    counts = {n: 0 for n in ("punsafe.missing", "punsafe.max", "similarity.missing", "similarity.min", "min_size",
                             "max_aspect")}
    per_part = [dict(counts) for _ in range(3)]
    for i, (_, why) in enumerate(WDS_METAS):
        if why is not None:
            per_part[i // 6][why] += 1
    for p in range(3):
        assert json.loads((out / "done" / f"part_{p:06d}.json").read_text())["filtered"] == per_part[p]
    info = json.loads((out / "dataset.json").read_text())
    total = {n: sum(part[n] for part in per_part) for n in counts}
    assert info["skipped"] == {"bad_images": 0, "missing_captions": 0, "filtered": total}
    assert info["num_samples"] == len(expect) == 5
    assert "filtered out 8 records before encoding (punsafe.missing: 2, punsafe.max: 2" in log
    with pytest.raises(FileExistsError, match=r"'min_size': \(256, 128\)"):  # the filters are part of the fingerprint
        precompute({**base, "out": str(out), **WDS_FILTERS, "min_size": 128}, rank=0, world_size=1)


def test_size_filters_read_the_decoded_image_of_a_folder(tmp_path, tiny_text_encoder_dir):
    """Without a .json the size and shape are the decoded image's: of the folder's eight images, (30, 61) is under
    min_size=35 and (40, 90) and (90, 40) are longer than twice their width or height; (40, 80) is exactly 2:1 and
    kept. The rest are the unfiltered dataset's rows."""
    from tests.helpers import MIXED_SIZES

    src = make_mixed_folder(tmp_path / "imgs")
    everything = read_rows(precompute(folder_config(src, tmp_path / "all", "minilm"), rank=0, world_size=1))
    out = precompute(folder_config(src, tmp_path / "kept", "minilm", min_size=35, max_aspect=2.0), rank=0, world_size=1)
    dropped = {MIXED_SIZES.index(s) for s in ((30, 61), (40, 90), (90, 40))}
    assert [r["key"] for r in read_rows(out)] == [r["key"] for r in everything if int(r["key"][3:6]) not in dropped]
    assert json.loads((out / "dataset.json").read_text())["skipped"]["filtered"] == {"min_size": 1, "max_aspect": 2}


def test_filter_and_storage_keys_are_checked_before_anything_is_written(tmp_path):
    from data_prep.config import PrecomputeConfig

    for bad, match in (({"text_storage": "fp8"}, "text_storage='fp8': use one of fp16, bf16, int8"),
                       ({"min_size": 0}, "min_size=0"), ({"max_aspect": 0.5}, "max_aspect=0.5"),
                       ({"filters": {"punsafe": {"below": 0.5}}}, r"filters.punsafe=\{'below': 0.5\}: give min and/or max"),
                       ({"filters": {"punsafe": {"max": "x"}}}, "filters.punsafe.max='x': must be a number"),
                       ({"filters": {"punsafe": {"min": 0.6, "max": 0.5}}}, "min=0.6 > max=0.5"),
                       ({"filters": ["punsafe"]}, "a mapping")):
        with pytest.raises(ValueError, match=match):
            PrecomputeConfig(**bad)
    src = make_image_folder(tmp_path / "imgs", n=2)
    with pytest.raises(ValueError, match="source=folder does not have .source=webdataset does."):
        precompute(folder_config(src, tmp_path / "ds", "minilm", filters={"punsafe": {"max": 0.5}}), rank=0, world_size=1)
    assert not (tmp_path / "ds").exists()


# --------------------------------------------------------------------------------------------
# Video clips (source=video_folder)
# --------------------------------------------------------------------------------------------


def test_video_folder_becomes_clips_of_num_frames_at_fps_with_short_and_broken_videos_counted(tmp_path,
                                                                                           tiny_text_encoder_dir):
    """source=video_folder num_frames=4 fps=12 on 24-fps videos: every 2nd frame from the start, each frame cropped and
    encoded like an image (pixel codec: the frame itself), latents (C, 4, h, w); a video with too few frames at that
    rate and a file that is no video are skipped and counted with the unreadable images; dataset.json records the clips,
    which training reads as clips."""
    from data_prep.record import DatasetRecord
    from framework.data.datamodule import read_dataset_info

    src = tmp_path / "videos"
    src.mkdir()
    write_gray_video(src / "ramp.mp4", [20 * i for i in range(12)])
    write_gray_video(src / "short.mp4", [0, 100, 200])  # 2 frames at every 2nd: fewer than 4
    (src / "broken.mp4").write_bytes(b"not a video at all")
    for name in ("ramp", "short", "broken"):
        (src / f"{name}.txt").write_text(f"a {name} clip")
    cfg = {"source": {"name": "video_folder", "path": str(src)}, "vae": "pixel", "text_encoder": str(tiny_text_encoder_dir),
           "resolution": 8, "image_mode": "L", "num_frames": 4, "fps": 12, "max_bad_fraction": 1.0,
           "out": str(tmp_path / "clips"), "progress": False}
    out = precompute(cfg, rank=0, world_size=1)
    rec = DatasetRecord.read(out)
    assert (rec.num_frames, rec.fps, rec.format_version, rec.num_samples) == (4, 12, 5, 1) and rec.latent_frames == 4
    assert rec.skipped["bad_images"] == 2 and (rec.latent_channels, rec.latent_size) == (1, [8, 8])
    (row,) = read_rows(out)
    assert row["key"] == "ramp.mp4#0" and row["latents"].shape == (1, 4, 8, 8)
    want = np.array([20 * i for i in (0, 2, 4, 6)]) / 127.5 - 1.0  # frames 0, 2, 4, 6 of the ramp
    got = row["latents"].astype(np.float32)
    np.testing.assert_allclose(got.mean(axis=(0, 2, 3)), want, atol=2 / 127.5)
    assert float(np.ptp(got, axis=(0, 2, 3)).max()) <= 2 / 127.5  # each frame stays uniform
    info = read_dataset_info(str(out))
    assert (info.num_frames, info.fps, info.latent_size) == (4, 12, (8, 8))
    with pytest.raises(ValueError, match="num_frames=F"):
        precompute({**cfg, "num_frames": None, "out": str(tmp_path / "none")}, rank=0, world_size=1)
    with pytest.raises(ValueError, match="holds images, not videos"):
        images = make_image_folder(tmp_path / "images", n=2)
        precompute({**cfg, "source": {"name": "folder", "path": str(images)}, "out": str(tmp_path / "img")}, rank=0,
                   world_size=1)


def test_manifest_and_webdataset_videos_become_clips(tmp_path, tiny_text_encoder_dir):
    """A manifest whose rows name videos, and video2dataset-style tars (<key>.mp4 + <key>.txt), give clips with
    num_frames as a folder of videos does: the first frames of each, in order; without num_frames they are refused
    as videos are by the image path (unreadable images)."""
    import tarfile

    from data_prep.record import DatasetRecord

    src = tmp_path / "videos"
    src.mkdir()
    levels = {"up": [20 * i for i in range(6)], "down": [200 - 30 * i for i in range(6)]}
    for name, values in levels.items():
        write_gray_video(src / f"{name}.mp4", values)
    (src / "clips.jsonl").write_text("".join(json.dumps({"image": f"{n}.mp4", "caption": f"going {n}"}) + "\n"
                                             for n in levels))
    tars = tmp_path / "tars"
    tars.mkdir()
    with tarfile.open(tars / "00000.tar", "w") as tar:
        for i, name in enumerate(levels):
            for ext, data in (("mp4", (src / f"{name}.mp4").read_bytes()), ("txt", f"going {name}".encode())):
                info = tarfile.TarInfo(f"{i:09d}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    common = {"vae": "pixel", "text_encoder": str(tiny_text_encoder_dir), "resolution": 8, "image_mode": "L",
              "num_frames": 4, "progress": False}
    for source in ({"name": "manifest", "path": str(src / "clips.jsonl")}, {"name": "webdataset", "path": str(tars)}):
        out = precompute({**common, "source": source, "out": str(tmp_path / source["name"])}, rank=0, world_size=1)
        assert DatasetRecord.read(out).num_frames == 4
        rows = read_rows(out)
        assert [r["caption"] for r in rows] == ["going up", "going down"]
        for row, values in zip(rows, levels.values()):
            got = row["latents"].astype(np.float32).mean(axis=(0, 2, 3))  # (1, 4, 8, 8): a level a frame
            np.testing.assert_allclose(got, np.array(values[:4]) / 127.5 - 1.0, atol=2 / 127.5)


def test_a_folder_another_rank_is_writing_the_fingerprint_into_is_not_refused(tmp_path):
    """Ranks start at once: one may find the other's temporary precompute.json (written, then renamed) and must not take
    the folder for someone else's; any other file in a folder without precompute.json is still refused."""
    from data_prep.location import open_output
    from data_prep.precompute import FINGERPRINT_FILE, _check_existing, as_config, fingerprint

    fp = fingerprint(as_config(digits_config(tmp_path / "out")))
    out = tmp_path / "out"
    out.mkdir()
    (out / f"{FINGERPRINT_FILE}.tmp4242").write_text("{")  # another rank, between its write and its rename
    assert _check_existing(open_output(str(out), None), fp) is False
    (out / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="is not empty and was not written by data_prep.precompute"):
        _check_existing(open_output(str(out), None), fp)


def test_digits_labels_keeps_only_those_digits(tmp_path):
    """source.labels=[3,7]: the dataset holds the training images of digits 3 and 7 and no other."""
    from data_prep.precompute import precompute
    from data_prep.sources.digits import load_digits
    from framework.training.validation import HeldOut
    from tests.helpers import digits_config

    out = precompute(digits_config(tmp_path / "d", source={"name": "digits", "labels": [3, 7], "rows_per_image": 1}),
                     rank=0, world_size=1)
    held = HeldOut(str(out))
    labels = [int(row["label"]) for group in held.groups for row in (group[i] for i in range(len(group)))]
    _, train_labels = load_digits("train")
    assert sorted(set(labels)) == [3, 7] and len(labels) == int(((train_labels == 3) | (train_labels == 7)).sum())
