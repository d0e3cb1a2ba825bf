"""The benchmark command runs and writes the JSON rows it promises (figures are not asserted)."""

import json
import pytest
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


def test_bench_overhead_times_both_sides_alike(tmp_path, digits_shards):
    """The framework's train command and the hand-written loop each run in their own process on the same shards,
    batch and threads; the command prints the ratio and writes a row per run plus the medians."""
    out = tmp_path / "bench.json"
    proc = zygote.run([sys.executable, "-m", "framework.bench", "overhead", "warmup=2", "steps=3", "rounds=2",
                       f"overrides=['data.path={digits_shards}','data.local={tmp_path / 'cache'}','data.batch_size=16']",
                       f"out={out}"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    *runs, ratio = json.loads(out.read_text())
    # alternating order, so drift of the machine falls on both sides alike
    assert [(r["round"], r["side"]) for r in runs] == [(0, "framework"), (0, "loop"), (1, "loop"), (1, "framework")]
    assert {(r["batch_size"], r["threads"]) for r in runs} == {(16, runs[0]["threads"])}
    assert all(r["samples_per_s"] > 0 for r in runs)
    fw = sorted(r["samples_per_s"] for r in runs if r["side"] == "framework")
    loop = sorted(r["samples_per_s"] for r in runs if r["side"] == "loop")
    assert ratio["framework_over_loop"] == pytest.approx(sum(fw) / sum(loop))  # medians of two runs each
    assert f"framework / loop = {ratio['framework_over_loop']:.3f}" in proc.stdout


def test_bench_gpu_writes_its_table_into_the_readme_block(tmp_path):
    """The GPU bench's rows on the CPU (debug presets, given batch): one row per family and switch, ratios against
    the plain row, and the table spliced between the README's gpu-bench markers (the text around them kept);
    `render=` rebuilds the same table from the JSON alone."""
    out, readme = tmp_path / "bench.json", tmp_path / "README.md"
    readme.write_text("intro\n<!-- gpu-bench:begin -->\nOwed.\n<!-- gpu-bench:end -->\noutro\n")
    proc = zygote.run([sys.executable, "-m", "framework.bench", "gpu", "families=[pixart_debug]",
                       "switches_preset=pixart_debug", "switches=[ema,act_ckpt]", "batch_size=2",
                       "warmup=1", "steps=1", f"out={out}", f"readme={readme}"],
                      cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [(r["preset"], r["label"]) for r in rows] == [("pixart_debug", "plain"), ("pixart_debug", "ema"),
                                                         ("pixart_debug", "act_ckpt")]
    assert all(r["batch_size"] == 2 and r["samples_per_s"] > 0 for r in rows)
    assert rows[1]["ema"] and rows[2]["act_ckpt"] and "speed_vs_plain" not in rows[0]
    assert rows[1]["speed_vs_plain"] == rows[1]["samples_per_s"] / rows[0]["samples_per_s"]
    text = readme.read_text()
    assert text.startswith("intro\n<!-- gpu-bench:begin -->\nMeasured ") and text.endswith("<!-- gpu-bench:end -->\noutro\n")
    assert "Owed." not in text and text.count("| pixart_debug |") == 3
    again = tmp_path / "again.md"
    proc = zygote.run([sys.executable, "-m", "framework.bench", "gpu", f"render={out}", f"markdown={again}",
                       f"out={tmp_path / 'again.json'}"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert again.read_text().strip() in text
