"""Precompute with object storage both ways (issue 41): img2dataset tars read from a bucket by a brace pattern
(source.path=s3://.../{00000..00003}.tar), the dataset written to a bucket (out=s3://..., through staging=DIR), on a
real S3 server on loopback (moto's server mode, tests/helpers.py S3Server), then trained from that bucket.

The module's fixture builds four tars of two images each, uploads them, and precomputes them twice: locally from a
local brace pattern (the reference), and bucket to bucket as rank 1 then rank 0 of two, recording what each rank
downloaded and what lay in the bucket and in staging whenever a part was marked done.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from data_prep.precompute import precompute
from tests.helpers import LEAST_GRID, S3Server, cheap, compose_cfg, folder_config, losses, make_image_folder, read_rows, \
    write_tars

BUCKET = "precompute"  # not tests/helpers.py S3_BUCKET: moto's buckets are shared by the servers of one process
TARS = [f"{t:05d}.tar" for t in range(4)]
PATTERN = "{00000..00003}.tar"


def remote_config(data: dict, out: str, staging: Path) -> dict:
    """The reference's config with the tars read from the bucket and the dataset written to it."""
    return {**data["config"], "source": {"name": "webdataset", "path": data["s3"].url(f"wds/{PATTERN}")}, "out": out,
            "staging": str(staging)}


@pytest.fixture(scope="module")
def data(tmp_path_factory, tiny_text_encoder_dir):
    tmp = tmp_path_factory.mktemp("remote")
    pngs = sorted(make_image_folder(tmp / "images", n=8).rglob("*.png"))
    write_tars(pngs, tmp / "wds", per_tar=2)
    config = folder_config(tmp / "images", tmp / "local", tiny_text_encoder_dir)
    config["source"] = {"name": "webdataset", "path": str(tmp / "wds" / PATTERN)}  # a local brace pattern
    reference = precompute(config, rank=0, world_size=1)
    files = {f.relative_to(reference).as_posix(): f.read_bytes() for f in reference.rglob("*") if f.is_file()}
    with S3Server(BUCKET) as s3, pytest.MonkeyPatch.context() as env:
        for k, v in s3.env.items():
            env.setenv(k, v)
        for name in TARS:
            s3.client.upload_file(str(tmp / "wds" / name), BUCKET, f"wds/{name}")
        data = {"tmp": tmp, "s3": s3, "config": config, "reference": reference, "files": files}
        with pytest.MonkeyPatch.context() as mp:
            data["run"] = bucket_to_bucket(data, mp)
        yield data


def bucket_to_bucket(data: dict, mp: pytest.MonkeyPatch) -> dict:
    """Rank 1 of 2, then rank 0 of 2, from the bucket's tars to s3://precompute/out: for each rank, the tars it
    downloaded (GETs per key) and every path it staged a file at; for each done marker, checks made as it is written."""
    from data_prep.location import RemoteLocation

    s3, staging = data["s3"], data["tmp"] / "staging"
    staged: list[Path] = []
    fetch, writer_out, write_json = RemoteLocation.fetch, RemoteLocation.writer_out, RemoteLocation.write_json

    def marked(self: RemoteLocation, name: str, obj: dict) -> None:
        if name.startswith("done/"):
            part = name.removeprefix("done/").removesuffix(".json")
            keys = set(s3.keys("out"))
            # Every shard the part's index.json lists, and the index itself, are in the bucket already
            assert f"{part}/index.json" in keys, f"{name} written before {part}/index.json was uploaded"
            index = json.loads(s3.client.get_object(Bucket=BUCKET, Key=f"out/{part}/index.json")["Body"].read())
            shards = [s["zip_data"]["basename"] for s in index["shards"]]
            assert shards and all(f"{part}/{b}" in keys for b in shards), (part, shards, sorted(keys))
            assert sum(s["samples"] for s in index["shards"]) == obj["rows"] == 2
            # ... and staging holds nothing of it any more: neither its tar nor its shards
            left = [p for p in staging.rglob("*") if p.suffix == ".tar" or p.name.startswith("shard.")]
            assert not left, f"{name}: still staged: {left}"
        write_json(self, name, obj)

    mp.setattr(RemoteLocation, "fetch", lambda self, name: staged.append(fetch(self, name)) or staged[-1])
    mp.setattr(RemoteLocation, "writer_out", lambda self, name: staged.append(Path(writer_out(self, name)[0]))
               or writer_out(self, name))
    mp.setattr(RemoteLocation, "write_json", marked)
    run = {"gets": {}, "staged": {}}
    for rank in (1, 0):
        since, staged[:] = len(s3.requests), []
        precompute(remote_config(data, s3.url("out"), staging), rank=rank, world_size=2)
        gets = s3.served("GET", since)
        run["gets"][rank] = {name: gets[f"wds/{name}"] for name in TARS if gets[f"wds/{name}"]}
        run["staged"][rank] = list(staged)
    run["staging_left"] = sorted(p.relative_to(staging).as_posix() for p in staging.rglob("*"))
    return run


