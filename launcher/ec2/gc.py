"""What `dtrain ec2 gc` removes: dtrain-tagged resources that no running job uses.

Resources are grouped by launch (their ``dtrain:launch`` tag); ``find_leftovers`` decides launch
by launch from what the caller's job records say (ended, still running, or unknown here) and,
for a launch without a record, from its age, its node count and its nodes' own reports.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from dtrain.core.states import FINAL_STATUSES
from dtrain.launcher.ec2 import resources as res
from dtrain.launcher.ec2 import tags
from dtrain.launcher.ec2.nodes import job_state, peer_grace, read_status_objects


@dataclass
class Launch:
    """One submission's dtrain-tagged resources, grouped by their ``dtrain:launch`` tag."""

    token: str
    instances: list[dict[str, Any]] = field(default_factory=list)
    security_groups: list[dict[str, Any]] = field(default_factory=list)
    placement_groups: list[dict[str, Any]] = field(default_factory=list)

    @property
    def live(self) -> list[dict[str, Any]]:
        return [i for i in self.instances if i["State"]["Name"] in res.LIVE_STATES]

    @property
    def num_nodes(self) -> int:
        found = tags.tag_map(self.instances[0]) if self.instances else {}
        return int(found.get(tags.TAG_NUM_NODES, len(self.instances)))

    def started(self) -> datetime | None:
        """Its ``dtrain:launched-at`` tag, else its first node's launch time (older dtrain)."""
        for resource in (*self.instances, *self.security_groups, *self.placement_groups):
            value = tags.tag_map(resource).get(tags.TAG_LAUNCHED_AT)
            if value:
                return datetime.strptime(value, tags.LAUNCHED_AT_FORMAT).replace(
                    tzinfo=timezone.utc)
        times = [i["LaunchTime"] for i in self.instances if i.get("LaunchTime")]
        return min(times) if times else None

    def everything(self) -> res.Created:
        return res.Created(job=self.token, instances=[i["InstanceId"] for i in self.live],
                           security_groups=[g["GroupId"] for g in self.security_groups],
                           placement_groups=[g["GroupName"] for g in self.placement_groups])


def find_launches(ec2: Any) -> dict[str, Launch]:
    """Every launch that has a dtrain-tagged instance (EC2 lists terminated ones for about an
    hour), security group or placement group; nothing untagged is ever listed."""
    launches: dict[str, Launch] = {}

    def launch(resource: dict[str, Any]) -> Launch:
        token = tags.tag_map(resource).get(tags.TAG_LAUNCH, "")
        return launches.setdefault(token, Launch(token=token))

    for instance in res.job_instances(ec2, None):
        launch(instance).instances.append(instance)
    for group in res.job_security_groups(ec2, None):
        launch(group).security_groups.append(group)
    for group in res.job_placement_groups(ec2, None):
        launch(group).placement_groups.append(group)
    return launches


@dataclass
class Leftovers:
    """What `dtrain ec2 gc` removes, and what it keeps only because it is too recent."""

    remove: res.Created = field(default_factory=lambda: res.Created(job="*"))
    too_recent: list[str] = field(default_factory=list)
    # of failed jobs whose unreported peers may still upload checkpoints; kept until then
    finishing: list[str] = field(default_factory=list)
    finishing_until: float | None = None

    def add(self, found: res.Created) -> None:
        self.remove.instances += found.instances
        self.remove.security_groups += found.security_groups
        self.remove.placement_groups += found.placement_groups


def find_leftovers(launches: dict[str, Launch], *, now: datetime, s3: Any = None,
                   ended: Collection[str] = (), running: Collection[str] = (),
                   min_age_s: float = 0.0, include_running: bool = False) -> Leftovers:
    """The launches' resources that no running job uses, launch by launch.

    ``ended``/``running``: launch tokens whose job record says the job ended / still runs. An
    ended job's live nodes and groups all go; a running job's stay. A launch without a record
    is left alone while younger than ``min_age_s`` (it may still be launching: its groups exist
    before its nodes); after that its groups go once no node of it is live, and its nodes too
    when fewer than its ``dtrain:num-nodes`` were ever launched (a launcher killed mid-way) or
    its nodes' status objects (read with ``s3``) say the job ended. Either way, while a node
    reported a failure and a peer that has not reported still runs (``peer_grace``), the launch
    is kept whole in ``finishing``: that peer may still upload its checkpoints, and its groups
    are in use. ``include_running``: all.
    """
    found = Leftovers()
    for token, launch in launches.items():
        started = launch.started()
        everything = launch.everything()
        names = [*everything.instances, *everything.security_groups, *everything.placement_groups]
        if include_running:
            found.add(everything)
        elif token in running:
            continue
        elif (token not in ended and started is not None
              and (now - started).total_seconds() < min_age_s):
            found.too_recent += names
        elif token in ended or not launch.live or len(launch.instances) < launch.num_nodes or (
                s3 is not None and _reported_ended(s3, launch)):
            until = _peers_finishing(s3, launch, now=now)
            if until is None:
                found.add(everything)
            else:
                found.finishing += names
                found.finishing_until = max(found.finishing_until or until, until)
    return found


def _reports(s3: Any, launch: Launch) -> list[dict[str, Any]]:
    """The status objects of the launch's own nodes; [] when they cannot be read."""
    ids = {i["InstanceId"] for i in launch.instances}
    prefix = tags.tag_map(launch.instances[0]).get(tags.TAG_PREFIX)
    try:
        return [n for n in read_status_objects(s3, prefix) if n.get("instance_id") in ids]
    except Exception:  # noqa: BLE001 - unreadable reports: judge by the instance states alone
        return []


def _reported_ended(s3: Any, launch: Launch) -> bool:
    """True when the launch's nodes' own reports and EC2's states say its job ended."""
    states = {i["InstanceId"]: i["State"]["Name"] for i in launch.instances}
    return job_state(states, _reports(s3, launch), launch.num_nodes)["status"] in FINAL_STATUSES


def _peers_finishing(s3: Any, launch: Launch, *, now: datetime) -> float | None:
    """Until when a failed job's unreported peers of this launch are left running; None if none."""
    if s3 is None or not launch.live:
        return None
    grace = peer_grace(_reports(s3, launch), now=now.timestamp())
    if grace is None or not any(grace.spares(i) for i in launch.live):
        return None
    return grace.until
