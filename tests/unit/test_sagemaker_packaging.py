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


def test_ignore_rules_have_gits_semantics_at_every_level(tmp_path):
    src = tree(tmp_path / "src", ["doc/a.txt", "doc/server/arch.txt", "sub/secret.txt",
                                  "sub/keep.txt", "sub/deeper/secret.txt", "train.py"])
    (src / ".gitignore").write_text("doc/*.txt\n")  # a slash anchors it: doc/ only, one level
    (src / "sub" / ".gitignore").write_text("secret.txt\n")  # a nested file, read too
    files, _ = packaging.list_source_files(src)
    assert files == [".gitignore", "doc/server/arch.txt", "sub/.gitignore", "sub/keep.txt",
                     "train.py"]


def test_credential_files_are_recognised_broadly_and_case_insensitively(tmp_path):
    secrets = [".ENV", "ID_RSA", "private.KEY", ".npmrc", ".docker/config.json", ".dockercfg",
               ".kube/config", ".ssh/id_ed25519", "gcp/service-account.json", ".htpasswd",
               "infra/terraform.tfstate", "deploy/secrets.yaml"]
    src = tree(tmp_path / "src", ["train.py", ".docker/daemon.json", *secrets])
    files, skipped = packaging.list_source_files(src)
    assert files == [".docker/daemon.json", "train.py"]
    assert skipped == sorted(s if s != ".ssh/id_ed25519" else ".ssh/" for s in secrets)


def test_links_inside_the_folder_are_packed_as_links_and_links_out_are_refused(tmp_path):
    src = tree(tmp_path / "src", ["train.py", "data/vocab.txt"])
    (src / "vocab.txt").symlink_to(src / "data" / "vocab.txt")  # absolute, inside
    (src / "assets").symlink_to("data")  # a folder, inside
    packed = packaging.pack_source(src, tmp_path / "out")
    with tarfile.open(packed.path) as tar:
        assert tar.getmember("vocab.txt").issym() and \
            tar.getmember("vocab.txt").linkname == "data/vocab.txt"
        assert tar.getmember("assets").issym() and tar.getmember("assets").linkname == "data"
    outside = tmp_path / "elsewhere.txt"
    outside.write_text("x")
    (src / "escape.txt").symlink_to(outside)
    with pytest.raises(DtrainError, match=r"^source_dir: escape.txt links to .*elsewhere.txt, "
                                          r"outside the source folder"):
        packaging.list_source_files(src)
