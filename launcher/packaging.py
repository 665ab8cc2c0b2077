"""Code and runtime delivery for the targets that ship code: the cloud ones and Slurm.

* ``pack_source`` makes ``sourcedir.tar.gz`` from ``source_dir``, honouring ``.gitignore`` and
  ``.dtrainignore`` in every folder with git's semantics (``pathspec``), never packing ``.git`` or
  anything that looks like a credential (``SECRET_PATTERNS``, case-insensitive; the secrets it
  skipped are returned so the caller can warn), and refusing links that leave the folder.
* ``build_runtime_wheel`` writes a pure-Python wheel of the dtrain that is running, so a stock AWS
  PyTorch image runs ``python -m dtrain.runtime`` after ``pip install --no-deps <wheel>``. The wheel
  is assembled from the import packages' files rather than with ``pip wheel``: that needs no build
  tools, takes milliseconds, and writes no ``build/`` or ``*.egg-info`` into a source checkout.
* ``place_all`` makes a request's ``Upload`` list in folders of a shared file system (Slurm),
  copying the same files ``pack_source`` would pack.
* ``upload_all`` makes and uploads a request's ``Upload`` list; ``upload_file`` /
  ``delete_objects`` move files to S3 with boto3 (client passed in), with a progress bar on
  stderr when that is a terminal.
"""

from __future__ import annotations

import base64
import fnmatch
import hashlib
import io
import os
import shutil
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from importlib import util as import_util
from pathlib import Path
from typing import IO, Any

import pathspec
from dtrain.core import s3
from dtrain.core.errors import DtrainError
from dtrain.launcher import aws
from dtrain.launcher.base import Upload

SOURCE_ARCHIVE = "sourcedir.tar.gz"
WHEEL = "dtrain-wheel"  # Upload.source of the runtime wheel dtrain builds
SAGEMAKER_ENTRY_SCRIPT = "sagemaker-entry-script"  # Upload.source of SageMaker's entry script
# Ignore files, read in every folder with git's semantics (.dtrainignore after .gitignore, so
# it has the last word; a deeper folder's rules override its parents').
IGNORE_FILES = (".gitignore", ".dtrainignore")
# Never packed, whatever the ignore files say.
ALWAYS_SKIPPED = (".git", "__pycache__", "*.pyc", ".DS_Store")
# Never packed, and named in a warning: shipping these would leak credentials into S3 and the
# container. Matched case-insensitively, on the name or (with a "/") on the path's tail.
SECRET_PATTERNS = (
    ".env", ".env.*", "*.pem", "*.key", "*.p12", "*.pfx", "*.jks", "*.keystore",
    "id_rsa*", "id_dsa*", "id_ecdsa*", "id_ed25519*", ".ssh", ".aws", ".gnupg",
    "credentials", "credentials.json", "*credentials*.json", "service-account*.json",
    "*-sa-key.json", "client_secret*.json", ".netrc", ".pypirc", ".npmrc", ".git-credentials",
    ".pgpass", ".htpasswd", ".dockercfg", ".docker/config.json", ".kube/config",
    ".vault-token", "*.tfstate", "*.tfstate.backup", "secrets.yaml", "secrets.yml",
    "secrets.json",
)
# Source packages of the runtime wheel: import name -> folder inside the wheel.
WHEEL_PACKAGES = ("dtrain", "dtrain.launcher", "dtrain.runtime")
_ZIP_DATE = (2020, 1, 1, 0, 0, 0)  # fixed timestamps: the same code gives the same wheel bytes


@dataclass
class PackedSource:
    path: Path
    files: list[str] = field(default_factory=list)
    skipped_secrets: list[str] = field(default_factory=list)


# ------------------------------------------------------------------ what gets packed

def is_secret(rel: str) -> bool:
    """True for a path that looks like a credential file (case-insensitive)."""
    rel = rel.rstrip("/").lower()
    name = rel.rsplit("/", 1)[-1]
    for pattern in SECRET_PATTERNS:
        if "/" in pattern:
            if rel == pattern or rel.endswith("/" + pattern):
                return True
        elif fnmatch.fnmatchcase(name, pattern):
            return True
    return False


