"""`python -m framework.eval watch=RUN_DIR`: evaluate a training run's checkpoints as they appear, from another job,
so that the training ranks never stop for an evaluation (a 14B video model's would idle the whole allocation).

Each complete numbered checkpoint (run.dir/checkpoints/stepNNNNNNN.ckpt, a file or a sharded folder) is evaluated once,
oldest first, with the command's settings (framework.eval's keys); the results go to out/stepNNNNNNN/ (metrics.json
and the judged grid), a record of what was evaluated to out/watched.json (a restarted watch goes on from it), and the
metrics, as eval/*, to the run's own logger at the checkpoint's step:
    logger=csv          out/metrics.csv (the training process owns run.dir/metrics.csv)
    logger=tensorboard  run.dir/tensorboard/, in an event file of its own: TensorBoard shows one run
    logger=wandb        a run of its own in the training run's group, named <name>-eval (W&B lets one process write a
                        run), its x axis trainer/global_step
The watch ends once the run has ended (framework.train writes run.dir/ended.json after its last checkpoint, and
removes it when a run starts or resumes) and every checkpoint is evaluated, or after `watch_idle_s` seconds without a
new checkpoint. A checkpoint pruned (trainer.keep_checkpoints) before its turn is skipped and named.
"""

from __future__ import annotations

import csv
import json
import time
import uuid
from pathlib import Path
from typing import Any, Callable

ENDED_FILE = "ended.json"  # written into run.dir by framework.train when a run has trained its last step
WATCHED_FILE = "watched.json"


def numbered_checkpoints(run_dir: Path) -> dict[int, Path]:
    """The complete checkpoints of a run, by step: the numbered ones (ModelCheckpoint names them by step), and
    last.ckpt when it is a file of its own (trainer.keep_checkpoints=0), not a link to one of them."""
    from framework.inference.checkpoint import checkpoint_step, is_complete

    found = {}
    for path in (run_dir / "checkpoints").glob("step*.ckpt"):
        if not path.is_symlink() and path.name[4:-5].isdigit() and is_complete(path):
            found[int(path.name[4:-5])] = path
    last = run_dir / "checkpoints" / "last.ckpt"
    if last.exists() and not last.is_symlink() and is_complete(last):
        found.setdefault(checkpoint_step(last), last)
    return dict(sorted(found.items()))


class RunLogger:
    """The eval/* metrics of each checkpoint, to where the training run logs (above)."""

    def __init__(self, run_dir: Path, out: Path) -> None:
        import yaml

        config = yaml.safe_load((run_dir / "config.yaml").read_text()) if (run_dir / "config.yaml").exists() else {}
        self.cfg = (config or {}).get("logger") or {"kind": "csv"}
        self.kind, self.run_dir, self.out = self.cfg.get("kind", "csv"), run_dir, out
        self.name = self.cfg.get("name") or (config or {}).get("name") or run_dir.name
        self._writer: Any = None
        self._wandb: Any = None

    def log(self, metrics: dict[str, float], step: int) -> None:
        if self.kind == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter

            if self._writer is None:
                self._writer = SummaryWriter(str(self.run_dir / "tensorboard"), filename_suffix=".eval")
            for k, v in metrics.items():
                self._writer.add_scalar(k, v, step)
            self._writer.flush()
        elif self.kind == "wandb":
            self._wandb_run().log({"trainer/global_step": step, **metrics})
        elif self.kind == "csv":
            path = self.out / "metrics.csv"
            rows = list(csv.DictReader(path.open(newline=""))) if path.exists() else []
            rows.append({"step": step, **metrics})
            keys = ["step", *sorted({k for r in rows for k in r} - {"step"})]
            with path.open("w", newline="") as f:
                writer = csv.DictWriter(f, keys)
                writer.writeheader()
                writer.writerows(rows)

    def _wandb_run(self) -> Any:
        if self._wandb is None:
            import wandb

            id_file = self.out / "wandb_eval_id.txt"
            if not id_file.exists():
                id_file.write_text(uuid.uuid4().hex[:8])
            train_id = self.run_dir / "wandb_id.txt"
            group = self.cfg.get("group") or (train_id.read_text().strip() if train_id.exists() else self.name)
            self._wandb = wandb.init(project=self.cfg.get("project"), entity=self.cfg.get("entity"), group=group,
                                     name=f"{self.name}-eval", job_type="eval", dir=str(self.out),
                                     mode="offline" if self.cfg.get("mode") == "offline" else "online",
                                     id=id_file.read_text().strip(), resume="allow")
            self._wandb.define_metric("eval/*", step_metric="trainer/global_step")
        return self._wandb

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        if self._wandb is not None:
            self._wandb.finish()


def agreed(look: Callable[[], Any]) -> Any:
    """What rank 0 sees, on every rank of an evaluation under torchrun (they generate together)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return look()
    seen = [look() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(seen, src=0)
    return seen[0]


def watch(run_dir: Path, out: Path, evaluate_one: Callable[[Path, Path], dict[str, Any]], poll_s: float = 30.0,
          idle_s: float | None = None, say: Callable[[str], None] = print) -> dict[int, dict[str, Any]]:
    """Evaluate each new checkpoint of `run_dir` with evaluate_one(checkpoint, out_folder) until the run has ended
    (or `idle_s` passed without a new one); returns {step: metrics} of every checkpoint evaluated, earlier watches'
    included."""
    if not is_rank0():
        say = lambda _: None  # noqa: E731
    if not agreed(lambda: (run_dir / "config.yaml").exists()):  # a second job may start before the training's
        say(f"watch: waiting for the run {run_dir} to start")
        while not agreed(lambda: (run_dir / "config.yaml").exists()):
            time.sleep(poll_s)
    out.mkdir(parents=True, exist_ok=True)
    record = out / WATCHED_FILE
    done: dict[int, dict[str, Any]] = ({int(k): v for k, v in json.loads(record.read_text()).items()}
                                       if record.exists() else {})
    logger = RunLogger(run_dir, out) if is_rank0() else None
    last_new = time.monotonic()
    try:
        while True:
            # ended.json read before the listing: every checkpoint written before it is listed
            ended, waiting = agreed(lambda: ((run_dir / ENDED_FILE).exists(),
                                             {s: p for s, p in numbered_checkpoints(run_dir).items() if s not in done}))
            for step, path in waiting.items():
                if not path.exists():
                    say(f"watch: {path.name} was removed before its turn (trainer.keep_checkpoints); skipped")
                    continue
                say(f"watch: evaluating {path} (step {step})")
                metrics = evaluate_one(path, out / f"step{step:07d}")
                done[step] = metrics
                if not metrics:  # a rank other than 0 (it shares the generation; rank 0 scores and records)
                    continue
                record.write_text(json.dumps({str(k): v for k, v in sorted(done.items())}, indent=2))
                flat = {f"eval/{k}": float(v) for k, v in metrics.items() if isinstance(v, (int, float))}
                if logger is not None:
                    logger.log(flat, step)
                last_new = time.monotonic()
            if ended and not waiting:
                say(f"watch: the run has ended; {len(done)} checkpoints evaluated")
                return done
            if idle_s is not None and time.monotonic() - last_new > idle_s:
                say(f"watch: no new checkpoint for {idle_s:g} s (watch_idle_s); stopping with {len(done)} evaluated")
                return done
            if not waiting:
                time.sleep(poll_s)
    finally:
        if logger is not None:
            logger.close()


def is_rank0() -> bool:
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
