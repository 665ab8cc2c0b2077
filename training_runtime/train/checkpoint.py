"""Sharded, atomic training checkpoints with ``torch.distributed.checkpoint`` (DCP).

Layout under the contract's checkpoint folder (``DTRAIN_CHECKPOINT_DIR``)::

    step-000120/            a complete checkpoint
        .metadata, __0_0.distcp, ...   model + optimizer, each rank writing its own shards
        trainer.json        step, data position, loss scale (the same on every rank)
        rng/rank-00003.pt   that rank's torch / numpy / python RNG states
        COMPLETE            written last
    step-000130.tmp/        being written (or abandoned by a crash): never loaded

A checkpoint is written to ``step-N.tmp``, every rank finishes (barrier), then ``COMPLETE`` is
written and the folder renamed to ``step-N`` — a rename is atomic, so a reader sees a whole
checkpoint or none. Only folders named ``step-N`` that hold ``COMPLETE`` are loaded, and on resume
only those where every rank finds the files it wrote, whole (:func:`missing_files`).

The folder should be shared by all hosts (the local target, a shared file system). Where each
host has its own folder that a sync merges later (SageMaker's and dtrain's EC2 checkpoint upload
to one S3 prefix), every host's first worker writes the metadata, ``COMPLETE`` and renames too,
so the merged copy is complete; resuming then needs the merged copy on every host, which is what
those targets restore before the job starts.
"""

from __future__ import annotations

import errno
import io
import json
import os
import random
import re
import shutil
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from dtrain.core.checkpoint_layout import (
    COMPLETE,
    METADATA,
    TRAINER_STATE,
    complete_checkpoints,
    latest_checkpoint,
    step_dir_name,
)
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

# The optimizer's state and settings keyed by parameter name, as torchtitan saves them: pipeline
# stages hold different parameters, and param groups saved as lists would be written once (the
# lists of rank 0's stage) and read back into every stage. Checkpoints written before kept lists
# (``optim.param_groups.0.params``); they still load.
FLAT_OPTIMIZER = StateDictOptions(flatten_optimizer_state_dict=True)
_LIST_GROUPS = "optim.param_groups.0.params"


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
             "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class NoSpaceError(OSError):
    """A checkpoint or model save found its disk full; the message names the path and the fix."""

    def __init__(self, what: str) -> None:
        super().__init__(errno.ENOSPC, f"no space left on device {what}")

    def __str__(self) -> str:
        return self.strerror


FULL_DISK_BYTES = 2**20  # less free than this after a failed write: the disk is full


def is_no_space(exc: BaseException, folder: str | Path) -> bool:
    """Whether ``exc``, raised while writing to ``folder``, comes from a full disk: ENOSPC in it,
    its causes or the ranks' failures DCP gathered, or (since torch's serializer can turn a
    short write into an unrelated RuntimeError) hardly any space left there."""
    pending, seen = [exc], set()
    while pending:
        error = pending.pop()
        if error is None or id(error) in seen:
            continue
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno == errno.ENOSPC:
            return True
        failures = getattr(error, "failures", None)
        if isinstance(failures, dict):
            pending += [f[0] if isinstance(f, tuple) else f for f in failures.values()
                        if isinstance(f, (tuple, BaseException))]
        pending += [error.__cause__, error.__context__]
    try:
        return shutil.disk_usage(folder).free < FULL_DISK_BYTES
    except OSError:
        return False


def free_space(folder: str | Path) -> str:
    try:
        return f"{shutil.disk_usage(folder).free / 2**20:.1f} MiB"
    except OSError:
        return "unknown space"