class _IgnoreRules:
    """The ignore files of every folder seen so far, applied as git does."""

    def __init__(self) -> None:
        self._specs: dict[str, pathspec.GitIgnoreSpec] = {}

    def read(self, folder: Path, rel: str) -> None:
        lines: list[str] = []
        for name in IGNORE_FILES:
            path = folder / name
            if path.is_file():
                lines += path.read_text(encoding="utf-8", errors="replace").splitlines()
        if lines:
            self._specs[rel] = pathspec.GitIgnoreSpec.from_lines(lines)

    def ignored(self, rel: str, *, is_dir: bool) -> bool:
        parts = rel.split("/")
        verdict = None
        for depth in range(len(parts)):  # the root's rules first, the deepest folder's last
            base = "/".join(parts[:depth])
            spec = self._specs.get(base)
            if spec is not None:
                tail = "/".join(parts[depth:]) + ("/" if is_dir else "")
                result = spec.check_file(tail).include
                verdict = result if result is not None else verdict
        return bool(verdict)


def _skipped(name: str) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in ALWAYS_SKIPPED)


def _check_link(source: Path, path: Path, rel: str) -> None:
    target = Path(os.path.realpath(path))
    root = Path(os.path.realpath(source))
    if target != root and root not in target.parents:
        raise DtrainError(
            f"source_dir: {rel} links to {target}, outside the source folder; a link leaving "
            "it would not exist in the container: copy the file in, or remove the link")


def list_source_files(source_dir: str | os.PathLike) -> tuple[list[str], list[str]]:
    """``(paths to pack, secrets skipped)``, sorted, relative to ``source_dir``.

    Ignore files apply at every level; links are packed as links when they stay inside the
    folder and refused (DtrainError) when they leave it.
    """
    source = Path(source_dir)
    if not source.is_dir():
        raise DtrainError(f"source_dir {str(source)!r} is not a folder; check the path")
    rules = _IgnoreRules()
    files: list[str] = []
    secrets: list[str] = []
    for folder, dirs, names in os.walk(source):
        base = Path(folder).relative_to(source).as_posix()
        prefix = "" if base == "." else base + "/"
        rules.read(Path(folder), prefix.rstrip("/"))
        kept_dirs = []
        for name in sorted(dirs):
            rel = prefix + name
            if _skipped(name) or rules.ignored(rel, is_dir=True):
                continue
            if is_secret(rel):
                secrets.append(rel + "/")
            elif (Path(folder) / name).is_symlink():  # os.walk does not enter it: a link entry
                _check_link(source, Path(folder) / name, rel)
                files.append(rel)
            else:
                kept_dirs.append(name)
        dirs[:] = kept_dirs
        for name in sorted(names):
            rel = prefix + name
            if _skipped(name) or rules.ignored(rel, is_dir=False):
                continue
            if is_secret(rel):
                secrets.append(rel)
                continue
            if (Path(folder) / name).is_symlink():
                _check_link(source, Path(folder) / name, rel)
            files.append(rel)
    return sorted(files), sorted(secrets)


def pack_source(source_dir: str | os.PathLike, dest_dir: str | os.PathLike) -> PackedSource:
    """Write ``dest_dir/sourcedir.tar.gz`` (files at the archive root, as SageMaker expects)."""
    files, secrets = list_source_files(source_dir)
    dest = Path(dest_dir) / SOURCE_ARCHIVE
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(dest, "w:gz") as tar:
        for rel in files:
            path = os.path.join(source_dir, rel)
            info = tar.gettarinfo(path, arcname=rel)
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            if info.issym():  # relative, so it resolves wherever the archive is unpacked
                info.linkname = os.path.relpath(
                    os.path.realpath(path), os.path.realpath(os.path.dirname(path)))
                tar.addfile(info)
            elif info.isreg():
                with open(path, "rb") as fh:
                    tar.addfile(info, fh)
            else:
                tar.addfile(info)
    return PackedSource(dest, files, secrets)


