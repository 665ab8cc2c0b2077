"""Which checkpoint folders count as complete: only ``step-N`` with a COMPLETE marker."""

from __future__ import annotations

from dtrain.runtime.checkpoint import COMPLETE, complete_checkpoints, latest_checkpoint


def _folder(root, name, *, complete):
    folder = root / name
    folder.mkdir()
    (folder / ".metadata").write_bytes(b"x")
    if complete:
        (folder / COMPLETE).write_text("{}")
    return folder


def test_partial_and_temporary_checkpoints_are_never_chosen(tmp_path):
    _folder(tmp_path, "step-000010", complete=True)
    _folder(tmp_path, "step-000020", complete=False)  # killed before its marker
    _folder(tmp_path, "step-000030.tmp", complete=True)  # killed before its rename
    _folder(tmp_path, "step-abc", complete=True)
    (tmp_path / "step-000040").write_text("a file, not a folder")
    assert latest_checkpoint(tmp_path).name == "step-000010"


def test_steps_are_ordered_numerically_not_by_name(tmp_path):
    _folder(tmp_path, "step-999999", complete=True)
    _folder(tmp_path, "step-1000000", complete=True)
    assert [step for step, _ in complete_checkpoints(tmp_path)] == [999999, 1000000]


def test_no_checkpoint_folder_means_a_fresh_start(tmp_path):
    assert latest_checkpoint(tmp_path / "missing") is None
    assert latest_checkpoint(tmp_path) is None
