"""The mutation check: plant known bugs one at a time and see whether the tests meant to catch them fail.

    python tests/mutants.py                 # every mutant; prints a table, exit status 1 if any is missed
    python tests/mutants.py --list          # the mutants and the tests each one runs
    python tests/mutants.py NAME [NAME...]  # only these
    python tests/mutants.py --markdown      # the table as Markdown (the README's copy)

    python tests/mutants.py --audit         # stale mutants and missing tests, reported; nothing runs, exit 0

Each mutant is a text edit of the product (a list of (file, old, new); `old` must occur exactly once, ignoring how
its tokens are spaced, so a reflowed line still matches and a mutant that no longer applies is reported as stale
rather than silently testing nothing). It is applied to a
copy of the checkout in a temporary folder, never to the checkout itself, and only the tests listed for it
run there (`python -m pytest -x` on those node ids, with their own TMPDIR). First the same tests run on the
unmutated copy: a mutant only counts as caught when its tests pass without it.

Verdicts: caught (a test failed on an assertion: `assert`, pytest.raises / pytest.fail, assert_close; read off the
exception pytest's short summary names for the failed test),
MISSED (they passed), crash (a test failed on another exception: the bug broke the code rather than being
observed), timeout, error (pytest could not run them: a test id that does not exist, a collection error),
stale (the mutant's text is no longer in the code). Only caught counts as caught.
"""

from __future__ import annotations

import argparse
import ast
import functools
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutant:
    name: str
    what: str
    edits: tuple[tuple[str, str, str], ...]  # (file relative to the root, old text, new text)
    tests: tuple[str, ...]


