"""``Ec2Launcher.submit``'s work: lookups, uploads, groups, then every node in one request.

The launch is recorded first (its token and prefix; ``submit`` recorded the launching process),
so a launcher killed outright leaves a record ``status`` can end, and `dtrain ec2 gc` on this
machine knows the launch is under way. Before the groups, before the nodes and once they are
launched the launch reads the record again: a `dtrain stop` meanwhile (or another client that
gave the launch up) makes it roll back. Any failure after the first resource exists —
``InsufficientInstanceCapacity`` for the cluster, Ctrl-C, anything — terminates every node
launched and deletes what was created, records the job Failed (Stopped after a stop) with what
is left, and raises one line saying what to try.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from datetime import datetime
from typing import IO, Any

from dtrain.core.errors import DtrainError
from dtrain.core.states import FAILED, PENDING, STARTING, STOPPED, STOPPING
from dtrain.launcher import aws, packaging
from dtrain.launcher.base import Handle, Journal, Request, Update
from dtrain.launcher.ec2 import cleanup, placeholders
from dtrain.launcher.ec2 import resources as res
from dtrain.launcher.ec2.state import Ec2State
from dtrain.launcher.ec2.tags import LAUNCHED_AT_FORMAT

CAPACITY_CODES = ("InsufficientInstanceCapacity", "InsufficientCapacityOnHost",
                  "InsufficientReservedInstanceCapacity", "SpotMaxPriceTooLow",
                  "InsufficientCapacity", "ReservationCapacityExceeded")
QUOTA_CODES = ("VcpuLimitExceeded", "InstanceLimitExceeded", "MaxSpotInstanceCountExceeded")
# After a RunInstances call that never answered: how often, and how far apart, the rollback
# lists the launch's nodes before it trusts that the call made none.
UNANSWERED_LISTS = 4
UNANSWERED_WAIT_S = 10.0


class Launch:
    """One submission: its clients, where it says what it does, and what it created so far."""

    def __init__(self, request: Request, journal: Journal, *, region: str | None, ec2: Any,
                 s3: Any, ssm: Any, out: IO[str], now: datetime) -> None:
        self.request, self.journal = request, journal
        self.region, self.ec2, self.s3, self.ssm, self.out = region, ec2, s3, ssm, out
        self.now = now
        self.created = res.Created(job=request.job.name)
        self.run_instances_pending = False  # a RunInstances call is out, its answer not in

    def run(self, *, sleep: Callable[[float], None]) -> Handle:
        payload = self.request.payload
        values = {"launch_token": uuid.uuid4().hex[:16],
                  "launched_at": self.now.strftime(LAUNCHED_AT_FORMAT)}
        prefix = payload["prefix"]
        self.journal.record(Update(
            log_location=f"{prefix}/logs/", output_location=f"{prefix}/model/",
            state=Ec2State.changes(region=self.region, prefix=prefix,
                                   checkpoints=payload["checkpoints"],
                                   launch_token=values["launch_token"],
                                   launched_at=values["launched_at"],
                                   num_nodes=payload["run_instances"]["MaxCount"])))
        try:
            self._check_not_stopped()  # e.g. `dtrain stop` while the cost question was open
            values.update(self._lookups(payload["lookups"]))
            packaging.upload_all(self.s3, self.request.uploads, stream=self.out,
                                 uploaded=self.created.uploads)
            facts = self._launch(placeholders.fill(payload, values), values)
        except BaseException as exc:  # noqa: BLE001 - Ctrl-C mid-launch must not leak nodes
            # a Ctrl-C (or a timeout) inside RunInstances can come after EC2 made the node
            unanswered = self.run_instances_pending and aws.error_code(exc) is None
            relist = self._relist(values["launch_token"], sleep, patient=unanswered) \
                if self.created.instances or unanswered else None
            left = res.rollback(self.ec2, self.s3, self.created, sleep=sleep, relist=relist)
            error = self._error(exc, left)
            status = STOPPED if self.journal.current().status == STOPPING else FAILED
            self.journal.record(Update(
                status=status,
                failure_reason=str(error) or f"launch interrupted ({type(exc).__name__})",
                state=Ec2State.changes(cleanup=cleanup.after_teardown(
                    self.created, left, now=self.now.timestamp()))))
            raise error from None
        return self.journal.record(Update(status=STARTING, state=Ec2State.changes(**facts)))

    def _lookups(self, lookups: dict[str, Any]) -> dict[str, str]:
        values = {"ami_id": res.resolve_ami(self.ssm, lookups["ami_id"])}
        values["root_device"] = res.resolve_root_device(self.ec2, lookups["root_device"],
                                                        values["ami_id"])
        values["subnet_id"], values["vpc_id"], zone = res.resolve_subnet(self.ec2,
                                                                          lookups["subnet_id"])
        reservation = lookups.get("capacity_reservation")
        if reservation:
            nodes = self.request.payload["run_instances"]
            res.check_reservation(
                self.ec2, reservation["describe_capacity_reservations"], zone=zone,
                instance_type=nodes["InstanceType"], nodes=nodes["MaxCount"],
                placement_group=self.request.payload["placement_group"]["GroupName"])
        return values

    def _check_not_stopped(self) -> None:
        """The launch goes on only while the record says Pending."""
        now = self.journal.current().status
        if now in (STOPPING, STOPPED):
            raise DtrainError("stopped by `dtrain stop` while launching")
        if now != PENDING:
            raise DtrainError(f"launch given up: the job was recorded {now} meanwhile")

    def _launch(self, payload: dict[str, Any], values: dict[str, str]) -> dict[str, Any]:
        """Groups, then the nodes; returns what the record keeps of them."""
        ec2, created = self.ec2, self.created
        self._check_not_stopped()
        group = payload["placement_group"]
        if group["create"]:
            ec2.create_placement_group(**group["CreatePlacementGroup"])
            created.placement_groups.append(group["GroupName"])
        sg = payload["security_group"]
        group_id = ec2.create_security_group(**sg["CreateSecurityGroup"])["GroupId"]
        created.security_groups.append(group_id)
        rules = placeholders.fill(sg, {"security_group_id": group_id})
        ec2.authorize_security_group_ingress(**rules["AuthorizeSecurityGroupIngress"])
        ec2.authorize_security_group_egress(**rules["AuthorizeSecurityGroupEgress"])
        nodes = placeholders.fill(payload["run_instances"], {"security_group_id": group_id})
        self._check_not_stopped()
        self.out.write(f"launching {nodes['MaxCount']} × {nodes['InstanceType']} in placement "
                       f"group {group['GroupName']}, in one request\n")
        self.run_instances_pending = True
        launched = ec2.run_instances(**nodes)["Instances"]
        created.instances.extend(i["InstanceId"] for i in res.in_rank_order(launched))
        self.run_instances_pending = False
        self._check_not_stopped()
        return {"instance_ids": list(created.instances), "subnet_id": values["subnet_id"],
                "security_group_id": group_id, "placement_group": group["GroupName"],
                "created_placement_group": group["create"], "uploads": list(created.uploads)}

    def _relist(self, token: str, sleep: Callable[[float], None], *,
                patient: bool) -> Callable[[], list[str]]:
        """The launch's nodes not terminated, listed by tag (for the rollback). ``patient``:
        a RunInstances call never answered, and EC2 may list the nodes it made only after a
        while, so the first list is repeated (``UNANSWERED_LISTS`` times) until it shows one."""
        waits = UNANSWERED_LISTS - 1 if patient else 0

        def relist() -> list[str]:
            nonlocal waits
            found = res.job_instance_ids(self.ec2, self.request.job.name, launch=token)
            while not found and waits:
                waits -= 1
                self.out.write("looking again for nodes the cut-off RunInstances may have "
                               "made (EC2 lists new nodes after a delay)\n")
                sleep(UNANSWERED_WAIT_S)
                found = res.job_instance_ids(self.ec2, self.request.job.name, launch=token)
            waits = 0  # only the first list waits
            return found
        return relist

    def _error(self, exc: BaseException, left: list[str]) -> BaseException:
        """The one line the user sees: what failed, what became of the nodes, what to try."""
        if isinstance(exc, KeyboardInterrupt):
            return exc
        nodes = self.request.payload["run_instances"]
        done = (f"launched {len(self.created.instances)} of {nodes['MaxCount']} nodes, all "
                "terminated" if self.created.instances else "no node was launched")
        left_line = "" if not left else \
            f"; could not remove {', '.join(left)}: run `dtrain ec2 gc`"
        code = aws.error_code(exc)
        what = f"{nodes['MaxCount']} × {nodes['InstanceType']}"
        if code in CAPACITY_CODES:
            return DtrainError(
                f"EC2 has no capacity for {what} ({code}; {done}){left_line}; try another AZ "
                "(ec2.subnet_id), a capacity reservation (ec2.capacity_reservation_id), or "
                "fewer nodes (compute.instance_count)")
        if code in QUOTA_CODES:
            return DtrainError(
                f"EC2 quota reached for {what} ({code}; {done}){left_line}; raise the 'Running "
                "On-Demand P instances' (or spot) vCPU quota in Service Quotas")
        if isinstance(exc, DtrainError):
            return DtrainError(f"{exc} ({done}){left_line}")
        if code is None:
            return DtrainError(f"EC2 launch failed: {type(exc).__name__}: {exc} ({done})"
                               f"{left_line}")
        call = getattr(exc, "operation_name", None)  # which of the launch's calls was refused
        action = f"EC2 launch ({call})" if call else "EC2 launch"
        return DtrainError(f"{aws.as_dtrain_error(exc, action)} ({done}){left_line}")
