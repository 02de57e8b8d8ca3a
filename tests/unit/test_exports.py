"""Each package's door (trio's ``_tests/test_exports.py`` is the model): ``__all__`` is the
public surface that was meant, every name in it exists, no private name is in it, and
nothing of ours is public in the package without being in ``__all__``.

A change to a package's surface changes ``SURFACES`` in the same commit, on purpose.
``ttpeer.train`` has its own, older test (``test_train_exports.py``); it is checked here too,
except for the pinned set.
"""

from __future__ import annotations

import importlib
import types

import pytest

SURFACES: dict[str, set[str]] = {
    'ttpeer': {
        '__version__', 'load'
    },
    'ttpeer.proto': {
        'Aggregate', 'Apply', 'Plan', 'steps_for',
        # the outer step a round's close picks (outer_auto jobs)
        'Outer', 'close_outer', 'outer_settings', 'round_outer', 'agreement',
        # a debug log's line for an effect
        'describe_effect',
        'Broadcast', 'Cancel', 'Chain', 'DECLINE_CODES', 'Effect', 'Ended',
        'FetchState', 'JobDone', 'MAX_KEEP', 'MAX_RECORD_BYTES', 'Member', 'PRECISION_CODES', 'PeerMachine',
        'Persist', 'PrepareJob', 'ProofError', 'PublishCheckpoint', 'PublishDelta', 'RETRY_AFTER', 'Record',
        'RecordError', 'RecordSet', 'RevokeError', 'Send', 'TaskSignatureError', 'Timing', 'Token',
        'TokenError', 'Train', 'TtpeerError', 'admitted', 'cancel_of', 'canonical_chain', 'checkpoints',
        'contributions', 'covered', 'decode', 'default_sizing', 'encode', 'failed_here', 'job_ended', 'joined_after',
        'lost_joins', 'acknowledged', 'provisional', 'used_by', 'Admit',
        'make_token', 'may_cancel', 'member_variants', 'members', 'open_task', 'overlapped',
        'parse', 'parse_token', 'pool_id_of', 'public_hex', 'revocation_keep', 'revocations',
        'select_cover', 'sign', 'sign_task', 'standing', 'standing_declines', 'train_base', 'verify_proof',
        'verify_revocation', 'token_used_message',
        # typed reports of the executor's outcomes, and the job record read once, and its mode
        'Mode', 'FUSED', 'ENSEMBLE', 'mode_named',
        'Aggregated', 'Applied', 'CheckpointPublished', 'Declined', 'DeltaEncoded', 'DeltaPublished', 'Failed',
        'Fetched', 'Holds', 'JobFailed', 'JobSpec', 'Prepared', 'Progress', 'Report', 'StateLost', 'Trained',
        'WorkLost',
        # aggregation slices: the effects (a round's slices, or its whole deltas, fetched
        # ahead), its reports, the plan's cut (the executor's slices), when slices are used,
        # whether they save enough and how often a slice is checked (advise's model; from how
        # many authors: status), and whether a peer's link was judged slow (status); what the
        # gossip carried, by kind (status)
        'CHECK_ONE_IN', 'GOSSIP_TRAFFIC',
        'FetchDeltas', 'FetchSlices', 'ReduceSlice', 'SLICES_FROM', 'SliceReduced', 'SliceRefused', 'slice_chunks',
        'pays', 'sliced', 'slow_link_of',
        # the key ring's decisions (who gets the pool key, who is told it ended)
        'AcceptKeys', 'EXPIRY_GRACE', 'EndMembership', 'HandKeys', 'KeyRing', 'Refuse', 'RejectKeys', 'Renamed',
        'Rotate', 'TellEnded',
        # datasets: which records stand, what a name means
        'DatasetMissing', 'dataset_sources', 'direct_routes', 'live_datasets', 'may_remove_dataset', 'resolve_dataset',
        # the pool's relays: which root record counts
        'pool_relays', 'relay_pairs',
    },
    'ttpeer.net': {
        'BlobCorrupt', 'BlobMissing', 'ErrorCode', 'Faults', 'MemoryRelay', 'MemoryTransport', 'Message', 'NetError',
        'MultiRelay', 'RelayClient', 'RelayFingerprintMismatch', 'RelayLimit', 'RelayRejected', 'RelayUnavailable',
        'Transport', 'fetch_certificate', 'fingerprint', 'fingerprint_of', 'login_message',
        'pinned_ssl_context',
        # what a node drives: the pool's relays as one transport
        'PoolTransport',
    },
    'ttpeer.daemon': {
        'DataStore', 'DeltaRef', 'Deltas', 'Executor', 'Home', 'Node', 'PoolConfig', 'ask', 'call', 'delta_bytes',
        'new_invite', 'run_daemon'
    },
    'ttpeer.tasks': {
        'LoRA', 'hf_causal_lm'
    },
    'ttpeer.testing': {
        'FakeDisk', 'FakeExecutor', 'HostileRelay', 'Hostility', 'SimPeer', 'Simulation', 'deterministic'
    },
    'ttpeer.errors': {
        'DaemonNotRunning', 'DataError', 'DiskError', 'HomeError', 'JobError', 'LocalWorkLost', 'MembershipEnded',
        'ProofError', 'RecordError', 'StateMissing', 'TaskFailed', 'TokenError', 'TtpeerError', 'UsageError'
    },
    'ttpeer_relay': {
        'RelayConfig', 'RelayRunning', 'main', 'serve'
    },
    'ttpeer_harness': {
        'Cluster', 'READY_TIMEOUT', 'job_spec', 'make_pool', 'status', 'stop_processes',
        'temporary_cluster', 'ttpeer', 'wait_for',
        # the secrets a home holds, which no log may contain (the security tests, the fault campaign)
        'secrets_of',
    },
}
# Public modules of a package that are its surface too (ttpeer's layers and commands; the
# relay: one concern per module).
PUBLIC_MODULES = {"ttpeer": {"proto", "net", "daemon", "train", "tasks", "testing", "errors", "config", "cli", "demo"},
                  # the control socket's requests and replies; the rooms, whose modules are all
                  # _private (tests/unit/test_architecture.py, ROOMS)
                  "ttpeer.daemon": {"control", "data", "node", "sealed", "service", "worker"},
                  "ttpeer_relay": {"app", "asgi", "auth", "blobs", "cli", "config", "mailbox", "ratelimit", "tls"},
                  "ttpeer_harness": {"netlab", "clidoc", "delayfwd"}}  # run as python -m
