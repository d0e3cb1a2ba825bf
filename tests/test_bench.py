"""The benchmark command runs and writes the JSON rows it promises (figures are not asserted)."""

import json
import sys
from pathlib import Path
from tests import zygote

ROOT = Path(__file__).resolve().parents[1]


def test_bench_train_writes_one_row_per_mode(tmp_path):
    out = tmp_path / "bench.json"
    proc = zygote.run(
        [sys.executable, "-m", "framework.bench", "train", "model=pixart_debug", "batch_size=2", "warmup=1", "steps=2",
         "modes=[precomputed,fp32,online]", "online_text_encoder=t5_base", f"out={out}"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [r["mode"] for r in rows] == ["precomputed", "fp32", "online"]
    for r in rows:
        assert r["samples_per_s"] > 0 and r["mfu"] is None and r["peak_mem_bytes"] > 0
        assert r["flops_per_sample"] > 0
    assert "samples_per_s" in proc.stdout  # the printed table


def test_bench_rejects_an_unknown_suite():
    proc = zygote.run([sys.executable, "-m", "framework.bench", "nope"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode != 0 and "SUITE is one of" in proc.stderr


def test_bench_checkpoint_saves_the_same_bytes_both_ways(tmp_path):
    """Two CPU ranks save their shards synchronously and with async_save: the same checkpoint size, and an
    asynchronous save is complete on disk only after the loop was released."""
    out = tmp_path / "bench.json"
    proc = zygote.run([sys.executable, "-m", "framework.bench", "checkpoint", "model=pixart_debug", "world_size=2",
                       "saves=1", f"dir={tmp_path}", f"out={out}"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["mode"]: r for r in json.loads(out.read_text())}
    # the same shards; DCP's .metadata names its folder (sync_0 vs async_0), so a few bytes may differ
    assert set(rows) == {"sync", "async"} and rows["sync"]["bytes"] > 1e6
    assert abs(rows["sync"]["bytes"] - rows["async"]["bytes"]) < 1024
    assert rows["async"]["complete_s"] >= rows["async"]["blocked_s"] > 0
    assert not any(p.name.startswith("bench_ckpt_") for p in tmp_path.iterdir())  # nothing left behind
