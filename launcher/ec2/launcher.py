"""The EC2 backend: a cluster placement group of EFA nodes that bootstrap themselves from S3.

``build_request(plan)`` is pure (``ec2_requests``); ``submit`` shows the cost, asks above
``ec2.confirm_above_usd`` (unless told yes), uploads the code and a dtrain wheel to
``{output_path}/{job}/source/``, resolves the lookups (DLAMI id from SSM, subnet, VPC), creates
the placement and security groups and launches one node at a time. Any failure after the first
resource exists — ``InsufficientInstanceCapacity`` on node 2, Ctrl-C, anything — terminates
every node launched and deletes what was created, then raises one line saying what to try. The
record names the launching process until every node is launched, so a launcher killed outright
leaves a record ``status`` can end (and ``stop`` meanwhile makes the launch roll back).

``submit`` returns the job's store record; ``status``/``logs``/``stop`` take it. Instances carry
the job's tags (its S3 prefix, launch token and launch time included), nodes write
``{prefix}/status/<host>.json`` and their logs under ``{prefix}/logs/<host>/``. ``stop``
terminates every node and deletes the groups dtrain created, also for a job that already ended.
A job that ends on its own leaves nothing behind either: the ``status`` call that sees it end
terminates what of it still runs and deletes the groups dtrain created for it, one try per call
(a security group stays in use while the nodes' network interfaces detach), and keeps what
happened in the record's ``cleanup`` so later calls know whether to try again;
``pending_cleanup`` tells a caller waiting for the job what is still to go. A failed node's
peers that have not reported are the exception: they upload their checkpoints only when their
own job ends, so they are left running until ``res.FAILED_PEER_GRACE_S`` after the failure.
``leftovers`` is what `dtrain ec2 gc` removes.
"""

from __future__ import annotations

import json
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from typing import IO, TYPE_CHECKING, Any

from dtrain.core.errors import DtrainError
from dtrain.jobs.store import (
    FAILED,
    FINAL_STATUSES,
    PENDING,
    RUNNING,
    STARTING,
    STOPPED,
    STOPPING,
    JobRecord,
    JobStore,
)
from dtrain.launcher import aws
from dtrain.launcher.base import Launcher, PendingCleanup, process_alive, this_process
from dtrain.launcher.ec2 import requests as req
from dtrain.launcher.ec2 import resources as res

if TYPE_CHECKING:
    from dtrain.planning.planner import Plan

# How long status keeps retrying the removal of an ended job's groups; then `dtrain ec2 gc`.
CLEANUP_RETRY_S = 3600.0
# How long a launch whose launcher this machine cannot see (another host) may take before its
# record, still without nodes, counts as abandoned.
LAUNCH_TIMEOUT_S = 3600.0
# `dtrain ec2 gc` leaves a launch it knows no record of alone this long: it may still be launching.
GC_MIN_AGE_S = 1800.0
STOP_REASON = "stopped by user (dtrain stop)"
CAPACITY_CODES = ("InsufficientInstanceCapacity", "InsufficientCapacityOnHost",
                  "InsufficientReservedInstanceCapacity", "SpotMaxPriceTooLow",
                  "InsufficientCapacity", "ReservationCapacityExceeded")
QUOTA_CODES = ("VcpuLimitExceeded", "InstanceLimitExceeded", "MaxSpotInstanceCountExceeded")


def needs_confirmation(request: dict[str, Any]) -> bool:
    """True when the job's max_run cost is above ``ec2.confirm_above_usd`` (or unknown)."""
    cost = request["cost"]
    return cost["max_run_cost"] is None or cost["max_run_cost"] > cost["confirm_above_usd"]