PACKAGES = [*SURFACES, "ttpeer.train"]


@pytest.mark.parametrize("name", sorted(SURFACES))
def test_all_is_the_intended_surface(name: str) -> None:
    assert set(importlib.import_module(name).__all__) == SURFACES[name]


@pytest.mark.parametrize("name", PACKAGES)
def test_every_name_in_all_exists_and_none_is_private(name: str) -> None:
    module = importlib.import_module(name)
    assert len(module.__all__) == len(set(module.__all__)), "a name listed twice"
    for public in module.__all__:
        assert public == "__version__" or not public.startswith("_"), public
        assert getattr(module, public) is not None  # the lazy doors (daemon, net) import it here


@pytest.mark.parametrize("name", PACKAGES)
def test_nothing_of_ours_is_public_outside_all(name: str) -> None:
    module = importlib.import_module(name)
    top = name.split(".")[0]
    leaked = []
    for attr, value in vars(module).items():
        if attr.startswith("_") or attr in module.__all__:
            continue
        if isinstance(value, types.ModuleType):
            mine = value.__name__.startswith(top)
            if mine and attr not in PUBLIC_MODULES.get(name, set()):
                leaked.append(attr)  # a public-named submodule: make it _private or list it
        elif getattr(value, "__module__", "").split(".")[0] == top:
            leaked.append(attr)  # a function or class of ours, reachable but not exported
    assert leaked == []
