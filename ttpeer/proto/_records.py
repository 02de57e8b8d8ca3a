"""Records moved to ``ttpeer_wire`` (the wire contract the relay shares); this name stays
so that ``from ._records import ...`` in proto's modules keeps working while ``_peer``
is being split. New code imports ``ttpeer_wire`` (or ``ttpeer.proto``)."""

from ttpeer_wire import MAX_KEEP, MAX_RECORD_BYTES, PRECISION_CODES, Record, parse, pool_id_of, public_hex, sign

__all__ = ["MAX_KEEP", "MAX_RECORD_BYTES", "PRECISION_CODES", "Record", "parse", "pool_id_of", "public_hex", "sign"]
