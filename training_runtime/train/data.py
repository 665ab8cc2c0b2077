"""Token dataset channels and a resumable, deterministic distributed loader.

A channel holds ``tokens.bin`` (token ids, native byte order, read through ``numpy.memmap``)
and a sidecar ``tokens.json`` saying how to read it::

    {"format": "dtrain-tokens/1", "dtype": "uint16", "num_tokens": 123456,
     "vocab_size": 260, "tokenizer": {"type": "byte", "special_tokens": {"<|endoftext|>": 256}}}

``python -m dtrain.runtime.train.tokenize`` writes one from text files.

The loader cuts the token stream into non-overlapping windows and visits them in a seeded
permutation per epoch. Every micro-step takes the next ``micro_batch_size × dp_world_size``
windows of that order and data-parallel rank ``r`` keeps the ``r``-th slice, so the ranks read
disjoint data, the global batch does not depend on how it is split, and the whole position is
two integers (epoch, micro-steps into the epoch) that a checkpoint saves and restores.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

FORMAT = "dtrain-tokens/1"
TOKENS_FILE = "tokens.bin"
META_FILE = "tokens.json"
_DTYPES = ("uint8", "uint16", "uint32", "int32", "int64")


@dataclass(frozen=True)
class TokenDataset:
    """A flat array of token ids plus what the tokenizer recorded about it."""

    tokens: np.ndarray  # 1-D, a memmap for channels on disk
    meta: dict[str, Any]

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    @property
    def special_tokens(self) -> dict[str, int]:
        return dict(self.meta.get("tokenizer", {}).get("special_tokens", {}))

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @classmethod
    def open(cls, path: str | Path) -> TokenDataset:
        """Open a channel folder (``tokens.bin`` + ``tokens.json``) or a ``.bin`` file."""
        path = Path(path)
        bin_path = path / TOKENS_FILE if path.is_dir() else path
        meta_path = bin_path.with_suffix(".json")
        if not bin_path.is_file() or not meta_path.is_file():
            raise ValueError(
                f"{path} is not a token channel: expected {bin_path.name} and {meta_path.name}; "
                "build one with `python -m dtrain.runtime.train.tokenize --input TEXT --output DIR`"
            )
        meta = json.loads(meta_path.read_text())
        dtype = meta.get("dtype")
        if dtype not in _DTYPES:
            raise ValueError(f"{meta_path}: dtype {dtype!r} is not one of {_DTYPES}; rebuild "
                             "the channel with dtrain.runtime.train.tokenize")
        if bin_path.stat().st_size == 0:  # np.memmap: "cannot mmap an empty file", naming none
            raise ValueError(f"{bin_path} is empty (no tokens); rebuild the channel with "
                             "`python -m dtrain.runtime.train.tokenize`")
        tokens = np.memmap(bin_path, dtype=np.dtype(dtype), mode="r")
        if "num_tokens" in meta and int(meta["num_tokens"]) != tokens.shape[0]:
            raise ValueError(f"{bin_path} holds {tokens.shape[0]} tokens but {meta_path.name} "
                             f"says {meta['num_tokens']}; the channel is truncated, rebuild it")
        return cls(tokens, meta)

    def save(self, folder: str | Path) -> Path:
        """Write ``tokens.bin`` and ``tokens.json`` (the sidecar last, so it marks completeness)."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        dtype = smallest_dtype(self.vocab_size)
        np.asarray(self.tokens, dtype=dtype).tofile(folder / TOKENS_FILE)
        meta = {**self.meta, "format": FORMAT, "dtype": dtype, "num_tokens": len(self)}
        (folder / META_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
        return folder


def smallest_dtype(vocab_size: int) -> str:
    return "uint8" if vocab_size <= 2**8 else "uint16" if vocab_size <= 2**16 else "uint32"


@dataclass(frozen=True)
class TokenBatch:
    """One rank's micro-batch: ``tokens`` is (micro_batch_size, window) int64."""

    tokens: torch.Tensor
    index: int  # global micro-step number since the start of training (seeds per-batch RNG)


class DistributedTokenLoader:
    """Endless micro-batches of token windows for one data-parallel rank (module docstring).

    ``window`` is the number of tokens per sample (``seq_len + 1`` for next-token prediction).
    """

    def __init__(
        self,
        dataset: TokenDataset,
        *,
        window: int,
        micro_batch_size: int,
        dp_rank: int = 0,
        dp_world_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
    ) -> None:
        if window < 2 or micro_batch_size < 1:
            raise ValueError(f"window must be >= 2 and micro_batch_size >= 1, got {window} and "
                             f"{micro_batch_size}")
        if not 0 <= dp_rank < dp_world_size:
            raise ValueError(f"dp_rank={dp_rank} is outside 0..{dp_world_size - 1}")
        self.dataset = dataset
        self.window = window
        self.micro_batch_size = micro_batch_size
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        self.seed, self.shuffle = seed, shuffle
        self.num_windows = len(dataset) // window
        self.global_batch = micro_batch_size * dp_world_size
        self.steps_per_epoch = self.num_windows // self.global_batch
        if self.steps_per_epoch < 1:
            raise ValueError(
                f"the dataset has {len(dataset)} tokens = {self.num_windows} windows of {window}, "
                f"fewer than one global micro-batch ({micro_batch_size} x {dp_world_size} ranks); "
                "add data or lower seq_len / micro_batch_size"
            )
        self.epoch, self.step_in_epoch = 0, 0
        self._order: np.ndarray | None = None

    def _epoch_order(self) -> np.ndarray:
        if self._order is None:
            if self.shuffle:
                rng = np.random.default_rng([self.seed, self.epoch])
                self._order = rng.permutation(self.num_windows)
            else:
                self._order = np.arange(self.num_windows)
        return self._order

    @property
    def position(self) -> int:
        """Micro-batches consumed since the start (the same on every rank)."""
        return self.epoch * self.steps_per_epoch + self.step_in_epoch

    def __iter__(self) -> Iterator[TokenBatch]:
        return self

    def __next__(self) -> TokenBatch:
        if self.step_in_epoch >= self.steps_per_epoch:
            self.epoch, self.step_in_epoch, self._order = self.epoch + 1, 0, None
        start = self.step_in_epoch * self.global_batch + self.dp_rank * self.micro_batch_size
        ids = self._epoch_order()[start:start + self.micro_batch_size]
        rows = [self.dataset.tokens[i * self.window:(i + 1) * self.window] for i in ids]
        index = self.position
        self.step_in_epoch += 1
        tokens = torch.from_numpy(np.stack(rows).astype(np.int64))
        return TokenBatch(tokens, index)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "step_in_epoch": self.step_in_epoch,
                "num_windows": self.num_windows, "global_batch": self.global_batch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue where ``state`` left off; the data and global batch must be unchanged."""
        saved = (int(state["num_windows"]), int(state["global_batch"]))
        if saved != (self.num_windows, self.global_batch):
            fits = saved[1] % self.dp_world_size == 0
            fix = ("as it is here" if saved[1] == self.global_batch else
                   f"here micro_batch_size {saved[1] // self.dp_world_size} on the "
                   f"{self.dp_world_size} data-parallel rank(s)" if fits else
                   f"which this run's {self.dp_world_size} data-parallel ranks cannot divide: "
                   "change the layout")
            raise ValueError(
                f"the checkpoint's data position is for {saved[0]} windows and a global "
                f"micro-batch of {saved[1]}, this run has {self.num_windows} and "
                f"{self.global_batch} ({self.micro_batch_size} x {self.dp_world_size} ranks); "
                "resume with the same data and seq_len, and the same global micro-batch "
                f"(micro_batch_size × data-parallel ranks): {fix}; or start from a fresh "
                "checkpoint folder"
            )
        self.epoch, self.step_in_epoch = int(state["epoch"]), int(state["step_in_epoch"])
        self._order = None
