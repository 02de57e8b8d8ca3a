"""Running as a service and talking to the user; the top room, which wires the others.

Start-up and stop (``_run``: a ``Node`` with a ``ProcessExecutor``), the start-up check
(``_integrity``), the control socket and its client (``_control``, ``_client``),
systemd (``_systemd``, ``_units``), what the service adds to status and how it is
shown (``_status_more``, ``_views``, ``_usage``, ``_metrics``, ``_board``). Kept free of
imports here: a client command imports ``_client`` alone, without trio or torch.
"""
