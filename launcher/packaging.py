"""Code and runtime delivery for cloud targets (target-neutral: SageMaker now, EC2 later).

* ``pack_source`` makes ``sourcedir.tar.gz`` from ``source_dir``, honouring ``.dtrainignore`` and
  ``.gitignore`` and never packing ``.git`` or secrets (``.env``, keys, ``.aws/``, credentials);
  the secrets it skipped are returned so the caller can warn.
* ``build_runtime_wheel`` writes a pure-Python wheel of the dtrain that is running, so a stock AWS
  PyTorch image runs ``python -m dtrain.runtime`` after ``pip install --no-deps <wheel>``. The wheel
  is assembled from the import packages' files rather than with ``pip wheel``: that needs no build
  tools, takes milliseconds, and writes no ``build/`` or ``*.egg-info`` into a source checkout.
* ``upload_file`` / ``delete_objects`` move it to S3 with boto3 (client passed in), with a
  progress bar on stderr when that is a terminal.
"""

from __future__ import annotations

import base64
import fnmatch
import hashlib
import io
import os
import sys
import tarfile
import zipfile
from dataclasses import dataclass, field
from importlib import util as import_util
from pathlib import Path
from typing import IO, Any

from dtrain.core.errors import DtrainError

SOURCE_ARCHIVE = "sourcedir.tar.gz"
IGNORE_FILES = (".dtrainignore", ".gitignore")
# Never packed, whatever the ignore files say.
ALWAYS_SKIPPED = (".git", "__pycache__", "*.pyc", ".DS_Store")
# Never packed, and reported: shipping these would leak credentials into S3 and the container.
SECRET_PATTERNS = (
    ".env", ".env.*", "*.pem", "*.key", "*.p12", "*.pfx", "id_rsa*", "id_dsa*", "id_ecdsa*",
    "id_ed25519*", ".aws", "credentials", "credentials.json", ".netrc", ".pypirc",
    ".git-credentials",
)
# Source packages of the runtime wheel: import name -> folder inside the wheel.
WHEEL_PACKAGES = ("dtrain", "dtrain.launcher", "dtrain.runtime")
_ZIP_DATE = (2020, 1, 1, 0, 0, 0)  # fixed timestamps: the same code gives the same wheel bytes


@dataclass
class PackedSource:
    path: Path
    files: list[str] = field(default_factory=list)
    skipped_secrets: list[str] = field(default_factory=list)


# ------------------------------------------------------------------ ignore patterns

@dataclass(frozen=True)
class _Rule:
    pattern: str
    negate: bool
    dir_only: bool
    anchored: bool


def _read_rules(source: Path) -> list[_Rule]:
    """gitignore-style rules: ``#`` comments, ``!`` negation, ``dir/``, ``/anchored``, ``**``."""
    rules = []
    for name in IGNORE_FILES:
        path = source / name
        if not path.is_file():
            continue
        for raw in path.read_text(encoding="utf-8", errors="replace").splitlines():
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            negate = line.startswith("!")
            line = line[1:] if negate else line
            dir_only = line.endswith("/")
            line = line.rstrip("/")
            anchored = line.startswith("/") or "/" in line
            rules.append(_Rule(line.lstrip("/"), negate, dir_only, anchored))
    return rules


def _matches(rule: _Rule, rel: str, is_dir: bool) -> bool:
    if rule.dir_only and not is_dir:
        return False
    if rule.anchored:
        pattern = rule.pattern
        return fnmatch.fnmatchcase(rel, pattern) or (
            pattern.startswith("**/") and fnmatch.fnmatchcase(rel, pattern[3:]))
    return fnmatch.fnmatchcase(rel.rsplit("/", 1)[-1], rule.pattern)


def _ignored(rules: list[_Rule], rel: str, is_dir: bool) -> bool:
    ignored = False
    for rule in rules:  # the last matching rule wins, as in git
        if _matches(rule, rel, is_dir):
            ignored = not rule.negate
    return ignored


def _any_match(patterns: tuple[str, ...], name: str) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


