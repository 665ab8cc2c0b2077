"""An EC2 job's log lines, read from ``{prefix}/logs/<host>/`` in the ``logformat`` format.

Each node uploads its log folder and its own log (``bootstrap.log``: the bootstrap's lines and
the node agent's, every worker line echoed by the agent) every 30 s while it runs and once more
at the end. ``dtrain logs`` reads the nodes' own logs: the agent stamps its lines with their
time (``logformat.STAMP_ENV``), so the hosts' lines are merged in the order they were written.
A rank's log objects (``rank-<r>.stdout.log``, ``rank-<r>.stderr.log``, ``.attempt-<n>`` for
restarts) hold the same worker lines raw, for whoever downloads them.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from dtrain.core import logformat
from dtrain.core import s3 as s3_uri
from dtrain.launcher.ec2 import layout


@dataclass(frozen=True)
class LogObject:
    key: str
    size: int
    host: str
    rank: int | None  # None: the bootstrap's or the agent's log


def log_objects(s3: Any, prefix: str, *, host: str | None = None) -> list[LogObject]:
    """The job's ``.log`` objects, by host and name; only ``host``'s if given."""
    folder = layout.logs_folder(prefix)
    bucket, root = s3_uri.split(folder)
    found = []
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=f"{root}/"):
        for item in page.get("Contents", []):
            node, _, name = item["Key"][len(root):].lstrip("/").partition("/")
            if not name.endswith(".log") or host not in (None, node):
                continue
            found.append(LogObject(item["Key"], item["Size"], node,
                                   logformat.rank_of_log_file(name)))
    return sorted(found, key=lambda o: o.key)


def new_lines(s3: Any, prefix: str, seen: dict[str, int], *, host: str | None,
              rank: int | None, final: bool) -> Iterator[str]:
    """Lines added to the nodes' own logs since the last call (``seen``: bytes read of each),
    every host's in time order; only ``host``'s / ``rank``'s if given.

    A line still being written (no newline yet) waits for the next call, unless ``final``.
    """
    bucket, _ = s3_uri.split(prefix)
    new: dict[str, list[str]] = {}
    for obj in log_objects(s3, prefix, host=host):
        start = seen.get(obj.key, 0)
        if obj.rank is not None or obj.size <= start:
            continue
        body = s3.get_object(Bucket=bucket, Key=obj.key, Range=f"bytes={start}-")["Body"].read()
        end = len(body) if final else body.rfind(b"\n") + 1
        seen[obj.key] = start + end
        new.setdefault(obj.host, []).extend(body[:end].decode(errors="replace").splitlines())
    for node, raw in logformat.merge_by_time(new):
        line = logformat.as_line(node, raw)
        if rank is None or logformat.rank_of(line) == rank:
            yield line
