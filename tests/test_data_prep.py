"""data_prep: sources, encoders, the precompute app's guarantees (no-op re-run, refusal, restart, bad input)."""
from __future__ import annotations

import io
import json
import sys
import tarfile
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from data_prep.precompute import load_pixels, precompute
from data_prep.sources.digits import digit_captions, load_digits
from tests.helpers import BUCKETS, MIXED_SIZES, digits_config, folder_config, make_image_folder, make_mixed_folder, read_rows
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
    assert record.format_version == FORMAT_VERSION and record.num_samples == 1438 * 3
    assert record.to_json() == written  # no field lost or added on the way through
    assert "width" not in written and "buckets" not in written  # optional fields stay out when a dataset has none
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
        pixels = load_pixels(_as_jpeg(pngs[i]), "RGB", 8).numpy()
        np.testing.assert_allclose(row["latents"].astype(np.float32), pixels, atol=1e-3)


def write_tars(pngs: list[Path], folder: Path, per_tar: int) -> list[Path]:
    """img2dataset-style tars of `per_tar` images each: <i>.jpg, <i>.txt (the png's caption) and <i>.json."""
    folder.mkdir(parents=True)
    tars = []
    for t in range(0, len(pngs), per_tar):
        tars.append(folder / f"{t // per_tar:05d}.tar")
        with tarfile.open(tars[-1], "w") as tar:
            for i, png in enumerate(pngs[t:t + per_tar], t):
                for ext, data in (("jpg", _as_jpeg(png)), ("txt", png.with_suffix(".txt").read_bytes()),
                                  ("json", b"{}")):
                    info = tarfile.TarInfo(f"{i:09d}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    return tars


def _as_jpeg(png: Path) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.open(png).convert("RGB").save(buf, format="JPEG")
    return buf.getvalue()


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
    import data_prep.precompute as pre

    written, write = [], pre.write_json_atomic

    def checked(path: Path, obj: dict) -> None:
        if path.parent.name == "done":
            index = path.parent.parent / path.stem / "index.json"
            assert index.is_file(), f"{path.name} written while its part has no index.json yet (writer still open)"
            assert sum(s["samples"] for s in json.loads(index.read_text())["shards"]) == obj["rows"]
            written.append(path)
        write(path, obj)

    monkeypatch.setattr(pre, "write_json_atomic", checked)
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
    opened: list[str] = []
    tar_open, read_caption, open_image = wds.tarfile.open, folder_source.read_caption, pre.open_image
    monkeypatch.setattr(wds.tarfile, "open", lambda path, *a, **k: opened.append(Path(path).name) or tar_open(path, *a, **k))
    monkeypatch.setattr(folder_source, "read_caption", lambda path: opened.append(path.name) or read_caption(path))
    monkeypatch.setattr(pre, "open_image", lambda image, mode: opened.append(getattr(image, "name", "bytes"))
                        or open_image(image, mode))
    precompute(cfg, rank=1, world_size=2)
    assert sorted(set(opened) - {"bytes"}) == sorted(inputs[1] + inputs[3])
    opened.clear()
    out = precompute(cfg, rank=0, world_size=2)
    assert sorted(set(opened) - {"bytes"}) == sorted(inputs[0] + inputs[2])
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


def test_precompute_bounds_its_caption_cache_by_caption_cache_mb(tmp_path, tiny_text_encoder_dir, monkeypatch):
    """caption_cache_mb reaches the rank's cache: 8 images with 2 distinct captions are 2 encoder inputs by default
    and 8 at caption_cache_mb=0 (nothing kept)."""
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
