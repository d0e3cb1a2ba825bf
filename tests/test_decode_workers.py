"""precompute's decode workers (decode_workers=N): the rows are those of decoding in the encoding process, byte for
byte and in the same order, bad and filtered records counted alike; and the decoding really runs in the workers."""

import io
import json
import os
import tarfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from data_prep.precompute import precompute
from tests.helpers import folder_config, make_image_folder, read_rows, write_tars


def rows_of(out: Path) -> list[tuple]:
    return [(r["key"], r["caption"], r["latents"].tobytes(), r["text_embeds"].tobytes()) for r in read_rows(out)]


def markers(out: Path) -> list[dict]:
    return [json.loads(f.read_text()) for f in sorted((out / "done").glob("part_*.json"))]


def folder_with_bad_records(root: Path) -> Path:
    """11 images: one truncated, one without a caption, one too small for min_size=12 (6 x 6)."""
    src = make_image_folder(root, n=10)
    png = src / "img000.png"
    png.write_bytes(png.read_bytes()[:100])  # truncated
    (src / "sub" / "img001.txt").unlink()  # missing caption
    Image.fromarray(np.full((6, 6, 3), 90, dtype=np.uint8)).save(src / "img010.png")
    (src / "img010.txt").write_text("a tiny picture")
    return src


def tars_with_bad_records(root: Path) -> Path:
    """Three tars of 4, 4 and 3 samples: one punsafe over the threshold, one without punsafe, one corrupt JPEG."""
    pngs = sorted(make_image_folder(root / "imgs", n=10).rglob("*.png"))
    metas = [{"punsafe": 0.1} for _ in pngs]
    metas[2] = {"punsafe": 0.9}  # filtered: punsafe.max
    metas[5] = {}  # filtered: punsafe.missing
    write_tars(pngs[:8], root / "wds", per_tar=4, metas=metas[:8])
    with tarfile.open(root / "wds" / "00002.tar", "w") as tar:  # 8.jpg corrupt, 9.jpg and 10.jpg good
        for i, data in ((8, b"\xff\xd8\xff\xe0 not a jpeg"), (9, pngs[8].read_bytes()), (10, pngs[9].read_bytes())):
            for ext, blob in (("jpg", data), ("txt", f"picture {i}".encode()), ("json", b'{"punsafe": 0.2}')):
                info = tarfile.TarInfo(f"{i:09d}.{ext}")
                info.size = len(blob)
                tar.addfile(info, io.BytesIO(blob))
    return root / "wds"


@pytest.mark.parametrize("kind", ["folder", "webdataset"])
def test_decode_workers_write_the_same_rows_in_the_same_order(tmp_path, tiny_text_encoder_dir, kind):
    """decode_workers=2 and 3 against 0: the same rows (keys, captions, latents and text bytes) in the same order,
    and the same counts of bad, captionless and filtered records in each part's marker and in dataset.json. Batches
    of 2 over parts of 7 and 4 records (folder) or 4, 4 and 3 (tars): the workers get unequal numbers of batches,
    and a batch may hold nothing usable."""
    if kind == "folder":
        src = folder_with_bad_records(tmp_path / "imgs")
        extra = {"records_per_part": 7, "min_size": 12}
    else:
        src = tars_with_bad_records(tmp_path)
        extra = {"filters": {"punsafe": {"max": 0.5}}}
    base = folder_config(src, tmp_path / "w0", tiny_text_encoder_dir, batch_size=2, max_bad_fraction=0.5, **extra)
    if kind == "webdataset":
        base["source"] = {"name": "webdataset", "path": str(src)}
    runs = {w: precompute({**base, "out": str(tmp_path / f"w{w}"), "decode_workers": w}, rank=0, world_size=1)
            for w in (0, 2, 3)}
    reference = rows_of(runs[0])
    assert len(reference) == 8
    counted = ("records", "images", "rows", "bad_images", "missing_captions", "filtered", "examples")
    for w in (2, 3):
        assert rows_of(runs[w]) == reference, f"decode_workers={w}"
        assert [{k: m[k] for k in counted} for m in markers(runs[w])] == \
            [{k: m[k] for k in counted} for m in markers(runs[0])]
        info, want = (json.loads((runs[i] / "dataset.json").read_text()) for i in (w, 0))
        assert info["skipped"] == want["skipped"] and info["num_samples"] == 8
        assert info["fingerprint"] == want["fingerprint"]  # not part of the content: a resume may change it
    skipped = json.loads((runs[0] / "dataset.json").read_text())["skipped"]
    if kind == "folder":
        assert skipped == {"bad_images": 1, "missing_captions": 1, "filtered": {"min_size": 1}}
    else:
        assert skipped == {"bad_images": 1, "missing_captions": 0,
                           "filtered": {"punsafe.missing": 1, "punsafe.max": 1}}
    assert [m["decode_workers"] for m in markers(runs[3])] == [3] * len(markers(runs[3]))


def test_the_images_are_decoded_in_the_worker_processes(tmp_path, tiny_text_encoder_dir, monkeypatch):
    """Every image is opened by a decode worker, never by the encoding process, and both workers take a share
    (worker w decodes batches w, w + 2, ...); with decode_workers=0 the encoding process opens them all."""
    import data_prep.precompute as pre

    src = make_image_folder(tmp_path / "imgs", n=8)
    log = tmp_path / "pids.txt"
    open_image = pre.open_image

    def recorded(image, mode):
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
        return open_image(image, mode)

    monkeypatch.setattr(pre, "open_image", recorded)
    cfg = folder_config(src, tmp_path / "w2", tiny_text_encoder_dir, batch_size=2, decode_workers=2)
    precompute(cfg, rank=0, world_size=1)
    pids = [int(p) for p in log.read_text().split()]
    assert len(pids) == 8 and os.getpid() not in pids and len(set(pids)) == 2, pids
    log.unlink()
    precompute({**cfg, "out": str(tmp_path / "w0"), "decode_workers": 0}, rank=0, world_size=1)
    assert [int(p) for p in log.read_text().split()] == [os.getpid()] * 8


def test_decode_workers_is_checked(tmp_path):
    from data_prep.config import PrecomputeConfig

    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="decode_workers"):
            PrecomputeConfig(decode_workers=bad)
