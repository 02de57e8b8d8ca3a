"""``Node`` and what it drives: one trio nursery that executes a ``PeerMachine``'s effects.

The node (``_node``) and its parts: the effects (``_effects``), what it is doing
(``_activity``), slices and a task's data (``_slices``, ``_taskdata``), the relay link
and the pool's relays (``_link``, ``_relays``), membership and admin actions
(``_membership``, ``_admin``), the record log and replay counters (``_recordlog``,
``_replay``) and the status snapshot (``_status``). Imports ``sealed``, ``data`` and the
floor; never ``worker`` (it is handed an ``Executor``) nor ``service``.
"""
