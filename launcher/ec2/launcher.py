"""The EC2 backend: a cluster placement group of EFA nodes that bootstrap themselves from S3.

``build_request`` is pure (``requests``): every EC2 call with ``{{placeholders}}`` for what only
``submit`` learns, and the uploads (source archive, runtime wheel) to
``{output_path}/{job}/source/``. ``submit`` shows the cost, asks above ``ec2.confirm_above_usd``
(unless told yes), then launches (``launch``: lookups, uploads, groups, every node in one
request, all rolled back on any failure).

Instances carry the job's tags (its S3 prefix, launch token and launch time included), nodes
write ``{prefix}/status/<host>.json`` and their logs under ``{prefix}/logs/<host>/``. ``status``
reads them and EC2's instance states (``nodes.job_state``). ``stop`` terminates every node and
deletes the groups dtrain created, also for a job that already ended. A job that ends on its own
leaves nothing behind either: the ``status`` call that sees it end terminates what of it still
runs and deletes its groups, one try per call (``cleanup``), and its ``Update`` carries what
happened as the record's ``cleanup`` so later calls know whether to try again;
``pending_cleanup`` tells a caller waiting for the job what is still to go. A failed node's
peers that have not reported are the exception: they stop their workers on seeing the report and
are left running until ``nodes.FAILED_PEER_GRACE_S`` after the failure to upload and report.
``leftovers`` is what `dtrain ec2 gc` removes. No method writes the job store: the jobs layer
writes the ``Update``s and what ``submit``/``stop`` record in their journal.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from datetime import datetime, timezone
from typing import IO, TYPE_CHECKING, Any

from dtrain.core.aws import region_of
from dtrain.core.errors import DtrainError
from dtrain.core.states import FAILED, FINAL_STATUSES, RUNNING, STOPPED, STOPPING
from dtrain.launcher import agents, aws, process
from dtrain.launcher.base import (
    Handle,
    JobIdentity,
    Journal,
    Launcher,
    PendingCleanup,
    Request,
    Update,
    judge_submitter,
)
from dtrain.launcher.ec2 import cleanup, gc, launch, nodes
from dtrain.launcher.ec2 import logs as s3_logs
from dtrain.launcher.ec2 import requests as req
from dtrain.launcher.ec2 import resources as res
from dtrain.launcher.ec2.state import (
    DONE,
    STOP_REASON,
    Cleanup,
    Ec2State,
    state_of,
    stop_requested,
)
from dtrain.launcher.ec2.tags import TAG_NUM_NODES, TAG_PREFIX, tag_map

if TYPE_CHECKING:
    from dtrain.planning.planner import Plan
    from dtrain.spec.model import JobSpec

# `dtrain ec2 gc` leaves a launch it knows no record of alone this long: it may still be launching.
GC_MIN_AGE_S = 1800.0

# Jobs whose groups (or spared peers) this process already said are not removed yet: a caller
# waiting polls status every few seconds, through more than one launcher (a waiting submit's
# progress and its wait), and needs that line once, not each time.
_TOLD_PENDING: set[Any] = set()


class Ec2Launcher(Launcher, aws.AwsBackend):
    """``build_request`` / ``submit`` / ``status`` / ``logs`` / ``stop`` for ``target: ec2``.

    ``assume_yes`` / ``confirm`` are the CLI's hook for the cost check: ``confirm(question)``
    returns True to go ahead; with neither, a job above the threshold is refused.
    """

    name = "ec2"
    state_type = Ec2State
    poll_s = 10.0  # each status is a DescribeInstances and a few S3 reads
    stamps_job_names = True

    def __init__(self, *, ec2_client: Any = None, s3_client: Any = None, ssm_client: Any = None,
                 region: str | None = None, stream: IO[str] | None = None,
                 assume_yes: bool = False, confirm: Callable[[str], bool] | None = None,
                 clock: Callable[[], datetime] = lambda: datetime.now(timezone.utc),
                 sleep: Callable[[float], None] = time.sleep):
        aws.AwsBackend.__init__(self, {"ec2": ec2_client, "s3": s3_client, "ssm": ssm_client},
                                region=region, stream=stream, clock=clock, sleep=sleep)
        self.assume_yes = assume_yes
        self.confirm = confirm
        self._regional: dict[tuple[str, str | None], Any] = {}
        self._told_pending = _TOLD_PENDING

    def client(self, service: str, *, region: str | None = None) -> Any:
        """The client passed in, else one for ``region`` (the job's; default: the launcher's)."""
        if self._clients.get(service) is not None:
            return self._clients[service]
        key = (service, region or self.region)
        if key not in self._regional:
            self._regional[key] = aws.make_client(service, region=key[1])
        return self._regional[key]

    def _clients_of(self, handle: Handle) -> tuple[Any, Any]:
        region = state_of(handle).region
        return self.client("ec2", region=region), self.client("s3", region=region)

    # ---------------------------------------------------------------- request and submit

    def build_request(self, spec: JobSpec, plan: Plan, job: JobIdentity) -> Request:
        """Every EC2 call of the job, with ``{{placeholders}}`` for the lookups (no AWS call)."""
        return Request(target=self.name, job=job, payload=req.payload(spec, plan, job.name),
                       uploads=req.uploads(spec, job.name))

    def check_cost(self, cost: dict[str, Any]) -> None:
        """Print the cost line; above the threshold go on only when told yes."""
        line = req.cost_line(cost)
        self.out.write(line + "\n")
        if not req.needs_confirmation(cost) or self.assume_yes:
            return
        limit = cost["confirm_above_usd"]
        # the cost line is just above: the question does not repeat it
        if self.confirm is not None and self.confirm(
                f"that is above ec2.confirm_above_usd (${limit:,.2f}). Launch?"):
            return
        # no one to ask (Python's Estimator, a script): the spec is what can say yes
        yes = "pass --yes, " if self.confirm is not None else ""
        raise DtrainError(f"not launched: {line} is above ec2.confirm_above_usd=${limit:,.2f}; "
                          f"{yes}raise ec2.confirm_above_usd, or lower compute.max_run")

    def submit(self, request: Request, journal: Journal) -> Handle:
        """Launch the cluster; on any failure leave nothing behind (see ``launch``)."""
        # the record names its submitting process from the start (``TargetState.submitter``),
        # the cost question included: `status` elsewhere then knows the launch is under way, and
        # ends it if that process dies
        self.check_cost(request.payload["cost"])
        region = region_of(request.payload["region"] or self.region)
        return launch.Launch(
            request, journal, region=region, ec2=self.client("ec2", region=region),
            s3=self.client("s3", region=region), ssm=self.client("ssm", region=region),
            out=self.out, now=self.clock()).run(sleep=self.sleep)

    # ---------------------------------------------------------------- status

    def describe(self, handle: Handle) -> dict[str, Any]:
        """The job's instances (found by its tags) and its prefix and node count."""
        state = state_of(handle)
        instances = res.job_instances(self._clients_of(handle)[0], handle.job.name,
                                      launch=state.launch_token)
        found = tag_map(instances[0]) if instances else {}
        prefix = state.prefix or found.get(TAG_PREFIX)
        if not prefix:
            raise DtrainError(f"job {handle.job.name!r}: no EC2 instance or job record found; "
                              "check the name with `dtrain list`")
        num_nodes = (state.num_nodes or int(found.get(TAG_NUM_NODES, 0))
                     or len(state.instance_ids or instances) or 1)
        return {"prefix": prefix, "num_nodes": num_nodes, "instances": instances}

    def job_status(self, handle: Handle) -> dict[str, Any]:
        """Job state from instance states plus each node's S3 status object (``nodes.job_state``:
        ``status`` in the store's names, ``secondary_status``, ``failure_reason``)."""
        facts = self.describe(handle)
        reports = nodes.read_status_objects(self._clients_of(handle)[1], facts["prefix"])
        states = {i["InstanceId"]: i["State"]["Name"] for i in facts["instances"]}
        return {**nodes.job_state(states, reports, facts["num_nodes"]), "instances": states,
                "nodes": reports, "model_data": f"{facts['prefix']}/model/"}

    def status(self, handle: Handle) -> Update:
        """What EC2 and the nodes' status objects say changed.

        The call that sees the job end (Completed, Failed, Stopped) also terminates whatever of
        it still runs and removes the groups dtrain created for it; while a group is still in
        use, later calls try again. A job whose launch never finished is resolved from its
        launcher: still launching, or gone (then the job failed, and what it launched goes).
        """
        if handle.is_final:
            if not state_of(handle).cleanup_pending:
                return Update()  # removed, or left to `dtrain ec2 gc`: no AWS call
            return Update(state=Ec2State.changes(cleanup=self._clear(handle)))
        status, fields, changes = self._observe(handle)
        if status in FINAL_STATUSES:
            if not state_of(handle).launched:
                self.out.write(f"{handle.job.name}: {fields['failure_reason']}\n")
            # also after a `dtrain stop` that said it was done: a racing launch may have added
            changes["cleanup"] = self._clear(handle)
        elif stop_requested(handle):
            self._finish_stop(handle, changes.get("instances") or {})
        return Update(status=status, state=Ec2State.changes(**changes), **fields)

    def _observe(self, handle: Handle) -> tuple[str | None, dict[str, Any], dict[str, Any]]:
        """What ``status`` would return (status, fields, state changes), without side effects."""
        if not state_of(handle).launched:
            return self._observe_launch(handle)
        current = self.job_status(handle)
        status = current["status"]
        if handle.status == STOPPING and status not in FINAL_STATUSES:
            # `dtrain stop` terminated the nodes: the job only ends from here, Stopped
            status = STOPPED if status is None else None
        fields: dict[str, Any] = {}
        # a Stopped job keeps the reason it got first: `dtrain stop`'s, or the interruption's
        if current["failure_reason"] and not (status == STOPPED and handle.failure_reason):
            fields["failure_reason"] = current["failure_reason"]
        if status == RUNNING and not handle.started_at:
            fields["started_at"] = self.clock().timestamp()
        return status, fields, {"secondary_status": current.get("secondary_status"),
                                "instances": current["instances"],
                                "model_data": current["model_data"]}

    def _observe_launch(self, handle: Handle) -> tuple[str | None, dict[str, Any], dict]:
        """A job whose ``submit`` has not finished: nothing changes while its launcher runs;
        once that process is gone the job has ended (Failed, or Stopped if `dtrain stop` asked)."""
        owner = state_of(handle).submitter
        # launched from another host (or by an older dtrain): given time, then judged gone
        if judge_submitter(handle, now=self.clock().timestamp())[0] is not False:
            return None, {}, {}
        if handle.status == STOPPING:
            return STOPPED, {"failure_reason": handle.failure_reason or STOP_REASON}, {}
        who = f"pid {owner['pid']} on {owner['host']}" if owner else "its launcher"
        return FAILED, {"failure_reason": f"launch interrupted: the process that launched it "
                                          f"({who}) exited before it recorded its nodes; "
                                          "what it launched is terminated"}, {}

    def _finish_stop(self, handle: Handle, instances: dict[str, str]) -> None:
        """`dtrain stop` was asked but nodes still run (it was cut short, or a launch raced it):
        terminate them; the job ends Stopped once they are gone."""
        running = [i for i, state in instances.items() if state in res.RUNNING_STATES]
        if not running:
            return
        name = handle.job.name
        try:
            self._clients_of(handle)[0].terminate_instances(InstanceIds=running)
        except Exception as exc:  # noqa: BLE001 - the next status call tries again
            self.out.write(f"{name} stopping: could not terminate {', '.join(running)} "
                           f"({aws.as_dtrain_error(exc, 'terminating')}); trying again later\n")
            return
        self.out.write(f"{name} stopping: terminated {len(running)} node(s) still running "
                       f"({', '.join(running)})\n")

    # ---------------------------------------------------------------- groups of ended jobs

    def pending_cleanup(self, handle: Handle) -> PendingCleanup | None:
        return cleanup.pending(handle)

    def _clear(self, handle: Handle) -> Cleanup:
        """Terminate what still runs of an ended job and delete its groups, once; say and
        return the outcome."""
        ec2, s3 = self._clients_of(handle)
        state = state_of(handle)
        if state.launch_token is None:  # it ended before it launched anything
            return Cleanup(state=DONE)
        try:
            grace = None
            if not stop_requested(handle) and state.prefix:  # none after `dtrain stop`
                grace = nodes.peer_grace(nodes.read_status_objects(s3, state.prefix),
                                         now=self.clock().timestamp())
            removal = cleanup.clear_ended_job(ec2, handle.job.name, launch=state.launch_token,
                                              grace=grace)
        except Exception as exc:  # noqa: BLE001 - a failed clean-up must not fail `status`
            removal = cleanup.Removal(left=[f"the groups of {handle.job.name}"], reason=str(
                aws.as_dtrain_error(exc, "finding the groups")))
        return cleanup.entry(handle, removal, now=self.clock().timestamp(), out=self.out,
                             told=self._told_pending)

    # ---------------------------------------------------------------- logs and stop

    def hosts(self, handle: Handle) -> list[str] | None:
        """Once the job ended, the nodes (private IPs) that uploaded logs (None before: a node
        uploads its first every 30 s)."""
        state = state_of(handle)
        if state.launch_token is None or not handle.is_final:
            return None
        prefix = state.prefix or self.describe(handle)["prefix"]
        found = {log.host for log in s3_logs.log_objects(self._clients_of(handle)[1], prefix)}
        return sorted(found) or None

    def logs(self, handle: Handle, *, follow: bool, host: str | None, rank: int | None,
             ended: Callable[[], bool]) -> Iterator[str]:
        """``logformat`` lines from each node's logs in S3 (uploaded every 30 s while it runs)."""
        state = state_of(handle)
        if state.launch_token is None and handle.is_final:
            raise DtrainError(f"job {handle.job.id} has no logs: it was never launched "
                              f"({handle.failure_reason or handle.status})")
        prefix = state.prefix or self.describe(handle)["prefix"]
        s3 = self._clients_of(handle)[1]
        seen: dict[str, int] = {}
        yield from agents.follow(
            lambda final: s3_logs.new_lines(s3, prefix, seen, host=host, rank=rank, final=final),
            follow=follow, ended=ended, poll_s=self.poll_s, sleep=self.sleep)

    def stop(self, handle: Handle, journal: Journal) -> Handle:
        """Terminate every node of the job, then delete the groups dtrain created for it.

        The record says Stopping before anything is terminated: a launch still under way sees
        it before or right after its RunInstances and rolls back, and if this call is cut short
        (Ctrl-C during the wait) ``status`` terminates what still runs. Nodes whose RunInstances
        landed after this call listed the launch are terminated too. A launched job ends
        Stopped here once its nodes are gone. Also for a job that has already ended (one failed
        node ends a job while its peers may still run): whatever of it still runs is
        terminated, and the job keeps its status.
        """
        state = state_of(handle)
        if handle.is_final and state.launch_token is None:
            return handle  # it never got to launch anything
        ended = f" (it had ended: {handle.status})" if handle.is_final else ""
        if not handle.is_final:
            handle = journal.record(Update(status=STOPPING, failure_reason=STOP_REASON,
                                           state=Ec2State.changes(
                                               stop_requested_at=self.clock().timestamp())))
        ec2 = self._clients_of(handle)[0]
        name, launch_token = handle.job.name, state.launch_token
        created = res.job_resources(ec2, name, launch=launch_token)
        if ended and not (created.instances or created.security_groups
                          or created.placement_groups):
            return handle
        left = res.rollback(ec2, None, created, sleep=self.sleep, keep_uploads=True,
                            relist=lambda: res.job_instance_ids(ec2, name, launch=launch_token))
        self.out.write(f"stopped {name}{ended}: terminated {len(created.instances)} node(s)"
                       + (f"; could not remove {', '.join(left)}: run `dtrain ec2 gc`"
                          if left else "") + "\n")
        done = Ec2State.changes(cleanup=cleanup.after_teardown(
            created, left, now=self.clock().timestamp()))
        handle = journal.current()
        if handle.is_final:  # it had ended, or the launch under way rolled back meanwhile
            return journal.record(Update(state=done))
        # a launch still under way finishes the stop itself (it checks around its RunInstances)
        launched = state_of(handle).launched
        under_way = not launched and process.process_alive(state_of(handle).submitter) is not False
        handle = journal.record(Update(status=STOPPING if launched or under_way else STOPPED,
                                       failure_reason=STOP_REASON, state=done))
        if launched:  # its nodes are gone, their last reports written: the job ends here
            try:
                status, fields, changes = self._observe(handle)
            except Exception:  # noqa: BLE001 - stopped all the same; the next status ends it
                return handle
            if status in FINAL_STATUSES:
                handle = journal.record(Update(status=status, state=Ec2State.changes(**changes),
                                               **fields))
        return handle

    # ---------------------------------------------------------------- `dtrain ec2 gc`

    def leftovers(self, handles: Iterable[Handle], *,
                  refresh: Callable[[Handle], Handle] | None = None,
                  include_running: bool = False, min_age_s: float = GC_MIN_AGE_S) -> gc.Leftovers:
        """What `dtrain ec2 gc` removes: ``gc.find_leftovers``, told by ``handles`` (this
        machine's EC2 jobs) which launches ended. A job that has not ended is asked about
        first: ``refresh(handle)`` is the caller's `dtrain status` (it records what ``status``
        returns, and returns the job as recorded then); without it (a dry run) it is only looked
        at, and nothing is terminated or removed. A job that still runs is kept."""
        ec2 = self.client("ec2")
        launches = gc.find_launches(ec2)
        known = {h.state.launch_token: h for h in handles if h.state.launch_token in launches}
        ended = {t for t, h in known.items() if h.is_final}
        newly = {t for t, h in known.items() if t not in ended and self._ended(h, refresh)}
        if refresh is not None and newly:
            launches = gc.find_launches(ec2)  # those status calls removed what they could
        ended |= newly
        return gc.find_leftovers(launches, now=self.clock(), s3=self.client("s3"), ended=ended,
                                 running=set(known) - ended, min_age_s=min_age_s,
                                 include_running=include_running)

    def _ended(self, handle: Handle, refresh: Callable[[Handle], Handle] | None) -> bool:
        try:
            if refresh is None:
                return self._observe(handle)[0] in FINAL_STATUSES
            return refresh(handle).is_final
        except Exception as exc:  # noqa: BLE001 - not known to have ended: kept
            self.out.write(f"keeping {handle.job.name}: its status is unknown ({exc})\n")
            return False

    def remove(self, found: res.Created) -> list[str]:
        """Terminate ``found``'s nodes, wait until they are gone, delete its groups; returns
        what could not be removed."""
        return res.rollback(self.client("ec2"), None, found, sleep=self.sleep, keep_uploads=True)
