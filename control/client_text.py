"""What a client may read of the serving side's reasons: worker addresses are the operator's, not
the client's. Reasons are built for logs, where addresses help (`worker at 10.0.0.7:50061
failed: ...`); before one reaches a client (an admission message, a request's error) each known
worker address becomes the worker's name, and any other host:port left in it is withheld."""
from __future__ import annotations

import re
from collections.abc import Mapping

# IPv4[:port] and [IPv6][:port] (two colons at least: "[abc]" in a regex error is no address);
# names of other hosts are replaced only when they are known workers.
_ADDRESS = re.compile(r"\b(?:\d{1,3}\.){3}\d{1,3}(?::\d+)?\b|\[[0-9A-Fa-f.%]*:[0-9A-Fa-f.%]*:[0-9A-Fa-f:.%]*\](?::\d+)?")
WITHHELD = "<internal address>"


def first_line(text: str, limit: int = 300) -> str:
    """The first line of a library's message, at most `limit` characters: parser state dumps and
    Rust backtraces (llguidance) follow it, and are not the client's to read."""
    line = text.strip().split("\n", 1)[0]
    return line if len(line) <= limit else line[:limit] + "..."


def for_client(text: str, workers: Mapping[str, str]) -> str:
    """`text` with each worker address (a key of `workers`, its name the value) replaced by the
    worker's name, and other IP addresses withheld."""
    for address, name in sorted(workers.items(), key=lambda item: -len(item[0])):  # w1:50061 before w1:5006
        text = (text.replace(f"worker {name} at {address}", f"worker {name}")
                .replace(f"worker at {address}", f"worker {name}")
                .replace(address, f"worker {name}"))
    return _ADDRESS.sub(WITHHELD, text)
