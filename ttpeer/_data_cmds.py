"""``ttpeer data add | ls | rm``: datasets the pool holds (the daemon does the work).

Client commands: they ask the running daemon over its control socket and import neither
torch nor trio. ``data add`` hands the daemon a path on this machine; the daemon, which
runs as the same user (the socket answers no one else), reads it.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

from ttpeer._status_cmds import _size

_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30}


def piece_size(text: str) -> int:
    """``--piece-size``: bytes, or a number with K, M or G (powers of 1024)."""
    m = re.fullmatch(r"\s*(\d+)\s*([kmg]?)(?:i?b)?\s*", text.lower())
    if m is None:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 64M, 256K or 65536)")
    return int(m[1]) * _UNITS[m[2]]


def sample_format(text: str) -> str:
    """``--format``: lines, npy, tar, parquet or records:BYTES (the daemon checks the files against it)."""
    if re.fullmatch(r"lines|npy|tar|parquet|records:[1-9]\d*", text) is None:
        raise argparse.ArgumentTypeError(f"not a format: {text!r} (use lines, npy, tar, parquet or records:BYTES, "
                                         "e.g. records:2050 for blocks of 1025 uint16 tokens)")
    return text


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    data = sub.add_parser("data", parents=[common], help="datasets the pool's peers fetch: add, ls, rm")
    act = data.add_subparsers(dest="data_command", metavar="ACTION", required=True)
    a = act.add_parser("add", parents=[common], help="cut a file or folder into pieces and publish it to the pool")
    a.add_argument("path", type=Path, help="a file, or a folder (its files; hidden ones skipped)")
    # dest: not ``name``, which the settings read as this machine's name (``ttpeer.config``)
    a.add_argument("--name", dest="dataset_name", default=None,
                   help="the name tasks ask for (dataset_path(NAME)); default: the path's base name")
    a.add_argument("--piece-size", type=piece_size, default=None,
                   help="bytes per piece (default: about 1/256 of the data, a power of two from 1M to 64M, "
                        "larger when the data needs it to fit one record; as small as 4K, for tests). "
                        "Smaller pieces fetch closer to a peer's share; each costs a request")
    a.add_argument("--format", dest="sample_format", type=sample_format, default=None,
                   help="index the samples, so tasks read them with dataset_samples(NAME) and each peer "
                        "fetches only the pieces of the shards it trains: lines (a sample per line: text, "
                        "JSON lines), npy (the rows of .npy arrays), tar (tar shards: the members "
                        "sharing a key, as webdataset writes them), parquet (a row each, as a dict; needs "
                        "pyarrow) or records:BYTES (fixed-size binary samples); default: files only, read "
                        "whole with dataset_path(NAME)")
    a.add_argument("--url", dest="urls", action="append", default=None, metavar="URL",
                   help="an https address that serves the files too, each at URL/<its path> (a web server, "
                        "an S3/R2/GCS bucket's https prefix); peers fetch there first. Up to 4")
    a.add_argument("--no-relay", action="store_true",
                   help="with --url: upload no piece to the relay now (one a peer cannot get from the urls "
                        "is uploaded when it asks)")
    ls = act.add_parser("ls", parents=[common], help="the pool's datasets, and what this peer holds")
    ls.add_argument("--json", action="store_true", help="one JSON object")
    rm = act.add_parser("rm", parents=[common], help="remove this peer's copy of a dataset")
    rm.add_argument("dataset", help="its name or id (or an id prefix of 6+ characters)")
    rm.add_argument("--withdraw", action="store_true",
                    help="also withdraw its record, so no new job can use it (its author or the admin)")


def run(args: argparse.Namespace, home: Any) -> int:
    from ttpeer._commands import ask_daemon
    from ttpeer.daemon import control

    if args.data_command == "add":
        request = control.DataAdd(str(args.path.expanduser().absolute()), args.dataset_name, args.piece_size,
                                  args.sample_format, args.urls, relay=not args.no_relay)
        added = ask_daemon(home, request, timeout=24 * 3600)
        what = "added" if added.new else "already added"
        indexed = f", {added.samples} samples as {added.format}" if added.format else ""
        print(f"{what} dataset {added.name}: {added.files} files, {_size(added.bytes)}, {added.pieces} pieces{indexed}")
        print(f"id {added.id}")
        for url in added.urls:
            print(f"served by {url}")
        return 0
    if args.data_command == "ls":
        rows = ask_daemon(home, control.DataList()).datasets
        if args.json:
            print(json.dumps({"datasets": rows}, indent=2))
            return 0
        if not rows:
            print("no datasets (add one with 'ttpeer data add PATH --name NAME')")
        for r in rows:
            refused = f", {r['bad_pieces']} refused" if r["bad_pieces"] else ""
            refused = (f", {_size(r['url_bytes'])} of it from urls" if r.get("url_bytes") else "") + refused
            refused = (f", {_size(r['direct_bytes'])} of it from members directly" if r.get("direct_bytes")
                       else "") + refused
            print(f"{r['name']:<20} {r['id'][:12]}  {_size(r['bytes']):>9}  {r['pieces']:>5} pieces  "
                  f"here: {r['here']} ({r['pieces_here']}/{r['pieces']}, fetched {_size(r['fetched_bytes'])}"
                  f"{refused})")
        return 0
    removed = ask_daemon(home, control.DataRemove(args.dataset, args.withdraw))
    print(f"removed this peer's copy of {removed.id[:12]}" if removed.removed
          else f"this peer held no copy of {removed.id[:12]}")
    for rec in removed.withdrawn:
        print(f"withdrew record {rec}")
    return 0