class CheckpointManager:
    """Save and restore model, optimizer, trainer state and RNG for all ranks (collective calls)."""

    def __init__(self, root: str | Path, *, keep_last: int = 2) -> None:
        if keep_last < 1:
            raise ValueError(f"checkpoint keep_last must be >= 1, got {keep_last}")
        self.root = Path(root)
        self.keep_last = keep_last
        self.rank = dist.get_rank()
        self.root.mkdir(parents=True, exist_ok=True)
        self.shared = self._probe_shared()
        local_rank = int(os.environ.get("LOCAL_RANK", self.rank))
        # One writer per folder: global rank 0, or each host's first worker when not shared.
        self.is_writer = self.rank == 0 or (not self.shared and local_rank == 0)

    def _probe_shared(self) -> bool:
        """Whether every rank sees rank 0's files in ``root`` (one collective, at start)."""
        name = [f".probe-{uuid.uuid4().hex}" if self.rank == 0 else ""]
        dist.broadcast_object_list(name, src=0)
        probe = self.root / name[0]
        if self.rank == 0:
            probe.touch()
        dist.barrier()
        seen = torch.tensor([1 if probe.exists() else 0])
        dist.all_reduce(seen, op=dist.ReduceOp.MIN)
        dist.barrier()
        if self.rank == 0:
            probe.unlink(missing_ok=True)
        return bool(seen.item())

    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
             trainer_state: dict[str, Any]) -> Path:
        """Write ``step-N`` atomically (module docstring); every rank must call it.

        A save that fails removes what it wrote, so a full disk gets back the room the error
        report and the logs need, and the complete checkpoints stay as they were; a full disk
        raises :class:`NoSpaceError` naming the folder.
        """
        final = self.root / step_dir_name(step)
        tmp = final.with_name(final.name + ".tmp")
        try:
            return self._save(step, final, tmp, model, optimizer, trainer_state)
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            free, full = free_space(self.root), is_no_space(exc, self.root)
            if self.is_writer:
                shutil.rmtree(tmp, ignore_errors=True)
            if not full:
                raise
            latest = latest_checkpoint(self.root)
            kept = f"the last complete checkpoint, {latest}, is intact" if latest else \
                "no complete checkpoint was written before"
            raise NoSpaceError(f"writing checkpoint {tmp} ({free} free there); "
                               f"free space on that disk or point checkpoint.uri at a larger "
                               f"one; {kept}") from exc

    def _save(self, step: int, final: Path, tmp: Path, model: nn.Module,
              optimizer: torch.optim.Optimizer, trainer_state: dict[str, Any]) -> Path:
        if self.is_writer:
            shutil.rmtree(tmp, ignore_errors=True)  # an earlier attempt that was killed
            tmp.mkdir(parents=True)
        dist.barrier()
        tmp.mkdir(parents=True, exist_ok=True)
        model_sd, optim_sd = get_state_dict(model, optimizer, options=FLAT_OPTIMIZER)
        ties = all_tie_groups(model_sd)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp)
        (tmp / "rng").mkdir(exist_ok=True)
        rng = io.BytesIO()
        torch.save(rng_state(), rng)
        _write_synced(tmp / "rng" / f"rank-{self.rank:05d}.pt", rng.getvalue())
        metadata = self._share_metadata(tmp)
        if self.is_writer:
            if metadata is not None:
                _write_synced(tmp / METADATA, metadata)
            # synced before COMPLETE, as DCP syncs its shards: a power cut cannot leave a
            # complete-looking folder with a torn file
            _write_synced(tmp / TRAINER_STATE, json.dumps({"step": step, **trainer_state}))
            _write_synced(tmp / COMPLETE, json.dumps({"step": step,
                                                      "world_size": dist.get_world_size(),
                                                      "state_layout": state_layout(model),
                                                      "tied": ties}))
            # a folder of this step already here is one resume passed over (files missing)
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            _fsync_dir(self.root)
            self._prune(step)
        dist.barrier()
        return final

    def _share_metadata(self, tmp: Path) -> bytes | None:
        """Rank 0's DCP metadata for hosts that cannot see rank 0's folder; barrier included."""
        dist.barrier()  # every rank's shards and RNG file are written
        if self.shared:
            return None
        payload = [(tmp / METADATA).read_bytes() if self.rank == 0 else None]
        dist.broadcast_object_list(payload, src=0)
        return payload[0] if self.rank != 0 else None

    def _prune(self, saved: int) -> None:
        """Keep the newest ``keep_last`` up to the step just ``saved``; newer folders are ones
        resume passed over (files missing) and count for nothing."""
        found = [(step, folder) for step, folder in complete_checkpoints(self.root)
                 if step <= saved]
        for _, folder in found[:-self.keep_last]:
            shutil.rmtree(folder, ignore_errors=True)
        newest = found[-1][0] if found else -1
        for stale in self.root.glob("step-*.tmp"):  # abandoned by a crash before the newest
            match = re.match(r"^step-(\d+)\.tmp$", stale.name)
            if match and int(match.group(1)) < newest:
                shutil.rmtree(stale, ignore_errors=True)

    def latest(self) -> Path | None:
        """The newest complete checkpoint as rank 0 sees it (all ranks agree), passing over one
        where a rank finds its own files missing or cut short in its copy (its shards, named
        ``__<rank>_`` by DCP, and the shared files): a merged copy can lack a host's shards (that
        host died between its own ``COMPLETE`` and the upload, or a sync copied ``COMPLETE``
        first). Each rank checks only what it wrote, so per-host folders, which hold only their
        host's shards, pass; that rank says which files, and the one before is taken."""
        steps = [[step for step, _ in complete_checkpoints(self.root)] if self.rank == 0 else None]
        dist.broadcast_object_list(steps, src=0)
        candidates: list[int] = steps[0]
        broken = torch.tensor([1.0 if self._own_files_missing(step) else 0.0
                               for step in candidates] or [0.0])
        dist.all_reduce(broken, op=dist.ReduceOp.MAX)  # CPU: gloo serves it with NCCL too
        usable = [step for step, bad in zip(candidates, broken.tolist()) if not bad]
        if not usable:
            return None
        path = self.root / step_dir_name(usable[-1])
        if not (path / COMPLETE).is_file():
            raise ValueError(
                f"rank {self.rank} cannot see checkpoint {path} that rank 0 resumes from; give "
                "every host the same checkpoint folder (a shared file system or a restored copy)"
            )
        return path

    def _own_files_missing(self, step: int) -> bool:
        """Whether this rank's copy of ``step`` lacks files it wrote (said on stdout); a copy
        this rank cannot see at all is ``load``'s error, not a broken checkpoint."""
        folder = self.root / step_dir_name(step)
        if not (folder / COMPLETE).is_file():
            return False
        missing = missing_files(folder, rank=self.rank)
        if missing:
            print(f"dtrain: not resuming from {folder}: {', '.join(missing[:3])} missing or "
                  "cut short; trying the checkpoint before it", flush=True)
        return bool(missing)

    def load(self, path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer
             ) -> dict[str, Any]:
        """Restore ``path`` into ``model``/``optimizer`` and this rank's RNG; returns trainer state."""
        path = Path(path)
        if not (path / COMPLETE).is_file():
            raise ValueError(f"{path} is not a complete checkpoint (no {COMPLETE} marker); "
                             "pass a step-N folder written by CheckpointManager.save")
        saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
        options = StateDictOptions() if _LIST_GROUPS in saved else FLAT_OPTIMIZER
        model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
        check_parameters(path, saved, model_sd)  # another model's: names, shapes, ties
        check_state_layout(path, model)  # this model's, laid out as an older dtrain did
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"], options=options)
        rng_file = path / "rng" / f"rank-{self.rank:05d}.pt"
        if rng_file.is_file():  # absent when resuming on a different world size
            set_rng_state(torch.load(rng_file, weights_only=False))
        return json.loads((path / TRAINER_STATE).read_text())


