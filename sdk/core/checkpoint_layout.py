"""Where a job's checkpoints are and which are complete (stdlib only: read by the node agent, the
EC2 node's checkpoint sync and the trainer alike).

Under the checkpoint folder, ``step-000120/`` is a complete checkpoint once it holds ``COMPLETE``
(written last, before an atomic rename from ``step-000120.tmp``); anything else is ignored.
"""

from __future__ import annotations

import re
from pathlib import Path

COMPLETE = "COMPLETE"
TRAINER_STATE = "trainer.json"
METADATA = ".metadata"
_STEP_DIR = re.compile(r"^step-(\d+)$")


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


def step_of(folder: str | Path) -> int:
    """The step a ``step-000120`` folder holds (ValueError for another name)."""
    match = _STEP_DIR.match(Path(folder).name)
    if match is None:
        raise ValueError(f"{folder} is not a step-N checkpoint folder")
    return int(match.group(1))


def complete_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """``(step, folder)`` of every complete checkpoint under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        if _STEP_DIR.match(child.name) and child.is_dir() and (child / COMPLETE).is_file():
            found.append((step_of(child), child))
    return sorted(found)


def latest_checkpoint(root: str | Path) -> Path | None:
    found = complete_checkpoints(root)
    return found[-1][1] if found else None
