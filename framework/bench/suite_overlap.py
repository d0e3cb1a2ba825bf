"""`python -m framework.bench overlap`: how much of sequence parallelism's communication a training step hides, on
one machine, for head groups G = 1, 2, 4, forward and backward apart.

One rank of a P-rank sequence-parallel group runs its real computation (torch's fake process group: every buffer a
real rank allocates, no data moved), and every collective of framework/distributed/sequence.py is recorded where it
is issued and where its result is first used (the Ulysses all-to-alls and SANA's all-reduces are asynchronous until
then; the output gather and SANA's halo swap wait at once; so are Latte's layout switches, and the ring attention's
passes across nodes). A calibrated stand-in then gives each collective a duration, latency + bytes / bandwidth, on the
channels it uses, each running its collectives in issue order beside the computation: a node's links (`link`: nvlink
or infiniband presets, gloo measured here on two processes, or custom) and, for a group over several nodes
(`ranks_per_node` < `ranks`), the network (`network`) for the share that leaves the node. Replaying the recorded
computation with those durations gives the step: computation, communication, and exposed communication (the step
minus the computation: waits the overlap did not hide). Each configuration's replay is saved as a Chrome trace
(chrome://tracing, ui.perfetto.dev: a computation lane and a communication lane), and one step's torch profiler trace
beside it. Each row also replays its step as the code before this schedule waited (`before_*`: at every exchange for
G = 1, in backward for G > 1).
"""

from __future__ import annotations

import json
import math
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from framework.cli import print_table
from framework.distributed.env import leave

# Per-message latency (s) and bandwidth one rank sends at (bytes/s), by link. NVLink: an H100 SXM's 450 GB/s each way,
# of which NCCL's all-to-all reaches about 80%; InfiniBand: NDR 400 Gb/s per GPU (50 GB/s), about 90% reached.
LINKS = {"nvlink": (15e-6, 360e9), "infiniband": (20e-6, 45e9)}


@dataclass
class OverlapBench:
    """Arguments of `python -m framework.bench overlap`."""

    preset: str = "pixart_xl_2_256"
    """Backbone preset (random weights); its sample_size is set to latent_size."""
    latent_size: int | None = 256
    """Latent side (height): pixart_xl_2 at 256 is 16,384 tokens (a 2048 px image); None: the preset's."""
    latent_width: int | None = None
    """Latent width, if not latent_size (a video preset's 480x832 is 60 x 104)."""
    num_frames: int | None = None
    """A video preset's latent frames (None: the preset's)."""
    num_layers: int | None = None
    """Fewer blocks than the preset's (each block repeats the same pattern): a CPU-sized run."""
    ranks: int = 8
    """P: the sequence-parallel group this rank is one of."""
    ranks_per_node: int | None = None
    """The group's ranks on one node (None: all of them); fewer: the group spans ranks / ranks_per_node nodes
    (Ulysses within a node, ring attention across, framework/distributed/mesh.py)."""
    network: str = "infiniband"
    """The link between nodes, as `link` (presets, or custom with network_latency_us= and network_bandwidth_GBps=)."""
    network_latency_us: float | None = None
    network_bandwidth_GBps: float | None = None
    target_tflops: float | None = None
    """The matmul rate (TFLOP/s) of the device the figures are meant for; set, every communication time is multiplied
    by that rate over this machine's (a timed 2048^3 fp32 matmul), so a CPU's slow computation meets communication as
    slow as the target's is fast against its computation (an H100's bf16 training matmuls: about 400). None: as is."""
    head_groups: list[int] = field(default_factory=lambda: [1, 2, 4])
    """G (latte: S, the slices of each layout switch)."""
    inter_layer: list[bool] = field(default_factory=lambda: [True])
    """latte: the switch to positions made by the spatial block's tail as it runs (True, the default) and/or by the
    temporal block (False: the intra-layer schedule alone); a row each."""
    link: str = "nvlink"
    """nvlink | infiniband (presets) | gloo (latency and bandwidth measured here on two processes) | custom."""
    latency_us: float | None = None
    """link=custom: per-message latency."""
    bandwidth_GBps: float | None = None
    """link=custom: bytes per second one rank sends, in GB/s."""
    batch_size: int = 1
    text_tokens: int = 120
    repeats: int = 3
    """Timed steps after one warm-up; the step with the median computation time is reported."""
    trace_dir: str = "overlap_traces"
    out: str = "bench_overlap.json"


# --------------------------------------------------------------------------------------------------
# Recording: where each collective is issued and where its result is first used
# --------------------------------------------------------------------------------------------------


