"""Token channels and the distributed loader: disjoint rank slices, resumable position."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from dtrain.runtime.train.data import DistributedTokenLoader, TokenDataset
from dtrain.runtime.train.tokenize import BYTE_VOCAB_SIZE, build_channel, encode_bytes, main


def _dataset(n: int = 1000) -> TokenDataset:
    return TokenDataset(np.arange(n, dtype=np.int64) % 250, {"vocab_size": 256})


def _take(loader: DistributedTokenLoader, steps: int) -> list[torch.Tensor]:
    return [next(loader).tokens for _ in range(steps)]


def test_ranks_read_disjoint_slices_of_the_same_global_batch():
    data = _dataset()
    single = DistributedTokenLoader(data, window=9, micro_batch_size=8, seed=3)
    ranks = [DistributedTokenLoader(data, window=9, micro_batch_size=2, dp_rank=r,
                                    dp_world_size=4, seed=3) for r in range(4)]
    for _ in range(5):
        whole = next(single).tokens
        parts = torch.cat([next(loader).tokens for loader in ranks])
        assert torch.equal(whole, parts)


def test_windows_are_contiguous_token_runs():
    data = TokenDataset(np.arange(100, dtype=np.int64), {"vocab_size": 100})
    batch = next(DistributedTokenLoader(data, window=10, micro_batch_size=3, seed=0)).tokens
    assert batch.dtype == torch.int64 and batch.shape == (3, 10)
    for row in batch:
        assert row[0] % 10 == 0 and torch.equal(row, torch.arange(row[0], row[0] + 10))


def test_restored_position_continues_the_same_sequence_across_epochs():
    data = _dataset(300)
    loader = DistributedTokenLoader(data, window=10, micro_batch_size=4, seed=1)  # 7 per epoch
    _take(loader, 5)
    state = loader.state_dict()
    expected = _take(loader, 12)
    resumed = DistributedTokenLoader(data, window=10, micro_batch_size=4, seed=1)
    resumed.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(_take(resumed, 12), expected))
    assert loader.epoch == 2


def test_each_epoch_has_its_own_seeded_order():
    loader = DistributedTokenLoader(_dataset(400), window=10, micro_batch_size=40, seed=0)
    first, second = next(loader).tokens, next(loader).tokens
    assert not torch.equal(first, second)
    assert sorted(first[:, 0].tolist()) == sorted(second[:, 0].tolist())  # same windows


def test_resuming_with_a_different_global_batch_is_refused():
    loader = DistributedTokenLoader(_dataset(), window=10, micro_batch_size=4)
    other = DistributedTokenLoader(_dataset(), window=10, micro_batch_size=2)
    with pytest.raises(ValueError, match=r"global micro-batch of 4, this run has 100 and 2 "
                                         r"\(2 x 1 ranks\); .*same global micro-batch "
                                         r"\(micro_batch_size × data-parallel ranks\): here "
                                         r"micro_batch_size 4 on the 1 data-parallel rank"):
        other.load_state_dict(loader.state_dict())
    # the world size is not what counts: the same ranks with more of them data-parallel (a
    # tensor-parallel pair turned into two shards) double the global micro-batch
    wider = DistributedTokenLoader(_dataset(), window=10, micro_batch_size=4, dp_world_size=2)
    with pytest.raises(ValueError, match="here micro_batch_size 2 on the 2 data-parallel"):
        wider.load_state_dict(loader.state_dict())
    other_data = DistributedTokenLoader(_dataset(120), window=10, micro_batch_size=4)
    with pytest.raises(ValueError, match=r"\(micro_batch_size × data-parallel ranks\): as it is "
                                         r"here; or start"):  # the data changed, not the batch
        other_data.load_state_dict(loader.state_dict())
    odd = DistributedTokenLoader(_dataset(), window=10, micro_batch_size=1, dp_world_size=3)
    with pytest.raises(ValueError, match="which this run's 3 data-parallel ranks cannot divide"):
        odd.load_state_dict(loader.state_dict())


def test_too_little_data_names_the_fix():
    with pytest.raises(ValueError, match="lower seq_len"):
        DistributedTokenLoader(_dataset(50), window=10, micro_batch_size=4, dp_world_size=2)


def test_tokenize_cli_writes_a_byte_level_channel(tmp_path):
    (tmp_path / "a.txt").write_text("héllo")
    (tmp_path / "b.txt").write_text("world")
    out = tmp_path / "channel"
    assert main(["--input", str(tmp_path / "a.txt"), str(tmp_path / "b.txt"),
                 "--output", str(out)]) == 0
    meta = json.loads((out / "tokens.json").read_text())
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == BYTE_VOCAB_SIZE
    data = TokenDataset.open(out)
    eos = data.special_tokens["<|endoftext|>"]
    ids = np.asarray(data.tokens).tolist()
    assert ids == [*"héllo".encode(), eos, *b"world", eos]
    assert np.array_equal(np.asarray(encode_bytes(["héllo", "world"]).tokens), ids)


def test_bpe_channel_saves_its_tokenizer(tmp_path):
    (tmp_path / "t.txt").write_text("the cat sat on the mat. " * 50)
    data = build_channel([tmp_path / "t.txt"], tmp_path / "c", tokenizer="bpe", vocab_size=300)
    assert (tmp_path / "c" / "tokenizer.json").is_file()
    assert data.vocab_size <= 300 and len(data) < len("the cat sat on the mat. " * 50)


def test_truncated_channel_is_rejected(tmp_path):
    build_channel([_write(tmp_path / "t.txt", "abcdef")], tmp_path / "c")
    (tmp_path / "c" / "tokens.bin").write_bytes(b"\x00\x00")
    with pytest.raises(ValueError, match="truncated"):
        TokenDataset.open(tmp_path / "c")


def test_missing_channel_says_how_to_build_one(tmp_path):
    with pytest.raises(ValueError, match="dtrain.runtime.train.tokenize"):
        TokenDataset.open(tmp_path)


def _write(path, text):
    path.write_text(text)
    return path


def test_an_empty_token_file_is_rejected_naming_it(tmp_path):
    (tmp_path / "tokens.bin").write_bytes(b"")
    (tmp_path / "tokens.json").write_text(json.dumps({"dtype": "uint16", "vocab_size": 260}))
    with pytest.raises(ValueError, match=f"{tmp_path / 'tokens.bin'} is empty"):
        TokenDataset.open(tmp_path)
