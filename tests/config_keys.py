"""The keys of the typed training config and the tests that observe each one.

    python tests/config_keys.py              # the keys no test observes, and the counts
    python tests/config_keys.py --markdown   # the whole record as a Markdown table
    python tests/config_keys.py --audit      # what is out of step with the code, reported (exit 0)

`KEYS` maps every dotted key of framework/config.py's TrainConfig (its groups' fields, the top-level fields, each
plugin's own fields `plugins.<name>.<field>` and the registered optimizer settings `optimizer.settings.<field>`) to
  tests:  the tests (file::function) that set the key or read it: an override string (`"trainer.max_steps=3"`), an
          attribute read (`cfg.trainer.max_steps`), a keyword of the key's own config dataclass
          (`ModelConfig(num_layers=...)`, `load_preset(name, num_layers=...)`), a plugin helper's keyword
          (`ema_plugin(decay=...)`), or an error message the test expects to name the key. What the test's own file
          builds for it counts too (module constants it names, its fixtures, tests/test_distributed.py's Runs, a helper
          only it calls); the fixed defaults of shared helpers (tests/helpers.py cheap() and
          train_args()) do not, their key-valued parameters (cheap(steps=...)) do. A test that only relies on a
          default is listed only where it asserts that key's effect (the entry says so).
  mutant: the name of a planted bug in tests/mutants.py that ignores or corrupts the key's value, so that one of its
          tests failing proves the value is used; None where no mutant does.

`python tests/config_keys.py --audit` (a step of .ci/run after the suite) reports what is out of step with the code: a
config field without an entry, an entry for no field, a test or mutant named here that no longer exists. It reports
and exits 0, so renaming a test or adding a field never fails the suite; a key with no test shows in the table.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _fields(cls: type, prefix: str) -> list[str]:
    """Dotted keys of a config dataclass: nested dataclasses are walked, every other field is one key."""
    hints = typing.get_type_hints(cls)
    keys: list[str] = []
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        if isinstance(kind, type) and dataclasses.is_dataclass(kind):
            keys += _fields(kind, f"{prefix}{f.name}.")
        else:
            keys.append(prefix + f.name)
    return keys


def config_keys() -> list[str]:
    """Every key of the training config, as the code defines it now: TrainConfig's fields, then after `plugins` the
    fields of each registered plugin's dataclass and after `optimizer.settings` those of each optimizer's settings."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    import plugins  # noqa: F401  (registers the plugins and their optimizers)
    from framework.config import TrainConfig
    from framework.training.optim import OPTIMIZER_SETTINGS
    from framework.training.registry import PLUGINS

    expand = {
        "plugins": [k for name, p in PLUGINS.items() for k in _fields(p.config, f"plugins.{name}.")],
        "optimizer.settings": [k for cls in OPTIMIZER_SETTINGS.values() for k in _fields(cls, "optimizer.settings.")],
    }
    keys: list[str] = []
    for key in _fields(TrainConfig, ""):
        keys.append(key)
        keys += expand.get(key, [])
    return list(dict.fromkeys(keys))  # came and came8bit share one settings class