# ------------------------------------------------------------------ source archive

def list_source_files(source_dir: str | os.PathLike) -> tuple[list[str], list[str]]:
    """``(files to pack, secrets skipped)`` as sorted paths relative to ``source_dir``."""
    source = Path(source_dir)
    if not source.is_dir():
        raise DtrainError(f"source_dir {str(source)!r} is not a folder; check the path")
    rules = _read_rules(source)
    files: list[str] = []
    secrets: list[str] = []
    for folder, dirs, names in os.walk(source):
        base = Path(folder).relative_to(source).as_posix()
        prefix = "" if base == "." else base + "/"
        kept_dirs = []
        for name in sorted(dirs):
            rel = prefix + name
            if _any_match(SECRET_PATTERNS, name):
                secrets.append(rel + "/")
            elif not _any_match(ALWAYS_SKIPPED, name) and not _ignored(rules, rel, True):
                kept_dirs.append(name)
        dirs[:] = kept_dirs
        for name in sorted(names):
            rel = prefix + name
            if _any_match(SECRET_PATTERNS, name):
                secrets.append(rel)
            elif not _any_match(ALWAYS_SKIPPED, name) and not _ignored(rules, rel, False):
                files.append(rel)
    return sorted(files), sorted(secrets)


def pack_source(source_dir: str | os.PathLike, dest_dir: str | os.PathLike) -> PackedSource:
    """Write ``dest_dir/sourcedir.tar.gz`` (files at the archive root, as SageMaker expects)."""
    files, secrets = list_source_files(source_dir)
    dest = Path(dest_dir) / SOURCE_ARCHIVE
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(dest, "w:gz") as tar:
        for rel in files:
            info = tar.gettarinfo(os.path.join(source_dir, rel), arcname=rel)
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            if info.isreg():
                with open(os.path.join(source_dir, rel), "rb") as fh:
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


def build_runtime_wheel(dest_dir: str | os.PathLike) -> Path:
    """Write ``dtrain-<version>-py3-none-any.whl`` into ``dest_dir`` and return its path.

    No dependencies are declared: containers install it with ``--no-deps`` and the runtime needs
    only the image's torch and the standard library.
    """
    from dtrain import __version__

    dist_info = f"dtrain-{__version__}.dist-info"
    path = Path(dest_dir) / f"dtrain-{__version__}-py3-none-any.whl"
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

def parse_s3_uri(uri: str) -> tuple[str, str]:
    """``s3://bucket/a/b`` -> ``("bucket", "a/b")``."""
    if not uri.startswith("s3://"):
        raise DtrainError(f"{uri!r} is not an s3:// URI; write it as s3://bucket/prefix")
    bucket, _, key = uri[5:].partition("/")
    return bucket, key.strip("/")


def join_s3(uri: str, *parts: str) -> str:
    return "/".join([uri.rstrip("/"), *(p.strip("/") for p in parts)])


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


def upload_file(s3: Any, path: str | os.PathLike, uri: str, *,
                stream: IO[str] | None = None) -> str:
    """Upload ``path`` to the S3 object ``uri`` with a progress display; returns ``uri``."""
    bucket, key = parse_s3_uri(uri)
    out = stream if stream is not None else sys.stderr
    progress = _Progress(key.rsplit("/", 1)[-1], os.path.getsize(path), out)
    s3.upload_file(str(path), bucket, key, Callback=progress)
    progress.finish()
    return uri


def delete_objects(s3: Any, uris: list[str]) -> None:
    """Best-effort removal of uploaded objects (used when a submission fails after upload)."""
    for uri in uris:
        bucket, key = parse_s3_uri(uri)
        try:
            s3.delete_object(Bucket=bucket, Key=key)
        except Exception:  # noqa: BLE001, S110 - cleanup must not hide the error that triggered it
            pass


def read_tar_names(data: bytes) -> list[str]:
    """Member names of a ``.tar.gz`` held in memory (for checks and tests)."""
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        return sorted(tar.getnames())