DIST = "tests/test_distributed.py::"
REMOTE = "tests/test_data_prep_remote.py::"
MUTANTS = [
    Mutant("caption_dropout_inverted", "90% of captions dropped instead of 10%",
           (("framework/training/draws.py", "[:, 0] < caption_dropout", "[:, 0] > caption_dropout"),),
           ("tests/test_train.py::test_quickstart_learns_the_prompts",)),
    Mutant("rank1_optimizer_never_steps", "rank 1's optimizer steps with lr 0: its weights never move",
           (("framework/training/optim.py", "    base = lr_lambda(module.optimizer_cfg, module.max_steps)",
             "    base = (lambda s: 0.0) if module.global_rank == 1 else lr_lambda(module.optimizer_cfg, module.max_steps)"),),
           (DIST + "test_two_ranks_follow_the_single_process_losses[sgo]",
            DIST + "test_two_ranks_follow_the_single_process_losses[ddp]")),
    Mutant("adam_state_dropped_on_reshard", "a sharded resume loads the weights but drops the optimizer's moments",
           (("framework/distributed/strategy.py", "    def finish_saves(self) -> None:",
             "    def load_checkpoint(self, *args, **kwargs):\n"
             "        out = super().load_checkpoint(*args, **kwargs)\n"
             "        for opt in self.optimizers:\n"
             "            opt.state.clear()\n"
             "        return out\n\n"
             "    def finish_saves(self) -> None:"),),
           (DIST + "test_sharded_checkpoint_resumes_on_another_world_size",
            "tests/test_large_jobs.py::test_a_16_node_job_starts_and_continues_hybrid_sharded_on_4_nodes_like_one_process")),
    Mutant("ema_not_used_for_grids", "sample grids drawn with the training weights instead of the EMA",
           (("framework/training/callbacks.py", 'with inference_view(trainer, pl_module), torch.compiler.set_stance("force_eager"):',
             'with __import__(\'contextlib\').nullcontext(), torch.compiler.set_stance("force_eager"):'),),
           ("tests/test_ema.py::test_grids_and_the_final_evaluation_use_the_averaged_weights",)),
    Mutant("ema_not_used_for_final_eval", "the end-of-training evaluation scores the training weights",
           (("framework/training/callbacks.py", "    with inference_view(trainer, pl_module):\n        ranks = SplitRanks()",
             "    with __import__('contextlib').nullcontext():\n        ranks = SplitRanks()"),),
           ("tests/test_ema.py::test_grids_and_the_final_evaluation_use_the_averaged_weights",)),
    Mutant("activation_checkpointing_off", "strategy.activation_checkpointing=true silently does nothing",
           (("framework/distributed/fsdp.py", "        denoiser.net.enable_gradient_checkpointing()", "        pass"),),
           ("tests/test_train.py::test_activation_checkpointing_recomputes_the_blocks_and_keeps_the_losses",)),
    Mutant("compile_off", "strategy.compile=true silently runs eager",
           (("framework/distributed/fsdp.py", "            unit.compile()", "            pass"),),
           ("tests/test_train.py::test_compiled_blocks_run_compiled_and_follow_the_eager_losses",)),
    Mutant("fsdp_precision_not_passed", "the bf16 MixedPrecisionPolicy never reaches fully_shard",
           (("framework/distributed/fsdp.py", "    for unit in shard_units(denoiser):\n        fully_shard(unit, **kwargs)",
             "    kwargs.pop('mp_policy', None)\n    for unit in shard_units(denoiser):\n        fully_shard(unit, **kwargs)"),),
           (DIST + "test_fsdp_bf16_mixed_computes_with_bf16_parameters_and_keeps_fp32_masters",)),
    Mutant("low_precision_norm_in_fp32", "LPLayerNorm computes in fp32 and only casts its output",
           (("plugins/low_precision_norm.py",
             "return F.layer_norm(x.to(dtype), self.normalized_shape, _cast(self.weight, dtype), _cast(self.bias, dtype), self.eps)",
             "return F.layer_norm(x.float(), self.normalized_shape, self.weight, self.bias, self.eps).to(dtype)"),),
           ("tests/test_low_precision_norm.py::test_norm_runs_in_the_autocast_dtype_close_to_fp32",)),
    Mutant("growth_leaves_one_projection", "growth's zero gate skips each block's last residual branch",
           (("framework/models/blocks.py", "    for branch in view.branches:\n        nn.init.zeros_(branch.out_proj.weight)",
             "    for branch in view.branches[:-1]:\n        nn.init.zeros_(branch.out_proj.weight)"),),
           ("tests/test_growth.py::test_grown_model_computes_the_source_function",)),
    Mutant("cache_skipped_branch_computed", "cached sampling still runs the branches it reuses",
           (("framework/inference/caching.py", "            return self.cache[key]  #",
             "            inner(*args, **kwargs)\n            return self.cache[key]  #"),),
           ("tests/test_cache_router.py::test_a_skipped_branch_is_not_called",)),
    Mutant("cache_penalty_ignores_cost", "the router's sparsity penalty weighs every branch alike whatever it costs",
           (("plugins/cache_router.py", "self.cfg.sparsity * (router.cost * beta).sum()", "self.cfg.sparsity * beta.sum()"),),
           ("tests/test_cache_router.py::test_the_sparsity_penalty_weighs_each_branch_by_its_cost",)),
    Mutant("router_cost_setting_ignored", "the router weighs branches by their flops whatever plugins.cache_router.cost says",
           (("plugins/cache_router.py", 'if self.cfg.cost != "none":', "if True:"),
            ("plugins/cache_router.py", "cost = branch_costs(model, self.cfg.cost).float()",
             'cost = branch_costs(model, "flops").float()')), ("tests/test_cache_router.py::test_the_schedule_goes_where_out_says_and_the_penalty_weighs_branches_as_cost_says",)),
    Mutant("router_schedule_out_ignored", "the schedule is written in run.dir whatever plugins.cache_router.out says",
           (("plugins/cache_router.py", "out = Path(cfg.out) if cfg.out else Path(run_cfg.run.dir) / SCHEDULE_FILE",
             "out = Path(run_cfg.run.dir) / SCHEDULE_FILE"),), ("tests/test_cache_router.py::test_the_schedule_goes_where_out_says_and_the_penalty_weighs_branches_as_cost_says",)),
    Mutant("eval_prompts_ignored", "the own-data evaluation draws the images' captions whatever eval.prompts says",
           (("framework/evaluation/realdata.py", "prompts = eval_prompts(settings.prompts, captions)",
             "prompts = eval_prompts(None, captions)"),), ("tests/test_own_data.py::test_training_ends_with_the_own_data_evaluation",)),
    Mutant("router_distilled_unguided", "the router distils the conditional prediction, not the guided one sampling uses",
           (("plugins/cache_router.py", "model, g = pl_module.model, self.cfg.guidance or 1.0", "model, g = pl_module.model, 1.0"),),
           ("tests/test_cache_router.py::test_the_distillation_starts_where_guided_sampling_is_and_distils_the_guided_prediction",)),
    Mutant("bucket_batches_mixed", "a bucketed dataset's batches mix buckets (Streaming's random batching)",
           (("framework/data/datamodule.py", '"batching_method": "per_stream"', '"batching_method": "random"'),),
           ("tests/test_buckets.py::test_the_data_module_reads_each_batch_from_one_bucket_and_reports_what_it_leaves_out",)),
    Mutant("router_states_from_noised_data", "the router trains on forward-noised data, not on the sampler's own states",
           (("plugins/cache_router.py", 'if self.cfg.start == "trajectory":', 'if self.cfg.start == "none":'),),
           ("tests/test_cache_router.py::test_the_distillation_starts_where_guided_sampling_is_and_distils_the_guided_prediction",)),
    Mutant("came8bit_wrong_block_scale", "CAME-8bit dequantises each block with its neighbour's scale",
           (("plugins/quant8.py", "torch.addcmul(lo[..., None], codes, scale[..., None])",
             "torch.addcmul(lo[..., None], codes, scale.roll(1, -1)[..., None])"),),
           ("tests/test_came.py::test_quantization_round_trip_error_and_constant_blocks",
            "tests/test_came.py::test_8bit_trajectory_follows_unquantized")),
    Mutant("streaming_resume_restarts_epoch", "a resumed data loader ignores its saved position",
           (("framework/data/shards.py", "        def prepare_shard(self, shard_id: int, blocking: bool = True) -> None:",
             "        def load_state_dict(self, obj) -> None:\n            return None\n\n"
             "        def prepare_shard(self, shard_id: int, blocking: bool = True) -> None:"),),
           ("tests/test_datamodule.py::test_lightning_resume_continues_mid_epoch",
            "tests/test_train.py::test_resume_auto_continues_like_an_uninterrupted_run")),
    Mutant("preemption_save_one_step_late", "the preemption checkpoint is written one step after the signal",
           (("framework/training/checkpointing.py", "        flag = torch.tensor([float(self.flag)])",
             "        late, self._late = getattr(self, '_late', False), self.flag\n"
             "        flag = torch.tensor([float(late)])"),),
           (DIST + "test_preemption_signal_mid_run_saves_one_step_on_every_rank_and_the_requeued_run_matches",)),
    Mutant("scancel_requeues", "a cancelled job (SIGTERM, no preemption) requeues itself",
           (("framework/training/checkpointing.py", '            if when not in ("None", "Unknown", "") and when >= start:',
             '            if True:'),),
           (DIST + "test_slurm_signal_saves_a_checkpoint_requeues_or_stops_and_the_rerun_resumes_there",)),
    Mutant("stale_preempt_time_counted", "a cancelled job that was preempted in an earlier run requeues itself",
           (("framework/training/checkpointing.py", '            if when not in ("None", "Unknown", "") and when >= start:',
             '            if when not in ("None", "Unknown", ""):'),),
           ("tests/test_checkpoints.py::test_a_sigterm_is_a_preemption_only_when_slurm_recorded_one_in_this_run",)),
    Mutant("preemption_asked_once", "a preemption the controller records after the signal arrived is taken for a cancel",
           (("framework/training/checkpointing.py", "            time.sleep(1.0)\n", "            break\n"),),
           ("tests/test_checkpoints.py::test_a_sigterm_is_a_preemption_only_when_slurm_recorded_one_in_this_run",)),
    Mutant("latte_temporal_blocks_not_restacked", "growth and pruning rebuild only the first list of a stack (Latte's spatial blocks)",
           (("framework/models/blocks.py", "        for prefix in prefixes:\n", "        for prefix in prefixes[:1]:\n"),),
           ("tests/test_blocks.py::test_a_latte_layer_is_its_spatial_and_temporal_block_and_restacks_whole",)),
    Mutant("grown_layer_half_silenced", "a grown layer starts as the identity in its first block only (Latte's temporal block computes)",
           (("plugins/growth/__init__.py", "                for view in layers[j]:\n                    make_identity(view)",
             "                for view in layers[j][:1]:\n                    make_identity(view)"),),
           ("tests/test_video.py::test_video_models_grow_and_prune_by_whole_layers_through_the_commands[latte]", "tests/test_growth.py::test_grown_model_computes_the_source_function[latte_debug-constant]")),
    Mutant("shm_prefix_searched_per_rank", "each rank searches for Streaming's shared-memory prefix on its own, as Streaming does",
           (("framework/data/shards.py", "    streaming.base.dataset.get_shm_prefix = agreed_shm_prefix  # StreamingDataset's own reference to it\n", ""),),
           ("tests/test_datamodule.py::test_a_nodes_ranks_take_their_leaders_shared_memory_prefix",)),
    Mutant("prefix_search_keeps_what_it_looked_at", "the prefix search is Streaming's: each segment it looks at stays open until the process exits",
           (("framework/data/shards.py", "        found = max(first_free_prefix(streams_local, streams_remote, name, retry) for name in shm.SHM_TO_CLEAN)\n",
             "        found = max(shm._check_and_find_retrying(streams_local, streams_remote, name, retry) for name in shm.SHM_TO_CLEAN)\n"),),
           ("tests/test_datamodule.py::test_each_dataset_opened_holds_descriptors_only_on_its_own_shared_memory",)),
    Mutant("throughput_flops_of_one_batch", "TFLOP/s and MFU count one batch's FLOPs per reading, not every batch since the last",
           (("framework/training/callbacks.py", "            pl_module.flops_per_batch = pending + flops\n", "            pl_module.flops_per_batch = flops\n"),),
           ("tests/test_train.py::test_throughput_counts_every_batch_and_reads_the_clock_on_logging_steps_only",)),
    Mutant("batch_flops_of_the_first_shape", "every bucket's batches are counted at the first batch's FLOPs",
           (("framework/training/figures.py", "    shape = tuple(batch[\"latents\"].shape) if \"latents\" in batch else ()\n", "    shape = next(iter(module._batch_flops), tuple(batch[\"latents\"].shape))\n"),),
           ("tests/test_video.py::test_clips_go_to_the_longest_frame_count_they_have_at_their_aspect_and_train_and_sample_by_bucket",)),
    Mutant("wan_rope_of_the_first_band", "every rank rotates its Wan queries and keys by the first band's positions",
           (("framework/distributed/sequence.py", "register_forward_hook(lambda module, args, out: tuple(band(t) for t in out))",
             "register_forward_hook(lambda module, args, out: tuple(t[:, :t.shape[1] // sp.size].clone() for t in out))"),),
           ("tests/test_sequence.py::test_split_forward_backward_and_sampling_equal_the_whole_model",)),
    Mutant("latte_switch_frames_reversed", "Latte's switch to the positions layout puts the sources' frames in reverse order",
           (("framework/distributed/sequence.py", "                rows = arrived.permute(1, 2, 0, 3, 4).reshape(B * w, F, D)",
             "                rows = arrived.flip(0).permute(1, 2, 0, 3, 4).reshape(B * w, F, D)"),),
           ("tests/test_sequence.py::test_split_forward_backward_and_sampling_equal_the_whole_model",)),
    Mutant("latte_switch_slices_swapped", "Latte's sliced switch puts the slices of positions back in reverse order",
           (("framework/distributed/sequence.py", "        whole = torch.stack(outs, dim=2)  # (P: source positions, B, S, w, f, D)",
             "        whole = torch.stack(outs[::-1], dim=2)  # (P: source positions, B, S, w, f, D)"),),
           ("tests/test_sequence.py::test_split_forward_backward_and_sampling_equal_the_whole_model",)),
    Mutant("preemption_not_requeued", "a job Slurm preempts saves and ends without being requeued",
           (("framework/training/checkpointing.py", 'if self.saved == REQUEUE or (trainer.is_global_zero and self.preempted()):',
             'if self.saved == REQUEUE:'),),
           (DIST + "test_slurm_signal_saves_a_checkpoint_requeues_or_stops_and_the_rerun_resumes_there",)),
    Mutant("every_rank_writes_hydra_files", "every rank of an srun, torchrun or submitit job writes .hydra/ and train.log",
           (("framework/config.py", "lambda on_zero, elsewhere: on_zero if writes_run_dir() else elsewhere", "lambda on_zero, elsewhere: on_zero"),),
           ("tests/test_train.py::test_only_global_rank_zero_writes_hydra_files_into_the_run_dir",
            "tests/test_slurm.py::test_submitit_job_of_two_tasks_logs_to_the_run_dir_from_global_rank_zero_only")),
    Mutant("salloc_step_not_a_slurm_job", "srun tasks in an allocation named `interactive` each train alone",
           (("framework/training/checkpointing.py",
             'return SLURMEnvironment.detect() or ("SLURM_STEP_ID" in os.environ and "SLURM_NTASKS" in os.environ)',
             "return SLURMEnvironment.detect()"),),
           (DIST + "test_preemption_signal_mid_run_saves_one_step_on_every_rank_and_the_requeued_run_matches",
            "tests/test_train.py::test_a_slurm_job_without_a_gpu_trains_on_the_cpu_only_when_asked")),
    Mutant("cpu_slurm_job_not_refused", "a Slurm job without a GPU trains on the CPU under trainer.accelerator=auto",
           (("framework/preflight.py", 'if cfg.trainer.accelerator == "auto" and slurm_task()',
             'if cfg.trainer.accelerator == "never" and slurm_task()'),),
           ("tests/test_train.py::test_a_slurm_job_without_a_gpu_trains_on_the_cpu_only_when_asked",)),
    Mutant("sbatch_setup_strict", "launch/train.sbatch runs the site set-up in strict mode (conda's activate fails)",
           (("launch/train.sbatch", "    set +e +u +o pipefail\n", ""),),
           ("tests/test_slurm.py::test_sbatch_job_saves_on_each_signal_and_resumes_exactly[scancel]",)),
    Mutant("sbatch_failure_not_requeued", "launch/train.sbatch ends a job whose rank died instead of requeueing it",
           (("launch/train.sbatch", '        scontrol requeue "$SLURM_JOB_ID"\n', ""),),
           ("tests/test_slurm.py::test_sbatch_job_whose_rank_is_killed_is_requeued_and_continues_exactly",)),
    Mutant("sbatch_exec_ignored", "launch/train.sbatch runs python outside LATENTFORGE_EXEC (apptainer exec ...)",
           (("launch/train.sbatch", "${LATENTFORGE_EXEC:-} python -m framework.train", "python -m framework.train"),),
           ("tests/test_slurm.py::test_sbatch_job_saves_on_each_signal_and_resumes_exactly[scancel]",)),
    Mutant("images_seen_restarts", "trainer/images_seen starts again from 0 when a run resumes",
           (("framework/training/module.py",
             'self.images_seen = extra.get("images_seen", checkpoint.get("global_step", 0) * (saved or 0))',
             "self.images_seen = 0"),),
           ("tests/test_loggers.py::test_wandb_offline_logs_loss_lr_throughput_and_grids_and_resumes_the_same_run",)),
    Mutant("wandb_grid_uncaptioned", "W&B gets the sample grid's images without their prompts",
           (("framework/training/loggers.py", "        logger.log_image(key=key, images=images, caption=captions, step=step)",
             "        logger.log_image(key=key, images=images, step=step)"),),
           ("tests/test_loggers.py::test_wandb_offline_logs_loss_lr_throughput_and_grids_and_resumes_the_same_run",)),
    Mutant("logged_loss_of_one_batch", "train/loss is the logged step's batch, not the mean since the last logged step",
           (("framework/training/module.py", "self.log(\"train/loss\", self._interval_loss / self._interval_batches,",
             "self.log(\"train/loss\", loss,"),),
           ("tests/test_train.py::test_the_logged_loss_is_the_mean_over_the_logging_interval",)),
    Mutant("logged_loss_interval_not_reset", "the logged loss averages every step since the start, not since the last log",
           (("framework/training/module.py", "            self._interval_loss, self._interval_batches = None, 0\n",
             "            pass\n"),),
           ("tests/test_train.py::test_the_logged_loss_is_the_mean_over_the_logging_interval",)),
    Mutant("grace_check_key_ignored", "trainer.grace_check=false still times a probe save and may refuse the run",
           (("framework/train.py", "*preemption_callbacks(run_dir, t.grace_check)]", "*preemption_callbacks(run_dir, True)]"),),
           (DIST + "test_grace_check_refuses_a_slurm_run_whose_save_outlasts_kill_wait[False]",)),
    Mutant("grace_check_never_refuses", "a step plus a save longer than Slurm's KillWait goes unreported",
           (("framework/training/checkpointing.py", "        if need > kill_wait:\n", "        if need > kill_wait and False:\n"),),
           (DIST + "test_grace_check_refuses_a_slurm_run_whose_save_outlasts_kill_wait[True]",)),
    Mutant("bench_checkpoint_ema_ignored", "framework.bench checkpoint saves no EMA whatever ema says",
           (("framework/bench/suite_checkpoint.py", "    if cfg.ema:  # an fp32 copy of each (sharded) weight", "    if False:  # an fp32 copy of each (sharded) weight"),),
           ("tests/test_bench.py::test_bench_checkpoint_saves_the_same_bytes_every_way",)),
    Mutant("async_step_does_not_wait_for_staging", "the optimizer step changes the weights while an async save copies them",
           (("framework/distributed/strategy.py", "                self._saver.wait_staged()\n", "                pass\n"),),
           ("tests/test_checkpoints.py::test_async_saves_resume_like_sync_ones",)),
    Mutant("staging_wait_returns_at_once", "wait_staged() returns before the copy to host memory is done",
           (("framework/distributed/strategy.py", "            self._staging.result()\n", "            pass\n"),),
           ("tests/test_checkpoints.py::test_a_process_based_async_save_holds_the_values_of_the_moment_it_was_asked_for",)),
    Mutant("grace_check_ignores_a_save_in_flight", "the grace check counts one save where an async one may be in flight",
           (("framework/training/checkpointing.py", "    return 2 if getattr(strategy, \"async_save\", False)", "    return 1 if getattr(strategy, \"async_save\", False)"),),
           ("tests/test_checkpoints.py::test_the_grace_check_counts_the_saves_a_sigterm_may_wait_for",)),
    Mutant("remote_checkpoint_never_fetched", "resume=auto ignores a newer checkpoint on trainer.checkpoint_dir",
           (("framework/train.py", "            found = fetched or found\n", "            found = found\n"),),
           ("tests/test_remote.py::test_checkpoints_on_s3_resume_a_run_whose_run_dir_is_gone_like_the_uninterrupted_run",)),
    Mutant("remote_checkpoints_never_pruned", "checkpoints on trainer.checkpoint_dir beyond keep_checkpoints stay",
           (("framework/training/remote.py", "for old in self.remote.names()[:-self.keep]:", "for old in []:"),),
           ("tests/test_remote.py::test_checkpoints_on_s3_resume_a_run_whose_run_dir_is_gone_like_the_uninterrupted_run",)),
    Mutant("failed_node_never_left_out", "launch/requeue.py requeues a job with the node whose task was killed",
           (("launch/requeue.py", "    return excluded | {blamed}, f\"leaving out", "    return None, f\"leaving out"),),
           ("tests/test_requeue.py::test_a_task_killed_by_a_signal_requeues_the_job_without_its_node",)),
    Mutant("too_few_nodes_left_out_anyway", "a node is left out though the job could then never be scheduled",
           (("launch/requeue.py", "    if len(left) < needed:", "    if len(left) < 0:"),),
           ("tests/test_requeue.py::test_a_node_is_not_left_out_when_too_few_would_remain_for_the_job",)),
    Mutant("precompute_preemption_not_requeued", "launch/precompute.sbatch lets a preempted job end instead of requeueing it",
           (("launch/precompute.sbatch", '        scontrol requeue "$job"\n', "        true\n"),),
           ("tests/test_slurm.py::test_precompute_sbatch_preempted_on_two_tasks_is_requeued_and_writes_the_one_process_dataset",)),
    Mutant("task_gpu_binding_ignored", "a Slurm task that sees one GPU of a several-task node is left to Lightning",
           (("framework/train.py", "torch.cuda.device_count() == 1 and tasks_per_node() > 1:", "torch.cuda.device_count() == 1 and tasks_per_node() < 1:"),),
           (DIST + "test_a_task_bound_to_one_gpu_takes_the_gpu_it_sees",)),
    Mutant("task_gpu_is_local_rank", "a task bound to one GPU is put on cuda:<local rank>",
           (("framework/distributed/strategy.py", 'return [torch.device("cuda", 0) for _ in devices]', 'return [torch.device("cuda", i) for i in devices]'),),
           (DIST + "test_a_task_bound_to_one_gpu_takes_the_gpu_it_sees",)),
    Mutant("slurm_devices_auto_not_tasks", "trainer.devices=auto under Slurm is left to Lightning (1 on a CPU node)",
           (("framework/train.py", 'return tasks_per_node() if devices == "auto" and slurm_task() else devices', "return devices"),),
           ("tests/test_slurm.py::test_submitit_job_of_two_tasks_logs_to_the_run_dir_from_global_rank_zero_only",)),
    Mutant("sigma_exported_as_alpha", "a 300-token PixArt model is exported as a PixArtAlphaPipeline (prompts cut at 120 tokens)",
           (("framework/models/families/pixart.py", '            return "PixArtSigmaPipeline"\n', "            return self.pipeline_class\n"),),
           ("tests/test_recipes.py::test_the_finetune_recipe_runs_from_a_released_folder_to_a_sampled_export",)),
    Mutant("video_fps_ignored", "fps never reaches the clip reader: every frame is taken",
           (("data_prep/video.py", "    if not fps or not source_fps:\n", "    if True:\n"),),
           ("tests/test_data_prep.py::test_video_folder_becomes_clips_of_num_frames_at_fps_with_short_and_broken_videos_counted",)),
    Mutant("video_latents_frames_first", "clip latents written (F, C, h, w) instead of (C, F, h, w)",
           (("data_prep/precompute.py", "t.unflatten(0, (-1, frames)).transpose(1, 2)", "t.unflatten(0, (-1, frames))"),),
           ("tests/test_data_prep.py::test_video_folder_becomes_clips_of_num_frames_at_fps_with_short_and_broken_videos_counted",)),
    Mutant("video_dataset_trained_as_images", "an image model is not refused on a video dataset (nor a video one on images)",
           (("framework/preflight.py", "    if (info.num_frames is not None) != fam.video:",
             "    if False:"),),
           ("tests/test_video.py::test_a_model_of_the_other_kind_than_the_data_is_refused",)),
    Mutant("video_vae_compression_ignored", "a video VAE's temporal compression not read: recorded as 1",
           (("data_prep/encoders.py", "            self.temporal_compression = int(cfg.temporal_compression_ratio)\n",
             "            self.temporal_compression = 1\n"),),
           ("tests/test_video.py::test_a_video_vae_encodes_each_clip_whole_into_fewer_latent_frames[hunyuan]",)),
    Mutant("vae_tile_ignored", "precompute's vae_tile never reaches the VAE: whole frames are encoded",
           (("data_prep/encoders.py", "            if class_name == \"AutoencoderKLCogVideoX\":\n                self.vae.enable_tiling(",
             "            if True:\n                (lambda *a: None)("),),
           ("tests/test_video.py::test_a_tiled_video_vae_encodes_in_tiles_and_sampling_decodes_with_the_same_tiles",)),
    Mutant("per_channel_scaling_averaged", "a video VAE's per-channel scaling applied as its average",
           (("data_prep/record.py", "    if isinstance(factor, (int, float)):\n        return float(factor)\n",
             "    if True:\n        return float(factor) if isinstance(factor, (int, float)) else sum(factor) / len(factor)\n"),),
           ("tests/test_video.py::test_a_video_vae_encodes_each_clip_whole_into_fewer_latent_frames[wan]",)),
    Mutant("sampled_latents_not_unscaled", "sampling decodes the model's latents without undoing the dataset's scaling",
           (("framework/inference/pipeline.py", '        raw = unscale_latents(z, self.info["scaling_factor"], self.info["shift_factor"])',
             "        raw = z"),),
           ("tests/test_video.py::test_wan_trains_on_video_vae_latents_samples_their_frames_and_exports_a_pipeline_with_the_vae",)),
    Mutant("video_vae_frames_unchecked", "precompute takes a clip length a video VAE cannot compress whole",
           (("data_prep/precompute.py", "            codec.check_frames(count)\n", "            pass\n"),),
           ("tests/test_video.py::test_a_video_vae_is_refused_frames_it_cannot_compress_images_and_tiles_it_cannot_take",)),
    Mutant("i3d_key_ignored", "eval.i3d is never read: clips get no fvd",
           (("framework/evaluation/realdata.py", '    if getattr(settings, "i3d", None):\n', "    if False:\n"),),
           ("tests/test_video.py::test_eval_scores_own_clips_with_fvd_and_per_frame_clip_score",)),
    Mutant("i3d_frames_stretched", "the I3D gets each frame stretched to 224 x 224, not resized and centre-cropped",
           (("framework/evaluation/realdata.py", "interpolate(frames, size=(h, w),",
             "interpolate(frames, size=(self.size, self.size),"),),
           ("tests/test_video.py::test_video_features_feed_i3d_224_pixel_frames_in_minus_one_to_one",)),
    Mutant("clip_score_of_first_frames", "a clip's CLIP score is its first frame's, not every frame's",
           (("framework/evaluation/realdata.py", "per_frame.view(len(images), -1).mean(1)", "per_frame.view(len(images), -1)[:, 0]"),),
           ("tests/test_video.py::test_eval_scores_own_clips_with_fvd_and_per_frame_clip_score",)),
    Mutant("flops_counted_on_the_live_model", "the FLOP count runs the live model (all its memory) instead of a meta replica",
           (("framework/models/flops.py", "    model = replica if replica is not None else denoiser\n",
             "    model = denoiser\n"),),
           ("tests/test_models.py::test_train_flops_are_counted_on_a_meta_replica_as_on_the_model_itself[pixart_debug]",)),
    Mutant("meta_attention_unfused", "on the meta replica attention is counted in its math form (one backward product short)",
           (("framework/models/flops.py", "        if func is torch.nn.functional.scaled_dot_product_attention:\n",
             "        if False:\n"),),
           ("tests/test_models.py::test_train_flops_are_counted_on_a_meta_replica_as_on_the_model_itself[wan_debug]",)),
    Mutant("keep_checkpoints_deletes_newest", "trainer.keep_checkpoints keeps the oldest numbered checkpoints",
           (("framework/train.py", 'mode="max",', 'mode="min",'),),
           ("tests/test_checkpoints.py::test_keep_checkpoints_keeps_the_newest_numbered_files_across_a_resume",)),
    Mutant("dropped_loader_keeps_its_threads", "a data loader dropped mid-epoch leaves Streaming's threads running",
           (("framework/data/shards.py", "                if mine is not None:\n                    self._stop_threads(mine)\n", ""),),
           ("tests/test_datamodule.py::test_dropped_loader_stops_its_threads",)),
    Mutant("failed_shard_ends_epoch_silently", "a shard that fails to prepare ends the epoch early without an error",
           (("framework/data/shards.py", "            if self._event.is_set():  # Streaming's way of ending an epoch whose thread failed\n"
             "                raise self._failure()\n", ""),),
           ("tests/test_datamodule.py::test_failed_shard_preparation_raises_instead_of_ending_the_epoch",)),
    Mutant("grids_decoded_on_every_rank", "every rank of a training job loads the VAE and decodes the grid",
           (("framework/training/callbacks.py", "decode_on_rank0=True", "decode_on_rank0=False"),),
           (DIST + "test_the_final_grid_is_decoded_on_rank_zero_only",)),
    Mutant("gradient_norm_not_checked", "only the losses are checked for finiteness, not the gradient norm",
           (("framework/training/finite.py", "        ok = torch.isfinite(whole.detach().float()).reshape(())\n",
             "        ok = torch.ones((), dtype=torch.bool, device=whole.device)\n"),),
           ("tests/test_train.py::test_a_nonfinite_gradient_with_a_finite_loss_is_skipped",)),
    Mutant("nonfinite_weights_saved", "a non-finite step found late is not checked before the next checkpoint save",
           (("framework/training/module.py", "        self.finite.check()  # never save weights that a non-finite step produced\n",
             ""),),
           ("tests/test_train.py::test_a_nonfinite_step_found_late_leaves_no_checkpoint_of_its_weights",)),
    Mutant("noise_by_global_rank", "a rank draws the noise of the samples at its global rank's position, not Streaming's "
           "(node-innermost) one: right on one node, wrong on several",
           (("framework/distributed/mesh.py", "        return local * nodes + node",
             "        return rank // self.sequence"),),
           (DIST + "test_two_nodes_hybrid_sharded_follow_one_process_and_resume_on_one_node",
            "tests/test_sequence.py::test_the_job_mesh_dims_follow_nodes_and_sequence_groups")),
    Mutant("inter_layer_waits_each_slice", "a Latte spatial block waits for each slice's switch to positions before "
           "running the next slice's tail",
           (("framework/distributed/sequence.py",
             "            arrivals.append(_all_to_all(sends[-1].detach(), sp.group))  # travels while slice s + 1's",
             "            arrivals.append(_wait(_all_to_all(sends[-1].detach(), sp.group)))  # travels while slice s + 1's"),),
           ("tests/test_bench.py::test_bench_overlap_records_the_ring_across_nodes_and_the_switches_of_a_video_model",)),
    Mutant("inter_layer_switch_waited_in_the_spatial_block", "a Latte spatial block waits for its switches to positions "
           "(the temporal block cannot start on the first slice before the last has arrived)",
           (("framework/distributed/sequence.py", "        if not (self.net.gradient_checkpointing and torch.is_grad_enabled()):",
             "        if False:"),),
           ("tests/test_bench.py::test_bench_overlap_records_the_ring_across_nodes_and_the_switches_of_a_video_model",)),
    Mutant("inter_layer_position_table_dropped", "the spatial block that switches its output leaves out Latte's "
           "temporal position table",
           (("framework/distributed/sequence.py", "            if table is not None:\n"
             "                h = h.reshape(B, f, P * w, D) + table.to(h.dtype)[:, :, None]\n", ""),),
           ("tests/test_sequence.py::test_split_forward_backward_and_sampling_equal_the_whole_model",)),
    Mutant("latte_output_gathered_from_the_first_frames", "every rank of a Latte group contributes the first frames' "
           "projected rows to the output gather, not its own",
           (("framework/distributed/sequence.py", "_GatherTokens.apply(out.reshape(B, F, -1)[:, r * f:(r + 1) * f], sp)",
             "_GatherTokens.apply(out.reshape(B, F, -1)[:, :f], sp)"),),
           ("tests/test_sequence.py::test_split_forward_backward_and_sampling_equal_the_whole_model",)),
    Mutant("latte_position_table_twice", "Latte's loop adds this rank's rows of the temporal position table again",
           (("framework/distributed/sequence.py", "        module.temp_pos_embed = torch.zeros_like(mine)",
             "        module.temp_pos_embed = mine"),),
           ("tests/test_sequence.py::test_split_forward_backward_and_sampling_equal_the_whole_model",)),
    Mutant("tensorboard_no_images", "logger=tensorboard gets no sample images",
           (("framework/training/loggers.py", '        logger.experiment.add_images(key, batch, step, dataformats="NHWC")\n', ""),),
           ("tests/test_tensorboard.py::test_tensorboard_logs_what_wandb_gets_and_a_resumed_run_continues_in_its_folder",)),
    Mutant("tensorboard_config_left_to_lightning", "logger=tensorboard's hparams.yaml is Lightning's (written before the "
           "config is known)",
           (("framework/training/loggers.py", "            Path(self.log_dir, self.NAME_HPARAMS_FILE).write_text(text)\n", ""),),
           ("tests/test_tensorboard.py::test_tensorboard_logs_what_wandb_gets_and_a_resumed_run_continues_in_its_folder",)),
    Mutant("noise_by_physical_nodes", "with sequence groups, a rank's noise follows the physical nodes, not the world of "
           "groups Streaming deals to",
           (("framework/distributed/mesh.py", "        nodes = groups // per_node if groups % per_node == 0 else 1",
             "        nodes = self.nodes"),),
           ("tests/test_sequence.py::test_the_job_mesh_dims_follow_nodes_and_sequence_groups",)),
    Mutant("sequence_group_over_nodes_as_one_ulysses", "a sequence group of whole nodes runs Ulysses over all of them "
           "(no ring dim)",
           (("framework/distributed/mesh.py", "            ring = sequence // ranks_per_node", "            ring = 1"),),
           ("tests/test_sequence.py::test_the_job_mesh_dims_follow_nodes_and_sequence_groups",
            DIST + "test_fsdp_and_sequence_parallelism_share_the_job_mesh")),
    Mutant("ring_chunks_not_merged_by_lse", "ring attention adds the chunks' partial outputs instead of weighting them "
           "by their log-sum-exp",
           (("framework/distributed/sequence.py",
             "                out = out * torch.exp(lse - total).unsqueeze(-1) + o * torch.exp(m - total).unsqueeze(-1)",
             "                out = out + o"),),
           ("tests/test_sequence.py::test_a_sequence_group_across_two_nodes_equals_the_whole_model",)),
    Mutant("ring_gradients_not_home", "ring attention's key and value gradients stay on the last node that added to "
           "them",
           (("framework/distributed/sequence.py", "        dkv = _ring_wait(sums)\n", "        _ring_wait(sums)\n"),),
           ("tests/test_sequence.py::test_a_sequence_group_across_two_nodes_equals_the_whole_model",)),
    Mutant("ring_gradients_waited_at_once", "ring attention waits for each chunk's key and value gradients as soon as "
           "it sends them on",
           (("framework/distributed/sequence.py", "            sums = _ring_pass(dkv, sp)  # on to",
             "            sums = (_ring_wait(_ring_pass(dkv, sp)), [])  # on to"),),
           ("tests/test_sequence.py::test_a_sequence_group_across_two_nodes_equals_the_whole_model",)),
    Mutant("ring_waits_before_attending", "ring attention waits for the next chunk before attending to this one (no "
           "overlap)",
           (("framework/distributed/sequence.py",
             "            pending = _ring_pass(kv, sp) if step < sp.ring - 1 else None  # the next chunk travels",
             "            pending = (_ring_wait(_ring_pass(kv, sp)), []) if step < sp.ring - 1 else None  # the next chunk travels"),),
           ("tests/test_sequence.py::test_a_sequence_group_across_two_nodes_equals_the_whole_model",)),
    Mutant("every_sequence_rank_decodes", "every rank of a sequence-parallel group decodes the same images",
           (("framework/inference/sharing.py", "    leader = sp is None or sp.rank == 0", "    leader = True"),),
           ("tests/test_sequence.py::test_split_forward_backward_and_sampling_equal_the_whole_model",)),
    Mutant("throughput_skips_unlogged_batches", "the throughput monitor counts only the batches of logging steps",
           (("framework/training/callbacks.py", "        self._batches[stage] += batches  # the base class adds this batch's own",
             "        self._batches[stage] += 0"),),
           ("tests/test_train.py::test_throughput_counts_every_batch_and_reads_the_clock_on_logging_steps_only",)),
    Mutant("new_blocks_not_warmed_up", "a grown model's new blocks start at the full lr (their own warm-up ignored)",
           (("framework/training/optim.py", "        ramp = min(1.0, (step + 1) / warmup_steps) if warmup_steps else 1.0",
             "        ramp = 1.0"),),
           ("tests/test_growth.py::test_a_grown_run_continues_the_schedule_and_warms_up_only_its_new_blocks",)),
    Mutant("early_ema_used", "an EMA that has barely moved from its start is used for sampling and export",
           (("framework/inference/checkpoint.py", "    if progress is not None and progress < MIN_EMA_PROGRESS:",
             "    if False:"),),
           ("tests/test_ema.py::test_an_ema_that_has_not_caught_up_is_not_used_silently",)),
    Mutant("unet_size_ids_not_fed", "a size-conditioned UNet trains on the target size only (records ignored)",
           (("framework/training/module.py", 'pred = self.model(xt, t, text, mask, labels, size_ids=batch.get("size_ids"))',
             "pred = self.model(xt, t, text, mask, labels)"),),
           ("tests/test_buckets.py::test_unet_size_conditioning_feeds_each_sample_its_original_size_and_crop",)),
    Mutant("sequence_band_is_a_view", "a rank's band of the patch embedding keeps the whole sequence alive",
           (("framework/distributed/sequence.py", "return out[:, sp.rank * n:(sp.rank + 1) * n].clone()",
             "return out[:, sp.rank * n:(sp.rank + 1) * n]"),),
           ("tests/test_sequence.py::test_split_forward_backward_and_sampling_equal_the_whole_model",)),
    Mutant("exchange_backward_waits", "attention's backward waits for each input-gradient exchange as soon as it is issued",
           (("framework/distributed/sequence.py", "        r = _Tied.apply(s, r, _all_to_all, group) if grad else r",
             "        r = _Tied.apply(s, r, lambda x, grp: _wait(_all_to_all(x, grp)), group) if grad else r"),),
           ("tests/test_bench.py::test_bench_overlap_records_the_exchanges_where_they_are_issued_and_used",)),
    Mutant("linear_sums_gradient_not_reduced", "SANA's split linear attention keeps this rank's share of the per-head "
           "sums' gradient instead of the group's total",
           (("framework/distributed/sequence.py", "_Tied.apply(s, total, _all_reduce, sp.group)",
             "_Tied.apply(s, total, lambda x, grp: x, sp.group)"),),
           ("tests/test_sequence.py::test_split_forward_backward_and_sampling_equal_the_whole_model",)),
    Mutant("linear_sums_backward_waits", "the sums' gradient all-reduce is waited for as soon as it is issued",
           (("framework/distributed/sequence.py", "_Tied.apply(s, total, _all_reduce, sp.group)",
             "_Tied.apply(s, total, lambda x, grp: _wait(_all_reduce(x, grp)), sp.group)"),),
           ("tests/test_bench.py::test_bench_overlap_issues_sanas_all_reduces_by_head_group_and_waits_late",)),
    Mutant("sequence_gather_gradient_unscaled", "the output gather's backward returns this rank's slice, not P x it "
           "(a sequence-parallel group's gradient is 1/P of the whole model's)",
           (("framework/distributed/sequence.py", "        return grad[:, sp.rank * n:(sp.rank + 1) * n] * sp.size, None",
             "        return grad[:, sp.rank * n:(sp.rank + 1) * n], None"),),
           ("tests/test_cache_router.py::test_the_router_trained_under_sequence_parallelism_follows_one_process",)),
    Mutant("caption_kv_not_in_gap", "the cross-attention's caption K/V are computed in its own module, not while the "
           "self-attention's first exchange travels",
           (("framework/distributed/sequence.py", "    if gap is not None:  # work that needs none of them, done while they travel\n        gap()\n", ""),),
           ("tests/test_sequence.py::test_split_forward_backward_and_sampling_equal_the_whole_model",)),
    Mutant("caption_kv_when_cached", "the caption K/V are computed in the gap at a cached-sampling step that reuses the "
           "cross-attention's output",
           (("framework/distributed/sequence.py", "        if x is not None and (runs is None or runs()):\n",
             "        if x is not None:\n"),),
           ("tests/test_sequence.py::test_split_forward_backward_and_sampling_equal_the_whole_model",)),
    Mutant("socket_room_unchecked", "data loader workers start under a temp folder too deep for their Unix socket",
           (("framework/data/datamodule.py", "        if self.cfg.num_workers:\n            check_socket_room()\n", ""),),
           ("tests/test_datamodule.py::test_a_temp_folder_too_deep_for_the_workers_socket_is_refused",)),
    Mutant("decoders_build_the_denoiser", "every rank of decode_ranks builds and loads the denoiser, decoders too",
           (("framework/inference/sharing.py", "        if denoising:  # a decoding rank never builds the denoiser\n",
             "        if True:\n"),),
           ("tests/test_decoupled.py::test_each_role_loads_only_its_own_model",)),
    Mutant("aco_key_ignored", "the sample and eval commands' aco= is dropped: decoding ranks never compute heads",
           (("framework/cli.py", "            return DecodeRanks(self.decode_ranks, self.aco)",
             "            return DecodeRanks(self.decode_ranks)"),),
           ("tests/test_decoupled.py::test_each_role_loads_only_its_own_model",)),
    Mutant("aco_heads_misplaced", "the helper's heads are put first in the output, before the denoiser's own",
           (("framework/inference/decoupled.py", "torch.cat([mine, back.to(mine.device)], dim=1)",
             "torch.cat([back.to(mine.device), mine], dim=1)"),),
           ("tests/test_decoupled.py::test_idle_decoders_compute_attention_heads_and_the_images_are_unchanged",)),
    Mutant("aco_no_heads_shared", "Aco shares no head: every self-attention computed by the denoiser alone",
           (("framework/inference/decoupled.py", "        return min(H - 1, round(self.share * H))",
             "        return 0"),),
           ("tests/test_decoupled.py::test_idle_decoders_compute_attention_heads_and_the_images_are_unchanged",)),
    Mutant("aco_help_not_modelled", "decode_ranks=auto's throughput ignores what idle decoders give back with Aco",
           (("framework/inference/decoupled.py", "        helped = min(1.0, (1 - busy) * k / d)",
             "        helped = 0.0"),),
           ("tests/test_decoupled.py::test_auto_decode_ranks_count_what_idle_decoders_give_back_with_aco",)),
    Mutant("aco_slower_help_counted", "decode_ranks=auto counts a helped batch slower than one alone as help",
           (("framework/inference/decoupled.py", "    t_helped = min(t_helped, t_denoise)\n", ""),),
           ("tests/test_decoupled.py::test_auto_decode_ranks_count_what_idle_decoders_give_back_with_aco",)),
    Mutant("aco_refused_on_denoisers_only", "a family Aco cannot share is refused on the denoising ranks only",
           (("framework/inference/sharing.py", "            aco_processors(pipe.model, None)\n", "            pass\n"),),
           ("tests/test_decoupled.py::test_a_family_aco_cannot_share_is_refused_on_every_rank",)),
    Mutant("plain_torchrun_draws_everything", "under plain torchrun every rank of framework.eval draws every image",
           (("framework/cli.py", "return SplitRanks() if dist.is_initialized() else OneProcess()", "return OneProcess()"),),
           ("tests/test_decoupled.py::test_under_plain_torchrun_the_ranks_share_the_images",)),
    Mutant("plain_torchrun_joins_no_group", "framework.eval under plain torchrun joins no process group: every rank "
           "draws every image and prints", (("framework/cli.py", "        init_from_env()\n    return not", "    return not"),),
           ("tests/test_decoupled.py::test_eval_command_on_two_processes_scores_what_one_process_scores[plain]",)),
    Mutant("adamw_weight_decay_dropped", "the AdamW the trainer builds ignores optimizer.weight_decay",
           (("framework/training/optim.py", "eps=cfg.eps, weight_decay=cfg.weight_decay, fused=fused or None",
             "eps=cfg.eps, weight_decay=0.0, fused=fused or None"),),
           ("tests/test_gpu.py::test_adamw_follows_the_reference_step_on_the_cpu",)),
    Mutant("fused_adamw_under_grad_scaler", "16-mixed runs get fused AdamW, which unscales after the norm check and clipping",
           (("framework/training/optim.py", "    return not grad_scaler and kinds in", "    return kinds in"),),
           ("tests/test_gpu.py::test_fused_adamw_only_for_parameters_on_one_kind_of_device_without_a_grad_scaler",)),
    Mutant("fused_adamw_on_cuda_only", "AdamW on the CPU loops over the parameters in Python instead of its fused kernel",
           (("framework/training/optim.py", 'kinds in ({"cuda"}, {"cpu"})', 'kinds == {"cuda"}'),),
           ("tests/test_gpu.py::test_adamw_follows_the_reference_step_on_the_cpu",)),
    Mutant("flops_reused_for_another_trainable_set", "a replica's FLOP count is reused for a model with other frozen parameters",
           (("framework/models/flops.py", "    return repr(replica.cfg), trainable, repr(adapters), shapes",
             "    return repr(replica.cfg), repr(adapters), shapes"),),
           ("tests/test_models.py::test_a_replicas_count_is_reused_for_the_same_model_and_inputs_only",)),
    Mutant("flops_reused_for_other_inputs", "a replica's FLOP count is reused for a longer caption",
           (("framework/models/flops.py", "    return repr(replica.cfg), trainable, repr(adapters), shapes",
             "    return repr(replica.cfg), trainable, repr(adapters)"),),
           ("tests/test_models.py::test_a_replicas_count_is_reused_for_the_same_model_and_inputs_only",)),
    Mutant("came8bit_threshold_strict", "CAME-8bit keeps a matrix of exactly 16K elements in fp32 (SANA-1.5: 16K or more)",
           (("plugins/came.py", "math.prod(shape) >= min_8bit_size", "math.prod(shape) > min_8bit_size"),),
           ("tests/test_came.py::test_8bit_state_is_about_one_byte_per_element",)),
    Mutant("memory_plan_counts_adamw_state", "the memory plan counts AdamW's 8 bytes a parameter whatever the optimizer",
           (("framework/training/memory.py", "state_bytes=state, shards=shards", "shards=shards"),),
           ("tests/test_came.py::test_the_memory_plan_counts_the_state_the_optimizer_holds_after_a_step",)),
    Mutant("growth_ignores_qk_norm", "a model without QK-norm is grown without a word (SANA-1.5 calls it crucial)",
           (("plugins/growth/__init__.py", "    if not has_qk_norm(target):", "    if False:"),),
           ("tests/test_growth.py::test_growing_a_model_without_qk_norm_warns_and_names_the_key_that_adds_it",)),
    Mutant("prune_calibrates_one_phrasing", "pruning calibrates on one prompt a class, not SANA-1.5's 100 samples",
           (("plugins/prune.py", "    return [pool[i % len(pool)] for i in range(samples)]",
             "    return pool[:len(pool) // 5]"),),
           ("tests/test_growth.py::test_pruning_calibrates_on_100_trajectories_over_every_training_phrasing",)),
    Mutant("vlm_rule_two_nos_reversed", "between two 'no' answers the surer 'no' wins (the paper: the less sure)",
           (("framework/evaluation/judge.py", "a.logp_yes >= b.logp_yes, a.logp_no <= b.logp_no)",
             "a.logp_yes >= b.logp_yes, a.logp_no >= b.logp_no)"),),
           ("tests/test_evaluation.py::test_the_yes_no_rule_is_sana_15s_by_hand",)),
    Mutant("vlm_answer_by_yes_over_no", "the VLM's answer read as p(yes) > p(no), not as its most likely token",
           (("framework/evaluation/judge.py", "        yes = torch.isin(logp.argmax(-1), torch.tensor(self.yes_ids))",
             "        yes = logp[:, self.yes_ids].logsumexp(-1) > logp[:, self.no_ids].logsumexp(-1)"),),
           ("tests/test_evaluation.py::test_vlm_judge_reads_a_local_vlm_and_its_tournament_follows_the_rule_by_hand",)),
    Mutant("vlm_winners_asked_again", "judge=vlm asks a tournament's winners again in every round",
           (("framework/evaluation/judge.py", "            if (image, prompt) not in self._seen:", "            if True:"),),
           ("tests/test_evaluation.py::test_vlm_judge_reads_a_local_vlm_and_its_tournament_follows_the_rule_by_hand",)),
    Mutant("digits_vlm_pair_one_half", "judge=digits_vlm answers yes to a pair when either half reads right",
           (("framework/evaluation/judge.py", "            yes, p = ok_l & ok_r, p_l * p_r", "            yes, p = ok_l | ok_r, p_l * p_r"),),
           ("tests/test_evaluation.py::test_digit_vlm_judge_answers_as_the_classifier_reads",)),
    Mutant("scaling_steps_not_scaled", "the scaling curve's steps points are drawn at the base steps",
           (("framework/eval.py", "replace(settings, steps=n * settings.steps)", "replace(settings, steps=settings.steps)"),),
           ("tests/test_train.py::test_scaling_command_writes_json_and_png",)),
    Mutant("head_groups_inputs_not_queued", "head_groups=auto's replay sends every group's inputs at once",
           (("framework/distributed/head_groups.py", "        link += send(layer.send_in_bytes)",
             "        link = send(layer.send_in_bytes)"),),
           ("tests/test_sequence.py::test_head_groups_auto_replays_the_schedule_by_hand",)),
    Mutant("aco_auto_share_half", "aco=auto gives a decoding rank half the heads whatever the rank counts",
           (("framework/inference/sharing.py", "        share = (k if isinstance(k, int) else 1) / world if self.aco == \"auto\" else self.aco",
             "        share = 0.5 if self.aco == \"auto\" else self.aco"),),
           ("tests/test_decoupled.py::test_idle_decoders_compute_attention_heads_and_the_images_are_unchanged[pixart-3-1-True-auto]",)),
    Mutant("prune_samples_ignored", "plugins.prune samples= never reaches the calibration (always 100)",
           (("plugins/prune.py", "    prompts = calibration_prompts(pipe, cmd.prompts, cmd.samples)",
             "    prompts = calibration_prompts(pipe, cmd.prompts)"),),
           ("tests/test_growth.py::test_prune_samples_reaches_the_calibration",)),
    Mutant("grouped_conv_weight_gradient_dense", "a grouped convolution's weight gradient counted as dense (torch's formula)",
           (("framework/models/flops.py", "    torch.ops.aten.convolution_backward: _conv_backward,\n", ""),),
           ("tests/test_models.py::test_a_grouped_convolutions_backward_counts_twice_its_forward",)),
    Mutant("blocks_not_compiled", "strategy.compile=true leaves the blocks eager",
           (("framework/distributed/fsdp.py", "            unit.compile()", "            pass"),),
           ("tests/test_train.py::test_compiled_blocks_run_compiled_and_follow_the_eager_losses",)),
    Mutant("grid_compiled", "under strategy.compile=true the sample grid compiles the blocks' no-grad graphs too",
           (("framework/training/callbacks.py", 'with inference_view(trainer, pl_module), torch.compiler.set_stance("force_eager"):',
             "with inference_view(trainer, pl_module):"),),
           ("tests/test_train.py::test_compiled_blocks_run_compiled_and_follow_the_eager_losses",)),
    Mutant("replay_forgets_stalls", "the overlap replay issues later collectives on the unstalled clock",
           (("framework/bench/suite_overlap.py", "            start = max(e.t + stall, *(free.get(c, 0.0) for c in parts))",
             "            start = max(e.t, *(free.get(c, 0.0) for c in parts))"),),
           ("tests/test_bench.py::test_the_replay_exposes_what_the_computation_does_not_hide",)),
    Mutant("dataset_record_reads_newer_versions", "a dataset.json from a newer LatentForge is read as if it were this one's",
           (("data_prep/record.py", "if not isinstance(version, int) or version > FORMAT_VERSION:",
             "if not isinstance(version, int):"),),
           ("tests/test_data_prep.py::test_the_dataset_record_round_trips_and_refuses_what_it_cannot_read",)),
    Mutant("given_model_keys_not_checked", "a data-decided model key the user gives that contradicts the dataset is "
           "overwritten by the dataset's instead of refused",
           (("framework/preflight.py", "        if current is not None:\n            raise ValueError(f\"model.{key}={current} does",
             "        if False:\n            raise ValueError(f\"model.{key}={current} does"),),
           ("tests/test_train.py::test_a_model_key_the_user_gives_is_checked_against_the_dataset",)),
    Mutant("plugins_checked_after_the_data", "framework.train checks the plugins' fields only after fitting the model "
           "to the data (a dataset may be built first)",
           (("framework/train.py", "    config_lib.check_plugins(dcfg.get(\"plugins\"))  # before fitting the model may build the dataset\n",
             ""),),
           ("tests/test_train.py::test_a_misspelled_plugin_field_is_refused_before_any_data_is_built",)),
    Mutant("plugins_unchecked_at_compose", "config.to_object leaves the plugins' own fields unchecked",
           (("framework/config.py", "    check_plugins(cfg.plugins)\n", ""),),
           ("tests/test_train.py::test_a_misspelled_plugin_field_is_refused_before_any_data_is_built",)),
    Mutant("came_settings_ignored", "CAME is built with its default clip threshold whatever optimizer.settings says",
           (("plugins/came.py", "eps=tuple(s.eps), clip_threshold=s.clip_threshold,", "eps=tuple(s.eps), clip_threshold=1.0,"),),
           ("tests/test_came.py::test_hydra_composes_came8bit",)),
    Mutant("adamw_eps_ignored", "optimizer.eps never reaches AdamW (torch's default 1e-8 instead)",
           (("framework/training/optim.py", "eps=cfg.eps, weight_decay=cfg.weight_decay", "eps=1e-8, weight_decay=cfg.weight_decay"),),
           ("tests/test_train.py::test_optimizer_eps_reaches_adamw_and_its_step",)),
    Mutant("ema_buffers_ignored", "plugins.ema.buffers=false still averages the float buffers",
           (("plugins/ema.py", "averaged_tensors(model, self.cfg.buffers).items()", "averaged_tensors(model).items()"),),
           ("tests/test_ema.py::test_buffers_false_averages_only_the_parameters",)),
    Mutant("sample_grid_seed_ignored", "sample grids are drawn with seed 0 whatever sample.seed says",
           (("framework/training/callbacks.py", "SamplingPlan.of(c), labels", "SamplingPlan.of(c, seed=0), labels"),),
           ("tests/test_train.py::test_sample_grid_draws_with_the_configured_seed_and_guidance",)),
    Mutant("sample_grid_guidance_ignored", "sample grids are drawn at guidance 4 whatever sample.guidance says",
           (("framework/training/callbacks.py", "SamplingPlan.of(c), labels", "SamplingPlan.of(c, guidance=4.0), labels"),),
           ("tests/test_train.py::test_sample_grid_draws_with_the_configured_seed_and_guidance",)),
    Mutant("eval_guidance_ignored", "evaluations sample at guidance 4 whatever eval.guidance says",
           (("framework/evaluation/scoring.py", "SamplingPlan.of(settings, seed=0, candidates=n,", "SamplingPlan.of(settings, seed=0, candidates=n, guidance=4.0,"),),
           ("tests/test_evaluation.py::test_eval_settings_reach_the_generation",)),
    Mutant("eval_sampler_ignored", "evaluations use the objective's default sampler whatever eval.sampler says",
           (("framework/evaluation/scoring.py", "SamplingPlan.of(settings, seed=0, candidates=n,", "SamplingPlan.of(settings, seed=0, candidates=n, sampler=None,"),),
           ("tests/test_evaluation.py::test_eval_settings_reach_the_generation",)),
    Mutant("eval_cache_schedule_ignored", "evaluations sample every branch at every step whatever eval.cache_schedule says",
           (("framework/evaluation/scoring.py", "SamplingPlan.of(settings, seed=0, candidates=n,", "SamplingPlan.of(settings, seed=0, candidates=n, cache_schedule=None,"),),
           ("tests/test_evaluation.py::test_eval_settings_reach_the_generation",)),
    Mutant("eval_batch_size_ignored", "evaluations generate 64 images at a time whatever eval.batch_size says",
           (("framework/evaluation/scoring.py", "ranks=ranks, batch_size=settings.batch_size,", "ranks=ranks, batch_size=64,"),),
           ("tests/test_evaluation.py::test_eval_settings_reach_the_generation",)),
    Mutant("eval_height_ignored", "evaluations ignore eval.height",
           (("framework/evaluation/scoring.py", "pipe.latent_size(settings.height, settings.width, settings.aspect, settings.num_frames)", "pipe.latent_size(None, settings.width, settings.aspect, settings.num_frames)"),),
           ("tests/test_evaluation.py::test_eval_settings_reach_the_generation",)),
    Mutant("eval_width_ignored", "evaluations ignore eval.width",
           (("framework/evaluation/scoring.py", "pipe.latent_size(settings.height, settings.width, settings.aspect, settings.num_frames)", "pipe.latent_size(settings.height, None, settings.aspect, settings.num_frames)"),),
           ("tests/test_evaluation.py::test_eval_settings_reach_the_generation",)),
    Mutant("eval_aspect_ignored", "evaluations ignore eval.aspect",
           (("framework/evaluation/scoring.py", "pipe.latent_size(settings.height, settings.width, settings.aspect, settings.num_frames)", "pipe.latent_size(settings.height, settings.width, None, settings.num_frames)"),),
           ("tests/test_evaluation.py::test_eval_settings_reach_the_generation",)),
    Mutant("eval_num_frames_ignored", "evaluations ignore eval.num_frames",
           (("framework/evaluation/scoring.py", "pipe.latent_size(settings.height, settings.width, settings.aspect, settings.num_frames)", "pipe.latent_size(settings.height, settings.width, settings.aspect, None)"),),
           ("tests/test_evaluation.py::test_eval_settings_reach_the_generation",)),
    Mutant("eval_pick_ignored", "the evaluation keeps one image per prompt whatever eval.pick says",
           (("framework/evaluation/evaluate.py", "settings.selection, settings.pick).flatten", "settings.selection, 1).flatten"),),
           ("tests/test_evaluation.py::test_eval_pick_judge_and_judge_path_reach_the_selection",)),
    Mutant("eval_judge_ignored", "the evaluation loads the dataset's own judge whatever eval.judge says",
           (("framework/evaluation/evaluate.py", "get_judge(settings.judge or ps.judge, settings.judge_path)", "get_judge(ps.judge, settings.judge_path)"),),
           ("tests/test_evaluation.py::test_eval_pick_judge_and_judge_path_reach_the_selection",)),
    Mutant("eval_judge_path_ignored", "the evaluation loads the judge without eval.judge_path",
           (("framework/evaluation/evaluate.py", "get_judge(settings.judge or ps.judge, settings.judge_path)", "get_judge(settings.judge or ps.judge, None)"),),
           ("tests/test_evaluation.py::test_eval_pick_judge_and_judge_path_reach_the_selection",)),
    Mutant("low_precision_group_norm_always", "plugins.low_precision_norm.group_norm=false still swaps the GroupNorms",
           (("plugins/low_precision_norm.py", "apply_low_precision_norms(pl_module.model, c.layer_norm, c.group_norm, c.rms_norm)", "apply_low_precision_norms(pl_module.model, c.layer_norm, True, c.rms_norm)"),),
           ("tests/test_low_precision_norm.py::test_a_norm_kind_turned_off_is_left_as_it_is",)),
    Mutant("low_precision_rms_norm_always", "plugins.low_precision_norm.rms_norm=false still swaps the RMSNorms",
           (("plugins/low_precision_norm.py", "apply_low_precision_norms(pl_module.model, c.layer_norm, c.group_norm, c.rms_norm)", "apply_low_precision_norms(pl_module.model, c.layer_norm, c.group_norm, True)"),),
           ("tests/test_low_precision_norm.py::test_a_norm_kind_turned_off_is_left_as_it_is",)),
    Mutant("growth_zero_gate_ignored", "plugins.growth.zero_gate=false still zeroes the new blocks' projections",
           (("plugins/growth/__init__.py", "cfg.init, cfg.drop_last, cfg.zero_gate, seed)", "cfg.init, cfg.drop_last, True, seed)"),),
           ("tests/test_growth.py::test_growth_config_seed_weights_and_zero_gate_reach_the_grown_weights",)),
    Mutant("growth_weights_ignored", "plugins.growth.weights=train still grows from the EMA weights",
           (("plugins/growth/__init__.py", "weights_used(ckpt, cfg.weights)", 'weights_used(ckpt, "ema")'),),
           ("tests/test_growth.py::test_growth_config_seed_weights_and_zero_gate_reach_the_grown_weights",)),
    Mutant("growth_seed_ignored", "plugins.growth.seed is ignored: the fresh blocks always use the run's seed",
           (("plugins/growth/__init__.py", "run_cfg.seed if cfg.seed is None else cfg.seed", "run_cfg.seed"),),
           ("tests/test_growth.py::test_growth_config_seed_weights_and_zero_gate_reach_the_grown_weights",)),
    Mutant("shuffle_seed_ignored", "data.shuffle_seed is ignored: the shuffle always follows the run's seed",
           (("framework/data/datamodule.py", "shuffle_seed=self.seed if cfg.shuffle_seed is None else cfg.shuffle_seed,", "shuffle_seed=self.seed,"),),
           ("tests/test_datamodule.py::test_shuffle_seed_predownload_cache_limit_and_persistent_workers_reach_the_loader",)),
    Mutant("predownload_ignored", "data.predownload never reaches the Streaming dataset",
           (("framework/data/datamodule.py", "predownload=cfg.predownload, cache_limit=cfg.cache_limit,", "predownload=None, cache_limit=cfg.cache_limit,"),),
           ("tests/test_datamodule.py::test_shuffle_seed_predownload_cache_limit_and_persistent_workers_reach_the_loader",)),
    Mutant("cache_limit_ignored", "data.cache_limit never reaches the Streaming dataset",
           (("framework/data/datamodule.py", "predownload=cfg.predownload, cache_limit=cfg.cache_limit,", "predownload=cfg.predownload, cache_limit=None,"),),
           ("tests/test_datamodule.py::test_shuffle_seed_predownload_cache_limit_and_persistent_workers_reach_the_loader",)),
    Mutant("persistent_workers_ignored", "data.persistent_workers never reaches the DataLoader",
           (("framework/data/datamodule.py", "persistent_workers=self.cfg.persistent_workers,", "persistent_workers=False,"),),
           ("tests/test_datamodule.py::test_shuffle_seed_predownload_cache_limit_and_persistent_workers_reach_the_loader",)),
    Mutant("plan_guidance_ignored", "the sampler ignores the plan's guidance scale (the conditional prediction alone)",
           (("framework/inference/sampling.py", "text2, mask2, lab), plan.guidance)", "text2, mask2, lab), 1.0)"),),
           ("tests/test_own_data.py::test_diffusers_export_is_a_pipeline_that_samples_like_framework_sample",)),
    Mutant("prefix_lock_skipped", "datasets are opened without the node's lock on Streaming's shared-memory prefixes",
           (("framework/data/shards.py", "    with prefix_lock():  # no other job", "    with contextlib.nullcontext():  #"),
            ("framework/data/shards.py", "import hashlib\n", "import contextlib\nimport hashlib\n")),
           ("tests/test_datamodule.py::test_two_jobs_opening_their_datasets_together_take_their_prefixes_in_turn",)),
    Mutant("orphan_segments_kept", "a dead dataset's shared-memory segments are left where the new one registers",
           (("framework/data/shards.py", "        removed = remove_orphan_shared_memory()  # a killed",
             "        removed = []  # a killed"),),
           ("tests/test_datamodule.py::test_shared_memory_left_by_a_dead_dataset_is_not_reused",)),
    Mutant("throughput_read_mid_accumulation", "the throughput clock is read after every micro-batch of a logged step",
           (("framework/training/callbacks.py", "        if not stepped or not logging_step(trainer, stepped=True):",
             "        if not logging_step(trainer, stepped=True):"),),
           ("tests/test_train.py::test_throughput_counts_every_batch_and_reads_the_clock_on_logging_steps_only",)),
    Mutant("logging_step_ignores_the_step_taken", "after a batch's optimizer step, logging_step still counts that step as to come",
           (("framework/training/registry.py", "    return (trainer.global_step + (0 if stepped else 1)) % every == 0",
             "    return (trainer.global_step + 1) % every == 0"),),
           ("tests/test_train.py::test_logging_step_is_lightnings_rule_at_every_hook",)),
    Mutant("log_every_ignored_by_the_framework", "the framework's logging decisions take every step as a logging step",
           (("framework/training/registry.py", "    every = trainer.log_every_n_steps\n", "    every = 1\n"),),
           ("tests/test_train.py::test_logging_step_is_lightnings_rule_at_every_hook",)),
    Mutant("bench_peak_from_ru_maxrss", "a bench arm's CPU peak is read from ru_maxrss, which keeps its parent's peak",
           (("framework/bench/fresh.py", "    if status.exists():\n        return 1024 * next(",
             "    if False:\n        return 1024 * next("),),
           ("tests/test_bench.py::test_a_spawned_arm_reports_its_own_peak_memory_not_its_parents",)),
    Mutant("digit_scorer_trained_on_every_thread", "the digit scorer trains on the caller's threads: its weights depend on the core count",
           (("framework/evaluation/metrics.py", "    torch.set_num_threads(1)\n    try:\n        return _train_digit_net(",
             "    try:\n        return _train_digit_net("),),
           ("tests/test_evaluation.py::test_the_scorer_trains_to_the_same_weights_whatever_the_thread_count",)),
    Mutant("srun_tasks_all_rank0", "precompute under srun reads only torchrun's RANK: every task is rank 0 of 1",
           (("data_prep/precompute.py", '    if "RANK" in env or "SLURM_PROCID" not in env:', "    if True:"),),
           ("tests/test_data_prep.py::test_two_ranks_merge",)),
    Mutant("canonical_nodes_auto_always_840", "data.num_canonical_nodes=auto takes 840 whatever the dataset's size",
           (("framework/data/datamodule.py",
             "    return next((c for c in CANONICAL_NODES if num_samples >= SAMPLES_PER_PARTITION * c), 1)",
             "    return 840"),),
           ("tests/test_datamodule.py::test_the_shipped_canonical_node_count_partitions_cleanly_on_other_node_counts",
            "tests/test_large_jobs.py::test_a_16_node_job_starts_and_continues_hybrid_sharded_on_4_nodes_like_one_process")),
    Mutant("caption_cache_unbounded", "precompute ignores caption_cache_mb: its caption cache grows without bound",
           (("data_prep/precompute.py", "CaptionCache(text, cfg.batch_size, cfg.caption_cache_mb * 2**20)",
             "CaptionCache(text, cfg.batch_size)"),),
           ("tests/test_data_prep.py::test_precompute_bounds_its_caption_cache_by_caption_cache_mb",)),
    Mutant("caption_cache_never_evicts", "the caption cache counts its bytes but never drops an embedding",
           (("data_prep/precompute.py", "        while self.bytes > self.max_bytes and self.table:",
             "        while False:"),),
           ("tests/test_data_prep.py::test_a_ranks_peak_memory_stays_flat_over_100k_distinct_captions",)),
    Mutant("caption_cache_evicts_oldest_inserted", "the caption cache drops the oldest encoded, not the least recently used",
           (("data_prep/precompute.py", "        for c in found:\n            self.table.move_to_end(c)\n", ""),),
           ("tests/test_data_prep.py::test_the_caption_cache_keeps_the_most_recently_used_within_its_bytes",)),
    # The suite's own machinery (findings 3 and 7 of the tests review):
    Mutant("job_status_largest_code", "a multi-rank job's status is the largest rank code (hides a rank killed by -9)",
           (("tests/zygote.py", "    return next((c for c in codes if c != 0), 0)", "    return max(codes)"),),
           ("tests/test_matrix.py::test_a_job_fails_when_any_rank_fails_a_signal_included",)),
    Mutant("forked_child_skips_shutdown", "forked test processes exit without joining threads or running atexit",
           (("tests/zygote.py", "    code = finish(code)\n", ""),),
           ("tests/test_zygote.py",)),
    # Precompute by input shard (issue 41):
    Mutant("precompute_rank_reads_every_shard", "a precompute rank reads every input shard and keeps its own part's "
           "records (the output is right; every rank opens every tar)",
           (("data_prep/precompute.py", "_batches(source.shard_records(local), cfg.batch_size)",
             "_batches((r for s in source.shards(cfg.records_per_part) for r in source.shard_records(s) if s == shard), "
             "cfg.batch_size)"),),
           ("tests/test_data_prep.py::test_a_rank_opens_only_its_own_input_shards",)),
    Mutant("precompute_part_marked_done_before_close", "a part's done marker is written while its MDS writer is still "
           "open (a kill then leaves a done part without its last shard or index.json)",
           (("data_prep/precompute.py",
             '    closed = time.perf_counter()\n    clock["write"] += closed - closing\n'
             '    stats.update(seconds=closed - start, **{f"seconds_{k}": v for k, v in clock.items()})\n'
             '    stats["examples"] = stats["examples"][:20]\n'
             '    # Only now have the writers closed (the last shard and the index.json are on disk, or uploaded): the '
             'part may be\n    # marked done.\n    out.write_json(done_name(index), {**stats, **dealt})\n',
             '        closed = time.perf_counter()\n        clock["write"] += closed - closing\n'
             '        stats.update(seconds=closed - start, **{f"seconds_{k}": v for k, v in clock.items()})\n'
             '        stats["examples"] = stats["examples"][:20]\n'
             '        out.write_json(done_name(index), {**stats, **dealt})\n'),),
           ("tests/test_data_prep.py::test_interrupted_run_restarts_cleanly",
            "tests/test_data_prep_remote.py::test_each_rank_downloads_only_its_own_tars_through_staging")),
    Mutant("precompute_done_parts_encoded_again", "a resumed precompute ignores the done markers and encodes every part "
           "again", (("data_prep/parts.py", "    done = read_done(out)\n", "    done = {}\n"),),
           ("tests/test_data_prep.py::test_a_killed_run_resumes_on_another_number_of_ranks",)),
    Mutant("precompute_parts_merged_out_of_order", "the parts' indexes are merged in reverse order (the rows no longer "
           "follow the source)",
           (("data_prep/parts.py", "merge_index([str(p) for p in parts], str(out.local(root)))",
             "merge_index([str(p) for p in reversed(parts)], str(out.local(root)))"),),
           ("tests/test_data_prep.py::test_two_ranks_merge[args]",
            "tests/test_data_prep.py::test_a_killed_run_resumes_on_another_number_of_ranks")),
    Mutant("precompute_merge_skips_a_part", "the merge leaves out the last part that holds rows",
           (("data_prep/precompute.py", 'merge(out, "", [i for i, s in enumerate(stats) if s["rows"]])',
             'merge(out, "", [i for i, s in enumerate(stats) if s["rows"]][:-1])'),),
           ("tests/test_data_prep.py::test_two_ranks_merge[args]",)),
    Mutant("precompute_records_per_part_ignored", "precompute cuts the source with the default records_per_part "
           "whatever the config says",
           (("data_prep/precompute.py", "shards = source.shards(cfg.records_per_part)", "shards = source.shards(1000)"),),
           ("tests/test_data_prep.py::test_two_ranks_merge[args]",)),
    # Decoding in worker processes (issue 41):
    Mutant("decode_workers_ignored", "decode_workers is ignored: the encoding process decodes every image itself",
           (("data_prep/precompute.py", "    if workers == 0:\n        return iter(data)", "    if True:\n        return iter(data)"),),
           ("tests/test_decode_workers.py::test_the_images_are_decoded_in_the_worker_processes",)),
    Mutant("decode_workers_reorder_batches", "each decode worker takes two consecutive batches in turn: the loader's "
           "round robin hands the batches back out of the source's order",
           (("data_prep/precompute.py", "            if c % n == w:", "            if c // 2 % n == w:"),),
           ("tests/test_decode_workers.py::test_decode_workers_write_the_same_rows_in_the_same_order[folder]",
            "tests/test_decode_workers.py::test_decode_workers_write_the_same_rows_in_the_same_order[webdataset]")),
    # Text storage, size projection and filters (issue 41):
    Mutant("text_storage_ignored", "precompute writes fp16 text whatever text_storage says",
           (("data_prep/config.py", "        self._check_storage_and_filters()\n",
             "        self._check_storage_and_filters()\n        self.text_storage = \"fp16\"\n"),),
           ("tests/test_data_prep.py::test_each_text_storage_keeps_the_fp16_embeddings_within_its_bound_and_reads_back",)),
    Mutant("text_storage_not_fingerprinted", "a finished fp16 folder is taken as done for text_storage=int8 (the key is "
           "left out of the fingerprint)",
           (("data_prep/precompute.py", '"text_storage": cfg.text_storage if cfg.text_storage != "fp16" else None',
             '"text_storage": None'),),
           ("tests/test_data_prep.py::test_each_text_storage_keeps_the_fp16_embeddings_within_its_bound_and_reads_back",)),
    Mutant("int8_read_without_its_scale", "the data module reads int8 text as its raw codes, its per-token scales ignored",
           (("framework/data/text_storage.py", "return torch.from_numpy(values).float() * scale[:, None]",
             "return torch.from_numpy(values).float()"),),
           ("tests/test_data_prep.py::test_a_dataset_stored_in_int8_trains_on_its_dequantized_embeddings",)),
    Mutant("bf16_bits_converted_as_integers", "the data module converts bf16's stored bits as integers instead of "
           "reinterpreting them", (("framework/data/text_storage.py", ".view(torch.bfloat16)", ".to(torch.bfloat16)"),),
           ("tests/test_data_prep.py::test_text_storage_round_trips_within_its_bound[bf16]",)),
    # From-scratch initialisation (issue 42):
    Mutant("reference_init_never_applied", "model.init=reference builds with the constructor's defaults",
           (("framework/models/init.py", '    if model.cfg.init == "reference":\n        apply(', '    if False:\n        apply('),),
           ("tests/test_init.py::test_the_reference_init_follows_the_reference_code[pixart_debug]",)),
    Mutant("reference_init_ignores_adaln_zero", "DiT's adaLN modulation gets the basic xavier init, not adaLN-Zero",
           (("framework/models/families/dit.py", r'(r"net\.transformer_blocks\.\d+\.norm1\.linear\.(weight|bias)", ZERO),', ""),),
           ("tests/test_init.py::test_the_reference_init_follows_the_reference_code[dit_debug]",)),
    Mutant("sharded_reference_init_skipped", "the sharded meta build keeps the constructor's weights under model.init=reference",
           (("framework/distributed/fsdp.py", 'if keep_params and cfg.init == "reference":', "if False:"),),
           ("tests/test_fsdp_init.py::test_fresh_shards_are_rows_of_the_ordinary_build[pixart_debug-reference]",)),
    Mutant("sharded_reference_init_by_local_shape", "the sharded build draws each rank's rows as a tensor of their own "
           "shape instead of cutting them from the whole one", (("framework/distributed/fsdp.py",
           "rows[p] = local_rows(reference_init.value(rule, name, p.shape, seed, p.dtype), rank, world).clone()",
           "rows[p] = reference_init.value(rule, name, local_rows(torch.empty(p.shape), rank, world).shape, seed, p.dtype)"),),
           ("tests/test_fsdp_init.py::test_fresh_shards_are_rows_of_the_ordinary_build[pixart_debug-reference]",)),
    # The W&B run's identity:
    Mutant("wandb_run_not_named_by_name", "without logger.name the W&B run is called 'run' whatever `name` says",
           (("framework/training/loggers.py", "name=cfg.name or run_name,", "name=cfg.name or \"run\","),), ("tests/test_matrix.py::test_combination_trains_samples_and_ends_with_the_evaluation[single-1-wandb]",)),
    Mutant("wandb_project_ignored", "every run goes to the default project", (("framework/training/loggers.py",
           "project=cfg.project,", "project=\"latentforge\","),), ("tests/test_matrix.py::test_combination_trains_samples_and_ends_with_the_evaluation[single-1-wandb]",)),
    Mutant("wandb_entity_ignored", "every run goes to the default entity", (("framework/training/loggers.py",
           "entity=cfg.entity,", "entity=None,"),), ("tests/test_matrix.py::test_combination_trains_samples_and_ends_with_the_evaluation[single-1-wandb]",)),
    Mutant("remote_prepared_dataset_never_complete", "data.prepare rebuilds a remote dataset the bucket already holds",
           (("framework/data/datamodule.py", 'return RemoteLocation(path, Path(staging), key="data.path").exists(DATASET_FILE)',
             "return False"),), ("tests/test_data_prep_remote.py::test_data_prepare_builds_a_missing_remote_dataset_once",)),
    Mutant("remote_prepare_without_staging_unnamed", "data.prepare of a remote data.path without staging fails with "
           "precompute's message about `staging=`, not the data.prepare key", (("framework/data/datamodule.py",
           'if builds_here and is_remote(cfg.path) and not prep.get("staging"):', "if False:"),), ("tests/test_data_prep_remote.py::test_data_prepare_builds_a_missing_remote_dataset_once",)),
    # Several captions per image (issue 41):
    Mutant("caption_layout_ignored", "precompute writes a row per caption whatever caption_layout says",
           (("data_prep/config.py", "        self._check_storage_and_filters()\n",
             "        self._check_storage_and_filters()\n        self.caption_layout = \"per_caption\"\n"),),
           ("tests/test_captions.py::test_per_image_rows_hold_the_latents_once_with_every_caption[fp16]",)),
    Mutant("caption_layout_not_fingerprinted", "a finished per_caption folder is taken as done for per_image",
           (("data_prep/precompute.py", '"caption_layout": cfg.caption_layout if cfg.caption_layout != "per_caption" else None',
             '"caption_layout": None'),),
           ("tests/test_captions.py::test_per_image_rows_hold_the_latents_once_with_every_caption[fp16]",)),
    Mutant("per_image_text_lengths_off_by_one", "a per_image row records each caption one token shorter than it is",
           (("data_prep/storage.py", 'return np.array([len(e["text_embeds"]) for e in embs], dtype=np.int32)',
             'return np.array([len(e["text_embeds"]) - 1 for e in embs] , dtype=np.int32)'),),
           ("tests/test_captions.py::test_per_image_rows_hold_the_latents_once_with_every_caption[int8]",)),
    Mutant("caption_draw_always_first", "training always takes a sample's first caption",
           (("framework/training/draws.py", "return (u.double() * counts).long()", "return torch.zeros_like(counts)"),),
           ("tests/test_captions.py::test_the_caption_draw_follows_the_step_and_the_global_row_not_the_rank_count",)),
    Mutant("caption_draw_ignores_the_step", "each sample draws the same caption (and noise, posterior sample and "
           "flip) at every step", (("framework/training/draws.py", "keyed.keys(self.seed, micro, range(r, r + n * W, W), tag)",
                          "keyed.keys(self.seed, 0, range(r, r + n * W, W), tag)"),),
           ("tests/test_captions.py::test_the_caption_draw_follows_the_step_and_the_global_row_not_the_rank_count",
            "tests/test_recipes.py::test_the_posterior_and_flip_draws_follow_the_step_and_the_global_row_not_the_rank_count")),
    Mutant("caption_draw_by_local_row", "the per-sample draws (caption, noise, posterior sample, flip) are keyed by the "
           "sample's row on its rank: another world size draws otherwise",
           (("framework/training/draws.py", "keyed.keys(self.seed, micro, range(r, r + n * W, W), tag)",
             "keyed.keys(self.seed, micro, range(n), tag)"),),
           ("tests/test_captions.py::test_the_caption_draw_follows_the_step_and_the_global_row_not_the_rank_count",
            "tests/test_recipes.py::test_the_posterior_and_flip_draws_follow_the_step_and_the_global_row_not_the_rank_count")),
    Mutant("keyed_draws_shift_the_sign_in", "the keyed generator shifts its int64 state arithmetically: the sign bit "
           "spreads into the high bits, so it is no longer SplitMix64",
           (("framework/training/keyed.py", "    return (x >> k) & ((1 << (64 - k)) - 1)", "    return x >> k"),),
           ("tests/test_objectives.py::test_the_step_draws_from_each_samples_splitmix64_sequence",)),
    Mutant("keyed_draws_repeat_within_a_sample", "every keyed draw of a sample is its sequence's first number: the "
           "noise of a sample is one value repeated",
           (("framework/training/keyed.py", "torch.arange(1, n + 1, dtype=torch.int64, device=keys.device)",
             "torch.ones(n, dtype=torch.int64, device=keys.device)"),),
           ("tests/test_objectives.py::test_keyed_normals_and_uniforms_have_their_distributions_and_no_correlation",)),
    Mutant("chosen_caption_from_the_first_sample", "each sample's chosen caption is looked up from the batch's first rows",
           (("framework/data/datamodule.py", "rows = torch.cumsum(counts, 0) - counts + chosen", "rows = chosen"),),
           ("tests/test_captions.py::test_training_draws_a_caption_per_sample_and_step_and_resumes_on_the_same_draws",)),
    Mutant("min_size_ignored", "min_size keeps every image whatever its size",
           (("data_prep/filters.py", "if self.min_size is not None and short < self.min_size:", "if False:"),),
           ("tests/test_data_prep.py::test_size_filters_read_the_decoded_image_of_a_folder",)),
    Mutant("max_aspect_ignored", "max_aspect keeps every image whatever its shape",
           (("data_prep/filters.py", "if self.max_aspect is not None and long > self.max_aspect * short:", "if False:"),),
           ("tests/test_data_prep.py::test_size_filters_read_the_decoded_image_of_a_folder",)),
    Mutant("json_filters_ignored", "the filters= thresholds on img2dataset's .json are never applied",
           (("data_prep/filters.py", "return cls(cfg.min_size, cfg.max_aspect, cfg.filters, cfg.val_fraction, cfg.split)",
             "return cls(cfg.min_size, cfg.max_aspect, None, cfg.val_fraction, cfg.split)"),),
           ("tests/test_data_prep.py::test_webdataset_filters_drop_records_by_their_json_and_count_each_filter",)),
    Mutant("json_key_missing_kept", "a record whose .json lacks a thresholded key is kept",
           (("data_prep/filters.py", 'return f"{key}.missing"', "continue"),),
           ("tests/test_data_prep.py::test_webdataset_filters_drop_records_by_their_json_and_count_each_filter",)),
    Mutant("size_filter_ignores_original_size", "min_size and max_aspect judge img2dataset's resized image, not the "
           "original size its .json records",
           (("data_prep/filters.py", "return (h, w) if h and w and h > 0 and w > 0 else None", "return None"),),
           ("tests/test_data_prep.py::test_webdataset_filters_drop_records_by_their_json_and_count_each_filter",)),
    Mutant("projection_ignores_compression", "the size projection counts uncompressed bytes, not the files written",
           (("data_prep/storage.py", '"disk": sizes["disk"] / rows', '"disk": sizes["raw"] / rows'),),
           ("tests/test_data_prep.py::test_the_size_projected_from_the_first_part_matches_the_output[folder]",)),
    Mutant("projection_counts_tars_as_records", "a webdataset's projection takes one record per tar",
           (("data_prep/storage.py", "else num_parts * seen", "else num_parts"),),
           ("tests/test_data_prep.py::test_the_size_projected_from_the_first_part_matches_the_output[webdataset]",)),
    # Precompute with object storage both ways (issue 41):
    Mutant("remote_rank_downloads_every_tar", "a precompute rank downloads every tar of a remote pattern and reads its "
           "own (the output is right; every rank fetches every tar)",
           (("data_prep/sources/webdataset.py", "        local = self.store.fetch(shard)\n",
             "        local = [self.store.fetch(n) for n in self.names][self.names.index(shard)]\n"),),
           (REMOTE + "test_each_rank_downloads_only_its_own_tars_through_staging",)),
    Mutant("remote_done_read_from_staging", "the done markers of a remote out are looked up in this machine's staging "
           "folder, not the bucket (a resume elsewhere encodes every part again)",
           (("data_prep/parts.py", "name for name in out.names(DONE_DIR)",
             "name for name in Location.names(out, DONE_DIR)"),),
           (REMOTE + "test_a_resume_elsewhere_redoes_nothing_the_bucket_marks_done",)),
    Mutant("staging_ignored", "staging= is ignored: remote inputs and parts pass through a temporary folder instead",
           (("data_prep/precompute.py", 'scratch = Path(cfg.staging).expanduser().resolve() / f"rank_{rank}"',
             'scratch = Path(__import__("tempfile").mkdtemp()) / f"rank_{rank}"'),),
           (REMOTE + "test_each_rank_downloads_only_its_own_tars_through_staging",)),
    Mutant("staged_parts_kept", "a remote out's parts stay in staging once uploaded (the local disk fills with the "
           "whole output)",
           (("data_prep/precompute.py", "MDSWriter(out=out.writer_out(folders[max(b, 0)]), columns=columns,",
             "MDSWriter(out=out.writer_out(folders[max(b, 0)]), keep_local=True, columns=columns,"),),
           (REMOTE + "test_each_rank_downloads_only_its_own_tars_through_staging",)),
    # Recipes (issue 42):
    Mutant("global_batch_ignored", "data.global_batch_size is ignored: data.batch_size per device, no accumulation",
           (("framework/training/plan.py", "    if asked is None:\n", "    if True:\n"),),
           (DIST + "test_fsdp_gradient_accumulation_follows_one_process_and_syncs_once_per_step",
            "tests/test_plan.py::test_a_run_reads_its_plan_and_leaves_the_config_as_composed")),
    Mutant("canonical_nodes_unchecked", "a job whose node count Streaming cannot partition with "
           "data.num_canonical_nodes starts, to fail in every rank's data loader",
           (("framework/training/plan.py", "        check_canonical_nodes(setting, ncn, nodes, num_samples)\n", ""),),
           ("tests/test_plan.py::test_the_data_partitions_fit_the_job_s_node_count_or_the_plan_refuses_it",)),
    Mutant("data_ignores_the_planned_partitions", "the data module resolves data.num_canonical_nodes again from the "
           "config instead of reading the run plan's",
           (("framework/data/datamodule.py", "self.plan.data_parallel, self.plan.num_canonical_nodes",
             "self.plan.data_parallel, self.cfg.num_canonical_nodes"),),
           ("tests/test_plan.py::test_a_run_reads_its_plan_and_leaves_the_config_as_composed",)),
    Mutant("shards_checked_on_every_rank", "every rank of a job reads every shard file at start-up",
           (("framework/data/shards.py",
             '    parts = (("dataset",) if rank == 0 else ()) + (("cache",) if leader else ())\n',
             '    parts = ("dataset", "cache")\n'),),
           ("tests/test_datamodule.py::test_the_ranks_of_a_job_receive_rank_0s_shard_verdict",)),
    Mutant("shard_verdict_by_mtime", "a shard rewritten with its size and mtime kept passes on its old verdict",
           (("framework/data/shards.py", "        return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]",
             "        return [st.st_size, st.st_mtime_ns]"),),
           ("tests/test_datamodule.py::test_a_later_start_checks_only_the_shard_files_changed_since_the_last_check",)),
    Mutant("hang_timeout_ignored", "trainer.hang_timeout_s is ignored: a stalled rank is timed out after the default",
           (("framework/train.py", "    hang_s = cfg.strategy.timeout_s / 3 if t.hang_timeout_s is None else t.hang_timeout_s\n",
             "    hang_s = cfg.strategy.timeout_s / 3\n"),),
           ("tests/test_large_jobs.py::test_a_stalled_rank_ends_the_job_naming_its_host_and_where_each_rank_waited",)),
    Mutant("hang_step_unnamed", "the hang watchdog does not mark a step's start: a rank stalled in a step is reported "
           "as waiting in the data loader",
           (("framework/training/watchdog.py", "        self._set(f\"training step {trainer",
             "        (f\"training step {trainer"),),
           ("tests/test_large_jobs.py::test_a_stalled_rank_ends_the_job_naming_its_host_and_where_each_rank_waited",)),
    Mutant("first_batch_unwatched", "the hang watchdog starts only after the first micro-batch: a loader that never "
           "delivers the first batch (a resumed job's too) idles the job forever",
           (("framework/training/watchdog.py", "        self._set(f\"the data loader's first batch",
             "        (f\"the data loader's first batch"),),
           ("tests/test_large_jobs.py::test_a_loader_that_never_delivers_the_first_batch_ends_the_run",)),
    Mutant("sharded_save_copies_to_host_first", "a sharded save takes the model's shards through Lightning's "
           "cpu_offload=True: on a GPU the training thread copies the whole state to host memory at every save",
           (("framework/distributed/strategy.py",
             "        return get_model_state_dict(self.model, options=StateDictOptions(cpu_offload=False))",
             "        return get_model_state_dict(self.model, options=StateDictOptions(cpu_offload=True))"),),
           ("tests/test_checkpoints.py::test_async_saves_resume_like_sync_ones",)),
    Mutant("lokr_alpha_ignored", "adapter.alpha never reaches LoKr: peft's default alpha scales the update",
           (("framework/models/adapters.py", "LoKrConfig(r=self.rank, alpha=alpha, module_dropout",
             "LoKrConfig(r=self.rank, module_dropout"),),
           ("tests/test_adapters.py::test_lokr_and_loha_compute_what_stock_peft_computes_with_the_trained_tensors",)),
    Mutant("validation_on_ema_weights", "val/loss measures the EMA's weights instead of the weights being trained",
           (("framework/training/validation.py", "            with paused(), base_precision(trainer, pl_module):",
             "            from framework.training.registry import averaged_weights\n"
             "            with paused(), averaged_weights(trainer, pl_module), base_precision(trainer, pl_module):"),),
           ("tests/test_validation.py::test_the_validation_loss_measures_the_weights_being_trained",)),
    Mutant("fresh_run_behind_remote_latest", "a run that starts behind the checkpoint prefix's `latest` goes on, "
           "uploading nothing until it passes that step",
           (("framework/training/remote.py", "    if name is not None and step_of(name) > start_step:",
             "    if False:"),),
           ("tests/test_remote.py::test_checkpoints_on_s3_resume_a_run_whose_run_dir_is_gone_like_the_uninterrupted_run",)),
    Mutant("arrival_every_micro_batch", "under gradient accumulation the arrival barrier runs at every micro-batch "
           "of a logged step, not once",
           (("framework/training/figures.py", "and (batch_idx + 1) % trainer.accumulate_grad_batches == 0)", ")"),),
           (DIST + "test_fsdp_gradient_accumulation_follows_one_process_and_syncs_once_per_step",)),
    Mutant("arrival_untimed", "the logging step's arrival barrier is skipped: a rank slow in its step goes unseen",
           (("framework/training/module.py", "                self.arrival_ms = figures.arrival_wait_ms(self.device)",
             "                self.arrival_ms = 0.0"),),
           ("tests/test_large_jobs.py::test_logging_steps_name_the_rank_the_others_wait_for",)),
    Mutant("watch_logs_at_one_step", "framework.eval watch= logs every checkpoint's metrics at step 0, not its own",
           (("framework/evaluation/watch.py", "                    logger.log(flat, step)", "                    logger.log(flat, 0)"),),
           ("tests/test_large_jobs.py::test_a_watching_evaluation_scores_each_checkpoint_as_the_run_writes_it",)),
    Mutant("lr_scaling_ignored", "optimizer.lr_scaling is ignored: the lr stays as given whatever the global batch",
           (("framework/training/optim.py", '    if cfg.lr_scaling == "none":\n        return cfg.lr',
             '    if True:\n        return cfg.lr'),),
           ("tests/test_growth.py::test_a_grown_run_continues_the_schedule_and_warms_up_only_its_new_blocks",)),
    Mutant("lr_reference_batch_ignored", "the lr is scaled from 256 whatever optimizer.lr_reference_batch says",
           (("framework/training/optim.py", "    ratio = global_batch / cfg.lr_reference_batch",
             "    ratio = global_batch / 256"),),
           ("tests/test_growth.py::test_a_grown_run_continues_the_schedule_and_warms_up_only_its_new_blocks",)),
    Mutant("released_kwargs_ignored", "init_from= a diffusers folder: the constructor arguments its config.json sets "
           "beyond the preset's are dropped (interpolation_scale, qk_norm, ...)",
           (("framework/preflight.py", "            own[key] = value\n", "            pass\n"),),
           ("tests/test_recipes.py::test_a_diffusers_folder_builds_the_model_its_config_json_describes",)),
    Mutant("released_user_key_not_checked", "init_from= a diffusers folder: a model key the user set that contradicts "
           "its config.json is replaced silently instead of refused",
           (("framework/preflight.py", "        if key in mine and current is not None:\n            raise ValueError(",
             "        if False:\n            raise ValueError("),),
           ("tests/test_recipes.py::test_a_key_the_user_set_that_contradicts_the_folder_is_refused_naming_both",)),
    Mutant("hflip_ignored", "data.hflip=true trains on the stored latents, never mirrored",
           (("framework/data/datamodule.py", '        if "latents_std" in batch or self.cfg.hflip:',
             '        if "latents_std" in batch:'),),
           ("tests/test_recipes.py::test_training_mirrors_the_samples_it_draws",)),
    Mutant("posterior_std_dropped", "a posterior=distribution dataset trains on the posterior's mean: the loader drops "
           "its std",
           (("framework/data/datamodule.py", '        if "latents_std" in samples[0]:', '        if False:'),),
           ("tests/test_recipes.py::test_training_draws_from_the_posterior_and_resumes_exactly",)),
    Mutant("text_prefix_ignored", "precompute's text_prefix is not put before the captions",
           (("data_prep/encoders.py", "        texts = [self.prefix + c for c in captions] if self.prefix else captions",
             "        texts = captions"),),
           ("tests/test_recipes.py::test_gemma2_captions_are_encoded_as_sanas_training_code_selects_them",)),
    Mutant("text_window_off_by_one", "the token window after the instruction starts one token late",
           (("data_prep/encoders.py", "        start = self.prefix_tokens - 1", "        start = self.prefix_tokens"),),
           ("tests/test_recipes.py::test_gemma2_captions_are_encoded_as_sanas_training_code_selects_them",)),
    Mutant("text_settings_not_carried", "sampling encodes prompts without the dataset's instruction and token window",
           (("framework/data/datamodule.py", '                              if k in ("max_tokens", "prefix")},',
             '                              if k in ()},'),),
           ("tests/test_recipes.py::test_gemma2_captions_are_encoded_as_sanas_training_code_selects_them",)),
    Mutant("memory_limit_ignored", "trainer.memory_limit_gb is ignored: the run is checked against the host's memory",
           (("framework/train.py", "    if limit is None:\n        available, what = memory.available_bytes",
             "    if True:\n        available, what = memory.available_bytes"),),
           ("tests/test_recipes.py::test_a_run_predicted_to_exceed_its_memory_is_refused_before_it_trains",)),
    Mutant("latte_mask_not_per_frame", "Latte's spatial blocks get no caption mask: padded tokens are attended",
           (("framework/models/families/latte.py", "            return net(x, timestep=t, encoder_hidden_states=text, "
             "encoder_attention_mask=bias,", "            return net(x, timestep=t, encoder_hidden_states=text, "
             "encoder_attention_mask=None,"),),
           ("tests/test_video.py::test_a_clip_is_denoised_alone_whatever_its_batch_and_padding[latte_debug]",)),
    Mutant("wan_padding_not_zeroed", "Wan reads the padded tokens' values instead of zeros",
           (("framework/models/families/wan.py", "        text = text * mask.unsqueeze(-1).to(text.dtype)\n",
             "        pass\n"),),
           ("tests/test_video.py::test_a_clip_is_denoised_alone_whatever_its_batch_and_padding[wan_debug]",)),
    Mutant("text_len_ignored", "model.text_len is ignored: Wan's captions padded to a fixed 32 tokens",
           (("framework/models/families/wan.py", "    n = cfg.text_len\n", "    n = 32\n"),),
           ("tests/test_video.py::test_wan_pads_every_caption_to_text_len_and_refuses_a_longer_one",)),
    Mutant("num_frames_not_checked", "a model of other frames than the data's clips is not refused",
           (("framework/data/datamodule.py", "    if num_frames is not None and num_frames != info.num_frames:",
             "    if False:"),),
           ("tests/test_video.py::test_check_compatible_names_the_frames",)),
    Mutant("clip_frames_out_of_order", "decoded clips come back with their frames reversed",
           (("framework/inference/pipeline.py", "            return out.float().clamp(-1, 1).cpu().unflatten(0, (b, frames))",
             "            return out.float().clamp(-1, 1).cpu().unflatten(0, (b, frames)).flip(1)"),),
           ("tests/test_video.py::test_latte_trains_on_clips_and_samples_mp4_gif_and_a_frame_grid",)),
    Mutant("sample_fps_ignored", "framework.sample writes every clip at 8 frames a second whatever fps= says",
           (("framework/sample.py", "    fps = cfg.fps or pipe.info.get", "    fps = None or pipe.info.get"),),
           ("tests/test_video.py::test_latte_trains_on_clips_and_samples_mp4_gif_and_a_frame_grid",)),
    Mutant("direction_sign_flipped", "the motion score reads a leftward track as rightward",
           (("framework/evaluation/motion.py", '        return "left" if dc < 0 else "right"',
             '        return "right" if dc < 0 else "left"'),),
           ("tests/test_video.py::test_real_clips_score_their_digit_and_direction_and_reversed_ones_the_opposite",)),
    Mutant("digit_read_off_centre", "the motion score classifies each frame's top-left 8x8 corner, not where the digit is",
           (("framework/evaluation/motion.py", "    best = mass.flatten(1).argmax(1)  # (N,)",
             "    best = mass.flatten(1).argmax(1) * 0  # (N,)"),),
           ("tests/test_video.py::test_real_clips_score_their_digit_and_direction_and_reversed_ones_the_opposite",)),
    Mutant("clip_bucket_shortest_count", "a clip goes to the shortest frame count instead of the longest it has frames for",
           (("data_prep/buckets.py", "    count = max(f for f, _, _ in buckets if f <= frames)",
             "    count = min(f for f, _, _ in buckets if f <= frames)"),),
           ("tests/test_video.py::test_clips_go_to_the_longest_frame_count_they_have_at_their_aspect_and_train_and_sample_by_bucket",)),
    Mutant("clip_min_frames_ignored", "a clip shorter than the longest frame count is skipped as too short",
           (("data_prep/video.py", "    least = num_frames if min_frames is None else min_frames",
             "    least = num_frames"),),
           ("tests/test_video.py::test_clips_go_to_the_longest_frame_count_they_have_at_their_aspect_and_train_and_sample_by_bucket",)),
    Mutant("sample_num_frames_ignored", "framework.sample makes the longest trained clips whatever num_frames= says",
           (("framework/sample.py", "                                                                                cfg.num_frames))",
             "                                                                                None))"),),
           ("tests/test_video.py::test_clips_go_to_the_longest_frame_count_they_have_at_their_aspect_and_train_and_sample_by_bucket",)),
    Mutant("latte_short_clip_last_positions", "a clip shorter than model.num_frames takes the last rows of Latte's temporal positions",
           (("framework/models/families/latte.py", "    net.temp_pos_embed = full[:, :frames]", "    net.temp_pos_embed = full[:, -frames:]"),),
           ("tests/test_video.py::test_latte_denoises_a_shorter_clip_as_a_latte_built_for_its_frames_and_refuses_a_longer_one",)),
    Mutant("adapter_rank_ignored", "adapter.rank is not passed to peft (its default rank 8 trains)",
           (("framework/models/adapters.py", "            return LoraConfig(r=self.rank,", "            return LoraConfig("),),
           ("tests/test_adapters.py::test_lora_update_is_alpha_over_rank_times_b_a_on_the_chosen_layers",)),
    Mutant("adapter_alpha_ignored", "adapter.alpha is ignored: alpha = rank (scale 1)",
           (("framework/models/adapters.py", "        alpha = self.alpha if self.alpha is not None else float(self.rank)",
             "        alpha = float(self.rank)"),),
           ("tests/test_adapters.py::test_lora_update_is_alpha_over_rank_times_b_a_on_the_chosen_layers",)),
    Mutant("adapter_dropout_ignored", "adapter.dropout is not passed to peft",
           (("framework/models/adapters.py", " lora_dropout=self.dropout,", ""),),
           ("tests/test_adapters.py::test_adapter_dropout_changes_what_the_adapter_learns",)),
    Mutant("adapter_targets_ignored", "adapter.targets is ignored: the family's defaults get the adapter",
           (("framework/models/adapters.py", "        return list(self.targets) if self.targets is not None else list(family_of(family).adapter_targets)",
             "        return list(family_of(family).adapter_targets)"),),
           ("tests/test_adapters.py::test_lora_update_is_alpha_over_rank_times_b_a_on_the_chosen_layers",)),
    Mutant("adapter_base_trains", "the base is not frozen: every weight trains beside the adapter",
           (("framework/models/adapters.py", "        p.requires_grad_(is_adapter_key(name))", "        p.requires_grad_(True)"),),
           ("tests/test_adapters.py::test_only_the_adapter_trains_and_the_checkpoint_holds_it_alone",)),
    Mutant("adapter_checkpoint_whole", "adapter checkpoints hold the base's weights too",
           (("framework/training/adapter_run.py", "        for key in [k for k in state if k.startswith(prefix + \"model.\") and not is_adapter_key(k)]:",
             "        for key in []:"),),
           ("tests/test_adapters.py::test_only_the_adapter_trains_and_the_checkpoint_holds_it_alone",
            "tests/test_distributed.py::test_an_adapter_sharded_on_two_ranks_follows_one_process_and_resumes_on_one")),
    Mutant("adapter_not_merged", "commands read an adapter run's checkpoint as its base alone (the adapter left out)",
           (("framework/models/adapters.py", "    denoiser.load_state_dict(state, strict=False)\n    return merge_adapter(denoiser)",
             "    return merge_adapter(denoiser)"),),
           ("tests/test_adapters.py::test_only_the_adapter_trains_and_the_checkpoint_holds_it_alone",)),
    Mutant("adapter_resume_unchecked", "a checkpoint of another adapter is resumed without a word",
           (("framework/training/adapter_run.py", "    if saved.get(\"kind\", \"none\") != now.get(\"kind\", \"none\") or (",
             "    if False and ("),),
           ("tests/test_adapters.py::test_resuming_with_another_adapter_is_refused",)),
    Mutant("lora_file_scale_lost", "format=lora writes the LoRA without its alpha (stock diffusers then scales by 1)",
           (("framework/export.py", "    metadata = adapter.peft_config(model.cfg.family).to_dict()",
             "    metadata = AdapterConfig(kind='lora', rank=adapter.rank).peft_config(model.cfg.family).to_dict()"),
            ("framework/export.py", "    from framework.models.adapters import add_adapter, to_adapter_config",
             "    from framework.models.adapters import AdapterConfig, add_adapter, to_adapter_config")),
           ("tests/test_adapters.py::test_lora_exports_as_diffusers_lora_file_merged_pipeline_and_merged_weights",
            "tests/test_own_data.py::test_a_lora_file_loads_into_the_stock_sd2_pipeline_and_samples_like_framework_sample")),
    Mutant("adapter_base_dtype_ignored", "adapter.base_dtype=bf16 keeps the frozen base in fp32",
           (("framework/models/adapters.py", "    dtype = BASE_DTYPES.get(cfg.base_dtype, torch.float32)", "    dtype = torch.float32"),),
           ("tests/test_adapters.py::test_a_bf16_base_is_held_in_bf16_and_the_memory_prediction_counts_it_so",)),
    Mutant("frozen_weights_predicted_at_fp32", "the memory prediction counts an adapter run's frozen base at 4 bytes",
           (("framework/training/memory.py", "        frozen_bytes = frozen_bytes_per_param(",
             "        frozen_bytes = 4.0 or frozen_bytes_per_param("),),
           ("tests/test_adapters.py::test_a_bf16_base_is_held_in_bf16_and_the_memory_prediction_counts_it_so",
            "tests/test_adapters.py::test_an_int8_base_computes_with_per_row_int8_weights_and_the_prediction_counts_a_byte_each")),
    Mutant("ddp_broadcasts_the_frozen_base", "DDP broadcasts an adapter run's frozen base (an int8 one cannot be)",
           (("framework/training/adapter_run.py", "        module, [f\"model.{n}\" for n, p in module.model.named_parameters() if not p.requires_grad])",
             "        module, [])"),),
           ("tests/test_matrix.py::test_combination_trains_samples_and_ends_with_the_evaluation[ddp-2-wandb-latte-lora-int8-offload-ema]",)),
    Mutant("int8_base_not_quantized", "adapter.base_dtype=int8 keeps the base's linear weights in fp32",
           (("framework/models/adapters.py", "        quantize_base(denoiser.net, cfg.base_dtype)", "        pass"),),
           ("tests/test_adapters.py::test_an_int8_base_computes_with_per_row_int8_weights_and_the_prediction_counts_a_byte_each",)),
    Mutant("quantized_base_saved_dequantized", "autograd keeps an fp32 copy of each int8 base weight for the backward",
           (("framework/models/adapters.py", "        layer.__class__ = QuantizedLinear", "        pass"),),
           ("tests/test_adapters.py::test_an_int8_base_computes_with_per_row_int8_weights_and_the_prediction_counts_a_byte_each",)),
    Mutant("quantized_weights_predicted_at_fp32", "the prediction counts an int8 base's linear weights at 4 bytes",
           (("framework/models/adapters.py", "            total += p.numel() + 4 * p.shape[0] if name in quantized else",
             "            total += 4 * p.numel() if name in quantized else"),),
           ("tests/test_adapters.py::test_an_int8_base_computes_with_per_row_int8_weights_and_the_prediction_counts_a_byte_each",)),
    Mutant("finetune_bench_predicts_one_sample", "the finetune bench predicts each arm's peak for a batch of one",
           (("framework/bench/suite_finetune.py", "ema=False, shards=1, batch=cfg.batch_size,", "ema=False, shards=1, batch=1,"),),
           ("tests/test_bench.py::test_bench_finetune_measures_each_arm_beside_its_predicted_peak",)),
    Mutant("offload_blocks_ignored", "adapter.offload_blocks=true keeps every block's frozen weights on the device",
           (("framework/training/module.py", "        if self.adapter_cfg is not None and self.adapter_cfg.offload_blocks:",
             "        if False:"),),
           ("tests/test_adapters.py::test_offloaded_blocks_train_the_same_adapter_from_copies_made_for_each_forward_and_recomputation",)),
    Mutant("offload_computes_on_the_host_weights", "an offloaded block computes with the host's tensors, not a copy",
           (("framework/models/adapters.py", "module._parameters[name] = moved.clone() if moved is kept else moved",
             "module._parameters[name] = moved"),),
           ("tests/test_adapters.py::test_offloaded_blocks_train_the_same_adapter_from_copies_made_for_each_forward_and_recomputation",)),
    Mutant("offload_copies_to_the_training_device", "offloaded blocks copy their weights to the training's device "
           "whatever device the call's inputs are on",
           (("framework/models/adapters.py", "            to = next((v.device for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)), device)",
             "            to = device"),),
           ("tests/test_adapters.py::test_an_offloaded_block_computes_where_its_inputs_are",)),
    Mutant("offload_predicted_on_the_device", "the prediction of an offloaded GPU run counts every block's frozen weights",
           (("framework/models/adapters.py", "        held = held - sum(in_blocks) + max(in_blocks)", "        held = held"),),
           ("tests/test_adapters.py::test_offloading_needs_activation_checkpointing_and_no_fsdp_and_is_predicted_as_one_block_on_a_gpu",)),
    Mutant("val_noise_drawn_per_evaluation", "the validation noise is drawn anew at each evaluation",
           (("framework/training/validation.py", "                g.manual_seed(hash((seed, VAL_DRAW, i)) & 0x7FFF_FFFF_FFFF)",
             "                g.manual_seed(hash((seed, VAL_DRAW, i, module.global_step)) & 0x7FFF_FFFF_FFFF)"),),
           ("tests/test_validation.py::test_the_validation_loss_of_unchanged_weights_is_the_same_at_every_evaluation",)),
    Mutant("val_padding_counted", "the rows padding a rank's last validation batch count in the loss",
           (("framework/training/validation.py", "                real = [i < n for i in rows]", "                real = [True for i in rows]"),),
           ("tests/test_distributed.py::test_the_validation_loss_on_two_ranks_is_the_one_process_loss",)),
    Mutant("val_sums_not_reduced", "each rank logs the validation loss of its own share of the samples",
           (("framework/training/validation.py", "    if module.trainer.world_size > 1:\n        sums =", "    if False:\n        sums ="),),
           ("tests/test_distributed.py::test_the_validation_loss_on_two_ranks_is_the_one_process_loss",)),
    Mutant("val_every_ignored", "the validation loss is measured at every step",
           (("framework/training/validation.py", "        if trainer.global_step % self.every == 0:", "        if True:"),),
           ("tests/test_validation.py::test_the_validation_loss_of_unchanged_weights_is_the_same_at_every_evaluation",)),
    Mutant("val_split_ignored", "precompute val_fraction writes every record to both splits",
           (("data_prep/filters.py", "        if self.split == \"all\":\n            return None", "        if True:\n            return None"),),
           ("tests/test_validation.py::test_val_fraction_holds_out_the_records_whose_keys_hash_low",)),
    Mutant("val_fraction_ignored", "precompute holds out half the records whatever val_fraction says",
           (("data_prep/filters.py", "in_val(key, self.val_fraction)", "in_val(key, 0.5)"),),
           ("tests/test_validation.py::test_val_fraction_holds_out_the_records_whose_keys_hash_low",)),
    Mutant("lora_merge_ignored", "format=lora merge=true writes the LoRA file, not the merged pipeline",
           (("framework/export.py", "    if cmd.format == \"lora\" and not cmd.merge:", "    if cmd.format == \"lora\":"),),
           ("tests/test_adapters.py::test_lora_exports_as_diffusers_lora_file_merged_pipeline_and_merged_weights",)),
]