KEYS: dict[str, dict] = {
    "name": {"tests": [
        "tests/test_matrix.py::test_combination_trains_samples_and_ends_with_the_evaluation",
    ], "mutant": "wandb_run_not_named_by_name"},
    "model.name": {"tests": [
        "tests/test_models.py::test_every_preset_file_loads_into_model_config",
        "tests/test_train.py::test_every_model_preset_composes",
        "tests/test_train.py::test_real_size_experiments_build_their_published_model",
    ], "mutant": None},
    "model.family": {"tests": [
        "tests/test_blocks.py::test_the_unet_declares_it_has_no_stack_and_says_why",
        "tests/test_models.py::test_bad_pixart_config_names_the_key",
        "tests/test_sequence.py::test_sizes_a_group_cannot_split_are_refused",
    ], "mutant": None},
    # the mutant: a model key given on the command line is fitted to the data instead of kept
    "model.in_channels": {"tests": [
        "tests/test_buckets.py::test_bucketed_training_on_two_ranks_follows_one_process_and_resumes_exactly",
        "tests/test_buckets.py::test_non_square_latents_go_through_the_families_that_take_them",
        "tests/test_buckets.py::test_pixart_size_conditioning_feeds_each_batch_its_own_shape",
        "tests/test_buckets.py::test_sample_draws_a_trained_bucket_by_size_or_aspect_and_refuses_others",
        "tests/test_buckets.py::test_unet_size_conditioning_feeds_each_sample_its_original_size_and_crop",
        "tests/test_datamodule.py::test_check_compatible",
        "tests/test_evaluation.py::test_best_of_one_is_plain_sampling_and_candidates_do_not_depend_on_n",
        "tests/test_export.py::test_export_round_trip_is_exact",
        "tests/test_loggers.py::test_wandb_offline_logs_loss_lr_throughput_and_grids_and_resumes_the_same_run",
        "tests/test_own_data.py::test_a_preset_trains_on_own_latents_and_grids_decode_with_local_encoders",
        "tests/test_sequence.py::test_two_rank_sequence_parallel_training_follows_one_process",
        "tests/test_train.py::test_a_model_key_the_user_gives_is_checked_against_the_dataset",
        "tests/test_train.py::test_a_preset_takes_its_input_and_caption_widths_from_the_dataset",
        "tests/test_train.py::test_model_that_does_not_fit_the_data_fails_naming_the_key",
    ], "mutant": "given_model_keys_not_checked"},
    "model.sample_size": {"tests": [
        "tests/test_buckets.py::test_bucketed_training_on_two_ranks_follows_one_process_and_resumes_exactly",
        "tests/test_buckets.py::test_non_square_latents_go_through_the_families_that_take_them",
        "tests/test_buckets.py::test_pixart_size_conditioning_feeds_each_batch_its_own_shape",
        "tests/test_buckets.py::test_sample_draws_a_trained_bucket_by_size_or_aspect_and_refuses_others",
        "tests/test_buckets.py::test_unet_size_conditioning_feeds_each_sample_its_original_size_and_crop",
        "tests/test_datamodule.py::test_check_compatible",
        "tests/test_evaluation.py::test_best_of_one_is_plain_sampling_and_candidates_do_not_depend_on_n",
        "tests/test_export.py::test_export_round_trip_is_exact",
        "tests/test_models.py::test_bad_pixart_config_names_the_key",
        "tests/test_own_data.py::test_a_preset_trains_on_own_latents_and_grids_decode_with_local_encoders",
        "tests/test_sequence.py::test_sizes_a_group_cannot_split_are_refused",
        "tests/test_sequence.py::test_two_rank_sequence_parallel_training_follows_one_process",
        "tests/test_train.py::test_a_preset_takes_its_input_and_caption_widths_from_the_dataset",
        "tests/test_train.py::test_model_that_does_not_fit_the_data_fails_naming_the_key",
    ], "mutant": None},
    "model.sample_width": {"tests": [
        "tests/test_datamodule.py::test_check_compatible",
        "tests/test_evaluation.py::test_best_of_one_is_plain_sampling_and_candidates_do_not_depend_on_n",
        "tests/test_train.py::test_a_preset_takes_its_input_and_caption_widths_from_the_dataset",
    ], "mutant": None},
    "model.num_frames": {"tests": [
        "tests/test_video.py::test_check_compatible_names_the_frames",
        "tests/test_video.py::test_latte_denoises_a_shorter_clip_as_a_latte_built_for_its_frames_and_refuses_a_longer_one",
        "tests/test_video.py::test_video_keys_are_checked_naming_the_key",
    ], "mutant": "num_frames_not_checked"},
    "model.text_len": {"tests": [
        "tests/test_video.py::test_video_keys_are_checked_naming_the_key",
        "tests/test_video.py::test_wan_pads_every_caption_to_text_len_and_refuses_a_longer_one",
    ], "mutant": "text_len_ignored"},
    "model.patch_size": {"tests": [
        "tests/test_models.py::test_bad_family_config_names_the_key",
    ], "mutant": None},
    "model.num_layers": {"tests": [
        "tests/test_blocks.py::test_replace_blocks_prunes_and_keeps_config_in_step",
        "tests/test_cache_router.py::test_the_sparsity_penalty_weighs_each_branch_by_its_cost",
        "tests/test_cache_router.py::test_the_stage_refuses_what_it_cannot_do",
        "tests/test_distributed.py::test_growth_from_a_sharded_checkpoint_on_two_fsdp_ranks_equals_one_process",
        "tests/test_evaluation.py::test_best_of_one_is_plain_sampling_and_candidates_do_not_depend_on_n",
        "tests/test_growth.py::test_a_grown_run_continues_the_schedule_and_warms_up_only_its_new_blocks",
        "tests/test_growth.py::test_grown_and_pruned_checkpoints_work_in_every_command",
        "tests/test_growth.py::test_grown_run_starts_at_the_source_models_loss_and_its_ema_at_the_grown_weights",
        "tests/test_growth.py::test_growth_run_resumes_after_a_crash_like_an_uninterrupted_run",
        "tests/test_matrix.py::test_combination_trains_samples_and_ends_with_the_evaluation",
        "tests/test_train.py::test_a_preset_takes_its_input_and_caption_widths_from_the_dataset",
    ], "mutant": None},
    "model.num_heads": {"tests": [
        "tests/test_evaluation.py::test_best_of_one_is_plain_sampling_and_candidates_do_not_depend_on_n",
        "tests/test_models.py::test_bad_family_config_names_the_key",
        "tests/test_models.py::test_bad_pixart_config_names_the_key",
        "tests/test_models.py::test_load_weights_from_another_model_names_the_file",
        "tests/test_sequence.py::test_sizes_a_group_cannot_split_are_refused",
    ], "mutant": None},
    "model.head_dim": {"tests": [
        "tests/test_buckets.py::test_pixart_size_conditioning_feeds_each_batch_its_own_shape",
        "tests/test_evaluation.py::test_best_of_one_is_plain_sampling_and_candidates_do_not_depend_on_n",
        "tests/test_models.py::test_bad_family_config_names_the_key",
    ], "mutant": None},
    "model.width": {"tests": [
        "tests/test_buckets.py::test_pixart_size_conditioning_feeds_each_batch_its_own_shape",
        "tests/test_models.py::test_bad_pixart_config_names_the_key",
        "tests/test_models.py::test_load_weights_from_another_model_names_the_file",
        "tests/test_train.py::test_a_preset_takes_its_input_and_caption_widths_from_the_dataset",
    ], "mutant": None},
    "model.text_dim": {"tests": [
        "tests/test_buckets.py::test_bucketed_training_on_two_ranks_follows_one_process_and_resumes_exactly",
        "tests/test_buckets.py::test_non_square_latents_go_through_the_families_that_take_them",
        "tests/test_buckets.py::test_pixart_size_conditioning_feeds_each_batch_its_own_shape",
        "tests/test_buckets.py::test_sample_draws_a_trained_bucket_by_size_or_aspect_and_refuses_others",
        "tests/test_buckets.py::test_unet_size_conditioning_feeds_each_sample_its_original_size_and_crop",
        "tests/test_datamodule.py::test_check_compatible",
        "tests/test_evaluation.py::test_best_of_one_is_plain_sampling_and_candidates_do_not_depend_on_n",
        "tests/test_export.py::test_export_round_trip_is_exact",
        "tests/test_models.py::test_bad_pixart_config_names_the_key",
        "tests/test_own_data.py::test_a_preset_trains_on_own_latents_and_grids_decode_with_local_encoders",
        "tests/test_sequence.py::test_two_rank_sequence_parallel_training_follows_one_process",
        "tests/test_train.py::test_a_preset_takes_its_input_and_caption_widths_from_the_dataset",
        "tests/test_train.py::test_model_that_does_not_fit_the_data_fails_naming_the_key",
    ], "mutant": None},
    "model.learned_sigma": {"tests": [
        "tests/test_evaluation.py::test_best_of_one_is_plain_sampling_and_candidates_do_not_depend_on_n",
        "tests/test_train.py::test_a_preset_takes_its_input_and_caption_widths_from_the_dataset",
    ], "mutant": None},
    "model.num_classes": {"tests": [
        "tests/test_models.py::test_bad_family_config_names_the_key",
        "tests/test_models.py::test_dit_null_labels_are_the_extra_class_and_dropout_is_ours",
    ], "mutant": None},
    "model.attention": {"tests": [
        "tests/test_models.py::test_an_xformers_build_without_kernels_is_refused_naming_the_key",
        "tests/test_models.py::test_bad_pixart_config_names_the_key",
        "tests/test_models.py::test_xformers_without_gpu_or_package_raises_naming_the_key",
    ], "mutant": None},
    "model.init": {"tests": [
        "tests/test_fsdp_init.py::test_fresh_shards_are_rows_of_the_ordinary_build",
        "tests/test_init.py::test_an_unknown_init_is_refused_naming_the_choices",
        "tests/test_init.py::test_the_reference_init_follows_the_reference_code",
    ], "mutant": "reference_init_never_applied"},
    "model.size_conditioning": {"tests": [
        "tests/test_buckets.py::test_pixart_size_conditioning_feeds_each_batch_its_own_shape",
        "tests/test_buckets.py::test_unet_size_conditioning_feeds_each_sample_its_original_size_and_crop",
    ], "mutant": "unet_size_ids_not_fed"},
    "model.made_for": {"tests": [
        "tests/test_train.py::test_a_preset_takes_its_input_and_caption_widths_from_the_dataset",
        "tests/test_train.py::test_real_size_experiments_build_their_published_model",
    ], "mutant": None},
    "model.kwargs": {"tests": [
        "tests/test_models.py::test_bad_family_config_names_the_key",
        "tests/test_models.py::test_bad_pixart_config_names_the_key",
    ], "mutant": None},
    "data.path": {"tests": [
        "tests/test_bench.py::test_bench_overhead_times_both_sides_alike",
        "tests/test_buckets.py::test_the_data_module_reads_each_batch_from_one_bucket_and_reports_what_it_leaves_out",
        "tests/test_came.py::test_short_training_run_with_came8bit",
        "tests/test_datamodule.py::test_a_shared_memory_prefix_taken_by_another_job_at_the_same_moment_is_retried",
        "tests/test_datamodule.py::test_a_temp_folder_too_deep_for_the_workers_socket_is_refused",
        "tests/test_datamodule.py::test_cache_of_another_dataset_fails",
        "tests/test_datamodule.py::test_corrupt_cache_shard_fails_at_setup",
        "tests/test_datamodule.py::test_corrupt_decompressed_shard_fails_at_setup",
        "tests/test_datamodule.py::test_dropped_loader_stops_its_threads",
        "tests/test_datamodule.py::test_failed_shard_preparation_releases_the_shard",
        "tests/test_datamodule.py::test_lightning_resume_continues_mid_epoch",
        "tests/test_datamodule.py::test_missing_dataset_and_corrupt_shards",
        "tests/test_datamodule.py::test_prepare_data_builds_missing_dataset",
        "tests/test_datamodule.py::test_size_check_reads_mds_header",
        "tests/test_datamodule.py::test_streaming_scale_keys_reach_the_dataset",
        "tests/test_growth.py::test_growth_study_runs_every_arm_and_compares_at_equal_flops",
        "tests/test_matrix.py::test_combination_trains_samples_and_ends_with_the_evaluation",
        "tests/test_own_data.py::test_diffusers_export_of_a_class_conditional_dit_samples_like_framework_sample",
        "tests/test_own_data.py::test_diffusers_export_of_sana_with_a_dc_ae_samples_like_framework_sample",
        "tests/test_remote.py::test_a_bad_remote_fails_at_start_up_naming_what_to_fix",
        "tests/test_remote.py::test_start_up_reads_the_index_and_no_shard",
        "tests/test_remote.py::test_training_from_s3_killed_and_resumed_follows_the_uninterrupted_local_run",
        "tests/test_train.py::test_a_model_key_the_user_gives_is_checked_against_the_dataset",
        "tests/test_train.py::test_a_misspelled_plugin_field_is_refused_before_any_data_is_built",
        "tests/test_train.py::test_a_preset_takes_its_input_and_caption_widths_from_the_dataset",
        "tests/test_train.py::test_every_experiment_composes",
        "tests/test_train.py::test_quickstart_learns_the_prompts",
        "tests/test_train.py::test_real_size_experiments_build_their_published_model",
    ], "mutant": None},
    # most set it to a cache folder of the test's own (see tests/conftest.py)
    "data.local": {"tests": [
        "tests/test_bench.py::test_bench_overhead_times_both_sides_alike",
        "tests/test_buckets.py::test_the_data_module_reads_each_batch_from_one_bucket_and_reports_what_it_leaves_out",
        "tests/test_came.py::test_short_training_run_with_came8bit",
        "tests/test_datamodule.py::test_a_shared_memory_prefix_taken_by_another_job_at_the_same_moment_is_retried",
        "tests/test_datamodule.py::test_a_temp_folder_too_deep_for_the_workers_socket_is_refused",
        "tests/test_datamodule.py::test_cache_of_another_dataset_fails",
        "tests/test_datamodule.py::test_corrupt_cache_shard_fails_at_setup",
        "tests/test_datamodule.py::test_lightning_resume_continues_mid_epoch",
        "tests/test_growth.py::test_growth_study_runs_every_arm_and_compares_at_equal_flops",
        "tests/test_matrix.py::test_combination_trains_samples_and_ends_with_the_evaluation",
        "tests/test_remote.py::test_a_bad_remote_fails_at_start_up_naming_what_to_fix",
        "tests/test_remote.py::test_start_up_reads_the_index_and_no_shard",
        "tests/test_train.py::test_quickstart_learns_the_prompts",
    ], "mutant": None},
    # most of its tests set it only to make a run short or cheap
    "data.batch_size": {"tests": [
        "tests/test_bench.py::test_bench_overhead_times_both_sides_alike",
        "tests/test_buckets.py::test_bucketed_training_on_two_ranks_follows_one_process_and_resumes_exactly",
        "tests/test_buckets.py::test_pixart_size_conditioning_feeds_each_batch_its_own_shape",
        "tests/test_buckets.py::test_sample_draws_a_trained_bucket_by_size_or_aspect_and_refuses_others",
        "tests/test_buckets.py::test_the_data_module_reads_each_batch_from_one_bucket_and_reports_what_it_leaves_out",
        "tests/test_buckets.py::test_unet_size_conditioning_feeds_each_sample_its_original_size_and_crop",
        "tests/test_cache_router.py::test_the_router_trained_under_sequence_parallelism_follows_one_process",
        "tests/test_came.py::test_short_training_run_with_came8bit",
        "tests/test_checkpoints.py::test_async_saves_resume_like_sync_ones",
        "tests/test_checkpoints.py::test_keep_checkpoints_removes_whole_sharded_folders",
        "tests/test_checkpoints.py::test_sharded_last_checkpoint_is_a_link_to_the_numbered_folder",
        "tests/test_datamodule.py::test_a_shared_memory_prefix_taken_by_another_job_at_the_same_moment_is_retried",
        "tests/test_datamodule.py::test_a_temp_folder_too_deep_for_the_workers_socket_is_refused",
        "tests/test_datamodule.py::test_digits_batches",
        "tests/test_datamodule.py::test_dropped_loader_stops_its_threads",
        "tests/test_datamodule.py::test_failed_shard_preparation_raises_instead_of_ending_the_epoch",
        "tests/test_datamodule.py::test_failed_shard_preparation_releases_the_shard",
        "tests/test_datamodule.py::test_lightning_resume_continues_mid_epoch",
        "tests/test_datamodule.py::test_loader_state_resumes_at_same_sample",
        "tests/test_datamodule.py::test_prepare_data_builds_missing_dataset",
        "tests/test_datamodule.py::test_shared_memory_left_by_a_dead_dataset_is_not_reused",
        "tests/test_datamodule.py::test_streaming_scale_keys_reach_the_dataset",
        "tests/test_datamodule.py::test_vae_latents_scaled_exactly_once",
        "tests/test_distributed.py::test_a_nonfinite_loss_on_one_rank_skips_the_step_on_every_rank",
        "tests/test_distributed.py::test_ddp_resume_with_workers_continues_like_an_uninterrupted_run",
        "tests/test_distributed.py::test_fsdp_gradient_accumulation_follows_one_process_and_syncs_once_per_step",
        "tests/test_distributed.py::test_fsdp_parameters_are_sharded_dtensors_and_frozen_ones_get_no_state",
        "tests/test_distributed.py::test_growth_from_a_sharded_checkpoint_on_two_fsdp_ranks_equals_one_process",
        "tests/test_distributed.py::test_slurm_signal_saves_a_checkpoint_requeues_or_stops_and_the_rerun_resumes_there",
        "tests/test_distributed.py::test_sharded_checkpoint_resumes_on_another_world_size",
        "tests/test_distributed.py::test_single_process_frozen_parameters_get_no_state",
        "tests/test_distributed.py::test_two_nodes_hybrid_sharded_follow_one_process_and_resume_on_one_node",
        "tests/test_distributed.py::test_two_ranks_follow_the_single_process_losses",
        "tests/test_ema.py::test_ddp_two_ranks_keep_the_full_ema_equal_to_one_process",
        "tests/test_ema.py::test_fsdp_ema_is_sharded_and_resumes_to_the_single_process_ema",
        "tests/test_growth.py::test_growth_study_runs_every_arm_and_compares_at_equal_flops",
        "tests/test_matrix.py::test_combination_trains_samples_and_ends_with_the_evaluation",
        "tests/test_own_data.py::test_a_dataset_smaller_than_one_batch_is_refused",
        "tests/test_own_data.py::test_diffusers_export_of_a_class_conditional_dit_samples_like_framework_sample",
        "tests/test_own_data.py::test_diffusers_export_of_sana_with_a_dc_ae_samples_like_framework_sample",
        "tests/test_remote.py::test_training_from_s3_killed_and_resumed_follows_the_uninterrupted_local_run",
        "tests/test_sequence.py::test_two_rank_sequence_parallel_training_follows_one_process",
        "tests/test_slurm.py::test_sbatch_job_saves_on_each_signal_and_resumes_exactly",
        "tests/test_train.py::test_a_resume_with_another_global_batch_is_refused_unless_asked_for",
        "tests/test_train.py::test_loss_goes_down_on_digits",
    ], "mutant": None},
    "data.global_batch_size": {"tests": [
        "tests/test_distributed.py::test_fsdp_gradient_accumulation_follows_one_process_and_syncs_once_per_step",
        "tests/test_recipes.py::test_a_global_batch_splits_into_the_fewest_even_micro_batches",
        "tests/test_recipes.py::test_a_global_batch_the_ranks_do_not_divide_is_refused_naming_the_key",
        "tests/test_train.py::test_bad_config_fails_at_start_with_the_key",
    ], "mutant": "global_batch_ignored"},
    "data.hflip": {"tests": [
        "tests/test_recipes.py::test_training_mirrors_the_samples_it_draws",
    ], "mutant": "hflip_ignored"},
    "data.num_workers": {"tests": [
        "tests/test_buckets.py::test_bucketed_training_on_two_ranks_follows_one_process_and_resumes_exactly",
        "tests/test_buckets.py::test_pixart_size_conditioning_feeds_each_batch_its_own_shape",
        "tests/test_buckets.py::test_sample_draws_a_trained_bucket_by_size_or_aspect_and_refuses_others",
        "tests/test_buckets.py::test_unet_size_conditioning_feeds_each_sample_its_original_size_and_crop",
        "tests/test_datamodule.py::test_a_temp_folder_too_deep_for_the_workers_socket_is_refused",
        "tests/test_distributed.py::test_ddp_resume_with_workers_continues_like_an_uninterrupted_run",
        "tests/test_distributed.py::test_two_nodes_hybrid_sharded_follow_one_process_and_resume_on_one_node",
        "tests/test_distributed.py::test_two_ranks_follow_the_single_process_losses",
        "tests/test_sequence.py::test_two_rank_sequence_parallel_training_follows_one_process",
        "tests/test_slurm.py::test_sbatch_job_saves_on_each_signal_and_resumes_exactly",
        "tests/test_slurm.py::test_submitit_sweep_job_saves_on_the_warning_and_submitit_requeues_it",
    ], "mutant": None},
    "data.shuffle": {"tests": [
        "tests/test_datamodule.py::test_dropped_loader_stops_its_threads",
        "tests/test_datamodule.py::test_failed_shard_preparation_raises_instead_of_ending_the_epoch",
        "tests/test_datamodule.py::test_failed_shard_preparation_releases_the_shard",
        "tests/test_datamodule.py::test_vae_latents_scaled_exactly_once",
    ], "mutant": None},
    "data.shuffle_seed": {"tests": [
        "tests/test_datamodule.py::test_shuffle_seed_predownload_cache_limit_and_persistent_workers_reach_the_loader",
    ], "mutant": "shuffle_seed_ignored"},
    # the default (true) leaves 3 samples one batch of 2; the two-rank script sets false to cover all
    "data.drop_last": {"tests": [
        "tests/test_datamodule.py::test_prepare_data_builds_missing_dataset",
        "tests/test_datamodule.py::test_two_ranks_read_disjoint_cover",
    ], "mutant": None},
    "data.predownload": {"tests": [
        "tests/test_datamodule.py::test_shuffle_seed_predownload_cache_limit_and_persistent_workers_reach_the_loader",
    ], "mutant": "predownload_ignored"},
    "data.cache_limit": {"tests": [
        "tests/test_datamodule.py::test_shuffle_seed_predownload_cache_limit_and_persistent_workers_reach_the_loader",
    ], "mutant": "cache_limit_ignored"},
    "data.num_canonical_nodes": {"tests": [
        "tests/test_plan.py::test_the_data_partitions_fit_the_job_s_node_count_or_the_plan_refuses_it",
        "tests/test_datamodule.py::test_streaming_scale_keys_reach_the_dataset",
        "tests/test_datamodule.py::test_the_shipped_canonical_node_count_partitions_cleanly_on_other_node_counts",
    ], "mutant": None},
    "data.shuffle_algo": {"tests": [
        "tests/test_datamodule.py::test_streaming_scale_keys_reach_the_dataset",
    ], "mutant": None},
    "data.shuffle_block_size": {"tests": [
        "tests/test_datamodule.py::test_streaming_scale_keys_reach_the_dataset",
    ], "mutant": None},
    "data.download_retry": {"tests": [
        "tests/test_datamodule.py::test_streaming_scale_keys_reach_the_dataset",
    ], "mutant": None},
    "data.download_timeout": {"tests": [
        "tests/test_datamodule.py::test_streaming_scale_keys_reach_the_dataset",
    ], "mutant": None},
    "data.persistent_workers": {"tests": [
        "tests/test_datamodule.py::test_shuffle_seed_predownload_cache_limit_and_persistent_workers_reach_the_loader",
    ], "mutant": "persistent_workers_ignored"},
    "data.validate": {"tests": [
        "tests/test_datamodule.py::test_missing_dataset_and_corrupt_shards",
        "tests/test_datamodule.py::test_size_check_reads_mds_header",
    ], "mutant": None},
    # most set it to null so that composing the config builds no dataset
    "data.prepare": {"tests": [
        "tests/test_came.py::test_hydra_composes_came8bit",
        "tests/test_datamodule.py::test_prepare_data_builds_missing_dataset",
        "tests/test_train.py::test_a_model_key_the_user_gives_is_checked_against_the_dataset",
        "tests/test_train.py::test_a_misspelled_plugin_field_is_refused_before_any_data_is_built",
        "tests/test_train.py::test_a_preset_takes_its_input_and_caption_widths_from_the_dataset",
        "tests/test_train.py::test_every_model_preset_composes",
        "tests/test_train.py::test_model_that_does_not_fit_the_data_fails_naming_the_key",
    ], "mutant": None},
    "objective.name": {"tests": [
        "tests/test_cache_router.py::test_straight_through_trains_on_the_forward_that_sampling_runs",
        "tests/test_cache_router.py::test_the_distillation_starts_where_guided_sampling_is_and_distils_the_guided_prediction",
        "tests/test_objectives.py::test_eps_and_v_targets_match_the_ddpm_formulas",
        "tests/test_objectives.py::test_flow_corruption_is_the_straight_path",
        "tests/test_objectives.py::test_flow_objective_refuses_ddim_with_a_message",
        "tests/test_objectives.py::test_logit_normal_draws_concentrate_mid_path",
        "tests/test_objectives.py::test_samplers_recover_the_data_point_with_an_oracle",
        "tests/test_own_data.py::test_diffusers_export_of_a_class_conditional_dit_samples_like_framework_sample",
        "tests/test_own_data.py::test_diffusers_export_of_an_sd2_unet_samples_like_framework_sample_unguided",
        "tests/test_train.py::test_bad_config_fails_at_start_with_the_key",
        "tests/test_train.py::test_debug_presets_train_a_few_steps_with_each_objective",
    ], "mutant": None},
    # the default, read back into the references
    "objective.num_train_timesteps": {"tests": [
        "tests/test_objectives.py::test_eps_and_v_targets_match_the_ddpm_formulas",
        "tests/test_objectives.py::test_samplers_recover_the_data_point_with_an_oracle",
    ], "mutant": None},
    # the default (scaled_linear), written out by hand as the reference
    "objective.beta_schedule": {"tests": [
        "tests/test_objectives.py::test_eps_and_v_targets_match_the_ddpm_formulas",
    ], "mutant": None},
    # the defaults, read back into the hand-written scaled_linear reference
    "objective.beta_start": {"tests": [
        "tests/test_objectives.py::test_eps_and_v_targets_match_the_ddpm_formulas",
    ], "mutant": None},
    # the defaults, read back into the hand-written scaled_linear reference
    "objective.beta_end": {"tests": [
        "tests/test_objectives.py::test_eps_and_v_targets_match_the_ddpm_formulas",
    ], "mutant": None},
    "objective.flow_shift": {"tests": [
        "tests/test_objectives.py::test_flow_corruption_is_the_straight_path",
    ], "mutant": None},
    "objective.timestep_sampling": {"tests": [
        "tests/test_objectives.py::test_eps_and_v_targets_match_the_ddpm_formulas",
        "tests/test_objectives.py::test_flow_objective_refuses_ddim_with_a_message",
        "tests/test_objectives.py::test_logit_normal_draws_concentrate_mid_path",
        "tests/test_objectives.py::test_samplers_recover_the_data_point_with_an_oracle",
    ], "mutant": None},
    # the default (0): the logit-normal draws must centre on 0.5
    "objective.logit_mean": {"tests": [
        "tests/test_objectives.py::test_logit_normal_draws_concentrate_mid_path",
    ], "mutant": None},
    # the default (1): the draws must concentrate mid-path
    "objective.logit_std": {"tests": [
        "tests/test_objectives.py::test_logit_normal_draws_concentrate_mid_path",
    ], "mutant": None},
    # no test sets it: the quickstart's 0.1 is what the mutant's test relies on
    "objective.caption_dropout": {"tests": [
        "tests/test_train.py::test_quickstart_learns_the_prompts",
    ], "mutant": "caption_dropout_inverted"},
    "optimizer.name": {"tests": [
        "tests/test_came.py::test_hydra_composes_came8bit",
        "tests/test_came.py::test_short_training_run_with_came8bit",
        "tests/test_gpu.py::test_adamw_follows_the_reference_step_on_the_cpu",
        "tests/test_gpu.py::test_fused_adamw_follows_the_reference_step",
        "tests/test_matrix.py::test_combination_trains_samples_and_ends_with_the_evaluation",
    ], "mutant": None},
    "optimizer.lr": {"tests": [
        "tests/test_cache_router.py::test_router_training_lowers_the_distillation_loss_and_leaves_the_backbone_bit_identical",
        "tests/test_cache_router.py::test_the_router_trained_under_sequence_parallelism_follows_one_process",
        "tests/test_ema.py::test_ddp_two_ranks_keep_the_full_ema_equal_to_one_process",
        "tests/test_ema.py::test_fsdp_ema_is_sharded_and_resumes_to_the_single_process_ema",
        "tests/test_ema.py::test_grids_and_the_final_evaluation_use_the_averaged_weights",
        "tests/test_gpu.py::test_adamw_follows_the_reference_step_on_the_cpu",
        "tests/test_gpu.py::test_fused_adamw_follows_the_reference_step",
        "tests/test_growth.py::test_a_grown_run_continues_the_schedule_and_warms_up_only_its_new_blocks",
        "tests/test_loggers.py::test_wandb_offline_logs_loss_lr_throughput_and_grids_and_resumes_the_same_run",
        "tests/test_train.py::test_bad_config_fails_at_start_with_the_key",
        "tests/test_train.py::test_nonfinite_loss_stops_with_a_message",
        "tests/test_train.py::test_skip_nonfinite_gives_up_on_a_run_of_bad_steps",
    ], "mutant": None},
    "optimizer.weight_decay": {"tests": [
        "tests/test_gpu.py::test_adamw_follows_the_reference_step_on_the_cpu",
        "tests/test_gpu.py::test_fused_adamw_follows_the_reference_step",
    ], "mutant": "adamw_weight_decay_dropped"},
    "optimizer.betas": {"tests": [
        "tests/test_came.py::test_hydra_composes_came8bit",
    ], "mutant": None},
    "optimizer.eps": {"tests": [
        "tests/test_train.py::test_optimizer_eps_reaches_adamw_and_its_step",
    ], "mutant": "adamw_eps_ignored"},
    "optimizer.settings": {"tests": [
        "tests/test_came.py::test_hydra_composes_came8bit",
    ], "mutant": None},
    # optimizer.settings.*: plugins/came.py CameSettings (OPTIMIZER_SETTINGS: came, came8bit)
    "optimizer.settings.eps": {"tests": [
        "tests/test_came.py::test_hydra_composes_came8bit",
    ], "mutant": None},
    "optimizer.settings.clip_threshold": {"tests": [
        "tests/test_came.py::test_hydra_composes_came8bit",
    ], "mutant": "came_settings_ignored"},
    "optimizer.settings.block_size": {"tests": [
        "tests/test_came.py::test_hydra_composes_came8bit",
    ], "mutant": None},
    "optimizer.settings.min_8bit_size": {"tests": [
        "tests/test_came.py::test_hydra_composes_came8bit",
    ], "mutant": None},
    "optimizer.warmup_steps": {"tests": [
        "tests/test_came.py::test_short_training_run_with_came8bit",
        "tests/test_ema.py::test_ddp_two_ranks_keep_the_full_ema_equal_to_one_process",
        "tests/test_ema.py::test_fsdp_ema_is_sharded_and_resumes_to_the_single_process_ema",
        "tests/test_ema.py::test_grids_and_the_final_evaluation_use_the_averaged_weights",
        "tests/test_growth.py::test_a_grown_run_continues_the_schedule_and_warms_up_only_its_new_blocks",
        "tests/test_train.py::test_loss_goes_down_on_digits",
    ], "mutant": None},
    "optimizer.schedule": {"tests": [
        "tests/test_ema.py::test_ddp_two_ranks_keep_the_full_ema_equal_to_one_process",
        "tests/test_ema.py::test_fsdp_ema_is_sharded_and_resumes_to_the_single_process_ema",
        "tests/test_growth.py::test_a_grown_run_continues_the_schedule_and_warms_up_only_its_new_blocks",
        "tests/test_train.py::test_quickstart_learns_the_prompts",
    ], "mutant": None},
    "optimizer.min_lr_ratio": {"tests": [
        "tests/test_growth.py::test_a_grown_run_continues_the_schedule_and_warms_up_only_its_new_blocks",
    ], "mutant": None},
    "optimizer.schedule_steps": {"tests": [
        "tests/test_growth.py::test_a_grown_run_continues_the_schedule_and_warms_up_only_its_new_blocks",
    ], "mutant": None},
    "optimizer.schedule_start": {"tests": [
        "tests/test_growth.py::test_a_grown_run_continues_the_schedule_and_warms_up_only_its_new_blocks",
    ], "mutant": None},
    "optimizer.lr_scaling": {"tests": [
        "tests/test_growth.py::test_a_grown_run_continues_the_schedule_and_warms_up_only_its_new_blocks",
        "tests/test_recipes.py::test_the_lr_scales_with_the_global_batch_as_the_rule_says",
        "tests/test_train.py::test_bad_config_fails_at_start_with_the_key",
    ], "mutant": "lr_scaling_ignored"},
    "optimizer.lr_reference_batch": {"tests": [
        "tests/test_growth.py::test_a_grown_run_continues_the_schedule_and_warms_up_only_its_new_blocks",
        "tests/test_recipes.py::test_the_lr_scales_with_the_global_batch_as_the_rule_says",
    ], "mutant": "lr_reference_batch_ignored"},
    "strategy.name": {"tests": [
        "tests/test_buckets.py::test_bucketed_training_on_two_ranks_follows_one_process_and_resumes_exactly",
        "tests/test_cache_router.py::test_the_router_trained_under_sequence_parallelism_follows_one_process",
        "tests/test_cache_router.py::test_the_stage_refuses_what_it_cannot_do",
        "tests/test_distributed.py::test_ddp_resume_with_workers_continues_like_an_uninterrupted_run",
        "tests/test_distributed.py::test_fsdp_parameter_dtype_follows_trainer_precision",
        "tests/test_distributed.py::test_two_nodes_hybrid_sharded_follow_one_process_and_resume_on_one_node",
        "tests/test_distributed.py::test_two_ranks_follow_the_single_process_losses",
        "tests/test_ema.py::test_ddp_two_ranks_keep_the_full_ema_equal_to_one_process",
        "tests/test_ema.py::test_fsdp_ema_is_sharded_and_resumes_to_the_single_process_ema",
        "tests/test_gpu.py::test_fsdp_on_one_gpu_gathers_bf16_parameters_over_nccl",
        "tests/test_matrix.py::test_combination_trains_samples_and_ends_with_the_evaluation",
        "tests/test_sequence.py::test_sizes_a_group_cannot_split_are_refused",
        "tests/test_sequence.py::test_training_refuses_a_sequence_group_over_parts_of_nodes_at_start_up",
        "tests/test_sequence.py::test_training_refuses_an_indivisible_split_at_start_up",
        "tests/test_sequence.py::test_two_rank_sequence_parallel_training_follows_one_process",
        "tests/test_slurm.py::test_sbatch_job_saves_on_each_signal_and_resumes_exactly",
        "tests/test_train.py::test_bad_config_fails_at_start_with_the_key",
    ], "mutant": None},
    "strategy.sharding": {"tests": [
        "tests/test_distributed.py::test_fsdp_parameters_are_sharded_dtensors_and_frozen_ones_get_no_state",
        "tests/test_distributed.py::test_two_nodes_hybrid_sharded_follow_one_process_and_resume_on_one_node",
        "tests/test_distributed.py::test_two_ranks_follow_the_single_process_losses",
        "tests/test_matrix.py::test_combination_trains_samples_and_ends_with_the_evaluation",
    ], "mutant": None},
    "strategy.activation_checkpointing": {"tests": [
        "tests/test_train.py::test_activation_checkpointing_recomputes_the_blocks_and_keeps_the_losses",
    ], "mutant": "activation_checkpointing_off"},
    # blocks_not_compiled is the same planted bug under another name
    "strategy.compile": {"tests": [
        "tests/test_gpu.py::test_compiled_blocks_on_cuda_follow_the_eager_losses",
        "tests/test_sequence.py::test_sizes_a_group_cannot_split_are_refused",
        "tests/test_train.py::test_compiled_blocks_run_compiled_and_follow_the_eager_losses",
    ], "mutant": "compile_off"},
    # its default (true): these assert that fsdp checkpoints are folders
    "strategy.sharded_checkpoint": {"tests": [
        "tests/test_checkpoints.py::test_keep_checkpoints_removes_whole_sharded_folders",
        "tests/test_checkpoints.py::test_sharded_last_checkpoint_is_a_link_to_the_numbered_folder",
        "tests/test_distributed.py::test_sharded_checkpoint_resumes_on_another_world_size",
        "tests/test_distributed.py::test_sharded_folder_exports_and_samples",
    ], "mutant": None},
    # its default (true), under strategy=fsdp with trainer.precision=bf16-mixed
    "strategy.mixed_precision": {"tests": [
        "tests/test_distributed.py::test_fsdp_bf16_mixed_computes_with_bf16_parameters_and_keeps_fp32_masters",
        "tests/test_distributed.py::test_fsdp_parameter_dtype_follows_trainer_precision",
    ], "mutant": "fsdp_precision_not_passed"},
    "strategy.sequence_parallel": {"tests": [
        "tests/test_cache_router.py::test_the_router_trained_under_sequence_parallelism_follows_one_process",
        "tests/test_distributed.py::test_fsdp_and_sequence_parallelism_share_the_job_mesh",
        "tests/test_distributed.py::test_two_ranks_follow_the_single_process_losses",
        "tests/test_matrix.py::test_combination_trains_samples_and_ends_with_the_evaluation",
        "tests/test_sequence.py::test_sizes_a_group_cannot_split_are_refused",
        "tests/test_sequence.py::test_training_refuses_a_sequence_group_over_parts_of_nodes_at_start_up",
        "tests/test_sequence.py::test_training_refuses_an_indivisible_split_at_start_up",
        "tests/test_sequence.py::test_two_rank_sequence_parallel_training_follows_one_process",
    ], "mutant": None},
    "strategy.sequence_parallel_head_groups": {"tests": [
        "tests/test_distributed.py::test_fsdp_and_sequence_parallelism_share_the_job_mesh",
        "tests/test_distributed.py::test_two_ranks_follow_the_single_process_losses",
    ], "mutant": None},
    "strategy.async_save": {"tests": [
        "tests/test_checkpoints.py::test_async_saves_resume_like_sync_ones",
        "tests/test_matrix.py::test_combination_trains_samples_and_ends_with_the_evaluation",
    ], "mutant": None},
    "strategy.timeout_s": {"tests": [
        "tests/test_matrix.py::test_combination_trains_samples_and_ends_with_the_evaluation",
    ], "mutant": None},
    # most of its tests set it only to make a run short or cheap
    "trainer.max_steps": {"tests": [
        "tests/test_buckets.py::test_bucketed_training_on_two_ranks_follows_one_process_and_resumes_exactly",
        "tests/test_buckets.py::test_pixart_size_conditioning_feeds_each_batch_its_own_shape",
        "tests/test_buckets.py::test_sample_draws_a_trained_bucket_by_size_or_aspect_and_refuses_others",
        "tests/test_buckets.py::test_unet_size_conditioning_feeds_each_sample_its_original_size_and_crop",
        "tests/test_cache_router.py::test_router_training_lowers_the_distillation_loss_and_leaves_the_backbone_bit_identical",
        "tests/test_cache_router.py::test_the_cache_curve_compares_learned_schedules_with_uniform_and_fewer_steps",
        "tests/test_cache_router.py::test_the_router_trained_under_sequence_parallelism_follows_one_process",
        "tests/test_cache_router.py::test_the_stage_refuses_what_it_cannot_do",
        "tests/test_cache_router.py::test_the_stage_resumes_after_a_kill_like_an_uninterrupted_run",
        "tests/test_came.py::test_short_training_run_with_came8bit",
        "tests/test_checkpoints.py::test_async_saves_resume_like_sync_ones",
        "tests/test_checkpoints.py::test_keep_checkpoints_keeps_the_newest_numbered_files_across_a_resume",
        "tests/test_checkpoints.py::test_keep_checkpoints_removes_whole_sharded_folders",
        "tests/test_checkpoints.py::test_keep_checkpoints_zero_keeps_only_last",
        "tests/test_checkpoints.py::test_last_checkpoint_links_the_numbered_one_it_equals",
        "tests/test_checkpoints.py::test_sharded_last_checkpoint_is_a_link_to_the_numbered_folder",
        "tests/test_decoupled.py::test_each_role_loads_only_its_own_model",
        "tests/test_decoupled.py::test_eval_command_on_two_processes_scores_what_one_process_scores",
        "tests/test_decoupled.py::test_sequence_parallel_denoising_groups_with_decode_ranks",
        "tests/test_distributed.py::test_a_nonfinite_loss_on_one_rank_skips_the_step_on_every_rank",
        "tests/test_distributed.py::test_ddp_resume_with_workers_continues_like_an_uninterrupted_run",
        "tests/test_distributed.py::test_fsdp_and_sequence_parallelism_share_the_job_mesh",
        "tests/test_distributed.py::test_fsdp_bf16_mixed_computes_with_bf16_parameters_and_keeps_fp32_masters",
        "tests/test_distributed.py::test_fsdp_gradient_accumulation_follows_one_process_and_syncs_once_per_step",
        "tests/test_distributed.py::test_fsdp_parameters_are_sharded_dtensors_and_frozen_ones_get_no_state",
        "tests/test_distributed.py::test_fsdp_resume_with_workers_continues_like_an_uninterrupted_run",
        "tests/test_distributed.py::test_growth_from_a_sharded_checkpoint_on_two_fsdp_ranks_equals_one_process",
        "tests/test_distributed.py::test_preemption_signal_mid_run_saves_one_step_on_every_rank_and_the_requeued_run_matches",
        "tests/test_distributed.py::test_slurm_signal_saves_a_checkpoint_requeues_or_stops_and_the_rerun_resumes_there",
        "tests/test_distributed.py::test_sharded_checkpoint_resumes_on_another_world_size",
        "tests/test_distributed.py::test_sharded_folder_exports_and_samples",
        "tests/test_distributed.py::test_single_process_frozen_parameters_get_no_state",
        "tests/test_distributed.py::test_the_final_grid_is_decoded_on_rank_zero_only",
        "tests/test_distributed.py::test_two_nodes_hybrid_sharded_follow_one_process_and_resume_on_one_node",
        "tests/test_distributed.py::test_two_ranks_follow_the_single_process_losses",
        "tests/test_ema.py::test_an_ema_that_has_not_caught_up_is_not_used_silently",
        "tests/test_ema.py::test_crash_and_resume_gives_the_ema_of_an_uninterrupted_run",
        "tests/test_ema.py::test_ddp_two_ranks_keep_the_full_ema_equal_to_one_process",
        "tests/test_ema.py::test_ema_equals_hand_computed_reference",
        "tests/test_ema.py::test_fsdp_ema_is_sharded_and_resumes_to_the_single_process_ema",
        "tests/test_ema.py::test_grids_and_the_final_evaluation_use_the_averaged_weights",
        "tests/test_ema.py::test_nothing_is_allocated_before_the_start",
        "tests/test_ema.py::test_swapping_in_and_out_leaves_training_bit_identical",
        "tests/test_export.py::test_export_round_trip_is_exact",
        "tests/test_gpu.py::test_16_mixed_skips_an_overflowing_step_under_skip_nonfinite",
        "tests/test_gpu.py::test_sampling_and_evaluation_devices_on_the_cpu",
        "tests/test_gpu.py::test_sampling_and_evaluation_run_on_the_local_ranks_gpu",
        "tests/test_growth.py::test_a_grown_run_continues_the_schedule_and_warms_up_only_its_new_blocks",
        "tests/test_growth.py::test_eval_every_n_steps_logs_fd_and_accuracy_curves",
        "tests/test_growth.py::test_grown_and_pruned_checkpoints_work_in_every_command",
        "tests/test_growth.py::test_grown_run_starts_at_the_source_models_loss_and_its_ema_at_the_grown_weights",
        "tests/test_growth.py::test_growth_run_resumes_after_a_crash_like_an_uninterrupted_run",
        "tests/test_loggers.py::test_wandb_offline_logs_loss_lr_throughput_and_grids_and_resumes_the_same_run",
        "tests/test_low_precision_norm.py::test_bf16_run_swaps_norms_before_the_optimizer_is_built",
        "tests/test_low_precision_norm.py::test_fp32_run_warns_and_is_bit_identical",
        "tests/test_matrix.py::test_combination_trains_samples_and_ends_with_the_evaluation",
        "tests/test_own_data.py::test_diffusers_export_of_a_class_conditional_dit_samples_like_framework_sample",
        "tests/test_own_data.py::test_diffusers_export_of_an_sd2_unet_samples_like_framework_sample_unguided",
        "tests/test_own_data.py::test_diffusers_export_of_sana_needs_a_dc_ae",
        "tests/test_own_data.py::test_diffusers_export_of_sana_with_a_dc_ae_samples_like_framework_sample",
        "tests/test_remote.py::test_training_from_s3_killed_and_resumed_follows_the_uninterrupted_local_run",
        "tests/test_sequence.py::test_training_refuses_a_sequence_group_over_parts_of_nodes_at_start_up",
        "tests/test_sequence.py::test_training_refuses_an_indivisible_split_at_start_up",
        "tests/test_sequence.py::test_two_rank_sequence_parallel_training_follows_one_process",
        "tests/test_train.py::test_a_nonfinite_gradient_with_a_finite_loss_is_skipped",
        "tests/test_train.py::test_a_nonfinite_step_found_late_leaves_no_checkpoint_of_its_weights",
        "tests/test_train.py::test_a_resume_with_another_global_batch_is_refused_unless_asked_for",
        "tests/test_train.py::test_activation_checkpointing_recomputes_the_blocks_and_keeps_the_losses",
        "tests/test_train.py::test_bad_config_fails_at_start_with_the_key",
        "tests/test_train.py::test_compiled_blocks_run_compiled_and_follow_the_eager_losses",
        "tests/test_train.py::test_every_experiment_composes",
        "tests/test_train.py::test_loss_goes_down_on_digits",
        "tests/test_train.py::test_nonfinite_loss_stops_with_a_message",
        "tests/test_train.py::test_quickstart_learns_the_prompts",
        "tests/test_train.py::test_resume_auto_continues_like_an_uninterrupted_run",
        "tests/test_train.py::test_same_seed_gives_identical_losses",
        "tests/test_train.py::test_sample_and_eval_run_end_to_end",
        "tests/test_train.py::test_scaling_command_writes_json_and_png",
        "tests/test_train.py::test_skip_nonfinite_gives_up_on_a_run_of_bad_steps",
        "tests/test_train.py::test_skip_nonfinite_skips_the_bad_step_and_finishes",
        "tests/test_train.py::test_throughput_counts_every_batch_and_reads_the_clock_on_logging_steps_only",
    ], "mutant": None},
    "trainer.devices": {"tests": [
        "tests/test_buckets.py::test_bucketed_training_on_two_ranks_follows_one_process_and_resumes_exactly",
        "tests/test_cache_router.py::test_the_router_trained_under_sequence_parallelism_follows_one_process",
        "tests/test_checkpoints.py::test_async_saves_resume_like_sync_ones",
        "tests/test_checkpoints.py::test_keep_checkpoints_removes_whole_sharded_folders",
        "tests/test_checkpoints.py::test_sharded_last_checkpoint_is_a_link_to_the_numbered_folder",
        "tests/test_distributed.py::test_ddp_resume_with_workers_continues_like_an_uninterrupted_run",
        "tests/test_distributed.py::test_fsdp_and_sequence_parallelism_share_the_job_mesh",
        "tests/test_distributed.py::test_sharded_checkpoint_resumes_on_another_world_size",
        "tests/test_distributed.py::test_two_ranks_follow_the_single_process_losses",
        "tests/test_ema.py::test_ddp_two_ranks_keep_the_full_ema_equal_to_one_process",
        "tests/test_ema.py::test_fsdp_ema_is_sharded_and_resumes_to_the_single_process_ema",
        "tests/test_matrix.py::test_combination_trains_samples_and_ends_with_the_evaluation",
        "tests/test_sequence.py::test_training_refuses_a_sequence_group_over_parts_of_nodes_at_start_up",
        "tests/test_sequence.py::test_training_refuses_an_indivisible_split_at_start_up",
        "tests/test_sequence.py::test_two_rank_sequence_parallel_training_follows_one_process",
        "tests/test_train.py::test_bad_config_fails_at_start_with_the_key",
    ], "mutant": None},
    "trainer.num_nodes": {"tests": [
        "tests/test_sequence.py::test_training_refuses_a_sequence_group_over_parts_of_nodes_at_start_up",
    ], "mutant": None},
    "trainer.accelerator": {"tests": [
        "tests/test_ema.py::test_ddp_two_ranks_keep_the_full_ema_equal_to_one_process",
        "tests/test_ema.py::test_fsdp_ema_is_sharded_and_resumes_to_the_single_process_ema",
        "tests/test_gpu.py::test_sampling_and_evaluation_devices_on_the_cpu",
        "tests/test_matrix.py::test_combination_trains_samples_and_ends_with_the_evaluation",
    ], "mutant": None},
    "trainer.precision": {"tests": [
        "tests/test_distributed.py::test_fsdp_bf16_mixed_computes_with_bf16_parameters_and_keeps_fp32_masters",
        "tests/test_gpu.py::test_16_mixed_skips_an_overflowing_step_under_skip_nonfinite",
        "tests/test_gpu.py::test_compiled_blocks_on_cuda_follow_the_eager_losses",
        "tests/test_gpu.py::test_fsdp_on_one_gpu_gathers_bf16_parameters_over_nccl",
        "tests/test_low_precision_norm.py::test_bf16_run_swaps_norms_before_the_optimizer_is_built",
        "tests/test_low_precision_norm.py::test_fp32_run_warns_and_is_bit_identical",
        "tests/test_matrix.py::test_combination_trains_samples_and_ends_with_the_evaluation",
        "tests/test_train.py::test_bad_config_fails_at_start_with_the_key",
    ], "mutant": None},
    "trainer.accumulate_grad_batches": {"tests": [
        "tests/test_distributed.py::test_a_nonfinite_loss_on_one_rank_skips_the_step_on_every_rank",
        "tests/test_distributed.py::test_fsdp_gradient_accumulation_follows_one_process_and_syncs_once_per_step",
        "tests/test_matrix.py::test_combination_trains_samples_and_ends_with_the_evaluation",
        "tests/test_train.py::test_a_resume_with_another_global_batch_is_refused_unless_asked_for",
    ], "mutant": None},
    "trainer.log_every_n_steps": {"tests": [
        "tests/test_came.py::test_short_training_run_with_came8bit",
        "tests/test_matrix.py::test_combination_trains_samples_and_ends_with_the_evaluation",
        "tests/test_train.py::test_a_nonfinite_step_found_late_leaves_no_checkpoint_of_its_weights",
        "tests/test_train.py::test_logging_step_is_lightnings_rule_at_every_hook",
        "tests/test_train.py::test_throughput_counts_every_batch_and_reads_the_clock_on_logging_steps_only",
    ], "mutant": "log_every_ignored_by_the_framework"},
    "trainer.val_check_interval": {"tests": [
        "tests/test_train.py::test_bad_config_fails_at_start_with_the_key",
    ], "mutant": None},
    "trainer.gradient_clip_val": {"tests": [
        "tests/test_train.py::test_nonfinite_loss_stops_with_a_message",
        "tests/test_train.py::test_skip_nonfinite_gives_up_on_a_run_of_bad_steps",
    ], "mutant": None},
    "trainer.checkpoint_every_n_steps": {"tests": [
        "tests/test_buckets.py::test_bucketed_training_on_two_ranks_follows_one_process_and_resumes_exactly",
        "tests/test_cache_router.py::test_the_router_trained_under_sequence_parallelism_follows_one_process",
        "tests/test_checkpoints.py::test_async_saves_resume_like_sync_ones",
        "tests/test_checkpoints.py::test_keep_checkpoints_keeps_the_newest_numbered_files_across_a_resume",
        "tests/test_checkpoints.py::test_keep_checkpoints_removes_whole_sharded_folders",
        "tests/test_checkpoints.py::test_keep_checkpoints_zero_keeps_only_last",
        "tests/test_checkpoints.py::test_last_checkpoint_links_the_numbered_one_it_equals",
        "tests/test_checkpoints.py::test_sharded_last_checkpoint_is_a_link_to_the_numbered_folder",
        "tests/test_distributed.py::test_a_nonfinite_loss_on_one_rank_skips_the_step_on_every_rank",
        "tests/test_distributed.py::test_ddp_resume_with_workers_continues_like_an_uninterrupted_run",
        "tests/test_distributed.py::test_fsdp_gradient_accumulation_follows_one_process_and_syncs_once_per_step",
        "tests/test_distributed.py::test_fsdp_parameters_are_sharded_dtensors_and_frozen_ones_get_no_state",
        "tests/test_distributed.py::test_slurm_signal_saves_a_checkpoint_requeues_or_stops_and_the_rerun_resumes_there",
        "tests/test_distributed.py::test_sharded_checkpoint_resumes_on_another_world_size",
        "tests/test_distributed.py::test_single_process_frozen_parameters_get_no_state",
        "tests/test_distributed.py::test_two_nodes_hybrid_sharded_follow_one_process_and_resume_on_one_node",
        "tests/test_distributed.py::test_two_ranks_follow_the_single_process_losses",
        "tests/test_ema.py::test_crash_and_resume_gives_the_ema_of_an_uninterrupted_run",
        "tests/test_ema.py::test_fsdp_ema_is_sharded_and_resumes_to_the_single_process_ema",
        "tests/test_growth.py::test_growth_run_resumes_after_a_crash_like_an_uninterrupted_run",
        "tests/test_loggers.py::test_wandb_offline_logs_loss_lr_throughput_and_grids_and_resumes_the_same_run",
        "tests/test_matrix.py::test_combination_trains_samples_and_ends_with_the_evaluation",
        "tests/test_own_data.py::test_a_failing_final_grid_keeps_the_final_checkpoint",
        "tests/test_own_data.py::test_diffusers_export_of_an_sd2_unet_samples_like_framework_sample_unguided",
        "tests/test_own_data.py::test_diffusers_export_of_sana_needs_a_dc_ae",
        "tests/test_remote.py::test_training_from_s3_killed_and_resumed_follows_the_uninterrupted_local_run",
        "tests/test_sequence.py::test_two_rank_sequence_parallel_training_follows_one_process",
        "tests/test_train.py::test_a_nonfinite_gradient_with_a_finite_loss_is_skipped",
        "tests/test_train.py::test_a_nonfinite_step_found_late_leaves_no_checkpoint_of_its_weights",
        "tests/test_train.py::test_a_resume_with_another_global_batch_is_refused_unless_asked_for",
        "tests/test_train.py::test_quickstart_learns_the_prompts",
        "tests/test_train.py::test_resume_auto_continues_like_an_uninterrupted_run",
    ], "mutant": None},
    "trainer.checkpoint_dir": {"tests": [
        "tests/test_remote.py::test_checkpoints_on_s3_resume_a_run_whose_run_dir_is_gone_like_the_uninterrupted_run",
        "tests/test_remote.py::test_a_checkpoint_dir_that_is_no_object_store_url_is_refused",
    ], "mutant": "remote_checkpoint_never_fetched"},
    "trainer.grace_check": {"tests": [
        "tests/test_distributed.py::test_grace_check_refuses_a_slurm_run_whose_save_outlasts_kill_wait",
    ], "mutant": "grace_check_key_ignored"},
    "trainer.hang_timeout_s": {"tests": [
        "tests/test_large_jobs.py::test_a_stalled_rank_ends_the_job_naming_its_host_and_where_each_rank_waited",
        "tests/test_large_jobs.py::test_a_hang_timeout_the_process_group_would_outlast_is_refused",
    ], "mutant": "hang_timeout_ignored"},
    "trainer.keep_checkpoints": {"tests": [
        "tests/test_checkpoints.py::test_async_saves_resume_like_sync_ones",
        "tests/test_checkpoints.py::test_keep_checkpoints_keeps_the_newest_numbered_files_across_a_resume",
        "tests/test_checkpoints.py::test_keep_checkpoints_removes_whole_sharded_folders",
        "tests/test_checkpoints.py::test_keep_checkpoints_zero_keeps_only_last",
        "tests/test_checkpoints.py::test_last_checkpoint_links_the_numbered_one_it_equals",
        "tests/test_checkpoints.py::test_sharded_last_checkpoint_is_a_link_to_the_numbered_folder",
        "tests/test_train.py::test_a_nonfinite_gradient_with_a_finite_loss_is_skipped",
        "tests/test_train.py::test_a_nonfinite_step_found_late_leaves_no_checkpoint_of_its_weights",
        "tests/test_train.py::test_bad_config_fails_at_start_with_the_key",
    ], "mutant": "keep_checkpoints_deletes_newest"},
    "trainer.skip_nonfinite": {"tests": [
        "tests/test_distributed.py::test_a_nonfinite_loss_on_one_rank_skips_the_step_on_every_rank",
        "tests/test_distributed.py::test_fsdp_gradient_accumulation_follows_one_process_and_syncs_once_per_step",
        "tests/test_gpu.py::test_16_mixed_skips_an_overflowing_step_under_skip_nonfinite",
        "tests/test_train.py::test_a_nonfinite_gradient_with_a_finite_loss_is_skipped",
        "tests/test_train.py::test_skip_nonfinite_gives_up_on_a_run_of_bad_steps",
        "tests/test_train.py::test_skip_nonfinite_skips_the_bad_step_and_finishes",
    ], "mutant": None},
    "trainer.allow_global_batch_change": {"tests": [
        "tests/test_train.py::test_a_resume_with_another_global_batch_is_refused_unless_asked_for",
    ], "mutant": None},
    # set to false for quiet logs; nothing asserts on the bar
    "trainer.memory_limit_gb": {"tests": [
        "tests/test_recipes.py::test_a_run_predicted_to_exceed_its_memory_is_refused_before_it_trains",
    ], "mutant": "memory_limit_ignored"},
    "trainer.enable_progress_bar": {"tests": [
        "tests/test_came.py::test_short_training_run_with_came8bit",
        "tests/test_growth.py::test_growth_study_runs_every_arm_and_compares_at_equal_flops",
        "tests/test_matrix.py::test_combination_trains_samples_and_ends_with_the_evaluation",
        "tests/test_own_data.py::test_diffusers_export_of_a_class_conditional_dit_samples_like_framework_sample",
        "tests/test_own_data.py::test_diffusers_export_of_sana_with_a_dc_ae_samples_like_framework_sample",
        "tests/test_train.py::test_quickstart_learns_the_prompts",
    ], "mutant": None},
    # most choose logger=none to write nothing; test_loggers and test_matrix choose wandb
    "logger.kind": {"tests": [
        "tests/test_checkpoints.py::test_async_saves_resume_like_sync_ones",
        "tests/test_checkpoints.py::test_keep_checkpoints_keeps_the_newest_numbered_files_across_a_resume",
        "tests/test_checkpoints.py::test_keep_checkpoints_removes_whole_sharded_folders",
        "tests/test_checkpoints.py::test_keep_checkpoints_zero_keeps_only_last",
        "tests/test_checkpoints.py::test_last_checkpoint_links_the_numbered_one_it_equals",
        "tests/test_checkpoints.py::test_sharded_last_checkpoint_is_a_link_to_the_numbered_folder",
        "tests/test_ema.py::test_ddp_two_ranks_keep_the_full_ema_equal_to_one_process",
        "tests/test_ema.py::test_fsdp_ema_is_sharded_and_resumes_to_the_single_process_ema",
        "tests/test_export.py::test_export_round_trip_is_exact",
        "tests/test_loggers.py::test_wandb_offline_logs_loss_lr_throughput_and_grids_and_resumes_the_same_run",
        "tests/test_matrix.py::test_combination_trains_samples_and_ends_with_the_evaluation",
        "tests/test_own_data.py::test_diffusers_export_of_a_class_conditional_dit_samples_like_framework_sample",
        "tests/test_own_data.py::test_diffusers_export_of_sana_with_a_dc_ae_samples_like_framework_sample",
        "tests/test_train.py::test_debug_presets_train_a_few_steps_with_each_objective",
        "tests/test_train.py::test_quickstart_learns_the_prompts",
    ], "mutant": None},
    # the default (offline): the test reads the offline run's files
    "logger.mode": {"tests": [
        "tests/test_loggers.py::test_wandb_offline_logs_loss_lr_throughput_and_grids_and_resumes_the_same_run",
    ], "mutant": None},
    "logger.name": {"tests": [
        "tests/test_loggers.py::test_wandb_offline_logs_loss_lr_throughput_and_grids_and_resumes_the_same_run",
        "tests/test_matrix.py::test_combination_trains_samples_and_ends_with_the_evaluation",
    ], "mutant": None},
    "logger.group": {"tests": [
        "tests/test_loggers.py::test_wandb_offline_logs_loss_lr_throughput_and_grids_and_resumes_the_same_run",
        "tests/test_matrix.py::test_combination_trains_samples_and_ends_with_the_evaluation",
    ], "mutant": None},
    "logger.tags": {"tests": [
        "tests/test_loggers.py::test_wandb_offline_logs_loss_lr_throughput_and_grids_and_resumes_the_same_run",
        "tests/test_matrix.py::test_combination_trains_samples_and_ends_with_the_evaluation",
    ], "mutant": None},
    "logger.project": {"tests": [
        "tests/test_matrix.py::test_combination_trains_samples_and_ends_with_the_evaluation",
    ], "mutant": "wandb_project_ignored"},
    "logger.entity": {"tests": [
        "tests/test_matrix.py::test_combination_trains_samples_and_ends_with_the_evaluation",
    ], "mutant": "wandb_entity_ignored"},
    "run.dir": {"tests": [
        "tests/test_came.py::test_short_training_run_with_came8bit",
        "tests/test_matrix.py::test_combination_trains_samples_and_ends_with_the_evaluation",
        "tests/test_own_data.py::test_diffusers_export_of_a_class_conditional_dit_samples_like_framework_sample",
        "tests/test_own_data.py::test_diffusers_export_of_sana_with_a_dc_ae_samples_like_framework_sample",
        "tests/test_train.py::test_quickstart_learns_the_prompts",
    ], "mutant": None},
    # most set it to 0 (no grids during training)
    "sample.every_n_steps": {"tests": [
        "tests/test_buckets.py::test_pixart_size_conditioning_feeds_each_batch_its_own_shape",
        "tests/test_buckets.py::test_sample_draws_a_trained_bucket_by_size_or_aspect_and_refuses_others",
        "tests/test_buckets.py::test_unet_size_conditioning_feeds_each_sample_its_original_size_and_crop",
        "tests/test_ema.py::test_ddp_two_ranks_keep_the_full_ema_equal_to_one_process",
        "tests/test_ema.py::test_fsdp_ema_is_sharded_and_resumes_to_the_single_process_ema",
        "tests/test_ema.py::test_swapping_in_and_out_leaves_training_bit_identical",
        "tests/test_loggers.py::test_wandb_offline_logs_loss_lr_throughput_and_grids_and_resumes_the_same_run",
        "tests/test_matrix.py::test_combination_trains_samples_and_ends_with_the_evaluation",
        "tests/test_own_data.py::test_diffusers_export_of_a_class_conditional_dit_samples_like_framework_sample",
        "tests/test_own_data.py::test_diffusers_export_of_an_sd2_unet_samples_like_framework_sample_unguided",
        "tests/test_own_data.py::test_diffusers_export_of_sana_needs_a_dc_ae",
        "tests/test_own_data.py::test_diffusers_export_of_sana_with_a_dc_ae_samples_like_framework_sample",
        "tests/test_train.py::test_quickstart_learns_the_prompts",
    ], "mutant": None},
    "sample.prompts": {"tests": [
        "tests/test_came.py::test_short_training_run_with_came8bit",
        "tests/test_matrix.py::test_combination_trains_samples_and_ends_with_the_evaluation",
        "tests/test_own_data.py::test_grids_of_the_prompts_encoded_with_the_data_load_no_text_encoder",
    ], "mutant": None},
    "sample.per_prompt": {"tests": [
        "tests/test_came.py::test_short_training_run_with_came8bit",
        "tests/test_matrix.py::test_combination_trains_samples_and_ends_with_the_evaluation",
        "tests/test_own_data.py::test_diffusers_export_of_a_class_conditional_dit_samples_like_framework_sample",
        "tests/test_own_data.py::test_diffusers_export_of_sana_with_a_dc_ae_samples_like_framework_sample",
    ], "mutant": None},
    "sample.steps": {"tests": [
        "tests/test_came.py::test_short_training_run_with_came8bit",
        "tests/test_matrix.py::test_combination_trains_samples_and_ends_with_the_evaluation",
        "tests/test_own_data.py::test_diffusers_export_of_a_class_conditional_dit_samples_like_framework_sample",
        "tests/test_own_data.py::test_diffusers_export_of_sana_with_a_dc_ae_samples_like_framework_sample",
    ], "mutant": None},
    # the grid's plan; that the sampler uses a plan's guidance is mutant plan_guidance_ignored (test_own_data.py)
    "sample.guidance": {"tests": [
        "tests/test_train.py::test_sample_grid_draws_with_the_configured_seed_and_guidance",
    ], "mutant": "sample_grid_guidance_ignored"},
    "sample.sampler": {"tests": [
        "tests/test_train.py::test_bad_config_fails_at_start_with_the_key",
    ], "mutant": None},
    "sample.seed": {"tests": [
        "tests/test_train.py::test_sample_grid_draws_with_the_configured_seed_and_guidance",
    ], "mutant": "sample_grid_seed_ignored"},
    "sample.vae": {"tests": [
        "tests/test_matrix.py::test_combination_trains_samples_and_ends_with_the_evaluation",
        "tests/test_own_data.py::test_a_dataset_smaller_than_one_batch_is_refused",
        "tests/test_own_data.py::test_a_failing_final_grid_keeps_the_final_checkpoint",
        "tests/test_own_data.py::test_a_preset_trains_on_own_latents_and_grids_decode_with_local_encoders",
        "tests/test_own_data.py::test_diffusers_export_is_a_pipeline_that_samples_like_framework_sample",
        "tests/test_own_data.py::test_diffusers_export_of_an_sd2_unet_samples_like_framework_sample_unguided",
        "tests/test_own_data.py::test_diffusers_export_of_sana_needs_a_dc_ae",
        "tests/test_own_data.py::test_diffusers_export_of_sana_with_a_dc_ae_samples_like_framework_sample",
        "tests/test_own_data.py::test_encoders_missing_on_this_machine_fail_before_training",
        "tests/test_own_data.py::test_eval_command_scores_own_data_against_held_out_images",
        "tests/test_own_data.py::test_grids_of_the_prompts_encoded_with_the_data_load_no_text_encoder",
        "tests/test_own_data.py::test_sample_command_takes_the_encoders_of_this_machine",
        "tests/test_own_data.py::test_training_ends_with_the_own_data_evaluation",
    ], "mutant": None},
    "sample.text_encoder": {"tests": [
        "tests/test_matrix.py::test_combination_trains_samples_and_ends_with_the_evaluation",
        "tests/test_own_data.py::test_a_dataset_smaller_than_one_batch_is_refused",
        "tests/test_own_data.py::test_a_failing_final_grid_keeps_the_final_checkpoint",
        "tests/test_own_data.py::test_a_preset_trains_on_own_latents_and_grids_decode_with_local_encoders",
        "tests/test_own_data.py::test_diffusers_export_is_a_pipeline_that_samples_like_framework_sample",
        "tests/test_own_data.py::test_diffusers_export_of_an_sd2_unet_samples_like_framework_sample_unguided",
        "tests/test_own_data.py::test_diffusers_export_of_sana_needs_a_dc_ae",
        "tests/test_own_data.py::test_diffusers_export_of_sana_with_a_dc_ae_samples_like_framework_sample",
        "tests/test_own_data.py::test_eval_command_scores_own_data_against_held_out_images",
        "tests/test_own_data.py::test_sample_command_takes_the_encoders_of_this_machine",
        "tests/test_own_data.py::test_training_ends_with_the_own_data_evaluation",
    ], "mutant": None},
    # eval.*: only the training run's keys count here; `python -m framework.eval` fields of the same names (EvalCommand) are not
    "eval.height": {"tests": [
        "tests/test_evaluation.py::test_eval_settings_reach_the_generation",
    ], "mutant": "eval_height_ignored"},
    "eval.width": {"tests": [
        "tests/test_evaluation.py::test_eval_settings_reach_the_generation",
    ], "mutant": "eval_width_ignored"},
    "eval.aspect": {"tests": [
        "tests/test_evaluation.py::test_eval_settings_reach_the_generation",
    ], "mutant": "eval_aspect_ignored"},
    "eval.num_frames": {"tests": [
        "tests/test_evaluation.py::test_eval_settings_reach_the_generation",
    ], "mutant": "eval_num_frames_ignored"},
    "eval.seeds": {"tests": [
        "tests/test_ema.py::test_an_ema_that_has_not_caught_up_is_not_used_silently",
        "tests/test_ema.py::test_grids_and_the_final_evaluation_use_the_averaged_weights",
        "tests/test_growth.py::test_eval_every_n_steps_logs_fd_and_accuracy_curves",
        "tests/test_growth.py::test_growth_study_runs_every_arm_and_compares_at_equal_flops",
        "tests/test_matrix.py::test_combination_trains_samples_and_ends_with_the_evaluation",
        "tests/test_own_data.py::test_training_ends_with_the_own_data_evaluation",
        "tests/test_train.py::test_quickstart_learns_the_prompts",
    ], "mutant": None},
    "eval.phrasings": {"tests": [
        "tests/test_ema.py::test_an_ema_that_has_not_caught_up_is_not_used_silently",
        "tests/test_ema.py::test_grids_and_the_final_evaluation_use_the_averaged_weights",
        "tests/test_growth.py::test_eval_every_n_steps_logs_fd_and_accuracy_curves",
        "tests/test_growth.py::test_growth_study_runs_every_arm_and_compares_at_equal_flops",
        "tests/test_matrix.py::test_combination_trains_samples_and_ends_with_the_evaluation",
    ], "mutant": None},
    "eval.steps": {"tests": [
        "tests/test_ema.py::test_an_ema_that_has_not_caught_up_is_not_used_silently",
        "tests/test_ema.py::test_grids_and_the_final_evaluation_use_the_averaged_weights",
        "tests/test_growth.py::test_eval_every_n_steps_logs_fd_and_accuracy_curves",
        "tests/test_growth.py::test_growth_study_runs_every_arm_and_compares_at_equal_flops",
        "tests/test_matrix.py::test_combination_trains_samples_and_ends_with_the_evaluation",
        "tests/test_own_data.py::test_training_ends_with_the_own_data_evaluation",
    ], "mutant": None},
    # the evaluation's plan; that the sampler uses a plan's guidance is mutant plan_guidance_ignored (test_own_data.py)
    "eval.guidance": {"tests": [
        "tests/test_evaluation.py::test_eval_settings_reach_the_generation",
    ], "mutant": "eval_guidance_ignored"},
    "eval.sampler": {"tests": [
        "tests/test_evaluation.py::test_eval_settings_reach_the_generation",
    ], "mutant": "eval_sampler_ignored"},
    "eval.batch_size": {"tests": [
        "tests/test_evaluation.py::test_eval_settings_reach_the_generation",
    ], "mutant": "eval_batch_size_ignored"},
    "eval.best_of": {"tests": [
        "tests/test_matrix.py::test_combination_trains_samples_and_ends_with_the_evaluation",
    ], "mutant": None},
    "eval.judge": {"tests": [
        "tests/test_evaluation.py::test_eval_pick_judge_and_judge_path_reach_the_selection",
    ], "mutant": "eval_judge_ignored"},
    "eval.judge_path": {"tests": [
        "tests/test_evaluation.py::test_eval_pick_judge_and_judge_path_reach_the_selection",
    ], "mutant": "eval_judge_path_ignored"},
    "eval.selection": {"tests": [
        "tests/test_matrix.py::test_combination_trains_samples_and_ends_with_the_evaluation",
    ], "mutant": None},
    "eval.pick": {"tests": [
        "tests/test_evaluation.py::test_eval_pick_judge_and_judge_path_reach_the_selection",
    ], "mutant": "eval_pick_ignored"},
    "eval.cache_schedule": {"tests": [
        "tests/test_evaluation.py::test_eval_settings_reach_the_generation",
    ], "mutant": "eval_cache_schedule_ignored"},
    "eval.real": {"tests": [
        "tests/test_matrix.py::test_combination_trains_samples_and_ends_with_the_evaluation",
        "tests/test_own_data.py::test_training_ends_with_the_own_data_evaluation",
    ], "mutant": None},
    "eval.prompts": {"tests": [
        "tests/test_own_data.py::test_training_ends_with_the_own_data_evaluation",
    ], "mutant": "eval_prompts_ignored"},
    "eval.inception": {"tests": [
        "tests/test_matrix.py::test_combination_trains_samples_and_ends_with_the_evaluation",
        "tests/test_own_data.py::test_training_ends_with_the_own_data_evaluation",
    ], "mutant": None},
    "eval.clip": {"tests": [
        "tests/test_matrix.py::test_combination_trains_samples_and_ends_with_the_evaluation",
        "tests/test_video.py::test_eval_scores_own_clips_with_fvd_and_per_frame_clip_score",
    ], "mutant": "clip_score_of_first_frames"},
    "eval.i3d": {"tests": [
        "tests/test_video.py::test_eval_scores_own_clips_with_fvd_and_per_frame_clip_score",
    ], "mutant": "i3d_key_ignored"},
    "eval.bootstrap": {"tests": [
        "tests/test_matrix.py::test_combination_trains_samples_and_ends_with_the_evaluation",
        "tests/test_own_data.py::test_training_ends_with_the_own_data_evaluation",
    ], "mutant": None},
    # most set it to false (no evaluation at the end)
    "eval.at_end": {"tests": [
        "tests/test_came.py::test_short_training_run_with_came8bit",
        "tests/test_ema.py::test_an_ema_that_has_not_caught_up_is_not_used_silently",
        "tests/test_ema.py::test_grids_and_the_final_evaluation_use_the_averaged_weights",
        "tests/test_matrix.py::test_combination_trains_samples_and_ends_with_the_evaluation",
        "tests/test_own_data.py::test_diffusers_export_of_a_class_conditional_dit_samples_like_framework_sample",
        "tests/test_own_data.py::test_diffusers_export_of_sana_with_a_dc_ae_samples_like_framework_sample",
        "tests/test_own_data.py::test_training_ends_with_the_own_data_evaluation",
    ], "mutant": None},
    "eval.every_n_steps": {"tests": [
        "tests/test_growth.py::test_eval_every_n_steps_logs_fd_and_accuracy_curves",
        "tests/test_matrix.py::test_combination_trains_samples_and_ends_with_the_evaluation",
        "tests/test_own_data.py::test_training_ends_with_the_own_data_evaluation",
    ], "mutant": None},
    "plugins": {"tests": [
        "tests/test_distributed.py::test_growth_from_a_sharded_checkpoint_on_two_fsdp_ranks_equals_one_process",
        "tests/test_ema.py::test_an_ema_that_has_not_caught_up_is_not_used_silently",
        "tests/test_ema.py::test_crash_and_resume_gives_the_ema_of_an_uninterrupted_run",
        "tests/test_ema.py::test_ddp_two_ranks_keep_the_full_ema_equal_to_one_process",
        "tests/test_ema.py::test_ema_equals_hand_computed_reference",
        "tests/test_ema.py::test_fsdp_ema_is_sharded_and_resumes_to_the_single_process_ema",
        "tests/test_ema.py::test_grids_and_the_final_evaluation_use_the_averaged_weights",
        "tests/test_ema.py::test_nothing_is_allocated_before_the_start",
        "tests/test_ema.py::test_plugin_fields_compose_under_plugins_ema",
        "tests/test_ema.py::test_swapping_in_and_out_leaves_training_bit_identical",
        "tests/test_growth.py::test_a_grown_run_continues_the_schedule_and_warms_up_only_its_new_blocks",
        "tests/test_growth.py::test_grown_run_starts_at_the_source_models_loss_and_its_ema_at_the_grown_weights",
        "tests/test_growth.py::test_growth_run_resumes_after_a_crash_like_an_uninterrupted_run",
        "tests/test_low_precision_norm.py::test_bf16_run_swaps_norms_before_the_optimizer_is_built",
        "tests/test_low_precision_norm.py::test_fp32_run_warns_and_is_bit_identical",
        "tests/test_matrix.py::test_combination_trains_samples_and_ends_with_the_evaluation",
        "tests/test_train.py::test_a_misspelled_plugin_field_is_refused_before_any_data_is_built",
        "tests/test_train.py::test_real_size_experiments_build_their_published_model",
    ], "mutant": None},
    # plugins.<name>.*: each plugin's config dataclass (framework.training.registry.PLUGINS)
    "plugins.cache_router.sampler": {"tests": [
        "tests/test_cache_router.py::test_the_stage_refuses_what_it_cannot_do",
    ], "mutant": None},
    "plugins.cache_router.steps": {"tests": [
        "tests/test_cache_router.py::test_a_schedule_that_computes_everything_samples_bit_for_bit_like_plain_sampling",
        "tests/test_cache_router.py::test_router_training_lowers_the_distillation_loss_and_leaves_the_backbone_bit_identical",
        "tests/test_cache_router.py::test_straight_through_trains_on_the_forward_that_sampling_runs",
        "tests/test_cache_router.py::test_the_distillation_starts_where_guided_sampling_is_and_distils_the_guided_prediction",
        "tests/test_cache_router.py::test_the_sparsity_penalty_weighs_each_branch_by_its_cost",
        "tests/test_cache_router.py::test_the_stage_refuses_what_it_cannot_do",
        "tests/test_matrix.py::test_combination_trains_samples_and_ends_with_the_evaluation",
    ], "mutant": None},
    "plugins.cache_router.sparsity": {"tests": [
        "tests/test_cache_router.py::test_router_training_lowers_the_distillation_loss_and_leaves_the_backbone_bit_identical",
        "tests/test_cache_router.py::test_the_router_trained_under_sequence_parallelism_follows_one_process",
        "tests/test_cache_router.py::test_the_sparsity_penalty_weighs_each_branch_by_its_cost",
    ], "mutant": None},
    # reads the default threshold to build the expected student
    "plugins.cache_router.threshold": {"tests": [
        "tests/test_cache_router.py::test_straight_through_trains_on_the_forward_that_sampling_runs",
    ], "mutant": None},
    "plugins.cache_router.init_logit": {"tests": [
        "tests/test_cache_router.py::test_router_training_lowers_the_distillation_loss_and_leaves_the_backbone_bit_identical",
        "tests/test_cache_router.py::test_the_router_trained_under_sequence_parallelism_follows_one_process",
    ], "mutant": None},
    # the mutant's test sets the router's costs by hand: the penalty is proven, not the key
    "plugins.cache_router.cost": {"tests": [
        "tests/test_cache_router.py::test_the_schedule_goes_where_out_says_and_the_penalty_weighs_branches_as_cost_says",
    ], "mutant": "router_cost_setting_ignored"},
    "plugins.cache_router.guidance": {"tests": [
        "tests/test_cache_router.py::test_straight_through_trains_on_the_forward_that_sampling_runs",
        "tests/test_cache_router.py::test_the_distillation_starts_where_guided_sampling_is_and_distils_the_guided_prediction",
    ], "mutant": "router_distilled_unguided"},
    "plugins.cache_router.start": {"tests": [
        "tests/test_cache_router.py::test_the_distillation_starts_where_guided_sampling_is_and_distils_the_guided_prediction",
    ], "mutant": "router_states_from_noised_data"},
    "plugins.cache_router.hard": {"tests": [
        "tests/test_cache_router.py::test_straight_through_trains_on_the_forward_that_sampling_runs",
    ], "mutant": None},
    "plugins.cache_router.out": {"tests": [
        "tests/test_cache_router.py::test_the_schedule_goes_where_out_says_and_the_penalty_weighs_branches_as_cost_says",
    ], "mutant": "router_schedule_out_ignored"},
    "plugins.ema.decay": {"tests": [
        "tests/test_ema.py::test_an_ema_that_has_not_caught_up_is_not_used_silently",
        "tests/test_ema.py::test_bad_fields_name_the_key",
        "tests/test_ema.py::test_crash_and_resume_gives_the_ema_of_an_uninterrupted_run",
        "tests/test_ema.py::test_ddp_two_ranks_keep_the_full_ema_equal_to_one_process",
        "tests/test_ema.py::test_ema_equals_hand_computed_reference",
        "tests/test_ema.py::test_fsdp_ema_is_sharded_and_resumes_to_the_single_process_ema",
        "tests/test_ema.py::test_grids_and_the_final_evaluation_use_the_averaged_weights",
        "tests/test_ema.py::test_plugin_fields_compose_under_plugins_ema",
        "tests/test_ema.py::test_swapping_in_and_out_leaves_training_bit_identical",
        "tests/test_growth.py::test_grown_run_starts_at_the_source_models_loss_and_its_ema_at_the_grown_weights",
    ], "mutant": None},
    "plugins.ema.half_life": {"tests": [
        "tests/test_ema.py::test_plugin_fields_compose_under_plugins_ema",
    ], "mutant": None},
    "plugins.ema.every": {"tests": [
        "tests/test_ema.py::test_bad_fields_name_the_key",
        "tests/test_ema.py::test_crash_and_resume_gives_the_ema_of_an_uninterrupted_run",
        "tests/test_ema.py::test_ema_equals_hand_computed_reference",
        "tests/test_ema.py::test_plugin_fields_compose_under_plugins_ema",
    ], "mutant": None},
    "plugins.ema.start": {"tests": [
        "tests/test_ema.py::test_an_ema_that_has_not_caught_up_is_not_used_silently",
        "tests/test_ema.py::test_bad_fields_name_the_key",
        "tests/test_ema.py::test_crash_and_resume_gives_the_ema_of_an_uninterrupted_run",
        "tests/test_ema.py::test_ddp_two_ranks_keep_the_full_ema_equal_to_one_process",
        "tests/test_ema.py::test_ema_equals_hand_computed_reference",
        "tests/test_ema.py::test_fsdp_ema_is_sharded_and_resumes_to_the_single_process_ema",
        "tests/test_ema.py::test_grids_and_the_final_evaluation_use_the_averaged_weights",
        "tests/test_ema.py::test_nothing_is_allocated_before_the_start",
        "tests/test_ema.py::test_plugin_fields_compose_under_plugins_ema",
        "tests/test_matrix.py::test_combination_trains_samples_and_ends_with_the_evaluation",
    ], "mutant": None},
    "plugins.ema.buffers": {"tests": [
        "tests/test_ema.py::test_buffers_false_averages_only_the_parameters",
    ], "mutant": "ema_buffers_ignored"},
    "plugins.growth.ckpt": {"tests": [
        "tests/test_distributed.py::test_growth_from_a_sharded_checkpoint_on_two_fsdp_ranks_equals_one_process",
        "tests/test_growth.py::test_a_grown_run_continues_the_schedule_and_warms_up_only_its_new_blocks",
        "tests/test_growth.py::test_grown_and_pruned_checkpoints_work_in_every_command",
        "tests/test_growth.py::test_grown_run_starts_at_the_source_models_loss_and_its_ema_at_the_grown_weights",
        "tests/test_growth.py::test_growth_refuses_the_unet_and_mismatched_sources",
        "tests/test_growth.py::test_growth_run_resumes_after_a_crash_like_an_uninterrupted_run",
        "tests/test_matrix.py::test_combination_trains_samples_and_ends_with_the_evaluation",
    ], "mutant": None},
    "plugins.growth.init": {"tests": [
        "tests/test_distributed.py::test_growth_from_a_sharded_checkpoint_on_two_fsdp_ranks_equals_one_process",
        "tests/test_growth.py::test_a_grown_run_continues_the_schedule_and_warms_up_only_its_new_blocks",
        "tests/test_growth.py::test_growth_refuses_the_unet_and_mismatched_sources",
        "tests/test_growth.py::test_growth_run_resumes_after_a_crash_like_an_uninterrupted_run",
        "tests/test_growth.py::test_growth_study_gives_grown_only_overrides_to_tagged_grown_arms",
        "tests/test_matrix.py::test_combination_trains_samples_and_ends_with_the_evaluation",
    ], "mutant": None},
    "plugins.growth.drop_last": {"tests": [
        "tests/test_growth.py::test_growth_refuses_the_unet_and_mismatched_sources",
    ], "mutant": None},
    # grow(zero_gate=True) itself: mutant growth_leaves_one_projection (test_grown_model_computes_the_source_function)
    "plugins.growth.zero_gate": {"tests": [
        "tests/test_growth.py::test_growth_config_seed_weights_and_zero_gate_reach_the_grown_weights",
    ], "mutant": "growth_zero_gate_ignored"},
    "plugins.growth.weights": {"tests": [
        "tests/test_growth.py::test_growth_config_seed_weights_and_zero_gate_reach_the_grown_weights",
    ], "mutant": "growth_weights_ignored"},
    "plugins.growth.seed": {"tests": [
        "tests/test_growth.py::test_growth_config_seed_weights_and_zero_gate_reach_the_grown_weights",
    ], "mutant": "growth_seed_ignored"},
    "plugins.growth.new_lr_scale": {"tests": [
        "tests/test_growth.py::test_a_grown_run_continues_the_schedule_and_warms_up_only_its_new_blocks",
        "tests/test_growth.py::test_growth_study_gives_grown_only_overrides_to_tagged_grown_arms",
    ], "mutant": None},
    "plugins.growth.new_warmup_steps": {"tests": [
        "tests/test_growth.py::test_a_grown_run_continues_the_schedule_and_warms_up_only_its_new_blocks",
    ], "mutant": "new_blocks_not_warmed_up"},
    # its default (true); the mutant's own test is a unit test of LPLayerNorm
    "plugins.low_precision_norm.layer_norm": {"tests": [
        "tests/test_low_precision_norm.py::test_bf16_run_swaps_norms_before_the_optimizer_is_built",
    ], "mutant": "low_precision_norm_in_fp32"},
    "plugins.low_precision_norm.group_norm": {"tests": [
        "tests/test_low_precision_norm.py::test_a_norm_kind_turned_off_is_left_as_it_is",
    ], "mutant": "low_precision_group_norm_always"},
    "plugins.low_precision_norm.rms_norm": {"tests": [
        "tests/test_low_precision_norm.py::test_a_norm_kind_turned_off_is_left_as_it_is",
    ], "mutant": "low_precision_rms_norm_always"},
    # also the tests that resume with the resume=auto of a shared helper (run_train, tiny, crash_and_resume)
    "resume": {"tests": [
        "tests/test_buckets.py::test_bucketed_training_on_two_ranks_follows_one_process_and_resumes_exactly",
        "tests/test_cache_router.py::test_the_stage_resumes_after_a_kill_like_an_uninterrupted_run",
        "tests/test_checkpoints.py::test_async_saves_resume_like_sync_ones",
        "tests/test_checkpoints.py::test_keep_checkpoints_keeps_the_newest_numbered_files_across_a_resume",
        "tests/test_checkpoints.py::test_last_checkpoint_links_the_numbered_one_it_equals",
        "tests/test_distributed.py::test_ddp_resume_with_workers_continues_like_an_uninterrupted_run",
        "tests/test_distributed.py::test_fsdp_resume_with_workers_continues_like_an_uninterrupted_run",
        "tests/test_distributed.py::test_preemption_signal_mid_run_saves_one_step_on_every_rank_and_the_requeued_run_matches",
        "tests/test_distributed.py::test_slurm_signal_saves_a_checkpoint_requeues_or_stops_and_the_rerun_resumes_there",
        "tests/test_distributed.py::test_sharded_checkpoint_resumes_on_another_world_size",
        "tests/test_distributed.py::test_two_nodes_hybrid_sharded_follow_one_process_and_resume_on_one_node",
        "tests/test_ema.py::test_crash_and_resume_gives_the_ema_of_an_uninterrupted_run",
        "tests/test_ema.py::test_fsdp_ema_is_sharded_and_resumes_to_the_single_process_ema",
        "tests/test_growth.py::test_growth_run_resumes_after_a_crash_like_an_uninterrupted_run",
        "tests/test_loggers.py::test_wandb_offline_logs_loss_lr_throughput_and_grids_and_resumes_the_same_run",
        "tests/test_remote.py::test_training_from_s3_killed_and_resumed_follows_the_uninterrupted_local_run",
        "tests/test_slurm.py::test_sbatch_job_saves_on_each_signal_and_resumes_exactly",
        "tests/test_slurm.py::test_submitit_sweep_job_saves_on_the_warning_and_submitit_requeues_it",
        "tests/test_train.py::test_a_resume_with_another_global_batch_is_refused_unless_asked_for",
        "tests/test_train.py::test_resume_auto_continues_like_an_uninterrupted_run",
    ], "mutant": None},
    # test_cache_router: the stage refuses to start without it
    "init_from": {"tests": [
        "tests/test_cache_router.py::test_the_stage_refuses_what_it_cannot_do",
        "tests/test_growth.py::test_grown_and_pruned_checkpoints_work_in_every_command",
        "tests/test_growth.py::test_grown_run_starts_at_the_source_models_loss_and_its_ema_at_the_grown_weights",
        "tests/test_matrix.py::test_combination_trains_samples_and_ends_with_the_evaluation",
        "tests/test_recipes.py::test_a_diffusers_folder_builds_the_model_its_config_json_describes",
        "tests/test_recipes.py::test_a_folder_of_another_family_is_refused_naming_the_class",
        "tests/test_recipes.py::test_a_key_the_user_set_that_contradicts_the_folder_is_refused_naming_both",
    ], "mutant": "released_kwargs_ignored"},
    "adapter.kind": {"tests": [
        "tests/test_adapters.py::test_only_the_adapter_trains_and_the_checkpoint_holds_it_alone",
        "tests/test_adapters.py::test_resuming_with_another_adapter_is_refused",
        "tests/test_adapters.py::test_bad_adapter_settings_are_refused",
        "tests/test_distributed.py::test_an_adapter_sharded_on_two_ranks_follows_one_process_and_resumes_on_one",
        "tests/test_matrix.py::test_combination_trains_samples_and_ends_with_the_evaluation",
        "tests/test_own_data.py::test_a_lora_file_loads_into_the_stock_sd2_pipeline_and_samples_like_framework_sample",
    ], "mutant": "adapter_base_trains"},
    "adapter.rank": {"tests": [
        "tests/test_adapters.py::test_lora_update_is_alpha_over_rank_times_b_a_on_the_chosen_layers",
        "tests/test_adapters.py::test_resuming_with_another_adapter_is_refused",
        "tests/test_adapters.py::test_bad_adapter_settings_are_refused",
    ], "mutant": "adapter_rank_ignored"},
    "adapter.alpha": {"tests": [
        "tests/test_adapters.py::test_lora_update_is_alpha_over_rank_times_b_a_on_the_chosen_layers",
        "tests/test_adapters.py::test_lora_exports_as_diffusers_lora_file_merged_pipeline_and_merged_weights",
    ], "mutant": "adapter_alpha_ignored"},
    "adapter.dropout": {"tests": [
        "tests/test_adapters.py::test_adapter_dropout_changes_what_the_adapter_learns",
        "tests/test_adapters.py::test_bad_adapter_settings_are_refused",
    ], "mutant": "adapter_dropout_ignored"},
    "adapter.base_dtype": {"tests": [
        "tests/test_adapters.py::test_a_bf16_base_is_held_in_bf16_and_the_memory_prediction_counts_it_so",
        "tests/test_adapters.py::test_bf16_base_needs_mixed_precision",
        "tests/test_bench.py::test_bench_finetune_measures_each_arm_beside_its_predicted_peak",
        "tests/test_matrix.py::test_combination_trains_samples_and_ends_with_the_evaluation",
        "tests/test_adapters.py::test_an_int8_base_computes_with_per_row_int8_weights_and_the_prediction_counts_a_byte_each",
    ], "mutant": "adapter_base_dtype_ignored"},
    "adapter.offload_blocks": {"tests": [
        "tests/test_adapters.py::test_offloaded_blocks_train_the_same_adapter_from_copies_made_for_each_forward_and_recomputation",
        "tests/test_adapters.py::test_offloading_needs_activation_checkpointing_and_no_fsdp_and_is_predicted_as_one_block_on_a_gpu",
        "tests/test_bench.py::test_bench_finetune_measures_each_arm_beside_its_predicted_peak",
        "tests/test_matrix.py::test_combination_trains_samples_and_ends_with_the_evaluation",
    ], "mutant": "offload_blocks_ignored"},
    "adapter.targets": {"tests": [
        "tests/test_adapters.py::test_lora_update_is_alpha_over_rank_times_b_a_on_the_chosen_layers",
        "tests/test_adapters.py::test_targets_that_match_nothing_are_refused_naming_the_layers",
    ], "mutant": "adapter_targets_ignored"},
    "data.val_path": {"tests": [
        "tests/test_validation.py::test_the_validation_loss_of_unchanged_weights_is_the_same_at_every_evaluation",
        "tests/test_tensorboard.py::test_tensorboard_logs_what_wandb_gets_and_a_resumed_run_continues_in_its_folder",
        "tests/test_loggers.py::test_wandb_offline_logs_loss_lr_throughput_and_grids_and_resumes_the_same_run",
        "tests/test_validation.py::test_a_validation_loss_without_held_out_latents_is_refused",
        "tests/test_distributed.py::test_the_validation_loss_on_two_ranks_is_the_one_process_loss",
        "tests/test_train.py::test_quickstart_learns_the_prompts",
    ], "mutant": None},
    "eval.val_every_n_steps": {"tests": [
        "tests/test_validation.py::test_the_validation_loss_of_unchanged_weights_is_the_same_at_every_evaluation",
        "tests/test_tensorboard.py::test_tensorboard_logs_what_wandb_gets_and_a_resumed_run_continues_in_its_folder",
        "tests/test_loggers.py::test_wandb_offline_logs_loss_lr_throughput_and_grids_and_resumes_the_same_run",
        "tests/test_validation.py::test_a_validation_loss_without_held_out_latents_is_refused",
        "tests/test_distributed.py::test_the_validation_loss_on_two_ranks_is_the_one_process_loss",
        "tests/test_train.py::test_quickstart_learns_the_prompts",
    ], "mutant": "val_every_ignored"},
    # the default seed, twice: the losses must be bit-identical (no test sets another seed)
    "seed": {"tests": [
        "tests/test_train.py::test_same_seed_gives_identical_losses",
    ], "mutant": None},
}