# ---------------------------------------------------------------------------------------------
# Bucket to bucket
# ---------------------------------------------------------------------------------------------


def test_the_dataset_in_the_bucket_is_the_local_one_and_trains(data, tmp_path, monkeypatch):
    """Every file the local run wrote is in the bucket: the parts' shards and indexes, the merged index.json and the
    grid prompts byte for byte, the markers, parts.json, projection.json and dataset.json as the same records; its
    rows read back the same. Training reads data.path=s3://... for a couple of steps."""
    from framework.train import train

    s3 = data["s3"]
    local = data["files"]
    assert set(s3.keys("out")) == set(local)
    copy = s3.download("out", tmp_path / "copy")
    for name, content in local.items():
        if name.startswith(("part_", "index.json", "prompts.", "empty_caption.", "parts.json", "projection.json")):
            assert (copy / name).read_bytes() == content, name
    record, want = (json.loads((copy / "dataset.json").read_text()), json.loads(local["dataset.json"]))
    assert record["source"]["path"] == s3.url(f"wds/{PATTERN}") and record["world_size"] == 2
    assert {k: v for k, v in record.items() if k not in ("source", "world_size", "fingerprint")} == \
        {k: v for k, v in want.items() if k not in ("source", "world_size", "fingerprint")}
    markers = [json.loads((copy / "done" / f"part_{i:06d}.json").read_text()) for i in range(4)]
    assert [(m["part"], m["shard"], m["rank"], m["rows"]) for m in markers] == \
        [(i, TARS[i], i % 2, 2) for i in range(4)]
    rows, ref = read_rows(copy), read_rows(data["reference"])
    assert len(rows) == 8
    assert [(r["key"], r["caption"], r["latents"].tobytes(), r["text_embeds"].tobytes()) for r in rows] == \
        [(r["key"], r["caption"], r["latents"].tobytes(), r["text_embeds"].tobytes()) for r in ref]

    out = train(compose_cfg(cheap(tmp_path, s3.url("out"), "logger=csv", "sample.every_n_steps=0", "data.batch_size=4",
                                  *LEAST_GRID, steps=2)))
    got = losses(Path(out["run_dir"]))
    assert sorted(got) == [0, 1] and all(np.isfinite(v) for v in got.values())
    assert list((tmp_path / "run" / "cache").rglob("shard.*")), "the run did not read the bucket's shards"


def test_each_rank_downloads_only_its_own_tars_through_staging(data):
    """Rank 1 of 2 GETs the tars of parts 1 and 3 once each and no other; rank 0 those of parts 0 and 2. Each rank
    stages its downloads and its parts' shards in staging/rank_<rank>/ only; a part is marked done once its shards
    and index.json are in the bucket and nothing of it is left in staging (checked as each marker is written, in the
    fixture); the rank folders are gone at the end."""
    run, staging = data["run"], data["tmp"] / "staging"
    assert run["gets"] == {1: {"00001.tar": 1, "00003.tar": 1}, 0: {"00000.tar": 1, "00002.tar": 1}}
    for rank in (0, 1):
        tars = [p.name for p in run["staged"][rank] if p.suffix == ".tar"]
        assert sorted(tars) == sorted(f"{i:05d}.tar" for i in range(rank, 4, 2))
        assert run["staged"][rank] and all(p.is_relative_to(staging / f"rank_{rank}") for p in run["staged"][rank]), \
            run["staged"][rank]
        assert {f"part_{i:06d}" for i in range(rank, 4, 2)} <= {p.name for p in run["staged"][rank]}
    assert run["staging_left"] == []


def test_a_resume_elsewhere_redoes_nothing_the_bucket_marks_done(data, tmp_path, capsys):
    """Rank 1 of 2 finishes parts 1 and 3 and its rank 0 never runs. One process on another machine (a fresh staging
    folder) resumes: the bucket's markers say which parts are done, so it downloads and uploads nothing of parts 1
    and 3 and encodes parts 0 and 2; the dataset equals the local one."""
    s3 = data["s3"]
    precompute(remote_config(data, s3.url("resume"), tmp_path / "first"), rank=1, world_size=2)
    assert [k for k in s3.keys("resume") if k.startswith("done/")] == ["done/part_000001.json", "done/part_000003.json"]
    capsys.readouterr()
    since = len(s3.requests)
    precompute(remote_config(data, s3.url("resume"), tmp_path / "elsewhere"), rank=0, world_size=1)
    assert "rank 0 of 1: 2 of 4 parts already done, 2 to encode here" in capsys.readouterr().out
    puts, gets = s3.served("PUT", since), s3.served("GET", since)
    assert {k for k in gets if k.startswith("wds/")} == {"wds/00000.tar", "wds/00002.tar"}
    again = sorted(k for k in puts if k.startswith(("resume/part_000001/", "resume/part_000003/", "resume/done/")))
    assert again == ["resume/done/part_000000.json", "resume/done/part_000002.json"]
    rows = read_rows(s3.download("resume", tmp_path / "copy"))
    assert [(r["key"], r["latents"].tobytes()) for r in rows] == \
        [(r["key"], r["latents"].tobytes()) for r in read_rows(data["reference"])]