def state_layout(model: nn.Module) -> dict[str, Any]:
    """How ``model`` lays out its parameters (a dtrain family's ``state_layout``; 1 for others),
    recorded in each checkpoint's ``COMPLETE``."""
    return {"model": getattr(model, "model_type", "") or type(model).__name__,
            "version": getattr(model, "state_layout", 1)}


def check_state_layout(path: Path, model: nn.Module) -> None:
    """Refuse a checkpoint whose parameters are laid out differently from ``model``'s: loading
    it would give wrong weights without an error. A checkpoint without the record is version 1."""
    try:
        saved = json.loads((path / COMPLETE).read_text()).get("state_layout") or {}
    except (OSError, ValueError, AttributeError):
        saved = {}
    ours = state_layout(model)
    if saved.get("model") == "PipelineModel":
        # written by pipelined runs before the family's layout was recorded for them (pipelining
        # came after the last layout change): the family's current layout
        return
    if saved.get("version", 1) != ours["version"]:
        raise ValueError(
            f"checkpoint {path} holds {ours['model']}'s parameters in layout "
            f"{saved.get('version', 1)}, and this dtrain's {ours['model']} uses layout "
            f"{ours['version']} (GPT-2's c_attn became per head in layout 2); it cannot be "
            "loaded as is: start a new job from the final model that job exported (its model/ "
            "folder, in Hugging Face format), or resume it with the dtrain that wrote it")