def short(test_id: str) -> str:
    """tests/test_train.py::test_x -> test_train::test_x"""
    path, _, name = test_id.partition("::")
    return f"{Path(path).stem}::{name}"


def markdown(keys: dict[str, dict], most: int = 8) -> list[str]:
    """The table (at most `most` tests in a cell, then how many more) and its summary line."""
    rows = ["| key | tests that observe it | mutant that proves it |", "|---|---|---|"]
    for key, entry in keys.items():
        tests = [f"`{short(t)}`" for t in entry["tests"]]
        if len(tests) > most:
            tests = tests[:most] + [f"(+{len(tests) - most} more)"]
        mutant = f"`{entry['mutant']}`" if entry["mutant"] else ""
        rows.append(f"| `{key}` | {'<br>'.join(tests)} | {mutant} |")
    return rows + ["", summary(keys), f"(A cell names at most {most} tests; tests/config_keys.py lists them all.)"]


def summary(keys: dict[str, dict]) -> str:
    """N keys, how many have a test, how many a mutant."""
    tested = sum(1 for e in keys.values() if e["tests"])
    proven = sum(1 for e in keys.values() if e["mutant"])
    return f"{len(keys)} keys; {tested} with at least one test; {proven} proven by a mutant."


def audit(keys: dict[str, dict], code: list[str], root: Path = ROOT) -> list[str]:
    """One line for each way `keys` is out of step with the config's keys `code`, the tests under root and the
    mutants' table."""
    from tests.mutants import MUTANTS, missing_tests

    known = {m.name for m in MUTANTS}
    lines = [f"{k}: a config key without an entry (add one, with tests [] if none)" for k in code if k not in keys]
    lines += [f"{k}: an entry for a key the config no longer has (remove it)" for k in keys if k not in code]
    for key, e in keys.items():
        if not isinstance(e, dict) or set(e) != {"tests", "mutant"} or not isinstance(e["tests"], list):
            lines.append(f"{key}: the entry must be {{'tests': [test ids], 'mutant': name or None}}")
            continue
        lines += [f"{key}: names {t}, which does not exist (renamed? update it)" for t in missing_tests(e["tests"], root)]
        if e["mutant"] and e["mutant"] not in known:
            lines.append(f"{key}: mutant {e['mutant']} is not in tests/mutants.py")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--markdown", action="store_true", help="print the whole record as a Markdown table")
    parser.add_argument("--audit", action="store_true", help="report what is out of step with the code; exit 0")
    args = parser.parse_args()
    code = config_keys()
    if args.audit:  # a report, never a failure (see the module's doc)
        lines = audit(KEYS, code)
        print("\n".join(lines) + "\n" if lines else "", end="")
        print(f"config keys audit: {len(code)} keys, {len(lines)} problems")
        return 0
    # The table follows the code: a key without an entry shows as unobserved, an entry for no key is left out.
    keys = {k: KEYS.get(k, {"tests": [], "mutant": None}) for k in code}
    if args.markdown:
        print("\n".join(markdown(keys)))
    else:
        untested = [k for k, e in keys.items() if not e["tests"]]
        print(f"no test observes these {len(untested)} keys:\n  " + "\n  ".join(untested))
        print(summary(keys))
    stale = sorted(set(code) ^ set(KEYS))
    if stale:
        print(f"KEYS is out of step with the code (see --audit): {', '.join(stale)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
