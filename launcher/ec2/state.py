"""What the job store keeps of an EC2 job (``Ec2State``, the record's ``target_data``).

``submit`` records the launch first (its token, prefix, region and the launching process), then
the nodes and groups once every node is launched; ``status`` adds what it sees and, once the job
ended, what became of the groups dtrain created for it (``Cleanup``); ``stop`` when it was asked.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from dtrain.launcher.base import Handle, TargetState

STOP_REASON = "stopped by user (dtrain stop)"
# Cleanup.state values
PENDING = "pending"  # `status` tries again on its next call
DONE = "done"
LEFT_FOR_GC = "left-for-gc"  # given up on: `dtrain ec2 gc` removes it


@dataclass(frozen=True)
class Cleanup:
    """The removal of what dtrain created for an ended job: its groups, and the nodes that
    still ran when it ended."""

    state: str
    removed: list[str] = field(default_factory=list)
    left: list[str] = field(default_factory=list)
    reason: str | None = None
    nodes_left: int = 0  # nodes of the launch not terminated yet: no group was tried
    spared: list[str] = field(default_factory=list)  # a failed job's peers left to upload
    spared_until: float | None = None  # when those are terminated (epoch seconds)
    first_try_at: float | None = None  # the retries stop CLEANUP_RETRY_S after this
    tries: int = 0

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Cleanup:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Ec2State(TargetState):
    """The record's ``target_data`` of an EC2 job."""

    region: str | None = None  # the job's: status, logs and stop ask there
    prefix: str | None = None  # {output_path}/{job}: source, status, logs, model
    launch_token: str | None = None  # the dtrain:launch tag of everything this launch made
    launched_at: str | None = None  # the dtrain:launched-at tag
    num_nodes: int | None = None
    instance_ids: list[str] = field(default_factory=list)  # recorded once all were launched
    subnet_id: str | None = None
    security_group_id: str | None = None
    placement_group: str | None = None
    created_placement_group: bool = False  # False: the user's ec2.placement_group
    uploads: list[str] = field(default_factory=list)
    instances: dict[str, str] = field(default_factory=dict)  # instance id -> EC2 state
    model_data: str | None = None
    stop_requested_at: float | None = None  # when `dtrain stop` was asked
    cleanup: Cleanup | None = None  # None: not ended yet (or recorded by an older dtrain)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> Ec2State:
        state = super().from_dict(data)
        if isinstance(state.cleanup, dict):
            state = dataclasses.replace(state, cleanup=Cleanup.from_dict(state.cleanup))
        return state

    @classmethod
    def changes(cls, **values: Any) -> dict[str, Any]:
        """As ``TargetState.changes``, with a ``Cleanup`` as the JSON the store keeps."""
        if isinstance(values.get("cleanup"), Cleanup):
            values["cleanup"] = values["cleanup"].to_dict()
        return super().changes(**values)

    @property
    def launched(self) -> bool:
        """True once ``submit`` launched every node (it records their ids last)."""
        return bool(self.instance_ids)

    @property
    def cleanup_pending(self) -> bool:
        """True until the groups of an ended job are removed or left to `dtrain ec2 gc`.

        A launched record without a ``cleanup`` entry (written before dtrain removed the groups
        of ended jobs) gets one try too; one without a launch token never created anything.
        """
        if self.cleanup is None:
            return self.launch_token is not None
        return self.cleanup.state == PENDING


def state_of(handle: Handle) -> Ec2State:
    """The handle's state, typed (the jobs layer builds it with ``Ec2Launcher.state_type``)."""
    assert isinstance(handle.state, Ec2State), type(handle.state)
    return handle.state


def stop_requested(handle: Handle) -> bool:
    """True once `dtrain stop` was run on the job (not an interruption's Stopping)."""
    return bool(state_of(handle).stop_requested_at or handle.failure_reason == STOP_REASON)


def retry_hint(handle: Handle) -> str:
    return f"`dtrain status {handle.job.id}` tries again, or run `dtrain ec2 gc`"


def join_names(names: list[str]) -> str:
    """Names as one phrase: "a", "a and b", "a, b and c"."""
    return " and ".join(filter(None, [", ".join(names[:-1]), *names[-1:]]))


def utc_time(epoch_s: float) -> str:
    return datetime.fromtimestamp(epoch_s, timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
