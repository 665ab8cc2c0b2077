"""``recipe:masked_lm`` as a user runs it: a job spec with hyperparameters and no code, on the
local target as 2 simulated hosts x 2 gloo workers with MiCS sharding degree 2 (shard inside a
host, replicate across the two). The loss falls, and rank 0 gathers the sharded BERT into a
Hugging Face folder that loads back with the trained weights.

    pytest tests/integration/test_masked_lm.py -q
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from dtrain.jobs import api as jobs
from dtrain.spec.model import JobSpec

pytestmark = pytest.mark.slow

SEED, SEQ_LEN = 5, 32
HYPERPARAMETERS = {"model": "bert-tiny", "steps": 16, "micro_batch_size": 2, "seq_len": SEQ_LEN,
                   "lr": 2e-3, "warmup_steps": 2, "log_interval": 4, "seed": SEED}


def masked_lm_loss(model, tokens: torch.Tensor, mask_id: int, vocab_size: int) -> float:
    """The recipe's own masking and loss on ``tokens``, without gradients."""
    from dtrain.runtime.recipes.masked_lm import IGNORE_INDEX, mask_tokens

    inputs, labels = mask_tokens(tokens, np.random.default_rng(0), mask_id=mask_id,
                                 vocab_size=vocab_size)
    with torch.no_grad():
        logits = model(inputs)
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(),
                           ignore_index=IGNORE_INDEX).item()


def test_masked_lm_job_on_four_sharded_ranks_learns_and_writes_a_loadable_hf_model(tmp_path):
    from dtrain.runtime.models import from_preset
    from dtrain.runtime.models.hf_io import load_pretrained
    from dtrain.runtime.train.tokenize import encode_bytes

    corpus = tmp_path / "corpus.txt"
    corpus.write_text(Path(__file__).read_text() * 4)
    spec = JobSpec.from_dict({
        "name": "mlm", "entry_point": "recipe:masked_lm", "hyperparameters": HYPERPARAMETERS,
        "inputs": {"train": str(corpus)}, "output_path": str(tmp_path / "jobs"),
        "compute": {"target": "local", "instance_type": "local", "instance_count": 2,
                    "processes_per_instance": 2, "max_run": 120},
        "distribution": {"sharding_degree": 2, "backend": "gloo"},
    })
    record = jobs.submit(spec, wait=True)
    host = Path(record.target_data["job_dir"]) / "algo-1"
    assert record.status == "Completed", record.failure_reason

    rows = [json.loads(line)
            for line in (host / "output" / "data" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [4, 8, 12, 16]
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.5
    # Each rank's log names the attention kernel its model ran (full windows, no padding mask,
    # so the default flash backend runs SDPA's flash kernel on the CPU).
    for rank in (0, 1):
        log = (host / "output" / "logs" / f"rank-{rank}.stderr.log").read_text()
        assert f"dtrain rank {rank} attention kernel: sdpa-flash (" in log, log[-2000:]

    model_dir = host / "model"
    config = json.loads((model_dir / "config.json").read_text())
    assert config["model_type"] == "bert"
    # (tests/unit/test_models_hf_parity.py proves transformers reads what save_pretrained writes.)
    trained = load_pretrained(model_dir).eval()

    # The folder holds the trained weights, gathered whole: better than the same seed untrained.
    data = encode_bytes([corpus.read_text()])
    tokens = torch.from_numpy(np.asarray(data.tokens[: 8 * SEQ_LEN], dtype=np.int64))
    tokens = tokens.view(8, SEQ_LEN)
    mask_id, vocab = data.special_tokens["<mask>"], config["vocab_size"]
    torch.manual_seed(SEED)
    untrained = from_preset("bert-tiny").eval()
    assert masked_lm_loss(trained, tokens, mask_id, vocab) < \
        masked_lm_loss(untrained, tokens, mask_id, vocab) - 0.5
