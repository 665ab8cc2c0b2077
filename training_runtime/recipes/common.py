"""What the built-in recipes share: hyperparameters, data and model resolution, the run itself."""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from dtrain.core import recipe_inputs
from dtrain.core.presets import count_parameters, get_preset
from dtrain.runtime.train import metrics
from dtrain.runtime.train.checkpoint import NoSpaceError
from dtrain.runtime.train.data import TOKENS_FILE, DistributedTokenLoader, TokenDataset
from dtrain.runtime.train.tokenize import encode_bytes, read_texts
from dtrain.runtime.train.trainer import PREEMPTED_EXIT_CODE, Trainer, TrainerConfig
from torch import nn

# Old aliases of the spec's checkpoint settings (which reach the Trainer through the contract).
DEPRECATED_CHECKPOINT_ARGS = {"checkpoint_interval": "checkpoint.interval_steps",
                              "keep_last": "checkpoint.keep_last"}
# Models up to this size are initialised whole on the CPU before sharding, so the weights do
# not depend on the world size (same seed, same model); bigger ones are built on the meta device.
CPU_INIT_MAX_PARAMETERS = 1_000_000_000
TOKENIZER_INFO = "dtrain_tokenizer.json"


def parse_bool(value: str | bool) -> bool:
    parsed = recipe_inputs.as_bool(value)
    if parsed is None:
        raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}")
    return parsed


def build_parser(prog: str, description: str, *, recipe: str,
                 lr: float) -> argparse.ArgumentParser:
    # no abbreviations: validation checks the names as given (recipe_inputs.HYPERPARAMETERS)
    p = argparse.ArgumentParser(prog=prog, description=description, allow_abbrev=False)
    p.add_argument("--model", default=recipe_inputs.DEFAULT_MODELS[recipe],
                   help="preset name (dtrain.core.presets) or HF folder")
    p.add_argument("--data", default=recipe_inputs.DEFAULTS["data"],
                   help="channel name, a token channel folder, a .bin file or a text file")
    p.add_argument("--steps", type=int, default=recipe_inputs.DEFAULTS["steps"],
                   help="optimizer steps")
    p.add_argument("--micro_batch_size", type=int,
                   default=recipe_inputs.DEFAULTS["micro_batch_size"],
                   help="sequences per rank per micro-step")
    p.add_argument("--seq_len", type=int, default=recipe_inputs.DEFAULTS["seq_len"])
    p.add_argument("--lr", type=recipe_inputs.NUMERIC["lr"], default=lr)
    p.add_argument("--min_lr_ratio", type=recipe_inputs.NUMERIC["min_lr_ratio"], default=0.1)
    p.add_argument("--warmup_steps", type=recipe_inputs.NUMERIC["warmup_steps"], default=10)
    p.add_argument("--weight_decay", type=recipe_inputs.NUMERIC["weight_decay"], default=0.1)
    p.add_argument("--max_grad_norm", type=recipe_inputs.NUMERIC["max_grad_norm"], default=1.0)
    p.add_argument("--log_interval", type=int, default=recipe_inputs.DEFAULTS["log_interval"])
    for name, field_name in DEPRECATED_CHECKPOINT_ARGS.items():
        p.add_argument(f"--{name}", type=recipe_inputs.NUMERIC[name], default=None,
                       help=f"deprecated: set {field_name} in the job spec instead")
    p.add_argument("--seed", type=recipe_inputs.NUMERIC["seed"], default=0)
    p.add_argument("--attention", choices=recipe_inputs.CHOICES["attention"], default=None)
    for name in recipe_inputs.BOOLEAN:
        p.add_argument(f"--{name}", type=parse_bool, default=None)
    return p


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    # SageMaker passes every hyperparameter as --key value; ignore (and name) the ones we lack.
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        warnings.warn(f"{parser.prog}: ignoring unknown arguments {unknown}", stacklevel=2)
    return args


def checkpoint_overrides(args: argparse.Namespace) -> dict[str, int]:
    """The deprecated checkpoint hyperparameters given, for TrainerConfig; each with a note."""
    given = {name: getattr(args, name) for name in DEPRECATED_CHECKPOINT_ARGS
             if getattr(args, name) is not None}
    for name in given:
        warnings.warn(f"hyperparameter {name} is deprecated: set "
                      f"{DEPRECATED_CHECKPOINT_ARGS[name]} in the job spec, which recipes and "
                      "the Trainer read alike", FutureWarning, stacklevel=2)
    return given


