"""`python -m framework.bench overhead`: the framework's own cost per training step, against a hand-written loop.

Both sides train the same experiment (default: the quickstart) on the same shards, model config, micro-batch,
objective, AdamW, gradient clipping, precision and CPU threads, each in its own child process, alternating
(F L, then L F, ...) so drift of the machine hits both alike. Each times the same window of optimizer steps
after a warm-up: from the moment step `warmup`'s batch is in hand to the end of the last step.

  framework  `framework.train.train` as the train command runs it (its logger, progress bar, callbacks,
             per-sample noise, finiteness checks), with sample grids, evaluation and checkpoints moved out of
             the window
  loop       the least a training step needs: a StreamingDataset + DataLoader over the same shards, the
             diffusers backbone called directly, torch.randn noise for the batch, logit-normal (or uniform) t,
             the flow loss, clip_grad_norm_ and AdamW; no learning-rate schedule, no caption dropout, no
             logging, no progress bar. What the framework does beyond it (the schedule, caption dropout,
             per-sample noise, the finiteness checks, logging) is its overhead.

Printed: samples/s of each run, the medians and framework / loop (the goal is >= 0.98), and each round's own
framework / loop (its two runs back to back) with their median, and their mean with its 95% t-interval: on a machine
whose speed drifts, the steadier figures.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from framework.cli import print_table
from framework.evaluation.realdata import t_interval
from typing import Any


SIDES = ("framework", "loop")


@dataclass
class OverheadBench:
    """Arguments of `python -m framework.bench overhead`."""

    experiment: str = "quickstart"
    """The experiment both sides train (conf/experiment/NAME.yaml)."""
    overrides: list[str] = field(default_factory=list)
    """More train overrides for both sides, each quoted: "overrides=['model=sana_debug','data.batch_size=32']"."""
    warmup: int = 30
    """Untimed steps first (allocation, the loader's first shards)."""
    steps: int = 300
    """Timed optimizer steps per run."""
    rounds: int = 2
    """Runs of each side (alternating)."""
    out: str = "bench_overhead.json"


# --------------------------------------------------------------------------------------------
# The parent: alternate the two sides in child processes
# --------------------------------------------------------------------------------------------


def _child(side: str, cfg: OverheadBench, work: Path, r: int) -> dict[str, Any]:
    """One timed run of `side` in a fresh interpreter, in its own run folder; its result row."""
    args = json.dumps({"experiment": cfg.experiment, "overrides": cfg.overrides, "warmup": cfg.warmup,
                       "steps": cfg.steps, "work": str(work), "run_dir": str(work / f"{side}{r}")})
    result = work / f"{side}.json"
    result.unlink(missing_ok=True)
    log = work / f"{side}.log"
    with open(log, "w") as f:
        proc = subprocess.run([sys.executable, "-m", "framework.bench.suite_overhead", side, args],
                              stdout=f, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if proc.returncode != 0 or not result.is_file():
        tail = log.read_text()[-3000:]
        raise RuntimeError(f"the {side} run failed (exit {proc.returncode}); the end of its output:\n{tail}")
    return json.loads(result.read_text())


def run(cfg: OverheadBench) -> list[dict[str, Any]]:
    if cfg.warmup < 1 or cfg.steps < 1 or cfg.rounds < 1:
        raise ValueError("warmup, steps and rounds must each be >= 1")
    work = Path(tempfile.mkdtemp(prefix="lf-overhead-"))
    rows = []
    for r in range(cfg.rounds):
        order = SIDES if r % 2 == 0 else SIDES[::-1]
        for side in order:
            row = {"round": r, **_child(side, cfg, work, r)}
            print(f"[bench overhead] round {r} {side}: {row['samples_per_s']:.1f} samples/s")
            rows.append(row)
    print_table(rows, ["round", "side", "samples_per_s", "step_ms", "threads", "device"])
    med = {s: statistics.median(r["samples_per_s"] for r in rows if r["side"] == s) for s in SIDES}
    ratio = med["framework"] / med["loop"]
    # each round's two runs are back to back: their ratio is the least touched by a machine whose speed drifts
    speed = {(x["round"], x["side"]): x["samples_per_s"] for x in rows}
    by_round = [speed[r, "framework"] / speed[r, "loop"] for r in range(cfg.rounds)]
    mean, low, high = t_interval(by_round)
    print(f"median samples/s: framework {med['framework']:.1f}, loop {med['loop']:.1f}; "
          f"framework / loop = {ratio:.3f}; per round {', '.join(f'{x:.3f}' for x in by_round)} "
          f"(median {statistics.median(by_round):.3f}; mean {mean:.3f}, 95% interval {low:.3f} to {high:.3f})")
    return [*rows, {"side": "ratio", "framework_over_loop": ratio, **{f"median_{s}": v for s, v in med.items()},
                    "round_ratios": by_round, "median_round_ratio": statistics.median(by_round),
                    "mean_round_ratio": mean, "round_ratio_interval": [low, high]}]


# --------------------------------------------------------------------------------------------
# The children
# --------------------------------------------------------------------------------------------


def _compose(experiment: str, overrides: list[str], max_steps: int, run_dir: Path):
    from framework.bench.harness import compose_training

    window = [f"experiment={experiment}", *overrides, f"trainer.max_steps={max_steps}", f"run.dir={run_dir}",
              # Outside the timed window: one checkpoint and the least grid (one image a prompt, one sampler step: the
              # full one costs more than a short run's training) at the very end, no evaluation.
              "sample.every_n_steps=0", "sample.per_prompt=1", "sample.steps=1", "eval.at_end=false",
              "eval.every_n_steps=0",
              f"trainer.checkpoint_every_n_steps={max_steps}"]
    return compose_training(window)  # (the loop side does not import framework.train, which registers the schema)


def _window_timer(warmup: int, steps: int):
    import lightning.pytorch as pl
    import torch

    class WindowTimer(pl.Callback):
        """Seconds from the start of step `warmup` (its batch in hand) to the end of step warmup + steps - 1."""

        def __init__(self) -> None:
            self.t0 = self.t1 = 0.0

        def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                                 batch_idx: int) -> None:
            if trainer.global_step == warmup:
                if pl_module.device.type == "cuda":
                    torch.cuda.synchronize(pl_module.device)
                self.t0 = time.perf_counter()

        def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
            if trainer.global_step == warmup + steps:
                if pl_module.device.type == "cuda":
                    torch.cuda.synchronize(pl_module.device)
                self.t1 = time.perf_counter()

    return WindowTimer()


def framework_side(a: dict[str, Any]) -> dict[str, Any]:
    import torch

    from framework.train import train

    dcfg = _compose(a["experiment"], a["overrides"], a["warmup"] + a["steps"], Path(a["run_dir"]))
    timer = _window_timer(a["warmup"], a["steps"])
    train(dcfg, extra_callbacks=[timer])
    return {"seconds": timer.t1 - timer.t0, "threads": torch.get_num_threads(),
            "batch_size": int(dcfg.data.batch_size)}


def loop_side(a: dict[str, Any]) -> dict[str, Any]:
    """The hand-written loop (see the module docstring); only the config's values come from the framework."""
    import numpy as np
    import torch
    import torch.nn.functional as F
    from streaming import StreamingDataset

    from data_prep.record import scale_latents
    from framework import config as config_lib
    from framework.data.datamodule import canonical_nodes
    from framework.data.shards import open_streaming
    from framework.data.text_storage import decode_text
    from framework.models.backbones import build_denoiser
    from framework.preflight import fit_model_to_data

    warmup, steps = a["warmup"], a["steps"]
    dcfg = _compose(a["experiment"], a["overrides"], warmup + steps, Path(a["run_dir"]))
    info, _ = fit_model_to_data(dcfg)  # the dataset's channels / size / text width, as the framework's run has them
    cfg = config_lib.to_object(dcfg)
    from framework.models.families import family_of

    bare_call = family_of(cfg.model).bare_call  # how the loop below calls the diffusers net; None: it cannot
    if bare_call is None or cfg.objective.name != "flow":
        raise ValueError("the hand-written loop covers the pixart and sana families with objective=flow")
    torch.manual_seed(cfg.seed)
    device = torch.device("cuda" if torch.cuda.is_available() and cfg.trainer.accelerator != "cpu" else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else None  # bf16 autocast on a GPU, fp32 on a CPU (as the framework)

    net = build_denoiser(cfg.model).net.to(device).train()  # the diffusers module itself
    o = cfg.optimizer
    opt = torch.optim.AdamW(net.parameters(), lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay)

    B = cfg.data.batch_size
    d = cfg.data  # with data.local, Streaming copies the shards there (as the framework's run does)
    remote, local = (d.path, d.local) if d.local else (None, str(Path(d.path).expanduser()))
    dataset = open_streaming(lambda: StreamingDataset(  # as the framework's data module opens it
        remote=remote, local=local, batch_size=B, shuffle=d.shuffle, shuffle_seed=cfg.seed,
        num_canonical_nodes=canonical_nodes(d.num_canonical_nodes, info.num_samples)))
    scale, shift = info.scaling_factor, info.shift_factor

    def collate(samples: list[dict]) -> dict[str, torch.Tensor]:
        latents = scale_latents(torch.from_numpy(np.stack([s["latents"] for s in samples])).float(), scale, shift)
        text = torch.nn.utils.rnn.pad_sequence([decode_text(s, info.text_storage) for s in samples],
                                               batch_first=True)  # (B, L, D) as stored (fp16 / bf16; int8 as float32)
        lengths = torch.tensor([len(s["text_embeds"]) for s in samples])
        mask = torch.arange(text.shape[1])[None] < lengths[:, None]  # (B, L)
        return {"latents": latents, "text_embeds": text, "text_mask": mask}

    if cfg.data.num_workers:
        from framework.data.datamodule import check_socket_room

        check_socket_room()  # as the framework's own loader does
    loader = torch.utils.data.DataLoader(dataset, batch_size=B, num_workers=cfg.data.num_workers, collate_fn=collate,
                                         drop_last=True, pin_memory=device.type == "cuda")
    ob, k = cfg.objective, cfg.objective.flow_shift
    clip = cfg.trainer.gradient_clip_val
    extra = bare_call
    step, t0 = 0, 0.0
    while step < warmup + steps:
        for batch in loader:
            if step == warmup:
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                t0 = time.perf_counter()
            x0 = batch["latents"].to(device, non_blocking=True)
            text = batch["text_embeds"].to(device, non_blocking=True).float()
            mask = batch["text_mask"].to(device, non_blocking=True)
            noise = torch.randn_like(x0)
            if ob.timestep_sampling == "logit_normal":
                u = torch.sigmoid(torch.randn(B, device=device) * ob.logit_std + ob.logit_mean)
            else:
                u = torch.rand(B, device=device)
            sigma = k * u / (1 + (k - 1) * u)
            s = sigma.view(-1, 1, 1, 1)
            xt = (1 - s) * x0 + s * noise
            with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
                pred = net(xt, encoder_hidden_states=text, timestep=sigma * ob.num_train_timesteps,
                           encoder_attention_mask=mask.to(xt.dtype), return_dict=False, **extra)[0]
            loss = F.mse_loss(pred.float(), noise - x0)
            loss.backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if step == warmup + steps:
                break
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "threads": torch.get_num_threads(), "batch_size": B}


def _main() -> None:
    import torch

    side, a = sys.argv[1], json.loads(sys.argv[2])
    result = framework_side(a) if side == "framework" else loop_side(a)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    row = {"side": side, "batch_size": result["batch_size"],
           "samples_per_s": a["steps"] * result["batch_size"] / result["seconds"],
           "step_ms": result["seconds"] / a["steps"] * 1e3, "threads": result["threads"], "device": device}
    (Path(a["work"]) / f"{side}.json").write_text(json.dumps(row))
    from framework.distributed.env import leave

    leave()


if __name__ == "__main__":
    _main()
