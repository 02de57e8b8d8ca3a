"""Helpers for the service-level integration tests: reading a home's files the way an
auditor would, and a headless Chromium that says whether a page's images loaded."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ttpeer import train
from ttpeer.daemon.service._integrity import scan_log
from ttpeer.proto import parse
from ttpeer_harness import status

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def job_of(home: Path, job_id: str) -> dict[str, Any] | None:
    return next((j for j in status(home)["jobs"] if j["id"] == job_id), None)


def job_finished(homes: Iterable[Path], job_id: str) -> bool:
    """Whether every home reports the job done: status says so once the peer has written
    its final files ("finishing" before), so ``ttpeer export`` can run."""
    return all((j := job_of(h, job_id)) is not None and j["state"] == "done" for h in homes)


def audit_home(home: Path) -> dict[str, int]:
    """Check every durable file as it lies on disk: each record-log frame whole and
    verified, each state hashing to its name. Returns counts; raises AssertionError."""
    log = home / "records.log"
    scan = scan_log(log.read_bytes() if log.exists() else b"")
    assert scan.problem is None, f"{log}: {scan.problem} after {len(scan.frames)} records"
    for raw in scan.frames:
        parse(raw)  # raises if the record does not verify
    states = 0
    for path in (home / "states").glob("*/*.state"):
        got = train.state_hash(train.state_from_bytes(path.read_bytes()))
        assert got == "sha256:" + path.stem, f"{path} hashes to {got}"
        states += 1
    return {"records": len(scan.frames), "states": states}


_PROBE = """<script>window.addEventListener('load', () => {
  const r = [...document.images].map(i => ({complete: i.complete, width: i.naturalWidth,
    height: i.naturalHeight, inline: i.src.startsWith('data:image/png;base64,')}));
  const p = document.createElement('pre'); p.id = 'ttpeer-probe'; p.textContent = JSON.stringify(r);
  document.body.appendChild(p);
});</script>"""


def images_in_chromium(page: Path, scratch: Path) -> list[dict[str, Any]]:
    """Load a copy of ``page`` (plus a probe script) in headless Chromium, offline, and
    return each image's load result as the browser saw it."""
    assert CHROMIUM is not None
    scratch.mkdir(parents=True, exist_ok=True)
    probe = scratch / page.name
    probe.write_text(page.read_text().replace("</body>", _PROBE + "</body>"))
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
           "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-extensions",
           f"--user-data-dir={scratch / 'profile'}", "--virtual-time-budget=10000", "--dump-dom",
           probe.as_uri()]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=90)
    found = re.search(r'<pre id="ttpeer-probe">(.*?)</pre>', out.stdout, re.S)
    assert found, f"chromium gave no probe result ({out.returncode}): {out.stderr[-1500:]}"
    return json.loads(found.group(1).replace("&quot;", '"'))
