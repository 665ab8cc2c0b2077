"""``dtrain ec2 ...``: EC2-only housekeeping. The lead registers ``ec2`` on the main CLI.

Like the rest of the CLI it parses, calls the launcher and prints; boto3 is imported only when a
command runs.
"""

from __future__ import annotations

import click


@click.group("ec2")
def ec2() -> None:
    """EC2 target housekeeping (resources dtrain created for `target: ec2` jobs)."""


@ec2.command("gc")
@click.option("--dry-run", is_flag=True, help="List what would be removed; remove nothing.")
@click.option("--yes", "-y", is_flag=True, help="Do not ask before removing.")
@click.option("--all", "include_running", is_flag=True,
              help="Also terminate the nodes of running dtrain jobs (and then their groups).")
@click.option("--region", default=None, help="AWS region (default: the boto3 default).")
def gc(dry_run: bool, yes: bool, include_running: bool, region: str | None) -> None:
    """Remove what dtrain created for EC2 jobs and no running job uses.

    Only resources tagged `dtrain:created-by=dtrain` are considered: the security and placement
    groups of jobs that completed, failed or were stopped (`dtrain status` removes them when it
    sees a job end, unless they were still in use then), and the nodes of launches that never
    came up whole (a launcher killed mid-launch). Running jobs are left alone unless --all.
    Untagged resources, such as a placement group named in `ec2.placement_group`, are never
    touched.
    """
    from dtrain.launcher import aws, ec2_resources

    client = aws.make_client("ec2", region=region)
    found = ec2_resources.find_leftovers(client, include_running=include_running)
    items = ([("instance", i) for i in found.instances]
             + [("security group", g) for g in found.security_groups]
             + [("placement group", g) for g in found.placement_groups])
    if not items:
        click.echo("no dtrain leftovers found")
        return
    for kind, name in items:
        click.echo(f"{'would remove' if dry_run else 'remove'} {kind} {name}")
    if dry_run:
        return
    if not yes and not click.confirm(f"remove these {len(items)} resources?", default=False):
        raise click.exceptions.Abort()
    left = ec2_resources.rollback(client, None, found, sleep=_sleep, keep_uploads=True)
    if left:
        from dtrain.errors import DtrainError

        raise DtrainError(f"could not remove {', '.join(left)}; they may still be in use, run "
                          "`dtrain ec2 gc` again in a few minutes")
    click.echo(f"removed {len(items)} resources")


def _sleep(seconds: float) -> None:
    import time

    time.sleep(seconds)


COMMANDS = [ec2]
