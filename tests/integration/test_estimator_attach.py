"""Estimator.attach finds a submitted job again; model_data says where its model went."""

from __future__ import annotations

from pathlib import Path

import pytest
from dtrain.core.errors import DtrainError
from dtrain.estimator import Estimator

SCRIPT = """import os, pathlib
pathlib.Path(os.environ["SM_MODEL_DIR"], "model.txt").write_text("trained")
"""


def test_attach_and_model_data_of_a_finished_local_job(tmp_path):
    (tmp_path / "train.py").write_text(SCRIPT)
    est = Estimator(entry_point="train.py", source_dir=str(tmp_path), name="attach-me",
                    output_path=str(tmp_path / "out"))
    with pytest.raises(DtrainError, match="no job yet"):
        _ = est.model_data
    record = est.fit(wait=True)
    assert record.status == "Completed", record.failure_reason

    attached = Estimator.attach("attach-me")
    assert attached.latest_job.id == record.id
    assert attached.spec().entry_point == "train.py"
    # the model folder itself (rank 0's host's), not the job folder around it
    assert (Path(attached.model_data) / "model.txt").read_text() == "trained"
    assert est.model_data == attached.model_data


def test_fit_of_a_failed_job_raises_with_its_reason_as_submit_exits_1(tmp_path):
    # fit returned the Failed record silently: nothing printed, nothing raised
    (tmp_path / "train.py").write_text("raise ValueError('bad batch')\n")
    est = Estimator(entry_point="train.py", source_dir=str(tmp_path), name="fails",
                    output_path=str(tmp_path / "out"))
    with pytest.raises(DtrainError, match=r"job \w+ Failed: rank 0 on algo-1 exited with code 1: "
                                          r"ValueError: bad batch"):
        est.fit()
    assert est.latest_job.status == "Failed"