@dataclass
class Event:
    t: float  # seconds since the step began (computation time: the recording runs no communication)
    kind: str  # issue | wait | enter (a marked module's forward begins: `order` only, not replayed)
    key: int
    op: str  # all_to_all | all_gather | all_reduce | halo | ring
    nbytes: int  # what this rank's buffer holds (the cost model turns it into bytes sent)
    span: int = 0  # the ranks of the group it ran over (0: the whole sequence group)


class Recorder:
    """Patches the collectives that sequence parallelism calls while it is entered (one process: the bench's)."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.events, self.t0 = device, [], 0.0
        # an asynchronous collective's result not yet used: its storage's address -> (its key, its op). Keys are
        # numbered, never addresses: a freed result's address is reused by a later one's
        self._pending: dict[int, tuple[int, str]] = {}
        self._next = 0

    def now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - self.t0

    def _blocking(self, op: str, nbytes: int) -> None:
        self._next += 1
        t = self.now()
        self.events += [Event(t, "issue", self._next, op, nbytes), Event(t, "wait", self._next, op, nbytes)]

    def __enter__(self) -> "Recorder":
        import framework.distributed.sequence as seq
        from torch.distributed._functional_collectives import AsyncCollectiveTensor

        rec = self
        self._saved = (seq._all_to_all, seq._all_reduce, AsyncCollectiveTensor.trigger_wait, seq._wait,
                       dist.all_gather, seq._swap_edges, seq._ring_pass, seq._ring_wait)
        all_to_all, all_reduce, trigger_wait, wait, all_gather, swap_edges, ring_pass, ring_wait = self._saved

        def asynchronous(op: str, collective: Callable) -> Callable:
            def recorded(x: torch.Tensor, group: Any) -> torch.Tensor:
                t = rec.now()
                out = collective(x, group)
                rec._next += 1
                rec._pending[out.elem.untyped_storage().data_ptr()] = (rec._next, op)
                rec.events.append(Event(t, "issue", rec._next, op, x.numel() * x.element_size(),
                                        dist.get_world_size(group)))
                return out
            return recorded

        def recorded_ring_pass(x: torch.Tensor, sp: Any) -> Any:  # this rank's chunk to the next node
            t = rec.now()
            pending = ring_pass(x, sp)
            rec._next += 1
            rec._pending[pending[0].untyped_storage().data_ptr()] = (rec._next, "ring")
            rec.events.append(Event(t, "issue", rec._next, "ring", x.numel() * x.element_size()))
            return pending

        def recorded_ring_wait(pending: Any) -> torch.Tensor:
            key, op = rec._pending.pop(pending[0].untyped_storage().data_ptr())
            rec.events.append(Event(rec.now(), "wait", key, op, 0))
            return ring_wait(pending)

        def first_use(x: Any) -> None:
            address = x.elem.untyped_storage().data_ptr() if isinstance(x, AsyncCollectiveTensor) else None
            if address in rec._pending:  # the first use of a recorded result (views share its storage)
                key, op = rec._pending.pop(address)
                rec.events.append(Event(rec.now(), "wait", key, op, 0))

        def recorded_trigger_wait(self: AsyncCollectiveTensor) -> torch.Tensor:  # an op on the result
            first_use(self)
            return trigger_wait(self)

        def recorded_wait(x: torch.Tensor) -> torch.Tensor:  # an explicit wait
            first_use(x)
            return wait(x)

        def recorded_all_gather(parts: list, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            rec._blocking("all_gather", x.numel() * x.element_size())
            return all_gather(parts, x, *args, **kwargs)

        def recorded_swap(up: torch.Tensor, down: torch.Tensor, sp: Any) -> Any:
            rec._blocking("halo", up.numel() * up.element_size())
            return swap_edges(up, down, sp)

        seq._all_to_all, seq._all_reduce = asynchronous("all_to_all", all_to_all), asynchronous("all_reduce", all_reduce)
        seq._wait, AsyncCollectiveTensor.trigger_wait = recorded_wait, recorded_trigger_wait
        dist.all_gather, seq._swap_edges = recorded_all_gather, recorded_swap
        seq._ring_pass, seq._ring_wait = recorded_ring_pass, recorded_ring_wait
        return self

    def __exit__(self, *exc: Any) -> None:
        import framework.distributed.sequence as seq
        from torch.distributed._functional_collectives import AsyncCollectiveTensor

        (seq._all_to_all, seq._all_reduce, AsyncCollectiveTensor.trigger_wait, seq._wait, dist.all_gather,
         seq._swap_edges, seq._ring_pass, seq._ring_wait) = self._saved


# --------------------------------------------------------------------------------------------------
# The cost model and the replay
# --------------------------------------------------------------------------------------------------


def cost_model(latency: float, bandwidth: float, ranks: int, per_node: int | None = None,
               network: tuple[float, float] | None = None) -> Callable[..., dict[str, float]]:
    """Seconds for one collective of a rank holding `nbytes`, on each channel it uses, over a group of s ranks (its
    span; the sequence group's P when 0): all-to-all sends (s-1)/s of it, an all-gather receives s-1 times it, a ring
    all-reduce moves 2(s-1)/s of it, the halo swap sends it to each neighbour at once, a ring pass sends it to the
    next node. Within a node (s <= per_node) all of it goes over the node's links; a group over several nodes sends the
    other nodes' share over the network (`network`: latency, bandwidth) while the node's own share goes over its links,
    at once (an all-reduce or halo across nodes: all over the network, its slowest link)."""
    per_node = per_node or ranks

    def seconds(op: str, nbytes: int, span: int = 0) -> dict[str, float]:
        s = span or ranks
        if op == "ring":
            return {"network": network[0] + nbytes / network[1]}
        share = {"all_to_all": (s - 1) / s, "all_gather": s - 1, "all_reduce": 2 * (s - 1) / s, "halo": 1.0}[op]
        if s <= per_node:
            return {"node": latency + share * nbytes / bandwidth}
        if op in ("all_reduce", "halo"):
            return {"network": network[0] + share * nbytes / network[1]}
        far = (s - per_node) / (s - 1)  # the share of the peers on other nodes
        return {"node": latency + (1 - far) * share * nbytes / bandwidth,
                "network": network[0] + far * share * nbytes / network[1]}

    return seconds


def replay(events: list[Event], backward_at: float, end: float, cost: Callable[..., Any]) -> dict[str, Any]:
    """The step with communication: each channel runs its collectives in issue order (`cost(op, nbytes, span)` gives
    seconds, or seconds per channel: a collective on several channels starts when all are free and holds them all
    for its longest part); a use of a result not yet arrived stalls the computation until it arrives. Returns the
    computation, communication and exposed times (forward and backward), and the timeline (for the trace)."""
    stall = 0.0
    free: dict[str, float] = {}
    exposed = {"forward": 0.0, "backward": 0.0}
    arrive: dict[int, float] = {}
    comm, timeline = 0.0, []
    for e in sorted(events, key=lambda e: (e.t, e.kind == "wait")):
        if e.kind == "issue":
            parts = cost(e.op, e.nbytes, e.span)
            parts = parts if isinstance(parts, dict) else {"link": parts}
            start = max(e.t + stall, *(free.get(c, 0.0) for c in parts))
            duration = max(parts.values())
            arrive[e.key] = start + duration
            for c in parts:
                free[c] = start + duration
            comm += duration
            timeline.append(("comm", e.op, start, duration))
        elif e.kind == "wait":
            late = arrive[e.key] - (e.t + stall)
            if late > 0:
                timeline.append(("stall", e.op, e.t + stall, late))
                stall += late
                exposed["backward" if e.t >= backward_at else "forward"] += late
    step = end + stall
    return {"compute_forward_ms": 1e3 * backward_at, "compute_backward_ms": 1e3 * (end - backward_at),
            "communication_ms": 1e3 * comm, "exposed_forward_ms": 1e3 * exposed["forward"],
            "exposed_backward_ms": 1e3 * exposed["backward"], "step_ms": 1e3 * step,
            "exposed_fraction": stall / step, "collectives": sum(e.kind == "issue" for e in events),
            "_timeline": timeline, "_events": events}


def without_overlap(events: list[Event], backward_from: float = 0.0) -> list[Event]:
    """The same step as if each collective issued from `backward_from` on were waited for where it is issued (no
    overlap): what diffusers' Ulysses attention did in forward and backward, and torch's functional all-to-all in
    backward, before this file's schedule (the `before` rows)."""
    issued = {e.key: e for e in events if e.kind == "issue" and e.t >= backward_from}
    out = [e for e in events if not (e.kind == "wait" and e.key in issued)]
    out += [Event(e.t, "wait", key, e.op, 0) for key, e in issued.items()]
    return out


def chrome_trace(result: dict[str, Any], path: Path) -> None:
    """The replayed step: computation (with its stalls) on one lane, the communication channel on another."""
    events = [{"name": "step", "ph": "X", "pid": 0, "tid": "compute", "ts": 0, "dur": result["step_ms"] * 1e3}]
    for lane, op, start, duration in result["_timeline"]:
        events.append({"name": op if lane == "comm" else f"waiting for {op}", "ph": "X", "pid": 0,
                       "tid": "communication" if lane == "comm" else "compute", "ts": start * 1e6, "dur": duration * 1e6})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"traceEvents": events}))


