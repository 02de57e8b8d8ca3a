"""Worker processes, and the torch executor they run.

The daemon side (no torch): ``ProcessExecutor`` (``_procexec``), its ``WorkerPool``
(``_workerpool``), one worker and its channel (``_workerproc``, ``_channel``), the
messages (``_workermsg``) and the failure table (``_failures``). The process side:
``python -m ttpeer.daemon.worker._worker`` runs ``TorchExecutor`` (``_torch``), which
hands a job to its mode (``_fused`` with ``_overlap``, or ``_ensemble``) and keeps its
states in ``JobStates`` (``_jobstates``). Imports ``data`` (``DataStore``) and the floor;
never ``node``: the node drives any ``Executor``.
"""
