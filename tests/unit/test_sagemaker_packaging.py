"""Source packing and runtime wheel: what goes into S3 and what never does."""

from __future__ import annotations

import io
import tarfile
import zipfile

import pytest
from dtrain.core.errors import DtrainError
from dtrain.launcher import packaging


@pytest.fixture(autouse=True)
def _dtrain_home(tmp_path, monkeypatch):
    monkeypatch.setenv("DTRAIN_HOME", str(tmp_path / "home"))


def tree(root, files):
    for rel in files:
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(rel)
    return root


def test_ignore_files_follow_gitignore_rules(tmp_path):
    src = tree(tmp_path / "src", ["train.py", "a/keep.log", "a/b.log", "build/x.py",
                                  "lib/build/y.py", "docs/build/z.py", "cache.pyc", ".git/HEAD"])
    (src / ".gitignore").write_text("# comment\n*.log\n!a/keep.log\n/build/\n")
    (src / ".dtrainignore").write_text("docs/\n")
    files, secrets = packaging.list_source_files(src)
    assert files == [".dtrainignore", ".gitignore", "a/keep.log", "lib/build/y.py", "train.py"]
    assert secrets == []


def test_secrets_are_never_packed_and_are_reported(tmp_path):
    src = tree(tmp_path / "src", ["train.py", ".env", ".env.prod", "keys/id_rsa", "keys/id_rsa.pub",
                                  "tls/server.pem", "tls/server.key", ".aws/credentials",
                                  "credentials", "conf/.netrc"])
    (src / ".gitignore").write_text("!.env\n")  # an ignore file cannot re-include a secret
    packed = packaging.pack_source(src, tmp_path / "out")
    with tarfile.open(packed.path) as tar:
        assert tar.getnames() == [".gitignore", "train.py"]
        assert tar.getmember("train.py").uid == 0
    assert packed.skipped_secrets == [".aws/", ".env", ".env.prod", "conf/.netrc", "credentials",
                                      "keys/id_rsa", "keys/id_rsa.pub", "tls/server.key",
                                      "tls/server.pem"]


def test_missing_source_dir_is_one_line_error(tmp_path):
    with pytest.raises(DtrainError, match="is not a folder"):
        packaging.list_source_files(tmp_path / "nope")


def test_runtime_wheel_is_reproducible_and_complete(tmp_path):
    first = packaging.build_runtime_wheel(tmp_path / "a").read_bytes()
    second = packaging.build_runtime_wheel(tmp_path / "b").read_bytes()
    assert first == second
    names = zipfile.ZipFile(io.BytesIO(first)).namelist()
    assert "dtrain/runtime/agent/node.py" in names and "dtrain/launcher/sagemaker/sagemaker_entry.sh" in names
    assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")]
    record = zipfile.ZipFile(io.BytesIO(first)).read("dtrain-0.1.0.dist-info/RECORD").decode()
    assert "dtrain/core/contract.py,sha256=" in record


class FakeS3:
    def __init__(self):
        self.calls = []

    def upload_file(self, path, bucket, key, Callback):
        Callback(5)
        self.calls.append((bucket, key))

    def delete_object(self, Bucket, Key):
        self.calls.append(("delete", Bucket, Key))


def test_upload_prints_one_line_when_not_a_terminal(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(b"x" * 2048)
    out, s3 = io.StringIO(), FakeS3()
    packaging.upload_file(s3, path, "s3://bucket/a/b/f.bin", stream=out)
    assert s3.calls == [("bucket", "a/b/f.bin")]
    assert out.getvalue() == "uploaded f.bin (2.0 KiB)\n"
    packaging.delete_objects(s3, ["s3://bucket/a/b/f.bin"])
    assert s3.calls[-1] == ("delete", "bucket", "a/b/f.bin")