# --------------------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------------------

def copy_checkout(dst: Path) -> None:
    """The files git knows about (tracked, or untracked and not ignored), as they are now in the work tree."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True,
                            check=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        src = ROOT / rel
        if src.is_file():
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / rel)


# --------------------------------------------------------------------------------------------------
# Matching: a mutant's text is found in its file whatever the whitespace, so reflowing a line keeps it
# --------------------------------------------------------------------------------------------------

TOKEN = re.compile(r"\w+|\S")  # words (names, numbers) and single other characters
WORD = re.compile(r"\w")


def pattern(old: str) -> re.Pattern[str]:
    """A regex for `old` that ignores how its tokens are spaced: any run of whitespace (newlines and indentation
    included) may stand between two tokens, and must where `old` separates two words."""
    parts, prev = [], ""
    for tok in TOKEN.findall(old):
        if prev:  # two words in a row were apart in `old` (else they would be one token)
            parts.append(r"\s+" if WORD.match(prev) and WORD.match(tok) else r"\s*")
        parts.append(re.escape(tok))
        prev = tok
    if old.endswith("\n"):  # a mutant of whole lines takes its last line's end too
        parts.append(r"[ \t]*\n")
    return re.compile("".join(parts))


def spans(text: str, old: str) -> list[tuple[int, int]]:
    """Where `old` occurs in `text`: its exact occurrences, or where none is exact those that differ only in
    whitespace between tokens."""
    exact = [(m.start(), m.start() + len(old)) for m in re.finditer(re.escape(old), text)]
    return exact or [m.span() for m in pattern(old).finditer(text)]


def reindented(text: str, start: int, old: str, new: str) -> tuple[int, str]:
    """Where `old` starts with indentation and matched at another depth (re-indented code), the start of its line and
    `new` shifted by the difference, so that a mutated block keeps the indentation of the code around it."""
    line = text.rfind("\n", 0, start) + 1
    wanted, actual = len(old) - len(old.lstrip(" ")), start - line
    if not wanted or text[line:start].strip():
        return start, new
    shift = actual - wanted
    lines = [(" " * shift + x if shift > 0 else x[min(-shift, len(x) - len(x.lstrip(" "))):]) if x.strip() else x
             for x in new.split("\n")]
    return line, "\n".join(lines)


def apply(mutant: Mutant, tree: Path) -> str | None:
    """Apply the edits in `tree`; None, or why the mutant is stale."""
    for rel, old, new in mutant.edits:
        text = (tree / rel).read_text() if (tree / rel).is_file() else ""
        found = spans(text, old)
        if len(found) != 1:
            return f"{rel}: the text to change occurs {len(found)} times, expected once"
        (start, end), = found
        if text[start:end] != old:
            start, new = reindented(text, start, old, new)
        (tree / rel).write_text(text[:start] + new + text[end:])
    return None


# --------------------------------------------------------------------------------------------------
# The audit: what in the table no longer fits the code, reported without running a test
# --------------------------------------------------------------------------------------------------

@functools.cache
def defined_tests(path: Path) -> frozenset[str]:
    """The test functions a file defines: `test_x` at module level, `Class::test_x` for a method."""
    tree = ast.parse(path.read_text(), filename=str(path))
    functions = (ast.FunctionDef, ast.AsyncFunctionDef)
    names = {n.name for n in tree.body if isinstance(n, functions)}
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        names |= {f"{cls.name}::{m.name}" for m in cls.body if isinstance(m, functions)}
    return frozenset(n for n in names if n.rpartition("::")[2].startswith("test_"))


def missing_tests(test_ids: list[str] | tuple[str, ...], root: Path = ROOT) -> list[str]:
    """The ids (tests/test_x.py or tests/test_x.py::name[param]) that name no test file or function under root."""
    out = []
    for test_id in test_ids:
        path, _, name = re.sub(r"\[.*\]$", "", test_id).partition("::")
        file = root / path
        if not path.startswith("tests/test_") or not file.is_file() or (name and name not in defined_tests(file)):
            out.append(test_id)
    return out


def audit(mutants: list[Mutant], root: Path = ROOT) -> list[str]:
    """One line for each mutant whose text is not in its file exactly once or that names a test that is gone."""
    lines = []
    for m in mutants:
        for rel, old, _ in m.edits:
            text = (root / rel).read_text() if (root / rel).is_file() else ""
            if len(found := spans(text, old)) != 1:
                lines.append(f"{m.name}: stale, its text occurs {len(found)} times in {rel} (retarget it)")
        for test_id in missing_tests(m.tests, root):
            lines.append(f"{m.name}: names {test_id}, which does not exist (renamed? update its tests)")
    return lines


def revert(mutant: Mutant, tree: Path) -> None:
    for rel, _, _ in mutant.edits:
        shutil.copy2(ROOT / rel, tree / rel)


def run_tests(tree: Path, tests: tuple[str, ...], timeout: float) -> tuple[int, float, str]:
    """(pytest's exit status, seconds, the end of its output); the status is 124 after `timeout`."""
    tmp = Path(tempfile.mkdtemp(prefix="mt", dir="/tmp"))  # short: sockets are created under TMPDIR
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "PYTEST_ADDOPTS")}
    # COLUMNS: pytest cuts the short summary's lines to the terminal's width (80 without one), which left a long test
    # name's reason as "As..." and its assertion failure read as a crash
    env.update(TMPDIR=str(tmp), PYTHONPATH=str(tree), PYTHONDONTWRITEBYTECODE="1", COLUMNS="1000")
    start = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-n", "0", "-p", "no:cacheprovider",
                               f"--basetemp={tmp / 'pt'}", *tests], cwd=tree, env=env, capture_output=True, text=True,
                              timeout=timeout)
        code, out = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        code, out = 124, f"timed out after {timeout:.0f} s\n{e.stdout or ''}"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return code, time.monotonic() - start, out


