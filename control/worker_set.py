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


async def follow_file(path: Path, flagged: tuple[WorkerSpec, ...],
                      apply: Callable[[tuple[WorkerSpec, ...]], None], reread: asyncio.Event,
                      poll_s: float = 2.0) -> None:
    """Apply `flagged` + the workers `path` lists whenever its content changes (checked every
    `poll_s`, and at once when `reread` is set: SIGHUP). A file that cannot be read or parsed
    keeps the current set (logged): a half-written edit must not drop every worker."""
    last = _read(path)
    while True:
        try:
            await asyncio.wait_for(reread.wait(), timeout=poll_s)
        except asyncio.TimeoutError:
            pass
        forced, _ = reread.is_set(), reread.clear()
        text = _read(path)
        if text is None or (text == last and not forced):
            continue
        try:
            specs = combine(list(flagged) + _parse_text(text, path))
        except WorkerSetError as e:
            log.error("--workers-file %s: %s; the worker set stays as it is", path, e)
            continue
        last = text
        log.info("--workers-file %s: %d worker(s): %s", path, len(specs),
                 ", ".join(f"{s.name}={s.address}" for s in specs) or "none")
        apply(specs)


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError as e:
        log.error("--workers-file %s: cannot read it (%s); the worker set stays as it is", path,
                  e.strerror or e)
        return None
