"""The benchmark command runs and writes the JSON rows it promises (figures are not asserted)."""

import json
import pytest
import sys
from pathlib import Path
from tests import zygote
from tests.helpers import forked_children

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
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


@pytest.mark.slow
def test_bench_train_runs_a_video_preset_at_the_frames_given(tmp_path):
    """A video preset's step on clips (C, F, h, w) of the frames and size given: each frame more costs more than the one
    before (its 3D attention grows with their square; its linear layers and the caption's projection would not)."""
    flops = {}
    for frames in (1, 2, 4):
        out = tmp_path / f"bench{frames}.json"
        proc = zygote.run([sys.executable, "-m", "framework.bench", "train", "model=wan_debug", f"num_frames={frames}",
                           "sample_size=4", "batch_size=2", "warmup=1", "steps=1", "modes=[precomputed]", f"out={out}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        (row,) = json.loads(out.read_text())
        assert row["samples_per_s"] > 0
        flops[frames] = row["flops_per_sample"]
    assert flops[4] - flops[2] > 2 * (flops[2] - flops[1]) > 0, flops


def test_bench_rejects_an_unknown_suite():
    proc = zygote.run([sys.executable, "-m", "framework.bench", "nope"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode != 0 and "SUITE is one of" in proc.stderr


def test_bench_cost_of_mosaics_sd2_recipe_by_hand(tmp_path):
    """Both phases of experiment=sd2_base_mosaic[_512] as the recipe's table cites them, and their cost: at MosaicML's
    own throughput per A100 (11,600 and 4,590 images/s on 128 GPUs) the 550k + 850k steps of 2,048 take the 5.51 days
    on 128 GPUs their repository's table gives; at an MFU, GPU-hours = samples x FLOPs / (MFU x peak)."""
    from framework.bench.harness import PEAK_BF16_FLOPS
    from framework.bench.suite_cost import compose_phase

    low, high = compose_phase("sd2_base_mosaic", []), compose_phase("sd2_base_mosaic_512", [])
    for cfg in (low, high):
        assert (cfg.model.name, cfg.data.global_batch_size, cfg.data.batch_size) == ("sd2_base", 2048, 16)
        assert (cfg.optimizer.name, cfg.optimizer.lr, cfg.optimizer.weight_decay, cfg.optimizer.warmup_steps,
                cfg.optimizer.schedule) == ("adamw", 1e-4, 0.01, 10000, "constant")
        assert (cfg.objective.name, cfg.objective.beta_schedule, cfg.objective.caption_dropout) == (
            "eps", "scaled_linear", 0.1)
        assert (cfg.strategy.name, cfg.strategy.sharding, cfg.trainer.precision) == ("fsdp", "SHARD_GRAD_OP", "16-mixed")
        assert cfg.trainer.gradient_clip_val is None and "low_precision_norm" in cfg.plugins
    assert low.trainer.max_steps == 550_000 and "ema" not in low.plugins
    assert high.trainer.max_steps == 850_000
    assert (high.plugins["ema"]["decay"], high.plugins["ema"]["start"]) == (0.9999, 800_000)

    out = tmp_path / "cost.json"
    proc = zygote.run([sys.executable, "-m", "framework.bench", "cost", "experiment=[sd2_base_mosaic,sd2_base_mosaic_512]",
                       "latent_size=[32,64]", f"samples_per_s=[{11600 / 128},{4590 / 128}]", "price_per_gpu_hour=2",
                       f"out={out}"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    first, second, total = json.loads(out.read_text())
    assert (first["samples"], second["samples"]) == (550_000 * 2048, 850_000 * 2048)
    assert (first["gpus"], second["gpus"], first["latent_size"], second["latent_size"]) == (128, 128, 32, 64)
    hours = 550_000 * 2048 / (11600 / 128) / 3600 + 850_000 * 2048 / (4590 / 128) / 3600
    assert total["gpu_hours"] == pytest.approx(hours) and total["days"] == pytest.approx(5.51, abs=0.005)
    assert total["price"] == pytest.approx(2 * hours)
    assert second["train_flops_per_sample"] > 3.5 * first["train_flops_per_sample"] > 0  # 4x the tokens, and more
    proc = zygote.run([sys.executable, "-m", "framework.bench", "cost", "experiment=[sd2_base_mosaic]", "mfu=0.25",
                       "gpu=h100", "gpus=64", "latent_size=[32]", f"out={out}"], cwd=ROOT, capture_output=True, text=True,
                      timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    row, _ = json.loads(out.read_text())
    assert row["train_flops_per_sample"] == first["train_flops_per_sample"]
    assert row["gpu_hours"] == pytest.approx(row["samples"] * row["train_flops_per_sample"]
                                             / (0.25 * PEAK_BF16_FLOPS["h100"]) / 3600)
    assert row["days"] == pytest.approx(row["gpu_hours"] / 64 / 24)
    # A recipe that gives the batch per GPU (SANA-1600M: 64): on 64 GPUs a step is 64 x 64 samples, as its run plans it
    from framework.bench.suite_cost import phase_cost

    sana = phase_cost(compose_phase("sana_1600m_1024", []), samples_per_s=10.0, mfu=0.4, peak=1.0, latent_size=None,
                      text_len=77, gpus=64)
    assert (sana["global_batch"], sana["samples"]) == (64 * 64, 100_000 * 64 * 64)


@pytest.mark.slow
def test_bench_checkpoint_saves_the_same_bytes_every_way(tmp_path):
    """Two CPU ranks save their shards synchronously and from a process of their own: the same
    checkpoint size, and an asynchronous save is complete on disk only after the loop was released. Without the
    EMA (ema=false) a save is smaller by the fp32 weights (4 bytes a parameter); modes=[sync] saves only
    synchronously. shard_of=4 writes rank 0's part of a 4-rank job: each parameter's first quarter of rows with its
    two AdamW moments and EMA, 16 bytes a value."""
    import math

    from framework.distributed.fsdp import build_meta
    from framework.models.backbones import build_denoiser, load_preset

    def bench(name: str, *args: str) -> dict[str, dict]:
        out = tmp_path / f"{name}.json"
        proc = zygote.run([sys.executable, "-m", "framework.bench", "checkpoint", "model=pixart_debug", "world_size=2",
                           "saves=1", "step_s=0.2", f"dir={tmp_path}", f"out={out}", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return {r["mode"]: r for r in json.loads(out.read_text())}

    rows = bench("ema", "modes=[sync,process]")
    # the same shards; DCP's .metadata names its folder (sync_0 vs process_0), so a few bytes may differ
    assert set(rows) == {"sync", "process"} and rows["sync"]["bytes"] > 1e6
    for mode in ("process",):
        assert abs(rows["sync"]["bytes"] - rows[mode]["bytes"]) < 1024
        assert rows[mode]["complete_s"] >= rows[mode]["blocked_s"] >= rows[mode]["returned_s"] > 0
    plain = bench("plain", "ema=false", "modes=[sync]")
    assert set(plain) == {"sync"}
    params = sum(p.numel() for p in build_denoiser(load_preset("pixart_debug")).parameters())
    ema_bytes = rows["sync"]["bytes"] - plain["sync"]["bytes"]
    # plus DCP's index of the EMA's tensors in .metadata (about 5% at this tiny size)
    assert 4 * params <= ema_bytes < 1.1 * 4 * params, (ema_bytes, params)
    part = bench("part", "shard_of=4", "world_size=1", "modes=[sync]")["sync"]
    values = sum(math.ceil(p.shape[0] / 4) * p[0].numel() if p.dim() else 1
                 for p in build_meta(load_preset("pixart_debug")).parameters())
    assert 16 * values <= part["bytes"] < 1.15 * 16 * values, (part["bytes"], values)
    assert not any(p.name.startswith("bench_ckpt_") for p in tmp_path.iterdir())  # nothing left behind


@pytest.mark.slow
def test_bench_overhead_times_both_sides_alike(tmp_path, digits_shards, monkeypatch, capsys):
    """The framework's train command and the hand-written loop each run in their own process on the same shards,
    batch and threads; the command prints the ratio and writes a row per run plus the medians."""
    from framework.bench.suite_overhead import OverheadBench, run

    children = forked_children(monkeypatch, "framework.bench.suite_overhead")  # the timed runs, each in its own process
    *runs, ratio = run(OverheadBench(
        warmup=2, steps=3, rounds=2,
        overrides=[f"data.path={digits_shards}", f"data.local={tmp_path / 'cache'}", "data.batch_size=16"]))
    assert [argv[3] for argv in children] == ["framework", "loop", "loop", "framework"]
    # alternating order, so drift of the machine falls on both sides alike
    assert [(r["round"], r["side"]) for r in runs] == [(0, "framework"), (0, "loop"), (1, "loop"), (1, "framework")]
    assert {(r["batch_size"], r["threads"]) for r in runs} == {(16, runs[0]["threads"])}
    assert all(r["samples_per_s"] > 0 for r in runs)
    fw = sorted(r["samples_per_s"] for r in runs if r["side"] == "framework")
    loop = sorted(r["samples_per_s"] for r in runs if r["side"] == "loop")
    assert ratio["framework_over_loop"] == pytest.approx(sum(fw) / sum(loop))  # medians of two runs each
    assert f"framework / loop = {ratio['framework_over_loop']:.3f}" in capsys.readouterr().out
    by_round = [runs[0]["samples_per_s"] / runs[1]["samples_per_s"], runs[3]["samples_per_s"] / runs[2]["samples_per_s"]]
    assert ratio["round_ratios"] == pytest.approx(by_round)  # each round's framework run over its loop run
    assert ratio["median_round_ratio"] == pytest.approx(sum(by_round) / 2)
    # their mean's 95% t-interval, by hand for two values: t(0.975, 1 degree of freedom) = 12.7062, sd = |a - b| / sqrt(2)
    mean, half = sum(by_round) / 2, 12.7062 * abs(by_round[0] - by_round[1]) / 2
    assert ratio["mean_round_ratio"] == pytest.approx(mean)
    assert ratio["round_ratio_interval"] == pytest.approx([mean - half, mean + half], rel=1e-4)


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


def test_overlap_replay_stalls_only_for_results_not_yet_arrived():
    """The replay's arithmetic by hand: A (5 ms) issued at 0 and used at 2 stalls the step 3 ms; B, issued at 4 (7 on
    the stalled clock) and lasting 1 ms, has arrived when it is used at 10 (13); a blocking gather (issue = use) of
    2 ms in backward stalls 2 ms."""
    from framework.bench.suite_overlap import Event, replay

    ms = 1e-3
    events = [Event(0, "issue", 1, "a", 0), Event(2 * ms, "wait", 1, "a", 0), Event(4 * ms, "issue", 2, "b", 0),
              Event(10 * ms, "wait", 2, "b", 0), Event(11 * ms, "issue", -1, "g", 0), Event(11 * ms, "wait", -1, "g", 0)]
    r = replay(events, backward_at=10.5 * ms, end=12 * ms, cost=lambda op, n, span: {"a": 5, "b": 1, "g": 2}[op] * ms)
    assert round(r["exposed_forward_ms"], 9) == 3 and round(r["exposed_backward_ms"], 9) == 2
    assert round(r["step_ms"], 9) == 17 and round(r["communication_ms"], 9) == 8 and r["collectives"] == 3


def bench_overlap(tmp_path: Path, preset: str, head_groups: list[int], *extra: str) -> list[dict]:
    """`framework.bench overlap` on one block of `preset`, one rank of 2, a slow custom link (500 us, 10 MB/s): its
    rows; traces under tmp_path/traces."""
    out = tmp_path / "bench.json"
    proc = zygote.run([sys.executable, "-m", "framework.bench", "overlap", f"preset={preset}", "num_layers=1",
                       "latent_size=8", "ranks=2", f"head_groups={head_groups}".replace(" ", ""), "repeats=1",
                       "link=custom", "latency_us=500", "bandwidth_GBps=0.01", f"trace_dir={tmp_path / 'traces'}",
                       f"out={out}", *extra], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_bench_overlap_records_the_exchanges_where_they_are_issued_and_used(tmp_path):
    """One rank of 2, two head groups: forward issues both groups' q/k/v exchanges first, each group's attention waits
    for its own, and its output leaves before the next group attends; backward issues both output-gradient exchanges,
    and each group's input-gradient exchange leaves before the next group's attention backward waits. The step is the
    computation plus the exposed communication; the replay and torch's profile are written as Chrome traces. (How
    much is exposed depends on the measured computation, so it is checked on fixed times in
    test_the_replay_exposes_what_the_computation_does_not_hide, not here.)"""
    g1, g2 = bench_overlap(tmp_path, "pixart_debug", [1, 2])
    schedule = ["issue all_to_all", "issue all_to_all", "wait all_to_all", "issue all_to_all", "wait all_to_all",
                "issue all_to_all", "wait all_to_all", "wait all_to_all"]
    assert g2["order"] == schedule + ["issue all_gather", "wait all_gather"] + schedule
    assert g1["order"] == ["issue all_to_all", "wait all_to_all"] * 2 + ["issue all_gather", "wait all_gather"] + \
        ["issue all_to_all", "wait all_to_all"] * 2
    for r in (g1, g2):
        assert r["step_ms"] == pytest.approx(r["compute_forward_ms"] + r["compute_backward_ms"] + r["exposed_forward_ms"]
                                             + r["exposed_backward_ms"])
    for name in ("overlap_G1.json", "overlap_G2.json", "profile_G2.json"):
        assert json.loads((tmp_path / "traces" / name).read_text())["traceEvents"]


def test_bench_overlap_issues_sanas_all_reduces_by_head_group_and_waits_late(tmp_path):
    """SANA (linear attention) with 2 head groups: forward issues both groups' all-reduces before waiting for the
    first; backward issues both gradient all-reduces (each as its group's output backward ends) before waiting; the
    halo swap and the output gather are blocking. The `before` replay (one blocking all-reduce) exposes more."""
    (row,) = bench_overlap(tmp_path, "sana_debug", [2])
    reduces = ["issue all_reduce", "issue all_reduce", "wait all_reduce", "wait all_reduce"]
    halo = ["issue halo", "wait halo"]
    assert row["order"] == reduces + halo + ["issue all_gather", "wait all_gather"] + halo + reduces
    assert row["before_exposed_fraction"] >= row["exposed_fraction"]  # strictly more on fixed times: below


def test_bench_overlap_records_the_ring_across_nodes_and_the_switches_of_a_video_model(tmp_path):
    """Wan on one rank of a group of 2 nodes x 2: each layer's forward exchanges within the node, passes the other
    node's keys and values round the ring (issued before this chunk's attention, waited after it), and exchanges back;
    backward passes the chunk and its gradients (2 issued, both waited, then the gradients' last pass home). Latte
    with 2 slices: the spatial block's tail issues each slice's switch to positions as it makes it, before the temporal
    block begins; the temporal block waits for slice 0's only, runs it, issues its switch back, waits for slice 1's,
    and so on; the switches back are waited for before the next block. With inter_layer=false the temporal block
    issues both switches to positions itself, once it has begun."""
    out = tmp_path / "bench.json"
    common = ["num_layers=1", "latent_size=null", "repeats=1", "text_tokens=16", f"trace_dir={tmp_path / 'traces'}"]
    proc = zygote.run([sys.executable, "-m", "framework.bench", "overlap", "preset=wan_debug", "ranks=4",
                       "ranks_per_node=2", "head_groups=[1]", *common, f"out={out}"],
                      cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (wan,) = json.loads(out.read_text())
    exchange = ["issue all_to_all", "wait all_to_all"]
    gather = ["issue all_gather", "wait all_gather"]
    forward = exchange + ["issue ring", "wait ring"] + exchange
    backward = exchange + ["issue ring", "issue ring", "wait ring", "wait ring", "issue ring", "wait ring"] + exchange
    assert wan["order"] == forward + gather + backward, wan["order"]
    assert wan["ranks_per_node"] == 2 and wan["network"] == "infiniband" and wan["tokens"] == 64
    proc = zygote.run([sys.executable, "-m", "framework.bench", "overlap", "preset=latte_debug", "ranks=2",
                       "head_groups=[2]", "inter_layer=[true,false]", *common, f"out={out}"], cwd=ROOT,
                      capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    latte, intra = json.loads(out.read_text())
    assert (latte["inter_layer"], intra["inter_layer"]) == (True, False)
    temporal = ["wait all_to_all", "issue all_to_all"] * 2 + ["wait all_to_all"] * 2
    backward = ["issue all_to_all"] * 2 + temporal
    assert latte["order"] == ["issue all_to_all"] * 2 + ["enter temporal block"] + temporal + gather + backward, \
        latte["order"]
    assert intra["order"] == ["enter temporal block"] + ["issue all_to_all"] * 2 + temporal + gather + backward, \
        intra["order"]


def test_bench_overlap_scales_communication_to_the_target_devices_rate(tmp_path):
    """target_tflops=T: every collective's time is multiplied by T over this machine's matmul rate (k), the figures
    of a machine k times slower at computing meeting communication k times slower: the same step's communication is
    k times the unscaled one's."""
    plain = bench_overlap(tmp_path, "pixart_debug", [1])[0]
    target = bench_overlap(tmp_path, "pixart_debug", [1], "target_tflops=400")[0]
    k = target["communication_scale"]
    assert plain["communication_scale"] == 1.0 and k > 1
    assert target["communication_ms"] == pytest.approx(k * plain["communication_ms"], rel=1e-9)


def test_the_cost_model_sends_the_other_nodes_share_over_the_network():
    """4 ranks, 2 a node; node links 1 us + 4 GB/s, network 2 us + 1 GB/s; a rank holding 1,200 bytes. An all-to-all
    over the whole group sends 3/4 of them, 1/3 of that to its node's other rank and 2/3 to the other node's two, at
    once; over the node's 2 ranks, half of them on the node's links; a ring pass sends all of them to the next node."""
    from framework.bench.suite_overlap import Event, cost_model, replay

    cost = cost_model(1e-6, 4e9, 4, 2, (2e-6, 1e9))
    whole = cost("all_to_all", 1200, 4)
    assert whole["node"] == pytest.approx(1e-6 + 300 / 4e9) and whole["network"] == pytest.approx(2e-6 + 600 / 1e9)
    assert cost("all_to_all", 1200, 2) == {"node": pytest.approx(1e-6 + 600 / 4e9)}
    assert cost("ring", 1200) == {"network": pytest.approx(2e-6 + 1200 / 1e9)}
    assert cost("all_reduce", 1200) == {"network": pytest.approx(2e-6 + 1800 / 1e9)}  # its slowest link
    # By hand, ms: a ring pass (3) and a node exchange (1) issued at 0 run at once, on their own channels; an exchange
    # over both issued at 0.5 waits for both to be free (3) and holds both for its longer part (2): it arrives at 5,
    # 1 after its use at 4.
    ms = 1e-3
    parts = {"ring": {"network": 3 * ms}, "node": {"node": 1 * ms}, "both": {"node": 1 * ms, "network": 2 * ms}}
    events = [Event(0, "issue", 1, "ring", 0), Event(0, "issue", 2, "node", 0), Event(0.5 * ms, "issue", 3, "both", 0),
              Event(3 * ms, "wait", 1, "ring", 0), Event(3 * ms, "wait", 2, "node", 0), Event(4 * ms, "wait", 3, "both", 0)]
    r = replay(events, backward_at=10 * ms, end=10 * ms, cost=lambda op, n, span: parts[op])
    assert r["exposed_forward_ms"] == pytest.approx(1.0) and r["communication_ms"] == pytest.approx(6.0)


def test_the_replay_exposes_what_the_computation_does_not_hide():
    """Fixed computation times and a cost of 1 ms per 100 bytes, replayed by hand: forward issues two exchanges
    (1 ms each) at 0 and 1 ms and waits for them at 1.2 and 1.5 ms; backward (from 5 ms) issues a 3 ms exchange at
    6 ms and waits at 7 ms; the computation ends at 10 ms."""
    from framework.bench.suite_overlap import Event, replay, without_overlap

    ms = 1e-3
    events = [Event(0.0, "issue", 1, "all_to_all", 100), Event(1 * ms, "issue", 2, "all_to_all", 100),
              Event(1.2 * ms, "wait", 1, "all_to_all", 0), Event(1.5 * ms, "wait", 2, "all_to_all", 0),
              Event(6 * ms, "issue", 3, "all_to_all", 300), Event(7 * ms, "wait", 3, "all_to_all", 0)]
    cost = lambda op, nbytes, span: nbytes * 1e-5  # noqa: E731
    got = replay(events, backward_at=5 * ms, end=10 * ms, cost=cost)
    # Exchange 2 arrives at 2 ms, 0.5 ms after its wait; exchange 3 then starts at 6.5 ms and arrives at 9.5 ms,
    # 2 ms after its wait (at 7.5 ms on the stalled clock).
    assert got["exposed_forward_ms"] == pytest.approx(0.5) and got["exposed_backward_ms"] == pytest.approx(2.0)
    assert got["communication_ms"] == pytest.approx(5.0) and got["step_ms"] == pytest.approx(12.5)
    assert got["exposed_fraction"] == pytest.approx(2.5 / 12.5)
    # Waiting where each exchange is issued exposes all 5 ms; waiting so in backward only, the forward's 0.5 plus 3.
    blocking = replay(without_overlap(events), backward_at=5 * ms, end=10 * ms, cost=cost)
    assert (blocking["exposed_forward_ms"], blocking["exposed_backward_ms"]) == (pytest.approx(2.0), pytest.approx(3.0))
    backward_only = replay(without_overlap(events, backward_from=5 * ms), backward_at=5 * ms, end=10 * ms, cost=cost)
    assert backward_only["exposed_forward_ms"] == pytest.approx(0.5)
    assert backward_only["exposed_backward_ms"] == pytest.approx(3.0) and backward_only["step_ms"] == pytest.approx(13.5)


def test_overlap_without_overlap_waits_where_each_collective_is_issued():
    from framework.bench.suite_overlap import Event, without_overlap

    events = [Event(0.0, "issue", 1, "all_to_all", 8), Event(2.0, "wait", 1, "all_to_all", 0),
              Event(5.0, "issue", 2, "all_to_all", 8), Event(7.0, "wait", 2, "all_to_all", 0)]
    waits = lambda evs: sorted((e.key, e.t) for e in evs if e.kind == "wait")  # noqa: E731
    assert waits(without_overlap(events)) == [(1, 0.0), (2, 5.0)]
    assert waits(without_overlap(events, backward_from=4.0)) == [(1, 2.0), (2, 5.0)]  # forward kept as recorded


def test_bench_precompute_writes_a_row_per_rank_and_worker_count(tmp_path, tiny_text_encoder_dir, monkeypatch, capsys):
    """The real precompute command per (ranks, decode_workers) on synthetic JPEGs: a row each, whose phase figures
    come from every image (records = images = rows = the source's size) and whose shares are fractions of the time.
    The bench runs here; its rank processes are forked from the test zygote (fresh interpreters took a minute)."""
    import types

    import framework.bench.suite_precompute as bench

    shim = types.SimpleNamespace(PIPE=None, STDOUT=None, Popen=lambda cmd, env=None, **_: zygote.popen(cmd, env=env))
    monkeypatch.setattr(bench, "subprocess", shim)
    rows = bench.run(bench.PrecomputeBench(images=6, image_size=24, resolution=16, batch_size=2, workers=[0, 2],
                                           ranks=[1, 2], text_encoder=str(tiny_text_encoder_dir), dir=str(tmp_path / "w"),
                                           out=str(tmp_path / "bench.json")))
    assert [(r["ranks"], r["decode_workers"]) for r in rows] == [(1, 0), (1, 2), (2, 0), (2, 2)]
    for r in rows:
        assert r["records"] == r["images"] == r["rows"] == 6 and r["parts"] == 3  # records_per_part: 6 / (2 ranks x 2) rounded up
        for key in ("images_per_s", "decode_img_s", "encode_img_s", "write_img_s", "wall_s"):
            assert r[key] > 0, key
        assert 0 < r["encoder_busy"] < 1 and 0 < r["waiting"] < 1
        assert r["seconds_encode"] + r["seconds_wait"] + r["seconds_write"] <= r["seconds"]
    assert "encoder_busy" in capsys.readouterr().out  # the printed table


def test_a_spawned_arm_reports_its_own_peak_memory_not_its_parents():
    """A bench arm's peak memory on a CPU is its own: its parent holds 1 GiB more than the arm ever does, and the arm
    reports less than its parent by more than half of that (ru_maxrss would report the parent's: a spawned process is
    forked before its exec, and exec keeps the forked copy's peak)."""
    import subprocess

    proc = subprocess.run([sys.executable, "-m", "tests.workers.peak_rss", "1024"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["parent"] > got["held"] > 0
    assert 0 < got["child"] < got["parent"] - got["held"] / 2, got


@pytest.mark.slow
def test_bench_finetune_measures_each_arm_beside_its_predicted_peak(tmp_path):
    """The LoRA on a bf16 base with its blocks offloaded (and its activations checkpointed, which offloading needs)
    trains the adapter alone; its row has the measured peak beside the prediction framework.train prints for the same
    run (on a CPU the whole prediction, its process part included). How close the two come is a figure, not asserted:
    on a CPU the peak is mostly the process itself, 0.98 GiB here against the 1.0 GiB predicted and 1.31 GiB on another
    machine (docs/finetune.md, Memory). One arm: each arm is a fresh process, and the prediction of the others is checked in
    tests/test_adapters.py."""
    from framework.config import to_object
    from framework.training.memory import GIB, plan_run
    from tests.helpers import compose_cfg

    out = tmp_path / "bench.json"
    proc = zygote.run([sys.executable, "-m", "framework.bench", "finetune", "model=pixart_debug", "batch_size=2",
                       "warmup=1", "steps=1", "rank=4", "arms=[lora_bf16_offload]", f"out={out}"], cwd=ROOT,
                      capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = json.loads(out.read_text())
    assert row["arm"] == "lora_bf16_offload" and row["precision"] == "bf16-mixed" and row["activation_checkpointing"]
    assert row["params"] > 10 * row["trainable"] > 0
    cfg = to_object(compose_cfg([  # the preset as the bench builds it (not the quickstart's, which has no sigma)
        "model=pixart_debug", "model.learned_sigma=true", "adapter=lora", "adapter.rank=4", "adapter.base_dtype=bf16",
        "adapter.offload_blocks=true", "init_from=X", "trainer.precision=bf16-mixed", "data.batch_size=2",
        "strategy.activation_checkpointing=true"]))
    cfg.model = cfg.model.filled()  # the data the preset was made for, as the bench builds it
    plan = plan_run(cfg, 1, "bf16-mixed")  # what framework.train prints before its first step on this CPU
    assert row["predicted_gib"] * GIB == pytest.approx(plan.total, rel=1e-12), (row, plan.describe())
    assert row["samples_per_s"] > 0 and row["peak_gib"] > 0
    assert row["measured_over_predicted"] == pytest.approx(row["peak_gib"] / row["predicted_gib"], rel=1e-12)
    assert "measured_over_predicted" in proc.stdout


def test_bench_startup_times_each_phase_at_each_rank_count(tmp_path):
    out = tmp_path / "startup.json"
    proc = zygote.run([sys.executable, "-m", "framework.bench", "startup", "ranks=[1,3]", "shards=12", "shard_kib=16",
                       f"out={out}"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = json.loads(out.read_text())
    assert [r["ranks"] for r in rows] == [1, 3]
    phases = ("rendezvous", "check_every", "check_once", "check_requeue", "index")
    assert all(r[p] > 0 for r in rows for p in phases)
    # The requeue's start reads no shard (the verdict is kept); its first start read every one.
    assert "shards: 0 files checked (hash)" in proc.stdout and "shards: 13 files checked (hash)" in proc.stdout