# What pytest prints (its "E" lines) when a test fails on an assertion rather than on an error it did not expect.
ASSERTION = re.compile(r"^E\s+(AssertionError\b|assert\b|Failed: DID NOT RAISE|Failed:)", re.MULTILINE)
# The reason `-ra` gives for each failed test in its short summary: the exception that ended the test. Read first:
# an "E" line may quote source (a TorchScript traceback quotes the scripted code, `assert`s included) on a crash.
SUMMARY = re.compile(r"^FAILED \S+ - (.*)$", re.MULTILINE)
ASSERTION_REASONS = ("AssertionError", "assert ", "Failed:")


def verdict_of(code: int, out: str) -> str:
    """A mutant's verdict from pytest's exit status and output (see the module's doc)."""
    if code == 0:
        return "MISSED"
    if code == 124:
        return "timeout"
    if code == 1:
        reasons = SUMMARY.findall(out)
        on_assertion = any(r.startswith(ASSERTION_REASONS) for r in reasons) if reasons else ASSERTION.search(out)
        return "caught" if on_assertion else "crash"
    return f"error ({code})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="run only these mutants")
    parser.add_argument("--list", action="store_true", help="list the mutants and their tests")
    parser.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per pytest run")
    parser.add_argument("--no-baseline", action="store_true", help="skip the unmutated run of the tests")
    parser.add_argument("--audit", action="store_true", help="report stale mutants and missing tests; run nothing")
    args = parser.parse_args()
    unknown = set(args.names) - {m.name for m in MUTANTS}
    if unknown:
        parser.error(f"unknown mutants: {', '.join(sorted(unknown))}; see --list")
    chosen = [m for m in MUTANTS if not args.names or m.name in args.names]
    if args.audit:  # a report, never a failure: a renamed test or a moved line is mended when someone next looks
        lines = audit(chosen)
        print("\n".join(lines) + "\n" if lines else "", end="")
        print(f"mutants audit: {len(chosen)} mutants, {len(lines)} problems")
        return 0
    if args.list:
        for m in chosen:
            print(f"{m.name}: {m.what}\n    " + "\n    ".join(m.tests))
        return 0

    tree = Path(tempfile.mkdtemp(prefix="mutants"))
    rows = []
    try:
        copy_checkout(tree)
        if not args.no_baseline:
            tests = tuple(dict.fromkeys(t for m in chosen for t in m.tests))
            code, secs, out = run_tests(tree, tests, args.timeout * 2)
            if code != 0:
                print(f"the tests fail without any mutant (exit {code}, {secs:.0f} s); fix them first:\n{out[-3000:]}")
                return 2
            print(f"baseline: {len(tests)} test ids pass unmutated ({secs:.0f} s)", flush=True)
        for m in chosen:
            stale = apply(m, tree)
            if stale:
                verdict, secs, out = "stale", 0.0, stale
            else:
                code, secs, out = run_tests(tree, m.tests, args.timeout)
                verdict = verdict_of(code, out)
                revert(m, tree)
            rows.append((m, verdict, secs))
            print(f"{m.name:<34} {verdict:<16} {secs:5.0f} s", flush=True)
            if verdict not in ("caught", "MISSED"):
                print("    " + out[-3000:].strip().replace("\n", "\n    ")[-1500:])
    finally:
        shutil.rmtree(tree, ignore_errors=True)

    caught = sum(v == "caught" for _, v, _ in rows)
    print(f"\n{caught} of {len(rows)} mutants caught")
    if args.markdown:
        print("\n| mutant | planted bug | tests run | verdict |\n|---|---|---|---|")
        for m, v, secs in rows:
            tests = "<br>".join(f"`{t.split('/')[-1]}`" for t in m.tests)
            print(f"| `{m.name}` | {m.what} | {tests} | {v} ({secs:.0f} s) |")
    return 0 if caught == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