# ------------------------------------------------------------------ runtime wheel

def _package_dir(name: str) -> Path:
    spec = import_util.find_spec(name)  # no import of the package itself (runtime needs torch)
    if spec is None or not spec.submodule_search_locations:
        raise DtrainError(f"cannot find the installed {name} package to build the runtime wheel; "
                          "reinstall dtrain (pip install -e . or pip install dtrain)")
    return Path(next(iter(spec.submodule_search_locations)))


def _wheel_files() -> list[tuple[str, Path]]:
    """``(path in wheel, file on disk)`` for every file of the three import packages."""
    out = []
    for name in WHEEL_PACKAGES:
        root = _package_dir(name)
        arc_root = name.replace(".", "/")
        for folder, dirs, names in os.walk(root):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__" and not d.startswith("."))
            rel = Path(folder).relative_to(root).as_posix()
            for file in sorted(names):
                if file.endswith((".pyc", ".pyo")) or file.startswith("."):
                    continue
                arc = f"{arc_root}/{file}" if rel == "." else f"{arc_root}/{rel}/{file}"
                out.append((arc, Path(folder) / file))
    return out


def _record_line(arc: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{arc},sha256={digest},{len(data)}"


def wheel_name() -> str:
    """The runtime wheel's file name: what ``build_runtime_wheel`` writes, and what a target's
    node or container installs (they find it in S3 under this name)."""
    from dtrain import __version__

    return f"dtrain-{__version__}-py3-none-any.whl"


def build_runtime_wheel(dest_dir: str | os.PathLike) -> Path:
    """Write ``wheel_name()`` into ``dest_dir`` and return its path.

    No dependencies are declared: containers install it with ``--no-deps`` and the runtime needs
    only the image's torch and the standard library.
    """
    from dtrain import __version__

    dist_info = f"dtrain-{__version__}.dist-info"
    path = Path(dest_dir) / wheel_name()
    path.parent.mkdir(parents=True, exist_ok=True)
    metadata = (f"Metadata-Version: 2.1\nName: dtrain\nVersion: {__version__}\n"
                "Summary: dtrain runtime (built by the dtrain launcher)\n"
                "Requires-Python: >=3.10\n")
    wheel = ("Wheel-Version: 1.0\nGenerator: dtrain.launcher.packaging\n"
             "Root-Is-Purelib: true\nTag: py3-none-any\n")
    records = []
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        entries = [(arc, file.read_bytes()) for arc, file in _wheel_files()]
        entries += [(f"{dist_info}/METADATA", metadata.encode()),
                    (f"{dist_info}/WHEEL", wheel.encode())]
        for arc, data in entries:
            _write_zip_entry(zf, arc, data)
            records.append(_record_line(arc, data))
        records.append(f"{dist_info}/RECORD,,")
        _write_zip_entry(zf, f"{dist_info}/RECORD", ("\n".join(records) + "\n").encode())
    return path


def _write_zip_entry(zf: zipfile.ZipFile, arc: str, data: bytes) -> None:
    info = zipfile.ZipInfo(arc, date_time=_ZIP_DATE)
    info.compress_type = zipfile.ZIP_DEFLATED
    info.external_attr = (0o755 if arc.endswith(".sh") else 0o644) << 16
    zf.writestr(info, data)


# ------------------------------------------------------------------ S3

class _Progress:
    """``\\r``-redrawn bar on a terminal; one summary line otherwise (logs stay readable)."""

    def __init__(self, label: str, total: int, stream: IO[str]):
        self.label, self.total, self.stream, self.done = label, max(total, 1), stream, 0
        self.tty = bool(getattr(stream, "isatty", lambda: False)())

    def __call__(self, chunk: int) -> None:
        self.done += chunk
        if self.tty:
            width = 30
            filled = int(width * min(self.done, self.total) / self.total)
            self.stream.write(f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] "
                              f"{_size(self.done)}/{_size(self.total)}")
            self.stream.flush()

    def finish(self) -> None:
        if self.tty:
            self.stream.write("\n")
        else:
            self.stream.write(f"uploaded {self.label} ({_size(self.total)})\n")
        self.stream.flush()


