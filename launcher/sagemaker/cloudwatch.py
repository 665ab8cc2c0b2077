"""Read a job's CloudWatch Logs: every host's stream, merged by time, optionally followed.

SageMaker writes ``/aws/sagemaker/TrainingJobs`` streams named ``<job>/algo-<N>-<epoch>``.
Lines come out in ``dtrain.core.logformat``'s one format, as on every target: a worker's line
keeps the ``[<host> <rank>]:`` prefix the node agent gave it (what the ``rank`` filter matches),
any other line gets ``[<host>] ``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from dtrain.core import logformat

SAGEMAKER_LOG_GROUP = "/aws/sagemaker/TrainingJobs"
# Empty GetLogEvents pages in a row after which a read stops until the next poll.
MAX_EMPTY_PAGES = 20


@dataclass
class _StreamCursor:
    name: str
    token: str | None = None
    seen_first_page: bool = False


@dataclass
class LogFilter:
    host: str | None = None  # "algo-1"
    rank: int | None = None

    def stream_matches(self, stream: str, job: str) -> bool:
        if self.host is None:
            return True
        rest = stream[len(job) + 1:]
        return rest == self.host or rest.startswith(self.host + "-")

    def line_matches(self, line: str) -> bool:
        return self.rank is None or logformat.rank_of(line) == self.rank


@dataclass
class LogReader:
    """Polls the streams of one job. ``done`` says when following may stop (job finished)."""

    client: Any
    job_name: str
    log_group: str = SAGEMAKER_LOG_GROUP
    filter: LogFilter = field(default_factory=LogFilter)
    poll_s: float = 5.0
    sleep: Callable[[float], None] = time.sleep
    _cursors: dict[str, _StreamCursor] = field(default_factory=dict)

    def _discover(self) -> None:
        prefix = self.job_name + "/"
        try:
            pages = self.client.get_paginator("describe_log_streams").paginate(
                logGroupName=self.log_group, logStreamNamePrefix=prefix)
            for page in pages:
                for stream in page.get("logStreams", []):
                    name = stream["logStreamName"]
                    wanted = self.filter.stream_matches(name, self.job_name)
                    if wanted and name not in self._cursors:
                        self._cursors[name] = _StreamCursor(name)
        except Exception as exc:  # the group appears only once the first host starts
            if "ResourceNotFoundException" not in type(exc).__name__ + str(exc):
                raise

    def hosts(self) -> list[str]:
        """The hosts that have a stream (``<job>/algo-<N>-<epoch>``), in host order."""
        self._discover()
        found = {name[len(self.job_name) + 1:].rsplit("-", 1)[0] for name in self._cursors}
        return sorted(found, key=lambda host: (len(host), host))

    def _read_new(self, cursor: _StreamCursor, *,
                  to_the_end: bool) -> list[tuple[int, str, str]]:
        """The stream's events after the cursor. GetLogEvents may answer an empty page with a
        new token while more events follow: the end is the token coming back unchanged. Unless
        ``to_the_end`` (a last read), a run of empty pages is cut short for the next poll."""
        events: list[tuple[int, str, str]] = []
        empty_pages = 0
        while True:
            kwargs: dict[str, Any] = {"logGroupName": self.log_group,
                                      "logStreamName": cursor.name, "startFromHead": True}
            if cursor.token:
                kwargs["nextToken"] = cursor.token
            page = self.client.get_log_events(**kwargs)
            batch = page.get("events", [])
            events.extend((e["timestamp"], cursor.name, e["message"]) for e in batch)
            token = page.get("nextForwardToken")
            unchanged = token == cursor.token
            cursor.token = token
            empty_pages = 0 if batch else empty_pages + 1
            if unchanged or (empty_pages >= MAX_EMPTY_PAGES and not to_the_end):
                return events

    def poll(self, *, to_the_end: bool = True) -> list[str]:
        """New lines since the last call, in time order, each saying where it came from
        (``to_the_end=False``: a poll of a followed job, which the next poll goes on from)."""
        self._discover()
        events: list[tuple[int, str, str]] = []
        for cursor in self._cursors.values():
            events.extend(self._read_new(cursor, to_the_end=to_the_end))
        events.sort(key=lambda e: e[0])
        lines = (logformat.as_line(_host_of(stream, self.job_name), message.rstrip("\n"))
                 for _, stream, message in events)
        return [line for line in lines if self.filter.line_matches(line)]

    def lines(self, *, follow: bool = False,
              done: Callable[[], bool] = lambda: True) -> Iterator[str]:
        """Everything so far; with ``follow``, keep polling until ``done()`` and one last read."""
        yield from self.poll(to_the_end=not follow)
        while follow:
            finished = done()
            self.sleep(0 if finished else self.poll_s)
            yield from self.poll(to_the_end=finished)
            if finished:
                return


def _host_of(stream: str, job: str) -> str:
    rest = stream[len(job) + 1:] if stream.startswith(job + "/") else stream
    parts = rest.split("-")
    return "-".join(parts[:2]) if len(parts) >= 2 and parts[0] == "algo" else rest