class Ec2Launcher(Launcher, aws.AwsBackend):
    """``build_request`` / ``submit`` / ``status`` / ``logs`` / ``stop`` for ``target: ec2``.

    Lifecycle methods take a store record (``dtrain.jobs.store.JobRecord``) or a job reference the
    store can find. ``assume_yes`` / ``confirm`` are the CLI's hook for the cost check:
    ``confirm(question)`` returns True to go ahead; with neither, a job above the threshold is
    refused.
    """

    name = "ec2"
    poll_s = 10.0  # each status is a DescribeInstances and a few S3 reads

    def __init__(self, *, ec2_client: Any = None, s3_client: Any = None, ssm_client: Any = None,
                 region: str | None = None, stream: IO[str] | None = None,
                 assume_yes: bool = False, confirm: Callable[[str], bool] | None = None,
                 clock: Callable[[], datetime] = lambda: datetime.now(timezone.utc),
                 sleep: Callable[[float], None] = time.sleep):
        aws.AwsBackend.__init__(self, {"ec2": ec2_client, "s3": s3_client, "ssm": ssm_client},
                                region=region, stream=stream, clock=clock, sleep=sleep)
        self.assume_yes = assume_yes
        self.confirm = confirm
        # jobs whose groups (or spared peers) this launcher already said are not removed yet: a
        # caller waiting polls status every few seconds and needs that line once, not each time
        self._told_pending: set[Any] = set()

    # ---------------------------------------------------------------- request

    def build_request(self, plan: Plan, *, job_name: str | None = None) -> dict[str, Any]:
        """Every EC2 call of the job, with ``{{placeholders}}`` for the lookups (no AWS call)."""
        from dtrain.launcher.sagemaker.request import training_job_name

        name = job_name or training_job_name(plan.spec.name, now=self.clock())
        self.region = self.region or plan.spec.ec2.region
        self._plans[name] = plan
        return req.build_request(plan, job_name=name)

    # ---------------------------------------------------------------- submit

    def check_cost(self, request: dict[str, Any]) -> None:
        """Print the cost line; above the threshold go on only when told yes."""
        line = req.cost_line(request["cost"])
        self.out.write(line + "\n")
        if not needs_confirmation(request) or self.assume_yes:
            return
        limit = request["cost"]["confirm_above_usd"]
        if self.confirm is not None and self.confirm(f"{line}; above ${limit:,.2f}. Launch?"):
            return
        raise DtrainError(f"not launched: {line} is above ec2.confirm_above_usd=${limit:,.2f}; "
                          "pass --yes, raise ec2.confirm_above_usd, or lower compute.max_run")

    def submit(self, request: dict[str, Any], *, store: JobStore | None = None,
               plan: Plan | None = None) -> JobRecord:
        """Launch the cluster; on any failure leave nothing behind. Returns the store record.

        The job is in ``store`` (default: the user's job store) from the first upload on, so a
        failed launch is recorded with its reason too.
        """
        job = request["job"]
        plan = plan or self._plans.get(job)
        self.check_cost(request)
        store = store if store is not None else JobStore()
        values = {"launch_token": uuid.uuid4().hex[:16],
                  "launched_at": self.clock().strftime(req.LAUNCHED_AT_FORMAT)}
        prefix = request["prefix"]
        # "launcher": who owns the record until every node runs (status finds it if that dies)
        record = store.create(
            name=job, target=self.name, spec=plan.spec.to_dict() if plan else {},
            log_location=f"{prefix}/logs/", output_location=f"{prefix}/model/",
            target_data={"job_name": job, "region": self.region, "prefix": prefix,
                         "launch_token": values["launch_token"], "launcher": this_process(),
                         "request": request})
        created = res.Created(job=job)
        try:
            values.update(self._lookups(request))
            self._upload_code(plan, request, created)
            facts = self._launch(req.fill_placeholders(request, values), values, created,
                                 status=lambda: store.get(record.id).status)
        except BaseException as exc:  # noqa: BLE001 - Ctrl-C mid-launch must not leak nodes
            left = res.rollback(self.client("ec2"), self.client("s3"), created,
                                sleep=self.sleep)
            error = self._launch_error(exc, request, created, left)
            status = STOPPED if store.get(record.id).status == STOPPING else FAILED
            store.update(record.id, status=status,
                         failure_reason=str(error) or f"launch interrupted ({type(exc).__name__})",
                         target_data={"cleanup": self._teardown_cleanup(created, left)})
            raise error from None
        return store.update(record.id, status=STARTING, target_data=facts)

    def _lookups(self, request: dict[str, Any]) -> dict[str, str]:
        lookups = request["lookups"]
        ec2 = self.client("ec2")
        values = {"ami_id": res.resolve_ami(self.client("ssm"), lookups["ami_id"])}
        values["root_device"] = res.resolve_root_device(ec2, lookups["root_device"],
                                                        values["ami_id"])
        values["subnet_id"], values["vpc_id"] = res.resolve_subnet(ec2, lookups["subnet_id"])
        return values

    def _upload_code(self, plan: Plan | None, request: dict[str, Any],
                     created: res.Created) -> None:
        from pathlib import Path

        from dtrain.launcher import packaging

        s3 = self.client("s3")
        prefix = f"{request['prefix']}/source"
        with tempfile.TemporaryDirectory(prefix="dtrain-ec2-") as tmp:
            files = [packaging.build_runtime_wheel(tmp)]
            source = plan.spec.source_dir if plan else None
            if source and not plan.spec.is_recipe and not source.startswith("s3://"):
                packed = packaging.pack_source(source, tmp)
                for secret in packed.skipped_secrets:
                    self.out.write(f"warning: not packing {secret} (looks like a secret)\n")
                files.insert(0, packed.path)
            for path in files:
                uri = f"{prefix}/{Path(path).name}"
                created.uploads.append(uri)
                packaging.upload_file(s3, path, uri, stream=self.out)

    def _launch(self, request: dict[str, Any], values: dict[str, str], created: res.Created, *,
                status: Callable[[], str]) -> dict[str, Any]:
        """Groups, then one node at a time; ends early once the record is no longer Pending
        (`dtrain stop` meanwhile, or another client gave the launch up)."""

        def check_not_stopped() -> None:
            now = status()
            if now in (STOPPING, STOPPED):
                raise DtrainError("stopped by `dtrain stop` while launching")
            if now != PENDING:
                raise DtrainError(f"launch given up: the job was recorded {now} meanwhile")

        ec2 = self.client("ec2")
        check_not_stopped()
        group = request["placement_group"]
        if group["create"]:
            ec2.create_placement_group(**group["CreatePlacementGroup"])
            created.placement_groups.append(group["GroupName"])
        sg = request["security_group"]
        group_id = ec2.create_security_group(**sg["CreateSecurityGroup"])["GroupId"]
        created.security_groups.append(group_id)
        rules = req.fill_placeholders(sg, {"security_group_id": group_id})
        ec2.authorize_security_group_ingress(**rules["AuthorizeSecurityGroupIngress"])
        ec2.authorize_security_group_egress(**rules["AuthorizeSecurityGroupEgress"])
        for rank, node in enumerate(request["run_instances"]):
            check_not_stopped()
            node = req.fill_placeholders(node, {"security_group_id": group_id})
            self.out.write(f"launching node {rank + 1}/{len(request['run_instances'])} "
                           f"({node['InstanceType']})\n")
            instance = ec2.run_instances(**node)["Instances"][0]
            created.instances.append(instance["InstanceId"])
        check_not_stopped()
        return {"job_name": created.job, "target": self.name, "region": self.region,
                "prefix": request["prefix"], "launch_token": values["launch_token"],
                "instance_ids": list(created.instances), "subnet_id": values["subnet_id"],
                "security_group_id": group_id, "placement_group": group["GroupName"],
                "created_placement_group": group["create"],
                "uploads": list(created.uploads)}

    def _launch_error(self, exc: BaseException, request: dict[str, Any], created: res.Created,
                      cleanup: list[str]) -> BaseException:
        if isinstance(exc, KeyboardInterrupt):
            return exc
        nodes = len(request["run_instances"])
        done = (f"launched {len(created.instances)} of {nodes} nodes, all terminated"
                if created.instances else "no node was launched")
        left = ("" if not cleanup else
                f"; could not remove {', '.join(cleanup)}: run `dtrain ec2 gc`")
        code = aws.error_code(exc)
        itype = request["run_instances"][0]["InstanceType"]
        if code in CAPACITY_CODES:
            return DtrainError(
                f"EC2 has no capacity for {nodes} × {itype} ({code}; {done}){left}; try another "
                "AZ (ec2.subnet_id), a capacity reservation (ec2.capacity_reservation_id), or "
                "fewer nodes (compute.instance_count)")
        if code in QUOTA_CODES:
            return DtrainError(
                f"EC2 quota reached for {nodes} × {itype} ({code}; {done}){left}; raise the "
                "'Running On-Demand P instances' (or spot) vCPU quota in Service Quotas")
        if isinstance(exc, DtrainError):
            return DtrainError(f"{exc} ({done}){left}")
        if code is None:
            return DtrainError(f"EC2 launch failed: {type(exc).__name__}: {exc} ({done}){left}")
        error = aws.as_dtrain_error(exc, "EC2 launch")
        return DtrainError(f"{error} ({done}){left}")

    # ---------------------------------------------------------------- lifecycle

    @staticmethod
    def _resolve(record: JobRecord | str,
                 store: JobStore | None) -> tuple[JobStore, JobRecord]:
        store = store if store is not None else JobStore()
        return store, store.find(record) if isinstance(record, str) else record

    def describe(self, record: JobRecord) -> dict[str, Any]:
        """The job's instances (found by its tags) and the facts its record holds, merged."""
        facts = dict(record.target_data or {})
        instances = res.job_instances(self.client("ec2"), record.name,
                                      launch=facts.get("launch_token"))
        if instances:
            tags = res.tag_map(instances[0])
            facts.setdefault("prefix", tags.get(req.TAG_PREFIX))
            facts.setdefault("num_nodes", int(tags.get(req.TAG_NUM_NODES, len(instances))))
        if not facts.get("prefix"):
            raise DtrainError(f"job {record.name!r}: no EC2 instance or job record found; check "
                              "the name with `dtrain list`")
        facts.setdefault("num_nodes", len(facts.get("instance_ids") or instances) or 1)
        facts["instances"] = instances
        return facts

    def job_status(self, record: JobRecord) -> dict[str, Any]:
        """Job state from instance states plus each node's S3 status object (``res.job_state``:
        ``status`` in the store's names, ``secondary_status``, ``failure_reason``)."""
        facts = self.describe(record)
        nodes = res.read_status_objects(self.client("s3"), facts["prefix"])
        states = {i["InstanceId"]: i["State"]["Name"] for i in facts["instances"]}
        return {"job_name": record.name, "target": self.name,
                **res.job_state(states, nodes, facts["num_nodes"]),
                "instances": states, "nodes": nodes,
                "model_data": f"{facts['prefix']}/model/"}

    def status(self, record: JobRecord | str, *, store: JobStore | None = None) -> JobRecord:
        """Refresh the record from EC2 and the nodes' status objects.

        The call that sees the job end (Completed, Failed, Stopped) also terminates whatever of
        it still runs and removes the groups dtrain created for it; while a group is still in
        use, later calls try again. A record whose launch never finished is resolved from its
        launcher: still launching, or gone (then the job failed, and what it launched goes).
        """
        store, record = self._resolve(record, store)
        if record.is_final:
            return self._retry_cleanup(record, store)
        status, fields, data = self._observe(record)
        if status in FINAL_STATUSES:
            if not launched(record):
                self.out.write(f"{record.name}: {fields['failure_reason']}\n")
            # also after a `dtrain stop` that said it was done: a racing launch may have added
            data["cleanup"] = self._clear(record)
        elif stop_requested(record):
            self._finish_stop(record, data.get("instances") or {})
        return store.update(record.id, status=status, target_data=data, **fields)

    def _finish_stop(self, record: JobRecord, instances: dict[str, str]) -> None:
        """`dtrain stop` was asked but nodes still run (it was cut short, or a launch raced it):
        terminate them; the job ends Stopped once they are gone."""
        running = [i for i, state in instances.items() if state in res.RUNNING_STATES]
        if not running:
            return
        try:
            self.client("ec2").terminate_instances(InstanceIds=running)
        except Exception as exc:  # noqa: BLE001 - the next status call tries again
            self.out.write(f"{record.name} stopping: could not terminate {', '.join(running)} "
                           f"({aws.as_dtrain_error(exc, 'terminating')}); trying again later\n")
            return
        self.out.write(f"{record.name} stopping: terminated {len(running)} node(s) still "
                       f"running ({', '.join(running)})\n")

    def _observe(self, record: JobRecord) -> tuple[str | None, dict[str, Any], dict[str, Any]]:
        """What ``status`` would write (status, fields, target data), read-only."""
        if not launched(record):
            return self._observe_launch(record)
        current = self.job_status(record)
        status = current["status"]
        if record.status == STOPPING and status not in FINAL_STATUSES:
            # `dtrain stop` terminated the nodes: the job only ends from here, Stopped
            status = STOPPED if status is None else None
        fields: dict[str, Any] = {}
        # a Stopped job keeps the reason it got first: `dtrain stop`'s, or the interruption's
        if current["failure_reason"] and not (status == STOPPED and record.failure_reason):
            fields["failure_reason"] = current["failure_reason"]
        if status == RUNNING and not record.started_at:
            fields["started_at"] = self.clock().timestamp()
        return status, fields, {"secondary_status": current.get("secondary_status"),
                                "instances": current["instances"],
                                "model_data": current["model_data"]}

    def _observe_launch(self, record: JobRecord) -> tuple[str | None, dict[str, Any], dict]:
        """A job whose ``submit`` has not finished: nothing changes while its launcher runs;
        once that process is gone the job has ended (Failed, or Stopped if `dtrain stop` asked)."""
        owner = (record.target_data or {}).get("launcher")
        alive = process_alive(owner)
        if alive is None:  # launched from another host (or by an older dtrain): give it time
            alive = self.clock().timestamp() - record.created_at < LAUNCH_TIMEOUT_S
        if alive:
            return None, {}, {}
        if record.status == STOPPING:
            return STOPPED, {"failure_reason": record.failure_reason or STOP_REASON}, {}
        who = f"pid {owner['pid']} on {owner['host']}" if owner else "its launcher"
        return FAILED, {"failure_reason": f"launch interrupted: the process that launched it "
                                          f"({who}) exited before every node was launched; "
                                          "nothing of it is left running"}, {}

    def logs(self, record: JobRecord | str, *, follow: bool = False, host: str | None = None,
             rank: int | None = None, poll_s: float = 10.0) -> Iterator[str]:
        """``host: line`` from each node's logs in S3 (uploaded every 30 s while it runs)."""
        _, record = self._resolve(record, None)
        facts = self.describe(record)
        seen: dict[str, int] = {}
        while True:
            yield from res.new_log_lines(self.client("s3"), facts["prefix"], seen,
                                         host=host, rank=rank)
            if not follow or self.job_status(record)["status"] in FINAL_STATUSES:
                yield from res.new_log_lines(self.client("s3"), facts["prefix"], seen,
                                             host=host, rank=rank)
                return
            self.sleep(poll_s)

    def stop(self, record: JobRecord | str, *, store: JobStore | None = None) -> JobRecord:
        """Terminate every node of the job, then delete the groups dtrain created for it.

        The record says Stopping before anything is terminated: a launch still under way sees
        it before its next node and rolls back, and if this call is cut short (Ctrl-C during the
        wait) ``status`` terminates what still runs. A node the launch started while this call
        was terminating the others is terminated too. Also for a job that has already ended
        (one failed node ends a job while its peers may still run): whatever of it still runs
        is terminated, and the job keeps its status.
        """
        store, record = self._resolve(record, store)
        ec2 = self.client("ec2")
        launch = (record.target_data or {}).get("launch_token")
        ended = f" (it had ended: {record.status})" if record.is_final else ""
        if not record.is_final:
            record = store.update(record.id, status=STOPPING, failure_reason=STOP_REASON,
                                  target_data={"stop_requested_at": self.clock().timestamp()})
        created = res.job_resources(ec2, record.name, launch=launch)
        if ended and not (created.instances or created.security_groups
                          or created.placement_groups):
            return record
        left = res.rollback(ec2, None, created, sleep=self.sleep, keep_uploads=True,
                            relist=lambda: res.job_instance_ids(ec2, record.name, launch=launch))
        self.out.write(f"stopped {record.name}{ended}: terminated {len(created.instances)} "
                       "node(s)" + (f"; could not remove {', '.join(left)}: run `dtrain ec2 gc`"
                                    if left else "") + "\n")
        cleanup = {"cleanup": self._teardown_cleanup(created, left)}
        record = store.get(record.id)
        if record.is_final:  # it had ended, or the launch under way rolled back meanwhile
            return store.update_target_data(record.id, cleanup)
        # a launch still under way finishes the stop itself (it checks before each node)
        under_way = (not launched(record)
                     and process_alive(record.target_data.get("launcher")) is not False)
        return store.update(record.id, status=STOPPING if launched(record) or under_way
                            else STOPPED, failure_reason=STOP_REASON, target_data=cleanup)

    def leftovers(self, *, store: JobStore | None = None, include_running: bool = False,
                  min_age_s: float = GC_MIN_AGE_S, dry_run: bool = False) -> res.Leftovers:
        """What `dtrain ec2 gc` removes: ``res.find_leftovers``, told by this machine's job
        store which launches ended. A record that has not ended is refreshed first, as `dtrain
        status` does (the job may have ended since, or its launcher died); ``dry_run`` only
        looks and writes nothing. A job that still runs is kept."""
        store = store if store is not None else JobStore()
        ec2 = self.client("ec2")
        launches = res.find_launches(ec2)
        records = {r.target_data.get("launch_token"): r for r in store.list(target=self.name)
                   if r.target_data.get("launch_token") in launches}
        ended = {t for t, r in records.items() if r.is_final}
        for token in set(records) - ended:
            try:
                if dry_run:
                    now_ended = self._observe(records[token])[0] in FINAL_STATUSES
                else:
                    now_ended = self.status(records[token], store=store).is_final
            except Exception as exc:  # noqa: BLE001 - not known to have ended: kept
                self.out.write(f"keeping {records[token].name}: its status is unknown ({exc})\n")
                now_ended = False
            if now_ended:
                ended.add(token)
        if not dry_run and ended - {t for t, r in records.items() if r.is_final}:
            launches = res.find_launches(ec2)  # those status calls removed what they could
        return res.find_leftovers(launches, now=self.clock(), s3=self.client("s3"), ended=ended,
                                  running=set(records) - ended, min_age_s=min_age_s,
                                  include_running=include_running)

    # ---------------------------------------------------------------- groups of ended jobs

    def pending_cleanup(self, record: JobRecord) -> PendingCleanup | None:
        """What of an ended job ``status`` still tries to remove (its groups, once its nodes
        have terminated), from the record."""
        if not record.is_final or not cleanup_pending(record):
            return None
        facts = record.target_data or {}
        cleanup = facts.get("cleanup") or {}
        kinds = {facts.get("security_group_id"): "security group",
                 facts.get("placement_group"): "placement group"}
        left = [f"{kinds[name]} {name}" if name in kinds else name
                for name in cleanup.get("left", [])]
        nodes = cleanup.get("nodes_left") or 0
        spared = len(cleanup.get("spared") or [])
        if spared:
            them = ("the node still running after the failure has uploaded its checkpoints"
                    if spared == 1 else f"the {spared} nodes still running after the failure "
                    "have uploaded their checkpoints")
            once = (f"{them} and terminated (dtrain terminates "
                    f"{'it' if spared == 1 else 'them'} at "
                    f"{res.utc_time(cleanup['spared_until'])} at the latest)")
        elif nodes:
            once = "the node has terminated" if nodes == 1 else f"the {nodes} nodes have terminated"
        else:
            once = "EC2 releases them" + (f" ({cleanup['reason']})" if cleanup.get("reason") else "")
        return PendingCleanup(what=join_names(left) or "its nodes",
                              once=once, retry_hint=retry_hint(record))

    def _retry_cleanup(self, record: JobRecord, store: JobStore) -> JobRecord:
        """An ended job whose groups were still in use last time: one more try."""
        if not cleanup_pending(record):
            return record  # removed, or left to `dtrain ec2 gc`: no AWS call
        return store.update_target_data(record.id, {"cleanup": self._clear(record)})

    def _clear(self, record: JobRecord) -> dict[str, Any]:
        """Terminate what still runs of an ended job and delete its groups, once; say and
        return the outcome."""
        try:
            removal = res.clear_ended_job(self.client("ec2"), record.name,
                                          launch=record.target_data.get("launch_token"),
                                          grace=self._peer_grace(record))
        except Exception as exc:  # noqa: BLE001 - a failed clean-up must not fail `status`
            removal = res.Removal(left=[f"the groups of {record.name}"], reason=str(
                aws.as_dtrain_error(exc, "finding the groups")))
        return self._cleanup_record(record, removal)

    def _peer_grace(self, record: JobRecord) -> res.PeerGrace | None:
        """The grace of a failed job's unreported peers (none after `dtrain stop`)."""
        prefix = (record.target_data or {}).get("prefix")
        if stop_requested(record) or not prefix:
            return None
        nodes = res.read_status_objects(self.client("s3"), prefix)
        return res.peer_grace(nodes, now=self.clock().timestamp())

    def _cleanup_record(self, record: JobRecord, removal: res.Removal) -> dict[str, Any]:
        previous = (record.target_data or {}).get("cleanup") or {}
        now = self.clock().timestamp()
        first_try = previous.get("first_try_at") or now
        removed = [*previous.get("removed", []), *removal.removed]
        if removal.terminated:
            self.out.write(f"{record.name} ended: terminated {len(removal.terminated)} node(s) "
                           f"still running ({', '.join(removal.terminated)})\n")
        if removal.removed:
            self.out.write(f"{record.name} ended: removed {', '.join(removal.removed)} "
                           "(the groups dtrain created for it)\n")
        if not removal.left and not removal.nodes_left:
            return {"state": "done", "removed": removed}
        if removal.spared:  # left running on purpose: the retry clock starts once they go
            return self._sparing(record, removal, removed=removed,
                                 tries=previous.get("tries", 0) + 1)
        what = ", ".join(removal.left) or f"{removal.nodes_left} node(s)"
        if removal.retry and now - first_try < CLEANUP_RETRY_S:
            if record.id not in self._told_pending:
                self.out.write(f"{record.name} ended: {what} not removed yet ({removal.reason}); "
                               f"{retry_hint(record)}\n")
                self._told_pending.add(record.id)
            state = "pending"
        else:
            self.out.write(f"{record.name} ended: could not remove {what} ({removal.reason}); "
                           "run `dtrain ec2 gc`\n")
            state = "left-for-gc"
        return {"state": state, "removed": removed, "left": removal.left,
                "reason": removal.reason, "nodes_left": removal.nodes_left,
                "first_try_at": first_try, "tries": previous.get("tries", 0) + 1}

    def _sparing(self, record: JobRecord, removal: res.Removal, *, removed: list[str],
                 tries: int) -> dict[str, Any]:
        """The cleanup entry while a failed job's unreported peers may still upload."""
        if (record.id, "spared") not in self._told_pending:
            self.out.write(f"{record.name} ended: leaving {len(removal.spared)} node(s) that "
                           f"have not reported running ({', '.join(removal.spared)}) so they "
                           "can upload their checkpoints; they are terminated at "
                           f"{res.utc_time(removal.spared_until)} if still running; "
                           f"{retry_hint(record)}\n")
            self._told_pending.add((record.id, "spared"))
        return {"state": "pending", "removed": removed, "left": removal.left,
                "reason": removal.reason, "nodes_left": removal.nodes_left,
                "spared": removal.spared, "spared_until": removal.spared_until,
                "tries": tries}

    def _teardown_cleanup(self, created: res.Created, left: list[str]) -> dict[str, Any]:
        """The cleanup entry after a blocking teardown (failed launch, stop)."""
        groups = created.security_groups + created.placement_groups
        if not left:
            return {"state": "done", "removed": groups}
        return {"state": "pending", "removed": [g for g in groups if g not in left],
                "left": left, "reason": "still in use after the teardown's retries",
                "first_try_at": self.clock().timestamp(), "tries": 1}


def cleanup_pending(record: JobRecord) -> bool:
    """True until the groups of the job are removed or left to `dtrain ec2 gc`.

    A record without a ``cleanup`` entry (written before dtrain removed the groups of ended
    jobs) gets one try too.
    """
    cleanup = (record.target_data or {}).get("cleanup")
    return cleanup is None or cleanup.get("state") == "pending"


def stop_requested(record: JobRecord) -> bool:
    """True once `dtrain stop` was run on the job (not an interruption's Stopping)."""
    return bool((record.target_data or {}).get("stop_requested_at")
                or record.failure_reason == STOP_REASON)


def launched(record: JobRecord) -> bool:
    """True once ``submit`` launched every node (it records their ids last)."""
    return bool((record.target_data or {}).get("instance_ids"))


def retry_hint(record: JobRecord) -> str:
    return f"`dtrain status {record.id}` tries again, or run `dtrain ec2 gc`"


def join_names(names: list[str]) -> str:
    """Names as one phrase: "a", "a and b", "a, b and c"."""
    return " and ".join(filter(None, [", ".join(names[:-1]), *names[-1:]]))


def dumps(request: dict[str, Any]) -> str:
    """The request set as ``--dry-run`` prints it."""
    return json.dumps(request, indent=2)
