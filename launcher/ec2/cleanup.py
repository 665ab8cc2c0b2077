"""Removing what dtrain created for an EC2 job that has ended, one try per ``status`` call.

A job ends while nodes may still run (a failed node ends it while its peers hang in a
collective), and a security group stays in use while the terminated nodes' network interfaces
detach. So ``clear_ended_job`` never waits: it terminates what still runs, deletes the groups
once no node holds them, and says what is left; ``entry`` turns that into the record's
``Cleanup``, which tells the next ``status`` call whether to try again (for up to
``CLEANUP_RETRY_S``, then `dtrain ec2 gc` is named).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import IO, Any

from dtrain.launcher import aws
from dtrain.launcher.base import Handle, PendingCleanup
from dtrain.launcher.ec2 import resources as res
from dtrain.launcher.ec2.nodes import PeerGrace
from dtrain.launcher.ec2.state import (
    DONE,
    LEFT_FOR_GC,
    PENDING,
    Cleanup,
    join_names,
    retry_hint,
    state_of,
    utc_time,
)

# How long status keeps retrying the removal of an ended job's groups; then `dtrain ec2 gc`.
CLEANUP_RETRY_S = 3600.0


@dataclass
class Removal:
    """One try at clearing an ended job: what went, what is left and why."""

    removed: list[str] = field(default_factory=list)
    left: list[str] = field(default_factory=list)
    reason: str | None = None
    retry: bool = True  # False: EC2 refused for a reason waiting will not fix
    nodes_left: int = 0  # nodes of the launch not terminated yet: no group was tried
    terminated: list[str] = field(default_factory=list)  # nodes this try asked EC2 to terminate
    spared: list[str] = field(default_factory=list)  # a failed job's peers left to upload
    spared_until: float | None = None  # when those are terminated (epoch seconds)


def clear_ended_job(ec2: Any, job: str, *, launch: str | None,
                    grace: PeerGrace | None = None) -> Removal:
    """Terminate what still runs of a job that has ended, and delete its groups; one try.

    Nodes still running are terminated (one already shutting down is left to finish), except
    the peers ``grace`` spares: they may still be stopping and uploading. While a node of the
    launch is not yet terminated its network interfaces hold the security group (and the node
    the placement group), so no group is tried then.
    """
    instances = [i for i in res.job_instances(ec2, job, launch=launch)
                 if i["State"]["Name"] != "terminated"]
    groups = ([(g["GroupId"], lambda g=g["GroupId"]: ec2.delete_security_group(GroupId=g))
               for g in res.job_security_groups(ec2, job, launch=launch)]
              + [(g["GroupName"], lambda n=g["GroupName"]: ec2.delete_placement_group(GroupName=n))
                 for g in res.job_placement_groups(ec2, job, launch=launch)])
    if instances:
        return _terminate_and_spare(ec2, instances, [name for name, _ in groups], grace)
    result = Removal()
    for name, delete in groups:
        error = res.delete_once(delete)
        if error is None:
            result.removed.append(name)
            continue
        result.left.append(name)
        code = aws.error_code(error)
        result.reason = (f"{name} still in use: {code}" if code in res.IN_USE_CODES
                         else str(aws.as_dtrain_error(error, f"deleting {name}")))
        # waiting fixes "in use" and a lost connection, not e.g. a missing permission
        result.retry = result.retry and (code in res.IN_USE_CODES or code is None)
    return result


def _terminate_and_spare(ec2: Any, instances: list[dict[str, Any]], groups: list[str],
                         grace: PeerGrace | None) -> Removal:
    result = Removal(left=groups, nodes_left=len(instances),
                     reason=f"{len(instances)} node(s) not terminated yet")
    result.spared = [i["InstanceId"] for i in instances if grace and grace.spares(i)]
    if result.spared:
        result.spared_until = grace.until
        result.reason += (f"; {len(result.spared)} left running after a peer failed, to "
                          f"stop and upload their logs, until {utc_time(grace.until)}")
    running = [i["InstanceId"] for i in instances if i["State"]["Name"] != "shutting-down"
               and i["InstanceId"] not in result.spared]
    if running:
        try:
            ec2.terminate_instances(InstanceIds=running)
            result.terminated = running
        except Exception as exc:  # noqa: BLE001 - reported; the next call tries again
            code = aws.error_code(exc)
            result.reason += f"; {aws.as_dtrain_error(exc, 'terminating ' + ', '.join(running))}"
            result.retry = code is None or code.startswith(("RequestLimit", "Throttl"))
    return result



def after_teardown(created: res.Created, left: list[str], *, now: float) -> Cleanup:
    """The cleanup entry after a blocking teardown (failed launch, stop)."""
    groups = created.security_groups + created.placement_groups
    if not left:
        return Cleanup(state=DONE, removed=groups)
    return Cleanup(state=PENDING, removed=[g for g in groups if g not in left], left=left,
                   reason="still in use after the teardown's retries", first_try_at=now,
                   tries=1)


def entry(handle: Handle, removal: Removal, *, now: float, out: IO[str],
          told: set[Any]) -> Cleanup:
    """The cleanup entry after one try of ``clear_ended_job``; says what happened on ``out``
    (what is not removed yet once per job: ``told`` holds the jobs already told of)."""
    previous = state_of(handle).cleanup or Cleanup(state=PENDING)
    name = handle.job.name
    removed = [*previous.removed, *removal.removed]
    tries = previous.tries + 1
    if removal.terminated:
        out.write(f"{name} ended: terminated {len(removal.terminated)} node(s) still running "
                  f"({', '.join(removal.terminated)})\n")
    if removal.removed:
        out.write(f"{name} ended: removed {', '.join(removal.removed)} "
                  "(the groups dtrain created for it)\n")
    if not removal.left and not removal.nodes_left:
        return Cleanup(state=DONE, removed=removed)
    if removal.spared:  # left running on purpose: the retry clock starts once they go
        if (handle.job.id, "spared") not in told:
            out.write(f"{name} ended: leaving {len(removal.spared)} node(s) that have not "
                      f"reported running ({', '.join(removal.spared)}) so they can upload their "
                      f"checkpoints; they are terminated at {utc_time(removal.spared_until)} if "
                      f"still running; {retry_hint(handle)}\n")
            told.add((handle.job.id, "spared"))
        return Cleanup(state=PENDING, removed=removed, left=removal.left, reason=removal.reason,
                       nodes_left=removal.nodes_left, spared=removal.spared,
                       spared_until=removal.spared_until, tries=tries)
    first_try = previous.first_try_at or now
    what = ", ".join(removal.left) or f"{removal.nodes_left} node(s)"
    if removal.retry and now - first_try < CLEANUP_RETRY_S:
        if handle.job.id not in told:
            out.write(f"{name} ended: {what} not removed yet ({removal.reason}); "
                      f"{retry_hint(handle)}\n")
            told.add(handle.job.id)
        state = PENDING
    else:
        out.write(f"{name} ended: could not remove {what} ({removal.reason}); "
                  "run `dtrain ec2 gc`\n")
        state = LEFT_FOR_GC
    return Cleanup(state=state, removed=removed, left=removal.left, reason=removal.reason,
                   nodes_left=removal.nodes_left, first_try_at=first_try, tries=tries)


def pending(handle: Handle) -> PendingCleanup | None:
    """What of an ended job ``status`` still tries to remove (its groups, once its nodes have
    terminated), from the record alone."""
    state = state_of(handle)
    if not handle.is_final or not state.cleanup_pending:
        return None
    cleanup = state.cleanup or Cleanup(state=PENDING)
    kinds = {state.security_group_id: "security group", state.placement_group: "placement group"}
    left = [f"{kinds[name]} {name}" if name in kinds else name for name in cleanup.left]
    nodes, spared = cleanup.nodes_left, len(cleanup.spared)
    if spared:
        them = ("the node still running after the failure has uploaded its checkpoints"
                if spared == 1 else f"the {spared} nodes still running after the failure "
                "have uploaded their checkpoints")
        once = (f"{them} and terminated (dtrain terminates {'it' if spared == 1 else 'them'} "
                f"at {utc_time(cleanup.spared_until)} at the latest)")
    elif nodes:
        once = "the node has terminated" if nodes == 1 else f"the {nodes} nodes have terminated"
    else:
        once = "EC2 releases them" + (f" ({cleanup.reason})" if cleanup.reason else "")
    return PendingCleanup(what=join_names(left) or "its nodes", once=once,
                          retry_hint=retry_hint(handle))
