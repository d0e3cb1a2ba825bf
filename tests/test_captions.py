"""Several captions per image (precompute's caption_layout=per_image): the latents stored once with every caption's
embedding, and one caption drawn per sample per training step from the step's seed.

References: the same source precomputed with a row per caption (the rows per_image must hold, regrouped); the
single-process draw (what two ranks must draw for the same global batch); an uninterrupted run (what a resumed one
must train on).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from data_prep.precompute import precompute
from tests.helpers import (
    crash_and_resume, digits_config, make_image_folder, rank_at, read_rows, with_callback,
)

# A manifest of 6 images captioned 1, 2 or 3 times (COCO-style lists), one of them with a blank caption in its list.
CAPTIONS = [["a red square"], ["a dot", "a small dot"], ["noise", "grey noise", "random grey noise"],
            ["stripes", " "], ["a blob", "a soft blob", "a soft round blob"], ["tiles"]]


def manifest(tmp_path: Path) -> Path:
    src = make_image_folder(tmp_path / "imgs", n=len(CAPTIONS))
    path = tmp_path / "manifest.jsonl"
    pngs = sorted(src.rglob("*.png"), key=lambda p: p.name)
    path.write_text("".join(json.dumps({"image": str(p), "caption": c}) + "\n" for p, c in zip(pngs, CAPTIONS)))
    return path


@pytest.mark.parametrize("storage", ["fp16", "int8"])
def test_per_image_rows_hold_the_latents_once_with_every_caption(tmp_path, tiny_text_encoder_dir, storage, monkeypatch):
    """A manifest whose caption column holds lists, precomputed both ways: per_image has a row per image with the
    latents and the text of the per_caption rows of that image, caption by caption in the list's order (blank ones
    left out), what dataset.json counts, and the latent bytes of 6 images instead of 11 captions; the data module
    hands every caption of a sample to the module; a per_image run over a finished per_caption folder is refused,
    and so is the dataset by a reader of format 2."""
    import data_prep.record as record
    from framework.data.datamodule import LatentCollate, read_dataset_info
    from framework.data.text_storage import decode_captions, decode_text

    src = manifest(tmp_path)
    cfg = lambda layout: {"source": {"name": "manifest", "path": str(src)}, "vae": "pixel",  # noqa: E731
                          "text_encoder": str(tiny_text_encoder_dir), "resolution": 8, "progress": False,
                          "text_storage": storage, "caption_layout": layout, "out": str(tmp_path / layout)}
    outs = {layout: precompute(cfg(layout), rank=0, world_size=1) for layout in ("per_caption", "per_image")}
    rows = {layout: read_rows(out) for layout, out in outs.items()}
    infos = {layout: json.loads((out / "dataset.json").read_text()) for layout, out in outs.items()}
    kept = [[c.strip() for c in each if c.strip()] for each in CAPTIONS]

    by_key = {r["key"]: r for r in rows["per_caption"]}
    assert len(rows["per_image"]) == len(CAPTIONS) and len(by_key) == sum(map(len, kept))
    for row, captions in zip(rows["per_image"], kept):
        assert row["captions"] == captions and list(row["text_lengths"]) == [
            len(by_key[f"{row['key']}#{j}"]["text_embeds"]) for j in range(len(captions))]
        embeds = decode_captions(row, storage)
        for j, caption in enumerate(captions):
            ref = by_key[f"{row['key']}#{j}"]
            assert ref["caption"] == caption and np.array_equal(ref["latents"], row["latents"])
            assert torch.equal(embeds[j], decode_text(ref, storage)), (row["key"], j)

    image, caption = infos["per_image"], infos["per_caption"]
    assert (image["caption_layout"], image["format_version"], caption["caption_layout"]) == ("per_image", 3, "per_caption")
    assert (image["num_samples"], image["num_images"], image["num_captions"]) == (6, 6, 11)
    assert (caption["num_samples"], caption["num_captions"]) == (11, 11)
    latents = lambda info: info["size"]["per_sample"]["latents"] * info["num_samples"]  # noqa: E731
    assert latents(image) == 6 * 3 * 8 * 8 * 2 and latents(caption) == 11 * 3 * 8 * 8 * 2
    text_columns = ["text_embeds", "text_scale"] if storage == "int8" else ["text_embeds"]
    assert image["columns"] == ["latents", *text_columns, "text_lengths", "captions", "key"]

    info = read_dataset_info(str(outs["per_image"]))
    batch = LatentCollate(info.scaling_factor, info.shift_factor, text_storage=storage,
                          caption_layout=info.caption_layout)(rows["per_image"][1:4])
    assert "text_embeds" not in batch and batch["caption_counts"].tolist() == [2, 3, 1]
    assert batch["captions"] == [c for each in kept[1:4] for c in each]
    flat = [e for r in rows["per_image"][1:4] for e in decode_captions(r, storage)]
    for n, e in enumerate(flat):
        assert torch.equal(batch["caption_embeds"][n, :len(e)], e) and int(batch["caption_mask"][n].sum()) == len(e)

    with pytest.raises(FileExistsError, match="caption_layout"):
        precompute({**cfg("per_image"), "out": str(outs["per_caption"])}, rank=0, world_size=1)
    # A LatentForge that reads up to format 2 refuses the per_image dataset; a record without the key is per_caption.
    monkeypatch.setattr(record, "FORMAT_VERSION", 2)
    with pytest.raises(ValueError, match="format_version 3; this LatentForge reads up to 2"):
        record.DatasetRecord.read(outs["per_image"])
    older = {k: v for k, v in caption.items() if k not in ("caption_layout", "num_captions")}
    assert record.DatasetRecord.from_json(older, "older/dataset.json").caption_layout == "per_caption"


def drawn(counts: list[int], micro: int, r: int = 0, W: int = 1, seed: int = 7) -> list[int]:
    """StepDraws.captions for a rank at stream position r of W, at micro-batch `micro`."""
    return rank_at(seed, micro, r, W).captions(torch.tensor(counts)).tolist()



def test_the_caption_draw_follows_the_step_and_the_global_row_not_the_rank_count():
    """One global batch of 8 samples of 1 to 4 captions over 40 micro-batches: two ranks (rows r, r + 2, ...) draw what
    one process draws for the same rows; a sample of one caption always gets it; every caption of every sample is
    drawn, at close to its share; another seed draws otherwise."""
    counts = [3, 1, 2, 4, 3, 3, 2, 4]
    draws = np.array([drawn(counts, m) for m in range(40)])  # (micro-batch, sample)
    for m in (0, 1, 17):
        two = [drawn(counts[r::2], m, r=r, W=2) for r in range(2)]
        assert [two[i % 2][i // 2] for i in range(8)] == draws[m].tolist()
    assert (draws[:, 1] == 0).all()
    for i, k in enumerate(counts):
        seen = np.bincount(draws[:, i], minlength=k)
        assert len(seen) == k and seen.min() >= 2, (i, seen.tolist())  # each drawn 40 / k times on average
    assert (draws[:, [0, 2, 3]] != draws[:1, [0, 2, 3]]).any(axis=1).mean() > 0.5  # steps differ, not one draw
    assert drawn(counts, 0, seed=8) != drawn(counts, 0) or drawn(counts, 1, seed=8) != drawn(counts, 1)


@pytest.fixture(scope="module")
def per_image_digits(tmp_path_factory) -> Path:
    """The digits training set, 1,438 images x 3 captions, as a row per image."""
    return precompute(digits_config(tmp_path_factory.mktemp("digits") / "data", caption_layout="per_image"),
                      rank=0, world_size=1)


class Batches:
    """Records each step's keys, captions and the text the training step gets, per trainer (run) in start order."""

    def __init__(self) -> None:
        import lightning.pytorch as pl

        self.runs: dict[int, dict[int, tuple]] = {}  # id(trainer) -> {step: (keys, captions, text, mask)}
        outer = self

        class Record(pl.Callback):
            def on_train_batch_start(self, trainer, module, batch, batch_idx):
                outer.runs.setdefault(id(trainer), {})[trainer.global_step] = (
                    list(batch["key"]), list(batch["caption"]), batch["text_embeds"].clone(), batch["text_mask"].clone())

        self.callback = Record()


