"""Which logits the 2-D cross-entropy recomputes in backward instead of keeping its probabilities,
on a 1 × 1 grid in one process: the LM head's logits as the head made them, or cast once to fp32
from a bf16 head while the head's logits are held; not logits changed after the head, nor cast
through a narrower type. Every path gives the loss and gradients of the same loss on a copy of
the logits, bit for bit.

The 4-rank parity, memory and pipeline tests are in tests/integration/test_tensor_parallel.py and
test_pipeline_parallel_8_ranks.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from dtrain.core.parallelism import GRID_AXES
from dtrain.runtime.distributed.tensor_parallel.grid_layers import GridHead, grid_cross_entropy
from dtrain.runtime.distributed.tensor_parallel.optimus import Grid
from dtrain.runtime.train.memory import saved_activations
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

SEQUENCES, TOKENS, HIDDEN, VOCAB = 2, 8, 16, 256


@pytest.fixture
def grid():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield Grid.from_mesh(init_device_mesh("cpu", (1, 1), mesh_dim_names=GRID_AXES))
    dist.destroy_process_group()


def run(grid: Grid, dtype: torch.dtype, prepare, *, hold: bool = True) -> dict:
    torch.manual_seed(0)
    head = GridHead.from_linear(nn.Linear(HIDDEN, VOCAB, bias=False).to(dtype), grid)
    x = torch.randn(SEQUENCES, TOKENS, HIDDEN, dtype=dtype, requires_grad=True)
    targets = torch.randint(0, VOCAB, (SEQUENCES, TOKENS))
    with grid_cross_entropy():
        with saved_activations(head) as kept:
            if hold:  # as the recipes' loss functions hold them
                logits = head(x)
                loss = F.cross_entropy(prepare(logits).flatten(0, 1), targets.flatten())
            else:  # a cast cannot tell whether they changed before it
                loss = F.cross_entropy(prepare(head(x)).flatten(0, 1), targets.flatten())
        loss.backward()
    return {"loss": loss.item(), "kept": kept.bytes,
            "grads": (x.grad, head.weight.grad.to_local())}


def changed_without_autograd(logits):
    with torch.no_grad():
        logits.mul_(1.0)
    return logits


PROBABILITIES = SEQUENCES * TOKENS * VOCAB * 4  # fp32
CASES = {  # dtype of the head, what happens to its logits, whether the loss recomputes them
    "fp32 head": (torch.float32, lambda logits: logits, True),
    "fp32 head, its logits dropped": (torch.float32, lambda logits: logits, True),
    "bf16 head, cast to fp32": (torch.bfloat16, lambda logits: logits.float(), True),
    "cast through fp16": (torch.bfloat16, lambda logits: logits.half().float(), False),
    "changed, then cast": (torch.bfloat16, lambda logits: changed_without_autograd(logits).float(),
                           False),
    "cast, then changed": (torch.bfloat16, lambda logits: changed_without_autograd(logits.float()),
                           False),
    "cast, the head's logits dropped": (torch.bfloat16, lambda logits: logits.float(), False),
    "changed through autograd": (torch.float32, lambda logits: logits.mul_(1.0), False),
}


@pytest.mark.parametrize("case", CASES)
def test_the_loss_recomputes_only_logits_left_as_the_head_made_them(grid, case):
    dtype, prepare, recomputes = CASES[case]
    got = run(grid, dtype, prepare, hold="dropped" not in case)
    expected = run(grid, dtype, lambda logits: prepare(logits).clone())  # never recomputed
    assert expected["kept"] >= PROBABILITIES
    assert (got["kept"] < PROBABILITIES / 4) == recomputes, got["kept"]
    assert got["loss"] == expected["loss"]
    for mine, theirs in zip(got["grads"], expected["grads"], strict=True):
        assert torch.equal(mine, theirs)