def load_dataset(data: str, ctx: Any) -> TokenDataset:
    """A token channel, or text tokenized byte-level in memory (every rank does the same)."""
    path = Path(data)
    if not path.exists():
        path = ctx.channel(data)
    problems = recipe_inputs.data_problems(path, what=f"data {data!r}")
    if problems:
        raise ValueError(problems[0])
    if path.is_file():
        if path.suffix == ".bin":
            return TokenDataset.open(path)
        return encode_bytes(read_texts([path]))
    if (path / TOKENS_FILE).is_file():
        return TokenDataset.open(path)
    # No token channel: every file is a text document (license folders have no suffixes).
    texts = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
    if not texts:
        raise ValueError(f"data {data!r} ({path}) has no {TOKENS_FILE} and no text files; "
                         "add files or tokenize them with `python -m dtrain.runtime.train.tokenize`")
    return encode_bytes(read_texts(texts))


def build_model(name_or_path: str, *, attention: str | None, seed: int) -> nn.Module:
    """A preset (fresh weights from ``seed``) or a Hugging Face folder (its weights)."""
    from dtrain.runtime.models import from_preset
    from dtrain.runtime.models.hf_io import load_pretrained

    torch.manual_seed(seed)  # same weights on every rank and for every world size
    kwargs = {"attention": attention} if attention else {}
    if Path(name_or_path, "config.json").is_file():
        return load_pretrained(name_or_path, dtype=torch.float32, **kwargs).train()
    big = count_parameters(get_preset(name_or_path)) > CPU_INIT_MAX_PARAMETERS
    return from_preset(name_or_path, device="meta" if big else "cpu", **kwargs)


def check_vocab(model: nn.Module, dataset: TokenDataset) -> int:
    vocab = int(model.hf_config_dict()["vocab_size"])
    if dataset.vocab_size > vocab:
        raise ValueError(f"the data's tokenizer has {dataset.vocab_size} ids but the model's "
                         f"vocab_size is {vocab}; pick a model with a larger vocabulary")
    return vocab


def save_tokenizer_info(dataset: TokenDataset, model_dir: Path) -> None:
    """Next to the HF weights, how token ids map to text (byte-level: ids < 256 are bytes)."""
    info = {"vocab_size": dataset.vocab_size, "tokenizer": dataset.meta.get("tokenizer", {})}
    (Path(model_dir) / TOKENIZER_INFO).write_text(json.dumps(info, indent=2) + "\n")


def run_recipe(args: argparse.Namespace, *, recipe: str,
               make_loss_fn: Callable[[argparse.Namespace, TokenDataset, Any], Any],
               window: int) -> int:
    """Init, load data and model, shard, train, save; returns the process exit code.

    ``make_loss_fn(args, dataset, ctx)`` returns the Trainer's ``loss_fn(model, batch)``.
    """
    import dtrain.runtime as rt

    ctx = rt.init()
    try:
        problems = recipe_inputs.hyperparameter_problems(
            {key: getattr(args, key) for key in ("model", *recipe_inputs.POSITIVE)},
            recipe=recipe)
        if problems:
            raise ValueError(problems[0])
        dataset = load_dataset(args.data, ctx)
        # the recipe's own --attention, else the job's distribution.attention
        model = build_model(args.model, attention=args.attention or ctx.config.attention,
                            seed=args.seed)
        check_vocab(model, dataset)
        checkpointing = (ctx.config.activation_checkpointing
                         if args.activation_checkpointing is None
                         else args.activation_checkpointing)
        model = rt.shard(model, ctx, activation_checkpointing=checkpointing,
                         pipeline_sample=(args.micro_batch_size, args.seq_len))
        # ranks of one tensor-parallel group read the same batch
        loader = DistributedTokenLoader(
            dataset, window=window, micro_batch_size=args.micro_batch_size,
            dp_rank=ctx.dp_rank, dp_world_size=ctx.dp_world_size, seed=args.seed)
        config = TrainerConfig(
            steps=args.steps, lr=args.lr, warmup_steps=min(args.warmup_steps, args.steps),
            min_lr_ratio=args.min_lr_ratio, weight_decay=args.weight_decay,
            max_grad_norm=args.max_grad_norm, log_interval=args.log_interval,
            **checkpoint_overrides(args))
        flops = metrics.model_flops_per_token(model, seq_len=args.seq_len,
                                              activation_checkpointing=checkpointing)
        loss_fn = make_loss_fn(args, dataset, ctx)
        trainer = Trainer(model, ctx, loss_fn, config=config, flops_per_token=flops)
        result = trainer.fit(loader)
        if ctx.is_main and not result.preempted:
            save_tokenizer_info(dataset, ctx.model_dir)
    except (ValueError, NoSpaceError) as err:  # the message says what to do
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return PREEMPTED_EXIT_CODE if result.preempted else 0