def _size(num: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if num < 1024 or unit == "GiB":
            return f"{num:.0f} {unit}" if unit == "B" else f"{num:.1f} {unit}"
        num /= 1024
    return f"{num:.1f} GiB"


def upload_file(client: Any, path: str | os.PathLike, uri: str, *,
                stream: IO[str] | None = None) -> str:
    """Upload ``path`` to the S3 object ``uri`` with a progress display; returns ``uri``."""
    bucket, key = s3.split(uri)
    out = stream if stream is not None else sys.stderr
    progress = _Progress(key.rsplit("/", 1)[-1], os.path.getsize(path), out)
    try:
        client.upload_file(str(path), bucket, key, Callback=progress)
    except Exception as exc:
        if aws.error_code(exc) is None:
            raise
        raise aws.as_dtrain_error(exc, f"uploading {Path(path).name} to {uri}") from None
    progress.finish()
    return uri


def delete_objects(client: Any, uris: list[str]) -> None:
    """Best-effort removal of uploaded objects (used when a submission fails after upload)."""
    for uri in uris:
        bucket, key = s3.split(uri)
        try:
            client.delete_object(Bucket=bucket, Key=key)
        except Exception:  # noqa: BLE001, S110 - cleanup must not hide the error that triggered it
            pass


def upload_all(client: Any, uploads: Iterable[Upload], *, stream: IO[str],
               uploaded: list[str], entry_script: str | None = None) -> None:
    """Make and upload each of a request's ``uploads``: the source folder packed (warning about
    each secret left out), the runtime wheel, or ``entry_script``'s text. Every URI goes into
    ``uploaded`` before its upload starts, so the caller can remove a partial upload too."""
    with tempfile.TemporaryDirectory(prefix="dtrain-upload-") as tmp:
        for upload in uploads:
            if upload.source == WHEEL:
                path = build_runtime_wheel(tmp)
            elif upload.source == SAGEMAKER_ENTRY_SCRIPT:
                if entry_script is None:
                    raise DtrainError("an entry-script upload needs the script's text")
                path = Path(tmp) / upload.uri.rsplit("/", 1)[-1]
                path.write_text(entry_script)
            else:
                packed = pack_source(upload.source, tmp)
                for secret in packed.skipped_secrets:
                    stream.write(f"warning: not packing {secret} (looks like a secret)\n")
                path = packed.path
            uploaded.append(upload.uri)
            upload_file(client, path, upload.uri, stream=stream)


def copy_source(source_dir: str | os.PathLike, dest_dir: str | os.PathLike) -> PackedSource:
    """Copy into ``dest_dir`` the files ``pack_source`` would pack (links as links)."""
    files, secrets = list_source_files(source_dir)
    for rel in files:
        source, target = Path(source_dir) / rel, Path(dest_dir) / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_symlink():
            os.symlink(os.readlink(source), target)
        else:
            shutil.copy2(source, target)
    return PackedSource(Path(dest_dir), files, secrets)


def place_all(uploads: Iterable[Upload], *, stream: IO[str]) -> None:
    """For a target whose nodes share the submitting machine's files (Slurm): each of a
    request's ``uploads`` made in the folder its ``uri`` names — the source folder copied
    (warning about each secret left out) or the runtime wheel built there."""
    for upload in uploads:
        if upload.source == WHEEL:
            build_runtime_wheel(upload.uri)
        else:
            for secret in copy_source(upload.source, upload.uri).skipped_secrets:
                stream.write(f"warning: not copying {secret} (looks like a secret)\n")


def read_tar_names(data: bytes) -> list[str]:
    """Member names of a ``.tar.gz`` held in memory (for checks and tests)."""
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        return sorted(tar.getnames())
