"""Datasets that reach the peers: ``data add``, ``ls``, ``rm``, and a job's pieces.

``Datasets`` (``_data``) composes the parts: the cache on disk (``_datastore``:
``DataStore``, which the torch executor reads too), reading what is added
(``_dataread``, ``_datasamples``), fetching (``_datafetch``) from the sources
(``_datasources``: members directly over the LAN shortcut, ``_direct``; the record's
urls, ``_urlsource``; the relays), and holding (``_dataholder``). Imports ``sealed``
and the floor only; the node hands ``Datasets`` what its parts use when it builds it.
"""