# --------------------------------------------------------------------------------------------------
# gloo, measured
# --------------------------------------------------------------------------------------------------


def _gloo_worker(rank: int, init_file: str, out: str, sizes: list[int]) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    rows = []
    for nbytes in sizes:
        x = torch.zeros(nbytes // 4)
        y = torch.empty_like(x)
        for _ in range(3):
            dist.all_to_all_single(y, x)
        times = []
        for _ in range(10):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_to_all_single(y, x)
            times.append(time.perf_counter() - t0)
        rows.append((nbytes // 2, statistics.median(times)))  # each rank sends half of its buffer
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def measure_gloo(sizes: tuple[int, ...] = (1 << 14, 1 << 20, 1 << 24)) -> tuple[float, float]:
    """(latency s, bandwidth bytes/s) of gloo's all-to-all between two processes here: a least-squares line through
    the median times of three message sizes."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "gloo.json")
        mp.spawn(_gloo_worker, args=(str(Path(tmp) / "init"), out, list(sizes)), nprocs=2)
        rows = json.loads(Path(out).read_text())
    xs, ys = [r[0] for r in rows], [r[1] for r in rows]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return max(my - slope * mx, 0.0), 1.0 / slope


# --------------------------------------------------------------------------------------------------
# The suite
# --------------------------------------------------------------------------------------------------


def _link(link: str, latency_us: float | None, bandwidth_GBps: float | None, key: str = "link") -> tuple[float, float]:
    if link in LINKS:
        return LINKS[link]
    if link == "gloo":
        return measure_gloo()
    if link == "custom" and latency_us is not None and bandwidth_GBps:
        return latency_us * 1e-6, bandwidth_GBps * 1e9
    prefix = "" if key == "link" else f"{key}_"
    raise ValueError(f"{key}={link!r}: choose nvlink, infiniband, gloo, or custom with {prefix}latency_us= and "
                     f"{prefix}bandwidth_GBps=")


def matmul_rate(device: torch.device, n: int = 2048, repeats: int = 5) -> float:
    """FLOP/s of one n^3 fp32 matmul here (best of `repeats`, after a warm-up)."""
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    best = float("inf")
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i:
            best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best


def scaled(cost: Callable[..., dict[str, float]], k: float) -> Callable[..., dict[str, float]]:
    """`cost` with every time multiplied by k."""
    return lambda op, nbytes, span=0: {c: k * t for c, t in cost(op, nbytes, span).items()}


def _model_config(bench: OverlapBench) -> Any:
    """The preset at the bench's size (fewer layers, another latent shape)."""
    from framework.models.backbones import load_preset

    extra: dict[str, Any] = {} if bench.num_layers is None else {"num_layers": bench.num_layers}
    if bench.latent_size is not None:
        extra["sample_size"] = bench.latent_size
        extra["sample_width"] = bench.latent_width
    elif bench.latent_width is not None:
        extra["sample_width"] = bench.latent_width
    if bench.num_frames is not None:
        extra["num_frames"] = bench.num_frames
    return load_preset(bench.preset, **extra)


def record_step(model: Any, cfg: Any, bench: OverlapBench, device: torch.device,
                marked: tuple[tuple[str, Any], ...] = ()) -> tuple[list[Event], float, float]:
    """One training step (forward, then backward of a squared-error loss) with its collectives recorded, and where each
    forward of a `marked` module begins."""
    g = torch.Generator(device=device).manual_seed(0)
    B = bench.batch_size
    x = torch.randn(B, cfg.in_channels, *cfg.latent_shape, generator=g, device=device)
    t = torch.rand(B, generator=g, device=device) * 1000
    text = torch.randn(B, bench.text_tokens, cfg.text_dim, generator=g, device=device)
    mask = torch.ones(B, bench.text_tokens, device=device)
    model.zero_grad(set_to_none=False)
    with Recorder(device) as rec:
        hooks = [m.register_forward_pre_hook(
            lambda mod, args, label=label: rec.events.append(Event(rec.now(), "enter", 0, label, 0)))
            for label, m in marked]
        rec.t0 = time.perf_counter()
        rec.now()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            pred = model(x, t, text, mask)
        loss = pred.float().square().mean()
        backward_at = rec.now()
        loss.backward()
        end = rec.now()
    for hook in hooks:
        hook.remove()
    return rec.events, backward_at, end


def run(bench: OverlapBench) -> list[dict[str, Any]]:
    from framework.bench.suite_sequence import _fake_group
    from framework.distributed.mesh import ParallelDims
    from framework.distributed.sequence import check, init, install
    from framework.models.backbones import build_denoiser
    from framework.models.families import plan_of

    latency, bandwidth = _link(bench.link, bench.latency_us, bench.bandwidth_GBps)
    per_node = bench.ranks_per_node or bench.ranks
    network = _link(bench.network, bench.network_latency_us, bench.network_bandwidth_GBps, "network") \
        if per_node < bench.ranks else None
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    scale = 1.0 if bench.target_tflops is None else bench.target_tflops * 1e12 / matmul_rate(device)
    cost = scaled(cost_model(latency, bandwidth, bench.ranks, per_node, network), scale)
    mcfg = _model_config(bench)
    switch = plan_of(mcfg.family).sequence.attention == "switch"
    tokens = math.prod(side // mcfg.patch_size for side in mcfg.latent_hw) * (mcfg.num_frames if mcfg.is_video else 1)
    rows = []
    for G, inter in [(G, inter) for G in bench.head_groups for inter in (bench.inter_layer if switch else [True])]:
        torch.manual_seed(0)
        try:
            check(mcfg, bench.ranks, G)
        except ValueError as e:  # e.g. 16 heads cannot go in 4 groups over 8 ranks
            print(f"G={G}: skipped ({e})", flush=True)
            continue
        with device:
            model = build_denoiser(mcfg)
        _fake_group(bench.ranks)
        sp = init(ParallelDims.of(bench.ranks, per_node, bench.ranks).build(device.type), G)
        sp.inter_layer = inter
        install(model, sp)
        # where Latte's temporal blocks begin (the order shows which block issued a switch)
        marked = tuple(("temporal block", b) for b in model.net.temporal_transformer_blocks) if switch else ()
        record_step(model, mcfg, bench, device)  # warm-up
        steps = [record_step(model, mcfg, bench, device, marked) for _ in range(bench.repeats)]
        steps.sort(key=lambda s: s[2])
        events, backward_at, end = steps[len(steps) // 2]
        result = replay(events, backward_at, end, cost)
        # before: G = 1 waited at every exchange (diffusers' attention); G > 1 overlapped in forward only; SANA's
        # all-reduce was one blocking call for every G
        blocking = G == 1 or plan_of(mcfg.family).sequence.attention == "linear"
        before = replay(without_overlap(events, 0.0 if blocking else backward_at), backward_at, end, cost)
        trace_dir = Path(bench.trace_dir)
        name = f"G{G}" + ("" if inter else "_intra")
        chrome_trace(result, trace_dir / f"overlap_{name}.json")
        with torch.profiler.profile() as prof:
            record_step(model, mcfg, bench, device)
        prof.export_chrome_trace(str(trace_dir / f"profile_{name}.json"))
        order = [f"{e.kind} {e.op}" for e in sorted(events, key=lambda e: (e.t, e.kind == "wait"))]
        rows.append({"preset": bench.preset, "layers": mcfg.num_layers, "tokens": tokens, "ranks": bench.ranks,
                     "ranks_per_node": per_node, "head_groups": G, "inter_layer": inter if switch else None,
                     "link": bench.link, "latency_us": latency * 1e6,
                     "bandwidth_GBps": bandwidth / 1e9, "network": bench.network if network else None,
                     "communication_scale": scale,
                     **{k: v for k, v in result.items() if not k.startswith("_")}, "order": order,
                     "before_exposed_forward_ms": before["exposed_forward_ms"],
                     "before_exposed_backward_ms": before["exposed_backward_ms"],
                     "before_exposed_fraction": before["exposed_fraction"],
                     "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"})
        print(f"{name}: step {result['step_ms']:.1f} ms, exposed {result['exposed_fraction']:.1%}", flush=True)
        del model
    leave()
    print_table(rows, ["tokens", "layers", "ranks", "ranks_per_node", "head_groups", "inter_layer", "link", "compute_forward_ms",
                       "compute_backward_ms", "communication_ms", "exposed_forward_ms", "exposed_backward_ms", "step_ms",
                       "exposed_fraction", "before_exposed_fraction"])
    return rows
