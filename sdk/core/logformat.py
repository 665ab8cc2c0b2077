"""The one log-line format on every target (stdlib only).

A worker's line is ``[<host> <rank>]:<text>`` (the node agent has torch elastic put that
prefix on each line); a line of the node agent or of the target's own machinery is
``[<host>] <text>``. ``dtrain logs`` prints them so on every target, and ``--host``/``--rank``
filter on them.
"""

from __future__ import annotations

import re

_RANK_LINE = re.compile(r"^\[(\S+) (\d+)\]:")
# A node agent asked to (STAMP_ENV) writes each line of its output as "@<epoch seconds> <line>":
# `dtrain logs` merges the hosts' lines in time order by it, and prints them without it.
STAMP_ENV = "DTRAIN_STAMP_LOGS"
_STAMP = re.compile(r"^@(\d+\.\d+) ")
# A rank's own log files in the contract's output/logs, as the node agent names them:
# rank-<r>.stdout.log, rank-<r>.stderr.log, rank-<r>.attempt-<n>.stdout.log after a restart.
_RANK_LOG_FILE = re.compile(r"^rank-(\d+)\.(?:.+\.)?log$")


def rank_prefix_template(host: str) -> str:
    """torch elastic's ``log_line_prefix_template`` for this host (it fills in ``${rank}``)."""
    return f"[{host} ${{rank}}]:"


def rank_line(host: str, rank: int, text: str) -> str:
    return f"[{host} {rank}]:{text}"


def host_line(host: str, text: str) -> str:
    return f"[{host}] {text}"


def rank_of(line: str) -> int | None:
    """The global rank a worker's line came from; None for other lines."""
    match = _RANK_LINE.match(line)
    return int(match.group(2)) if match else None


def stamp(when: float) -> str:
    return f"@{when:.3f} "


def unstamp(raw: str) -> tuple[float | None, str]:
    """``(time, line)`` of a stamped line; ``(None, raw)`` of another."""
    match = _STAMP.match(raw)
    return (float(match.group(1)), raw[match.end():]) if match else (None, raw)


def merge_by_time(per_host: dict[str, list[str]]) -> list[tuple[str, str]]:
    """``(host, line)`` of every host's new raw lines in time order, stamps removed. A line
    without a stamp keeps the time of the line before it on its host (a multi-line message)."""
    timed = []
    for host, lines in per_host.items():
        last = 0.0
        for index, raw in enumerate(lines):
            when, line = unstamp(raw)
            last = last if when is None else when
            timed.append((last, host, index, line))
    return [(host, line) for _when, host, _index, line in sorted(timed)]


def rank_of_log_file(name: str) -> int | None:
    """The rank whose log file ``name`` is (``rank-3.stderr.log`` -> 3); None for other files."""
    match = _RANK_LOG_FILE.match(name)
    return int(match.group(1)) if match else None


def as_line(host: str, raw: str) -> str:
    """A raw line read from ``host``'s agent output: kept when it is a worker's, else given
    the host prefix."""
    return raw if _RANK_LINE.match(raw) else host_line(host, raw)
