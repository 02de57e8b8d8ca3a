"""Default shard count and lease from the speeds peers publish.

Shards: enough that the slowest peer can take at least one and the fastest never
waits for work: twice the pool's total speed in units of the slowest peer (a 3x
slower machine among two fast ones gives 14), at least two per peer.
Lease: twice the time the slowest peer needs for one shard, so a live straggler is
never taken for dead, between 15 s and 5 min. Renewals go out every third of a
lease, so a paused or dead peer is noticed within one lease.
"""

from __future__ import annotations

import math

MIN_LEASE, MAX_LEASE = 15.0, 300.0
MAX_SHARDS = 4096
FALLBACK_LEASE = 30.0


def default_sizing(rates: list[float], peers: int, inner_steps: int) -> tuple[int, float]:
    """(shards per round, lease seconds) for ``peers`` members whose known speeds
    (inner steps a second; peers that never trained are missing) are ``rates``, in a job of
    ``inner_steps`` a shard."""
    known = [r for r in rates if r > 0]
    peers = max(1, peers)
    if not known:
        return max(4, 2 * peers), FALLBACK_LEASE
    slowest = min(known)
    # Peers without a measurement count as the median known speed.
    speeds = known + [sorted(known)[len(known) // 2]] * max(0, peers - len(known))
    shards = max(2 * peers, math.ceil(2 * sum(speeds) / slowest))
    lease = min(MAX_LEASE, max(MIN_LEASE, 2 * inner_steps / slowest))
    return min(shards, MAX_SHARDS), round(lease, 1)
