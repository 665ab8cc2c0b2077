"""A byte-level causal language model trained with DDP over gloo, for the local target.

    dtrain submit examples/local-cpu.yaml

Written against the SageMaker contract only (SM_* variables, --key value arguments), so the same
script runs under the node agent on this machine, SageMaker or EC2. The corpus is the license
texts every Linux/Python install ships (or the files of a `train` channel when one is given).
"""

import argparse
import glob
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from dtrain.metrics_format import format_metrics


def corpus_files() -> list[str]:
    channel = os.environ.get("SM_CHANNEL_TRAIN")
    if channel and os.path.isdir(channel):
        return sorted(p for p in glob.glob(os.path.join(channel, "**", "*"), recursive=True)
                      if os.path.isfile(p))
    lib = os.path.dirname(os.__file__)
    candidates = [os.path.join(lib, "LICENSE.txt"), *glob.glob("/usr/share/common-licenses/*")]
    return sorted(p for p in candidates if os.path.isfile(p))


def load_corpus() -> torch.Tensor:
    data = b"".join(open(p, "rb").read() for p in corpus_files())
    if len(data) < 10_000:
        sys.exit(f"corpus too small ({len(data)} bytes); pass a `train` input channel")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


class ByteLM(nn.Module):
    """Embedding, a few causal self-attention blocks, and a 256-way head."""

    def __init__(self, d_model: int, layers: int, seq_len: int):
        super().__init__()
        self.embed = nn.Embedding(256, d_model)
        self.pos = nn.Parameter(torch.zeros(seq_len, d_model))
        block = nn.TransformerEncoderLayer(d_model, nhead=4, dim_feedforward=4 * d_model,
                                           dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, 256)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq_len))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        return self.head(self.blocks(x, mask=self.mask, is_causal=True))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--seq_len", type=int, default=64)
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--d_model", type=int, default=64)
    parser.add_argument("--num_layers", type=int, default=2)
    parser.add_argument("--vocab_size", type=int, default=256, choices=[256])
    args = parser.parse_args()

    torch.set_num_threads(1)  # several workers share few cores
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    data = load_corpus()
    model = DistributedDataParallel(ByteLM(args.d_model, args.num_layers, args.seq_len))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    generator = torch.Generator().manual_seed(1000 + rank)  # each rank its own batches
    tokens_per_step = args.batch_size * args.seq_len * world
    started = time.perf_counter()
    for step in range(1, args.steps + 1):
        starts = torch.randint(0, len(data) - args.seq_len - 1, (args.batch_size,),
                               generator=generator)
        batch = torch.stack([data[s: s + args.seq_len + 1] for s in starts])
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, 256), batch[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 10 == 0 or step == 1:
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            elapsed = time.perf_counter() - started
            if rank == 0:
                print(format_metrics(step, loss=round(mean.item() / world, 4),
                                     tokens_per_s=round(tokens_per_step * step / elapsed)),
                      flush=True)
    if rank == 0:
        model_dir = os.environ["SM_MODEL_DIR"]
        torch.save(model.module.state_dict(), os.path.join(model_dir, "model.pt"))
        with open(os.path.join(model_dir, "config.json"), "w") as f:
            json.dump({**vars(args), "final_loss": round(mean.item() / world, 4)}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
