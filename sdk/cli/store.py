"""``dtrain store``: the job store itself (where it is, repairing a damaged one)."""

from __future__ import annotations

import click


@click.group("store")
def store_group() -> None:
    """The job store: one SQLite file recording every job (DTRAIN_JOBS_DB, else
    $DTRAIN_HOME/jobs.db), with a backup at most a day old next to it. Many dtrain processes
    may use it at once; on a file system machines share (NFS, Lustre: a home two login nodes
    mount) it keeps a rollback journal instead of WAL, which needs all of them on one machine."""


@store_group.command("path")
def path() -> None:
    """Print where the job store is."""
    from dtrain.core.paths import default_db_path

    click.echo(default_db_path())


@store_group.command("repair")
@click.option("--force", is_flag=True, help="Rebuild even a store that reads whole (it is "
              "moved aside too).")
def repair(force: bool) -> None:
    """Rebuild a damaged store from every job that can still be read, in it or its backup.

    The damaged file is moved aside (jobs.db.damaged-<time>), never deleted; jobs whose record
    cannot be read are named. A store that reads whole is left as it is."""
    from dtrain.jobs.repair import repair as run_repair

    report = run_repair(force=force)
    if report.healthy:
        click.echo(f"the store at {report.path} reads whole ({report.kept} job(s)): nothing to "
                   "repair (--force rebuilds it anyway)")
        return
    click.echo(f"kept {report.kept} job(s) ({report.from_backup} from the backup) in "
               f"{report.path}")
    if report.unreadable:
        click.echo(f"removed {len(report.unreadable)} unreadable record(s): "
                   + ", ".join(report.unreadable))
    if report.moved_aside:
        click.echo(f"the damaged file is at {report.moved_aside}")


COMMANDS = [store_group]
