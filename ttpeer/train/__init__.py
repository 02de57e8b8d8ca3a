"""ttpeer's torch layer: tasks, the shared data schedule, local training,
compressed pseudo-gradients, the outer step, checkpoints and export; and the
ensemble members, their checkpoints and the voting bundle.

Nothing here does I/O with peers; the daemon moves the bytes these functions
produce and consume. Everything peers must agree on (schedule, decoded deltas,
outer step, state hash) is deterministic across machines.
"""

from ._adapters import LoRA, freeze_outside_state, parameter_counts, peft_module, qlora_problem
from ._bundle import export_ensemble, load_bundle, read_sidecar
from ._compress import (
    CHUNK_HEADER,
    ChunkIndex,
    chunk_pieces,
    decode_chunks,
    decode_delta,
    encode_delta,
    fp32_size,
    head_size,
    iter_delta,
    read_index,
)
from ._curve import LossCurve
from ._datasets import DatasetResolver, dataset_path, dataset_samples, held_resolver, resolving
from ._ensemble import (
    Ensemble,
    combine,
    decode_member,
    encode_member,
    init_ensemble,
    member_steps,
    train_unit,
)
from ._ensemble import evaluate as evaluate_ensemble
from ._errors import CheckpointError, DatasetMissing, DeltaError, Diverged, TaskError, TrainError
from ._export import export_model, load_model
from ._failure import describe
from ._fit import BatchFit, MemoryNeed, Misfit, fit_batch, fit_problem, memory_need, warm_up
from ._inner import InnerTrainer
from ._localdp import agreed as agreed_stop
from ._localdp import agreed_signal, average_gradients, join_group
from ._localdp import split as split_batches
from ._lr import LrSchedule, outer_lr, shard_first_step
from ._outer import OuterSum, energy, outer_step
from ._probe import data_fingerprint, probe
from ._recipe import Recipe, check_job
from ._samples import Samples, shard_batches
from ._schedule import piece_shard_indices, shard_indices
from ._select import holdout_scores, holdout_size, holdout_split, weigh_members
from ._slices import decode_slice, encode_slice, iter_mean, mean_sum, reduce_slice
from ._spec import LoadedTask, TaskSpec
from ._state import (
    OuterState,
    file_state_hash,
    init_state,
    iter_state_file,
    state_chunks,
    state_from_bytes,
    state_from_file,
    state_hash,
    state_to_bytes,
    template,
)
from ._tasks import check_model, load_task
from ._warm import warm_state

__all__ = [
    "BatchFit",
    "DatasetMissing",
    "DatasetResolver",
    "dataset_path",
    "dataset_samples",
    "held_resolver",
    "resolving",
    "CheckpointError",
    "DeltaError",
    "Diverged",
    "Ensemble",
    "InnerTrainer",
    "agreed_signal",
    "agreed_stop",
    "average_gradients",
    "join_group",
    "split_batches",
    "LoRA",
    "LoadedTask",
    "LossCurve",
    "LrSchedule",
    "outer_lr",
    "MemoryNeed",
    "Misfit",
    "OuterState",
    "Recipe",
    "TaskError",
    "TaskSpec",
    "TrainError",
    "check_job",
    "check_model",
    "combine",
    "data_fingerprint",
    "decode_delta",
    "CHUNK_HEADER",
    "ChunkIndex",
    "chunk_pieces",
    "decode_chunks",
    "head_size",
    "read_index",
    "decode_slice",
    "encode_slice",
    "iter_mean",
    "mean_sum",
    "reduce_slice",
    "iter_delta",
    "iter_state_file",
    "file_state_hash",
    "OuterSum",
    "energy",
    "decode_member",
    "describe",
    "encode_delta",
    "encode_member",
    "evaluate_ensemble",
    "export_ensemble",
    "export_model",
    "fit_batch",
    "freeze_outside_state",
    "fit_problem",
    "fp32_size",
    "init_ensemble",
    "init_state",
    "load_bundle",
    "holdout_scores",
    "holdout_size",
    "holdout_split",
    "weigh_members",
    "load_model",
    "load_task",
    "member_steps",
    "memory_need",
    "outer_step",
    "parameter_counts",
    "peft_module",
    "probe",
    "qlora_problem",
    "read_sidecar",
    "shard_first_step",
    "shard_indices",
    "piece_shard_indices",
    "Samples",
    "shard_batches",
    "state_from_bytes",
    "state_from_file",
    "state_chunks",
    "template",
    "state_hash",
    "state_to_bytes",
    "train_unit",
    "warm_state",
    "warm_up",
]
