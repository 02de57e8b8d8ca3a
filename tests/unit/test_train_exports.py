"""The public surface of ttpeer.train is exactly what was meant."""

import ttpeer.train

EXPECTED = {
    "CheckpointError", "DeltaError", "InnerTrainer", "LoadedTask", "MemoryNeed", "Misfit",
    "OuterState", "TaskError", "TaskSpec", "TrainError", "decode_delta", "encode_delta",
    "export_model", "fit_problem", "fp32_size", "init_state", "load_model", "load_task", "memory_need",
    "outer_step", "shard_indices", "state_from_bytes", "state_hash", "state_to_bytes",
    "Ensemble", "combine", "decode_member", "encode_member", "evaluate_ensemble", "export_ensemble",
    "init_ensemble", "load_bundle", "member_steps", "read_sidecar", "train_unit", "warm_up",
    "agreed_signal", "agreed_stop", "average_gradients", "join_group", "split_batches",
    "holdout_scores", "holdout_size", "holdout_split", "weigh_members",
    "BatchFit", "LrSchedule", "Recipe", "check_job", "fit_batch", "outer_lr", "shard_first_step", "warm_state",
    "Diverged", "data_fingerprint", "describe", "probe", "LossCurve",
    "OuterSum", "energy", "iter_delta", "state_chunks", "state_from_file", "template", "file_state_hash",
    "iter_state_file",
    "DatasetMissing", "DatasetResolver", "dataset_path", "held_resolver", "resolving",
    "dataset_samples", "Samples", "piece_shard_indices", "shard_batches",
    "CHUNK_HEADER", "ChunkIndex", "chunk_pieces", "decode_chunks", "head_size", "read_index",
    "decode_slice", "encode_slice", "iter_mean", "mean_sum", "reduce_slice",
    # adapters over a frozen base (LoRA, peft), and the counts submit prints
    "LoRA", "check_model", "freeze_outside_state", "parameter_counts", "peft_module", "qlora_problem",
}


def test_all_is_the_intended_surface():
    assert set(ttpeer.train.__all__) == EXPECTED
    for name in EXPECTED:
        assert getattr(ttpeer.train, name) is not None


def test_errors_share_one_base():
    for name in ("TaskError", "DeltaError", "CheckpointError", "Diverged"):
        assert issubclass(getattr(ttpeer.train, name), ttpeer.train.TrainError)


def test_train_errors_are_ttpeer_errors():
    # The command line and the daemon handle TtpeerError: a TrainError must be one.
    from ttpeer.errors import TtpeerError

    assert issubclass(ttpeer.train.TrainError, TtpeerError)
