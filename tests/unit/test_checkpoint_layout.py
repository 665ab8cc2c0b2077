"""Which checkpoint folders count as complete: only ``step-N`` with a COMPLETE marker."""

from __future__ import annotations

from dtrain.runtime.train.checkpoint import COMPLETE, complete_checkpoints, latest_checkpoint


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


def test_the_final_model_is_staged_next_to_model_dir_never_inside_it(tmp_path):
    from dtrain.runtime.train.checkpoint import hf_staging_dir

    staging = hf_staging_dir(tmp_path / "model")
    assert staging == tmp_path / ".model.dtrain-partial"
    assert not staging.is_relative_to(tmp_path / "model")


def test_leftovers_of_a_killed_model_save_are_removed_and_the_model_is_kept(tmp_path):
    from dtrain.runtime.train.checkpoint import hf_staging_dir, remove_partial_model_files

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / ".model.safetensors.dtrain-partial").write_bytes(b"half a copy")
    hf_staging_dir(model).mkdir()
    (hf_staging_dir(model) / "model.safetensors").write_bytes(b"half a save")
    remove_partial_model_files(model)
    assert [p.name for p in tmp_path.iterdir()] == ["model"]
    assert [p.name for p in model.iterdir()] == ["config.json"]


def test_where_the_parent_cannot_take_the_staging_folder_it_goes_inside_and_is_cleaned(tmp_path):
    from dtrain.runtime.train.checkpoint import (
        _publish,
        hf_staging_dir,
        make_staging_dir,
        remove_partial_model_files,
    )

    model = tmp_path / "model"
    assert make_staging_dir(model) == hf_staging_dir(model)  # the usual case: a sibling
    hf_staging_dir(model).rmdir()
    # The sibling cannot be made (root ignores permission bits, so a file stands in its way,
    # as a read-only parent would).
    hf_staging_dir(model).write_text("not a folder")
    staging = make_staging_dir(model)
    assert staging.parent == model and staging.name.startswith(".")
    (staging / "model.safetensors").write_bytes(b"weights")
    remove_partial_model_files(model)  # a save killed here: the agent cleans before upload
    assert list(model.iterdir()) == []
    staging = make_staging_dir(model)
    (staging / "model.safetensors").write_bytes(b"weights")
    (staging / "config.json").write_text("{}")
    _publish(staging, model)
    assert sorted(p.name for p in model.iterdir()) == ["config.json", "model.safetensors"]


def test_a_model_dir_on_another_mount_gets_each_file_copied_then_renamed(tmp_path, monkeypatch):
    import errno
    import os

    from dtrain.runtime.train.checkpoint import _publish

    staging, model = tmp_path / "staging", tmp_path / "model"
    staging.mkdir()
    model.mkdir()
    (staging / "model.safetensors").write_bytes(b"weights")
    (staging / "config.json").write_text('{"new": true}')
    (model / "model.safetensors").write_bytes(b"old weights")
    rename = os.replace
    renamed = []

    def replace_within_one_mount(source, target):
        if os.path.dirname(source) != os.path.dirname(target):
            raise OSError(errno.EXDEV, "Invalid cross-device link")  # a bind-mounted model/
        renamed.append(os.path.basename(target))
        return rename(source, target)

    monkeypatch.setattr(os, "replace", replace_within_one_mount)
    _publish(staging, model)
    assert not staging.exists()
    assert sorted(p.name for p in model.iterdir()) == ["config.json", "model.safetensors"]
    assert (model / "model.safetensors").read_bytes() == b"weights"
    assert renamed == ["model.safetensors", "config.json"]  # atomic per file, config last