def test_training_draws_a_caption_per_sample_and_step_and_resumes_on_the_same_draws(tmp_path, per_image_digits,
                                                                                     monkeypatch):
    """A 4-step run on per-image digits and the same run crashed after step 3 and resumed from step 2: the same losses
    and weights (tests/helpers.py crash_and_resume) and the same caption for every sample in the resumed steps. Each
    step's text is the drawn caption's embedding as stored, padded to the longest drawn; over the steps every caption
    position is drawn."""
    from framework.data.text_storage import decode_captions

    record = Batches()
    with_callback(monkeypatch, record.callback)
    full, resumed = crash_and_resume(tmp_path, per_image_digits, [], monkeypatch)
    full_steps, _, resumed_steps = record.runs.values()  # the full run, the crashed one, the resumed one
    assert sorted(full_steps) == [0, 1, 2, 3] and sorted(resumed_steps) == [2, 3]
    for step in (2, 3):
        assert resumed_steps[step][:2] == full_steps[step][:2]

    rows = {r["key"]: r for r in read_rows(per_image_digits)}
    positions = set()
    for keys, captions, text, mask in full_steps.values():
        longest = 0
        for i, (key, caption) in enumerate(zip(keys, captions)):
            assert caption in rows[key]["captions"], (key, caption)
            j = rows[key]["captions"].index(caption)
            positions.add(j)
            want = decode_captions(rows[key])[j]
            longest = max(longest, len(want))
            assert int(mask[i].sum()) == len(want) and torch.equal(text[i, :len(want)], want), (key, caption)
        assert text.shape[1] == longest
    assert positions == {0, 1, 2}


def test_a_row_per_caption_is_kept_by_default(digits_shards):
    """The default layout is a row per caption (datasets and fingerprints from before caption_layout stay as they
    were): digits' 1,438 images x 3 captions are 4,314 rows, each with its own caption."""
    info = json.loads((digits_shards / "dataset.json").read_text())
    assert (info["caption_layout"], info["num_samples"], info["num_images"]) == ("per_caption", 4314, 1438)