def tie_groups(state_dict: dict[str, Any]) -> list[list[str]]:
    """The names under which this rank's state dict holds one parameter several times (tied
    embeddings), sorted: those whose local tensors share storage. The state dict's names, not
    the module's (no ``_orig_mod.`` of a compiled model, no activation-checkpoint wrapper)."""
    names: dict[tuple, list[str]] = {}
    for name, value in state_dict.items():
        if not isinstance(value, torch.Tensor):
            continue
        local = value.to_local() if hasattr(value, "to_local") else value
        if local.numel():  # an empty shard has no storage to tell by
            names.setdefault((local.data_ptr(), tuple(local.shape), local.stride()),
                             []).append(name)
    return sorted(sorted(group) for group in names.values() if len(group) > 1)


def all_tie_groups(state_dict: dict[str, Any]) -> list[list[str]]:
    """:func:`tie_groups` of every rank's part of the model (collective)."""
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, tie_groups(state_dict))
    return [list(group) for group in
            sorted({tuple(group) for groups in everyone for group in groups})]


def check_parameters(path: Path, saved: dict[str, Any], model_sd: dict[str, Any]) -> None:
    """Refuse a checkpoint of another model: DCP loads the tensors the model asks for and ignores
    the rest, so a model with fewer layers resumed silently from part of the weights (and one
    with more failed on a bare missing key); a tied embedding loaded the saved head into both.
    Every rank gathers every rank's names, shapes and ties (a pipeline stage holds only its
    own), so all raise the same error or none does."""
    ours = {f"model.{name}": tuple(value.shape) for name, value in model_sd.items()
            if isinstance(value, torch.Tensor)}
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, ours)
    model = {name: shape for rank_names in everyone for name, shape in rank_names.items()}
    ties = [tuple(group) for group in all_tie_groups(model_sd)]
    stored = {name: tuple(meta.size) for name, meta in saved.items()
              if name.startswith("model.") and isinstance(meta, TensorStorageMetadata)}
    lacks = [name for name in model if name not in stored]  # in the models' own order
    extra = [name for name in stored if name not in model]
    reshaped = [name for name in model if name in stored and model[name] != stored[name]]
    try:  # recorded since ties were checked; None before
        saved_ties = json.loads((path / COMPLETE).read_text()).get("tied")
    except (OSError, ValueError, AttributeError):
        saved_ties = None
    tied_there = [] if saved_ties is None else sorted(tuple(g) for g in saved_ties)
    retied = saved_ties is not None and tied_there != [tuple(g) for g in ties]
    if not (lacks or extra or reshaped or retied):
        return

    def names(found: list[str]) -> str:
        shown = ", ".join(name[len("model."):] for name in found[:3])
        return shown + (f" and {len(found) - 3} more" if len(found) > 3 else "")

    differences = ([f"it lacks this model's {names(lacks)}"] if lacks else []) + (
        [f"it holds {names(extra)}, which this model has not"] if extra else []) + [
        f"{name[len('model.'):]} is {list(stored[name])} there and {list(model[name])} here"
        for name in reshaped[:3]]
    if retied:
        differences.append(f"one parameter under several names there: {_ties(tied_there)}, "
                           f"and here: {_ties(ties)}")
    raise ValueError(
        f"checkpoint {path} was written by a different model: {'; '.join(differences)}. "
        "Resume it with the model settings that wrote it, or start afresh with a new "
        "checkpoint location (checkpoint.uri)")


def _ties(groups: list) -> str:
    return ", ".join(" = ".join(group) for group in groups) if groups else "none"


PARTIAL_SUFFIX = ".dtrain-partial"
MODEL_INFO = "dtrain_model.json"  # beside a model saved as a safetensors state dict


def hf_staging_dir(folder: str | Path) -> Path:
    """Where :func:`save_hf_model` writes before moving the files into ``folder``.

    A hidden sibling (``/opt/ml/.model.dtrain-partial`` for ``/opt/ml/model``), never a folder
    inside it: SageMaker and dtrain's EC2 nodes upload everything under ``model/`` as the
    model artifact, so a save killed half-way must leave nothing there. The same parent keeps it
    on the same file system, so the moves are renames.
    """
    folder = Path(folder)
    return folder.parent / f".{folder.name}{PARTIAL_SUFFIX}"


def remove_partial_model_files(folder: str | Path) -> None:
    """Delete what a model save that was killed left behind (staging folders, half-copied files)."""
    folder = Path(folder)
    shutil.rmtree(hf_staging_dir(folder), ignore_errors=True)
    for partial in folder.glob(f".*{PARTIAL_SUFFIX}"):
        if partial.is_dir():
            shutil.rmtree(partial, ignore_errors=True)
        else:
            partial.unlink(missing_ok=True)


