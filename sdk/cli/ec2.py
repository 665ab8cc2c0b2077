"""``dtrain ec2 ...``: EC2-only housekeeping. The lead registers ``ec2`` on the main CLI.

Like the rest of the CLI it parses, calls the launcher and prints; boto3 is imported only when a
command runs.
"""

from __future__ import annotations

from typing import Any

import click


@click.group("ec2")
def ec2() -> None:
    """EC2 target housekeeping (resources dtrain created for `target: ec2` jobs)."""


@ec2.command("gc")
@click.option("--dry-run", is_flag=True, help="List what would be removed; remove nothing.")
@click.option("--yes", "-y", is_flag=True, help="Do not ask before removing.")
@click.option("--min-age", "min_age_min", type=click.FloatRange(min=0), default=30,
              show_default=True, metavar="MINUTES",
              help="Leave launches younger than this alone when no job record says they "
                   "ended (they may still be launching); 0 includes them.")
@click.option("--all", "include_running", is_flag=True,
              help="Also terminate the nodes of running dtrain jobs (and then their groups), "
                   "whatever their age.")
@click.option("--region", default=None, help="AWS region (default: the boto3 default).")
def gc(dry_run: bool, yes: bool, min_age_min: float, include_running: bool,
       region: str | None) -> None:
    """Remove what dtrain created for EC2 jobs and no running job uses.

    Only resources tagged `dtrain:created-by=dtrain` are considered, launch by launch (the
    `dtrain:launch` tag). A launch whose job record (in this machine's job store, refreshed
    first) says the job ended loses its live nodes and its security and placement groups: for
    example the peers of a failed node still running. A launch whose record says the job still
    runs is kept. A launch without a record is kept while younger than --min-age; after that
    its groups go once none of its nodes is live, and its nodes too when fewer than the job's
    node count were ever launched (a launcher killed mid-launch) or the nodes' own status
    objects say the job ended. Either way, while a node reported a failure less than 10 minutes
    ago, a launch whose other nodes have not reported and still run is kept: they stop their
    workers on seeing the report and upload their last logs. --all removes every tagged resource. Untagged
    resources, such as a placement group named in `ec2.placement_group`, are never touched.
    """
    from dtrain.launcher.ec2.state import utc_time

    leftovers, launcher = _leftovers(region, dry_run=dry_run, include_running=include_running,
                                     min_age_s=min_age_min * 60)
    found = leftovers.remove
    items = ([("instance", i) for i in found.instances]
             + [("security group", g) for g in found.security_groups]
             + [("placement group", g) for g in found.placement_groups])
    if leftovers.too_recent:
        click.echo(f"keeping {len(leftovers.too_recent)} resource(s) of launches younger than "
                   f"{min_age_min:g} min ({', '.join(leftovers.too_recent)}); --min-age 0 "
                   "includes them")
    if leftovers.finishing:
        click.echo(f"keeping {len(leftovers.finishing)} resource(s) of failed jobs whose other "
                   "nodes may still be stopping and uploading their logs, until "
                   f"{utc_time(leftovers.finishing_until)} "
                   f"({', '.join(leftovers.finishing)}); --all includes them")
    if not items:
        click.echo("no dtrain leftovers found")
        return
    for kind, name in items:
        click.echo(f"{'would remove' if dry_run else 'remove'} {kind} {name}")
    if dry_run:
        return
    from dtrain.core.errors import DtrainError

    if not yes:
        try:
            agreed = click.confirm(f"remove these {len(items)} resources?", default=False)
        except click.exceptions.Abort:  # no terminal to answer from, or Ctrl-C: a "no"
            click.echo(err=True)
            agreed = False
        if not agreed:
            raise DtrainError("nothing removed; answer y, or pass --yes to remove them without "
                              "asking")
    left = launcher.remove(found)
    if left:
        raise DtrainError(f"could not remove {', '.join(left)}; they may still be in use, run "
                          "`dtrain ec2 gc` again in a few minutes")
    click.echo(f"removed {len(items)} resources")


def _leftovers(region: str | None, *, dry_run: bool, include_running: bool,
               min_age_s: float) -> tuple[Any, Any]:
    """The EC2 backend's leftovers, told of this machine's EC2 jobs; unless ``dry_run``, each
    job not ended yet is refreshed first as `dtrain status` does (and that is recorded)."""
    from dtrain.jobs import api
    from dtrain.jobs.store import JobStore

    store = JobStore()
    launcher = api.launcher_for("ec2", {"region": region})
    handles = [api.handle_of(record, launcher) for record in store.list(target="ec2")]

    def refresh(handle: Any) -> Any:
        record = api.refresh(store.get(handle.job.id), launcher, store)
        return api.handle_of(record, launcher)

    found = launcher.leftovers(handles, refresh=None if dry_run else refresh,
                               include_running=include_running, min_age_s=min_age_s)
    return found, launcher


COMMANDS = [ec2]
