"""The pool's key epochs and what is sealed with them.

``PoolKeys`` (``_keys``: seal with the newest epoch, open with any, rotate; the
envelopes), ``Blobs`` (``_blobs``: sealed blobs on the relays and the work files they
pass through) and ``OwnCopies`` (``_owncopies``: what this peer uploaded, kept so it is
not downloaded back). Below ``data`` and ``node``, which both seal and open blobs.
"""