def make_staging_dir(folder: str | Path) -> Path:
    """A fresh, empty :func:`hf_staging_dir`; inside ``folder`` (hidden) only where the parent
    cannot take it, e.g. a model folder mounted under a read-only path. That fallback is removed
    by the next save and by the node agent before anything is uploaded."""
    folder = Path(folder)
    try:
        staging = hf_staging_dir(folder)
        staging.mkdir()
    except OSError:
        staging = folder / f".staging{PARTIAL_SUFFIX}"
        folder.mkdir(parents=True, exist_ok=True)
        staging.mkdir()
    return staging


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's full tensors on rank 0, empty elsewhere (collective); for pipeline
    stages, every stage's."""
    gather = getattr(model, "gather_full_state_dict", None)
    if callable(gather):
        return gather()
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                cpu_offload=True))


def save_hf_model(model: nn.Module, folder: str | Path) -> Path:
    """Gather the full weights and write a Hugging Face folder from rank 0 (collective).

    The files are written to :func:`make_staging_dir` and then moved in one by one, ``config.json``
    last, so a save cut off half-way leaves the previous model (or none) and no partial files.
    """
    full = full_state_dict(model)  # pipeline stages: all of them; empty on ranks other than 0
    folder = Path(folder)
    if dist.get_rank() == 0:
        from dtrain.runtime.models import layout_model
        from dtrain.runtime.models.hf_io import save_pretrained

        plain = layout_model(model.hf_config_dict())  # on rank 0 only: the RNG stays in step
        plain.to_empty(device="cpu")
        plain.tie_weights()
        missing, unexpected = plain.load_state_dict(full, strict=False)
        tied = set(getattr(plain, "_tied_weights_keys", {}))
        assert not unexpected and set(missing) <= tied, (missing, unexpected)
        remove_partial_model_files(folder)  # left by a save that was killed
        staging = save_pretrained(plain, make_staging_dir(folder))
        folder.mkdir(parents=True, exist_ok=True)
        _publish(staging, folder)
    dist.barrier()
    return folder


def _publish(staging: Path, folder: Path, *, last: str | None = None) -> None:
    """Move a finished model save from ``staging`` into ``folder``; the file that describes the
    weights (``last``: ``config.json`` of an HF save, else ``dtrain_model.json``) goes in last."""
    from dtrain.runtime.models.hf_io import CONFIG_NAME

    last = last or CONFIG_NAME
    for descriptor in (CONFIG_NAME, MODEL_INFO):  # an old one never describes new weights
        (folder / descriptor).unlink(missing_ok=True)
    for stale in folder.glob("model*.safetensors*"):  # shards and index of an earlier save
        stale.unlink()
    for item in sorted(staging.iterdir(), key=lambda path: path.name == last):
        _move_file(item, folder / item.name)
    staging.rmdir()


def _move_file(source: Path, target: Path) -> None:
    """Atomically replace ``target`` with ``source``; a copy under a hidden name first when
    they are on different mounts (a ``model/`` bind-mounted on its own)."""
    try:
        os.replace(source, target)
    except OSError as err:
        if err.errno != errno.EXDEV:
            raise
        partial = target.with_name(f".{target.name}{PARTIAL_SUFFIX}")
        shutil.copyfile(source, partial)
        os.replace(partial, target)
        source.unlink()


def missing_files(folder: Path, *, rank: int | None = None) -> list[str]:
    """Files a checkpoint folder needs that are absent or shorter than its metadata says; with
    ``rank``, of the shards only those that rank wrote (DCP names them ``__<rank>_...``)."""
    if not (folder / TRAINER_STATE).is_file():
        return [TRAINER_STATE]
    try:
        storage = dcp.FileSystemReader(str(folder)).read_metadata().storage_data
    except Exception:  # noqa: BLE001 -- absent, cut short or not DCP's: not loadable either way
        return [METADATA]
    needed: dict[str, int] = {}
    for info in storage.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0),
                                         info.offset + info.length)
    mine = "" if rank is None else f"__{rank}_"
    return sorted(name for name, size in needed.items() if name.startswith(mine) and
                  (not (folder / name).is_file() or (folder / name).stat().st_size < size))


def _write_synced(path: Path, data: str | bytes) -> None:
    with open(path, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
