"""Which workers the control plane serves: named addresses from `--worker` and `--workers-file`.

A worker is known by a stable name (the `worker` label of every metric, the key a workers file
adds or removes it by) and reached at an address that may be a DNS name: a StatefulSet's
`ttserve-worker-0.ttserve-worker:50061` or a host name. The name is re-resolved on every
connection, so a worker that comes back on another IP is found again.

One entry a line: `NAME=HOST:PORT` or `HOST:PORT` (then the address is the name); `#` starts a
comment. The file is the operator's way to add and remove workers while serving: whoever may
write it may change the worker set (systemd: root, via ExecReload; Kubernetes: a ConfigMap), as
whoever may write the unit or the Deployment may change the flags.
"""
from __future__ import annotations

import asyncio
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

log = logging.getLogger(__name__)

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
_ADDRESS = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9][A-Za-z0-9.-]*):(\d{1,5})$")


class WorkerSetError(ValueError):
    """An entry that names no worker; the message quotes it and says what is allowed."""


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    name: str
    address: str


def parse_entry(text: str, where: str = "--worker") -> WorkerSpec:
    """`NAME=HOST:PORT` or `HOST:PORT`."""
    name, sep, address = text.strip().rpartition("=")
    if not sep:
        name = address
    match = _ADDRESS.match(address)
    if not match or not 0 < int(match.group(2)) < 65536:
        raise WorkerSetError(f"{where} {text.strip()!r}: expected HOST:PORT or NAME=HOST:PORT (an IPv6 "
                             "host in brackets, a port 1-65535)")
    if sep and not _NAME.match(name):
        raise WorkerSetError(f"{where} {text.strip()!r}: a worker name is 1-63 letters, digits, '.', '_' "
                             "or '-', starting with a letter or digit")
    return WorkerSpec(name, address)


def parse_file(path: Path) -> list[WorkerSpec]:
    """The workers a file lists. Raises WorkerSetError (bad entry) or OSError (unreadable)."""
    return _parse_text(path.read_text(), path)


def _parse_text(text: str, path: Path) -> list[WorkerSpec]:
    specs = []
    for number, line in enumerate(text.splitlines(), 1):
        entry = line.split("#", 1)[0].strip()
        if entry:
            specs.append(parse_entry(entry, f"{path}:{number}:"))
    return specs


def combine(specs: list[WorkerSpec]) -> tuple[WorkerSpec, ...]:
    """The worker set, each name and address once. Raises WorkerSetError naming a repeat."""
    names: dict[str, WorkerSpec] = {}
    addresses: dict[str, WorkerSpec] = {}
    for spec in specs:
        if spec.name in names and names[spec.name] != spec:
            raise WorkerSetError(f"worker name {spec.name!r} is given twice, for {names[spec.name].address} "
                                 f"and {spec.address}")
        if spec.address in addresses and addresses[spec.address] != spec:
            raise WorkerSetError(f"the worker at {spec.address} is listed twice, as "
                                 f"{addresses[spec.address].name!r} and {spec.name!r}")
        names[spec.name] = addresses[spec.address] = spec
    return tuple(names.values())


async def follow_file(path: Path, flagged: tuple[WorkerSpec, ...], current: tuple[WorkerSpec, ...],
                      apply: Callable[[tuple[WorkerSpec, ...]], None], reread: asyncio.Event,
                      poll_s: float = 2.0, settle_s: float = 0.5) -> None:
    """Apply `flagged` + the workers `path` lists whenever that differs from the set applied last
    (`current` at first), checked every `poll_s` and at once when `reread` is set (SIGHUP). An
    edit is applied only once the file reads the same twice, `settle_s` apart: an editor's
    half-written save is not a worker set. A file that cannot be read or parsed, or that would
    leave no worker at all, keeps the current set (logged)."""
    while True:
        try:
            await asyncio.wait_for(reread.wait(), timeout=poll_s)
        except asyncio.TimeoutError:
            pass
        reread.clear()
        specs = await _settled(path, flagged, settle_s)
        if specs is None or specs == current:
            continue
        if not specs:
            log.error("--workers-file %s lists no worker and no --worker is given: the worker set stays "
                      "as it is (stop the control plane to serve nothing)", path)
            continue
        log.info("--workers-file %s: %d worker(s): %s", path, len(specs),
                 ", ".join(f"{s.name}={s.address}" for s in specs))
        try:
            apply(specs)
        except Exception:  # noqa: BLE001 - a fault applying one edit must not stop following the file
            log.exception("--workers-file %s: applying the new worker set failed", path)
        current = specs


async def _settled(path: Path, flagged: tuple[WorkerSpec, ...], settle_s: float) -> tuple[WorkerSpec, ...] | None:
    """The worker set the file gives once two reads `settle_s` apart agree; None when it cannot
    be read or parsed (logged) or is still changing."""
    text = _read(path)
    if text is None:
        return None
    await asyncio.sleep(settle_s)
    if _read(path) != text:
        return None  # still being written: the next poll looks again
    try:
        return combine(list(flagged) + _parse_text(text, path))
    except WorkerSetError as e:
        log.error("--workers-file %s: %s; the worker set stays as it is", path, e)
        return None


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError as e:
        log.error("--workers-file %s: cannot read it (%s); the worker set stays as it is", path,
                  e.strerror or e)
        return None
