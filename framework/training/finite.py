"""Non-finite steps: each optimizer step's losses and gradient norm checked together, without a host wait.

The training module calls one FiniteGuard at four points of a step: `add_loss` (each micro-batch's loss),
`before_step` (the gradient norm, once per optimizer step: skip or record), `take_grad_norm` (clipping reuses that
norm) and `check` (a host read on logging steps, before checkpoint saves and at the end of training).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

MAX_CONSECUTIVE_SKIPS = 20  # with trainer.skip_nonfinite: stop after this many non-finite steps in a row


class NonFiniteLossError(RuntimeError):
    """Raised when the loss is NaN/inf and skipping such steps was not asked for."""


class FiniteGuard:
    """trainer.skip_nonfinite=true: a bad step's gradients are dropped on every rank (no parameter or optimizer
    state changes; the step still counts). false: the first bad step is recorded on the device and `check` stops the
    run there, before any checkpoint holds the non-finite weights."""

    def __init__(self, skip: bool) -> None:
        self.skip = skip
        self.consecutive_skips = 0  # non-finite steps skipped in a row
        self.step_skipped = False  # the last optimizer step was skipped
        self._loss_finite: torch.Tensor | None = None  # this step's micro-batch losses all finite (device bool)
        self._first_bad: torch.Tensor | None = None  # the first step with a non-finite loss / norm, -1: none (device)
        self._grad_norm: torch.Tensor | None = None  # this step's gradient norm, for clipping
        self.grad_norm: torch.Tensor | None = None  # the last step's global norm, whole (train/grad_norm)

    def add_loss(self, loss: torch.Tensor) -> None:
        """One micro-batch's loss, kept on the device until the step's gradient norm joins it."""
        finite = torch.isfinite(loss.detach())
        self._loss_finite = finite if self._loss_finite is None else self._loss_finite & finite

    def before_step(self, params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer, step: int,
                    world_size: int, device: torch.device) -> torch.Tensor:
        """The global gradient norm (returned, for logging; also what clipping uses) and the step's losses checked
        as one flag, all-reduced (min) so every rank agrees. Skipping reads it on the host now (it must be decided
        before the step); otherwise the first bad step is recorded on the device."""
        grads = [p.grad for p in params if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros((), device=device)
        self._grad_norm = norm  # a DTensor under fsdp (the shards' norms combined): clipping takes it as it is
        whole = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        self.grad_norm = whole
        ok = torch.isfinite(whole.detach().float()).reshape(())
        if self._loss_finite is not None:
            ok = ok & self._loss_finite.reshape(())
        self._loss_finite = None
        if world_size > 1:
            flag = ok.to(torch.int32)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)  # enqueued; NCCL keeps the host going
            ok = flag.bool()
        if self.skip:
            self.step_skipped = not bool(ok)
            if self.step_skipped:
                self._drop(optimizer, step)
            else:
                self.consecutive_skips = 0
        else:
            at = torch.full((), step, dtype=torch.long, device=ok.device)
            first = self._first_bad if self._first_bad is not None else torch.full_like(at, -1)
            self._first_bad = torch.where(ok | (first >= 0), first, at)
        return whole

    def _drop(self, optimizer: torch.optim.Optimizer, step: int) -> None:
        """No parameter changes this step: gradients set to None make AdamW and CAME leave the parameters and their
        state untouched (under 16-mixed the grad scaler has seen the inf/NaN too)."""
        optimizer.zero_grad(set_to_none=True)
        self._grad_norm = None
        # A skipped step does not change the weights, so a run whose weights are already non-finite would loop
        # forever: give up after a run of skips.
        self.consecutive_skips += 1
        if self.consecutive_skips > MAX_CONSECUTIVE_SKIPS:
            raise NonFiniteLossError(
                f"{self.consecutive_skips} consecutive non-finite losses at step {step}: the weights"
                " are likely broken; resume from an earlier checkpoint with a lower optimizer.lr."
            )

    def take_grad_norm(self) -> torch.Tensor | None:
        """This step's gradient norm for clipping, once (None after a skip)."""
        norm, self._grad_norm = self._grad_norm, None
        return norm

    def check(self) -> None:
        """Stop (every rank: the flag is the same on all) if some step since the start had a non-finite loss or
        gradient norm. A host read."""
        if self._first_bad is None:
            return
        step = int(self._first_bad)
        if step < 0:
            return
        raise NonFiniteLossError(
            f"loss is nan or inf (or the gradient norm is) on some rank at step {step}; stopping with the last good "
            "checkpoint intact. Lower optimizer.lr, enable gradient clipping, or set trainer.skip_nonfinite=true to "
            "skip such steps."
        )