# ---------------------------------------------------------------------------------------------
# Refusals, before anything is written
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["out", "source", "both"])
def test_a_remote_path_without_staging_is_refused_naming_the_fix(data, case):
    from data_prep.config import PrecomputeConfig, SourceConfig

    s3 = data["s3"]
    out = s3.url("refused") if case != "source" else str(data["tmp"] / "refused")
    source = s3.url(f"wds/{PATTERN}") if case != "out" else str(data["tmp"] / "wds")
    named = {"out": f"out={out}", "source": f"source.path={source}", "both": f"out={out} and source.path={source}"}[case]
    with pytest.raises(ValueError, match=f"^{re.escape(named)} is remote: set staging=DIR, a local folder"):
        PrecomputeConfig(source=SourceConfig(name="webdataset", path=source), out=out)
    with pytest.raises(ValueError, match="staging=s3://x: must be a folder on this machine"):
        PrecomputeConfig(source=SourceConfig(name="webdataset", path=source), out=out, staging="s3://x")
    assert not s3.keys("refused") and not (data["tmp"] / "refused").exists()


def test_a_pattern_names_only_its_tars_and_a_missing_one_is_refused_before_anything_is_written(data, tmp_path):
    """A brace pattern selects the tars it names (local or remote); one that names a tar the store lacks is refused,
    naming it, before anything is written; so is an out= bucket that does not exist. Only the webdataset source reads
    a remote source.path."""
    from data_prep.config import SourceConfig
    from data_prep.sources import get_source

    s3 = data["s3"]
    local = get_source(SourceConfig(name="webdataset", path=str(data["tmp"] / "wds" / "{00001..00002}.tar")))
    assert local.shards(1) == ["00001.tar", "00002.tar"]
    assert [r.key for r in local.records()] == [f"{t}:{i:09d}" for t, i in
                                                (("00001.tar", 2), ("00001.tar", 3), ("00002.tar", 4), ("00002.tar", 5))]
    with pytest.raises(ValueError, match="source=folder reads files on this machine only"):
        get_source(SourceConfig(name="folder", path=s3.url("wds")))
    remote = get_source(SourceConfig(name="webdataset", path=s3.url("wds/{00002..00003}.tar")))
    remote.staging = tmp_path / "in"
    assert remote.shards(1) == ["00002.tar", "00003.tar"]
    cfg = {**remote_config(data, s3.url("missing"), tmp_path / "staging"),
           "source": {"name": "webdataset", "path": s3.url("wds/{00000..00004}.tar")}}
    with pytest.raises(FileNotFoundError, match=rf"1 of 5 tars are not in the store, e.g. \['s3://{BUCKET}/wds/00004.tar'\]"):
        precompute(cfg, rank=0, world_size=1)
    assert s3.keys("missing") == []
    with pytest.raises(FileNotFoundError, match="out: s3://no-such-bucket/x does not exist .* check out="):
        precompute({**cfg, "out": "s3://no-such-bucket/x"}, rank=0, world_size=1)


def test_data_prepare_builds_a_missing_remote_dataset_once(data, tmp_path, monkeypatch):
    """data.prepare with data.path=s3://...: refused without its staging folder, naming the key; with it, the bucket
    gets the local reference's rows; a second start finds the bucket's dataset.json and builds nothing."""
    import data_prep.precompute as precompute_module
    from framework.data.datamodule import DataConfig, build_missing

    s3, url = data["s3"], data["s3"].url("prepared")
    recipe = {k: v for k, v in data["config"].items() if k != "out"}  # the reference's: the local brace pattern
    cfg = lambda **extra: DataConfig(path=url, local=str(tmp_path / "cache"), prepare={**recipe, **extra})  # noqa: E731
    with pytest.raises(ValueError, match=r"data.prepare.staging=DIR"):
        build_missing(cfg())
    assert not s3.keys("prepared")
    build_missing(cfg(staging=str(tmp_path / "staging")))
    assert set(s3.keys("prepared")) == set(data["files"])
    rows, ref = read_rows(s3.download("prepared", tmp_path / "copy")), read_rows(data["reference"])
    assert [(r["key"], r["latents"].tobytes(), r["text_embeds"].tobytes()) for r in rows] == \
        [(r["key"], r["latents"].tobytes(), r["text_embeds"].tobytes()) for r in ref]

    def again(*args, **kwargs):
        raise AssertionError("precompute ran for a dataset the bucket already holds")

    monkeypatch.setattr(precompute_module, "precompute", again)
    build_missing(cfg(staging=str(tmp_path / "staging")))
