"""What the built-in recipes need of their inputs, checked before any worker starts (stdlib only).

``dtrain validate`` runs these checks on what the spec says (a recipe's hyperparameters, the
positions of a preset it names, the data of a local input path), naming the spec's field; the
node agent runs them again on the host's own contract before it starts workers, where the rest
is known (the recipe's default model, a Hugging Face folder's config, a downloaded channel). Bad
input then fails in a second with the field or the file named, not 15-30 s later in every worker.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

from dtrain.core import presets
from dtrain.core.contract import RECIPE_PREFIX

# The recipes' defaults for what these checks read (training_runtime/recipes/common.py).
DEFAULTS = {"steps": 100, "micro_batch_size": 8, "seq_len": 128, "log_interval": 10,
            "data": "train"}
DEFAULT_MODELS = {"causal_lm": "gpt-neox-tiny", "masked_lm": "bert-tiny"}
POSITIVE = ("steps", "micro_batch_size", "seq_len", "log_interval")
# The recipes' other numeric hyperparameters and their types: the recipes' parser takes its
# types from here, so what validation accepts is what the recipe parses.
NUMERIC = {"lr": float, "min_lr_ratio": float, "warmup_steps": int, "weight_decay": float,
           "max_grad_norm": float, "seed": int, "checkpoint_interval": int, "keep_last": int}
# The recipes' hyperparameters that take one of a few words (their parser's choices), and the
# words a yes/no one takes.
CHOICES = {"attention": ("flash", "sdpa", "eager")}
BOOLEAN = ("activation_checkpointing",)
TRUE_WORDS, FALSE_WORDS = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
# Every hyperparameter the recipes read (their parser, training_runtime/recipes/common.py; a
# test holds the two equal): validation refuses any other, which the recipe would only ignore.
HYPERPARAMETERS = ("model", "data", "steps", "micro_batch_size", "seq_len", "lr", "min_lr_ratio",
                   "warmup_steps", "weight_decay", "max_grad_norm", "log_interval",
                   "checkpoint_interval", "keep_last", "seed", "attention",
                   "activation_checkpointing")
TOKENS_FILE, META_FILE = "tokens.bin", "tokens.json"  # a token channel (dtrain.runtime.train.data)
# A Hugging Face model folder (dtrain.runtime.models.hf_io): its config and where its weights are
HF_CONFIG, HF_WEIGHTS, HF_INDEX = "config.json", "model.safetensors", "model.safetensors.index.json"
BINARY_PROBE_BYTES = 8000  # as git: a NUL byte in a file's first 8000 bytes makes it binary
MAX_FILES_PROBED = 10_000


def as_the_recipe_reads(entry_point: str, hps: Mapping[str, Any]) -> dict[str, Any]:
    """``hps`` with the defaults a built-in recipe fills in (its model, micro-batch size and
    sequence length) where it leaves them out; other entry points' as they are."""
    recipe = entry_point.removeprefix(RECIPE_PREFIX) if entry_point.startswith(RECIPE_PREFIX) \
        else None
    if recipe not in DEFAULT_MODELS:
        return dict(hps)
    given = {key: value for key, value in hps.items() if key != "model" or value}
    return {"model": DEFAULT_MODELS[recipe], "micro_batch_size": DEFAULTS["micro_batch_size"],
            "seq_len": DEFAULTS["seq_len"], **given}  # an empty model is the default, as below


def hyperparameter_problems(hps: Mapping[str, Any], *, recipe: str, model_known: bool = True,
                            channels: Collection[str] | None = None) -> list[str]:
    """Problems of a recipe's ``steps``, ``micro_batch_size`` and ``seq_len``, of its other
    numbers (:data:`NUMERIC`), of a ``seq_len`` beyond the model's positions (the recipe's
    default model unless ``model_known`` is False: then only a model the hyperparameters name is
    checked) and, given the job's input ``channels`` (when it has any), of a ``data`` that names
    none of them."""
    problems = []
    for key in POSITIVE:
        if key in hps and _positive_int(hps[key]) is None:
            problems.append(f"hyperparameters.{key}: {hps[key]!r} is not a whole number >= 1; "
                            f"give one (the recipe's default is {DEFAULTS[key]})")
    for key, kind in NUMERIC.items():
        if key in hps and not _parses_as(hps[key], kind):
            what = "a whole number" if kind is int else "a number"
            problems.append(f"hyperparameters.{key}: {hps[key]!r} is not {what}; give one")
    for key, words in CHOICES.items():
        if key in hps and str(hps[key]) not in words:
            problems.append(f"hyperparameters.{key}: {hps[key]!r} is not one of "
                            f"{', '.join(words)}; give one of them")
    for key in BOOLEAN:
        if key in hps and as_bool(hps[key]) is None:
            problems.append(f"hyperparameters.{key}: {hps[key]!r} is neither true nor false; "
                            "give true or false")
    if channels:
        problems += _data_channel_problems(hps, sorted(channels))
    model = hps.get("model") or (DEFAULT_MODELS.get(recipe) if model_known else None)
    if model:
        problems += _model_folder_problems(str(model))
    seq_len = _positive_int(hps.get("seq_len", DEFAULTS["seq_len"]))
    positions = model_positions(str(model)) if model else None
    if seq_len and positions and seq_len > positions:
        problems.append(f"hyperparameters.seq_len: {seq_len} is more than the {positions} "
                        f"positions of model {model!r}; lower seq_len to at most {positions} or "
                        "use a model with more positions")
    return problems


def unread_hyperparameters(hps: Mapping[str, Any], *,
                           recipe: str) -> tuple[list[str], list[str]]:
    """``(problems, notes)`` of the keys the recipe does not read: a key only the planner reads
    (``num_parameters``, ``hidden_size``, ...: the plan sizes a model with it, the recipe trains
    its ``model``) is a note; any other is a problem (a misspelt ``stesp`` would train the
    default 100 steps), with the name it may have meant."""
    # the sizes of a model the recipe does not build (its batch and length it reads itself,
    # under their own names: an alias of those is a misspelling here)
    planner = {"num_parameters", *(n for key, names in presets.SHAPE_HYPERPARAMETERS.items()
                                   if key not in ("seq_len", "micro_batch_size") for n in names)}
    problems, notes = [], []
    model = hps.get("model") or DEFAULT_MODELS.get(recipe)
    for key in hps:
        if key in HYPERPARAMETERS:
            continue
        if key in planner:
            notes.append(f"hyperparameters.{key}: recipe:{recipe} does not read it (it trains "
                         f"model {model!r}); only dtrain plan's estimates use it")
            continue
        alias = next((name for name, names in presets.SHAPE_HYPERPARAMETERS.items()
                      if key in names and name in HYPERPARAMETERS), None)
        close = [alias] if alias else difflib.get_close_matches(str(key), HYPERPARAMETERS, n=1,
                                                                cutoff=0.6)
        hint = f"did you mean {close[0]!r}?" if close else \
            f"it reads {', '.join(HYPERPARAMETERS)}"
        problems.append(f"hyperparameters.{key}: not a hyperparameter of recipe:{recipe}, "
                        f"which would ignore it; {hint}")
    return problems, notes


def as_bool(value: Any) -> bool | None:
    """A yes/no hyperparameter's value as the recipe reads it (``TRUE_WORDS``/``FALSE_WORDS``,
    any case, or a boolean); None when it is neither."""
    if isinstance(value, bool):
        return value
    word = str(value).strip().lower()
    return True if word in TRUE_WORDS else False if word in FALSE_WORDS else None


def _parses_as(value: Any, kind: type) -> bool:
    """Whether the recipe's ``--key value`` parses ``value`` as ``kind`` (a JSON boolean
    does not: it arrives as ``true``)."""
    if isinstance(value, bool):
        return False
    try:
        kind(str(value))
    except ValueError:
        return False
    return True


def _data_channel_problems(hps: Mapping[str, Any], channels: list[str]) -> list[str]:
    """``data`` names a channel (:func:`channel_named`) the job lacks."""
    data = channel_named(hps)
    if data is None or find_channel(data, channels) is not None:
        return []
    return [missing_data(data, channels, default="data" not in hps)]


def channel_named(hps: Mapping[str, Any]) -> str | None:
    """The channel a recipe's ``data`` names: a bare name (no ``/``, no ``.``); None for a
    path in the container, checked where it runs."""
    data = str(hps.get("data", DEFAULTS["data"]))
    return None if "/" in data or "." in data else data


def no_inputs_note(hps: Mapping[str, Any]) -> list[str]:
    """A recipe job with no inputs at all: its ``data``, a bare name, can only be a folder in
    the nodes' working directory, which a job rarely has. A note, not a problem: ``dtrain plan``
    sizes channel-less specs, and the nodes check it before any worker starts."""
    data = channel_named(hps)
    if data is None:
        return []
    return [missing_data(data, (), default="data" not in hps,
                         fix="the nodes will refuse the job unless a folder of that name is in "
                             "their working directory: add it under inputs or fix the name")]


def find_channel(name: str, channels: Collection[str]) -> str | None:
    """The channel ``name`` means: SM_CHANNEL_* variables are upper-case, so names match
    case-blind."""
    return next((channel for channel in channels if channel.lower() == name.lower()), None)


def missing_data(data: str, channels: Collection[str], *, host: str | None = None,
                 default: bool = False, fix: str = "add it under inputs or fix the name") -> str:
    """The problem of a recipe's ``data`` that is no channel of the job (nor, on ``host``, a
    path); ``default``: the hyperparameters left it at the recipe's default."""
    named = f"{data!r} (the default)" if default else repr(data)
    listed = f"a channel of this job ({', '.join(sorted(channels)) or 'none'})"
    what = f"neither {listed} nor a path on {host}" if host else f"not {listed}"
    return f"hyperparameters.data: {named} is {what}; {fix}"


def _model_folder_problems(model: str) -> list[str]:
    """A model folder here with a config but no weights: the recipe starts from the weights."""
    folder = Path(model)
    if model in presets.PRESETS or not (folder / HF_CONFIG).is_file():
        return []  # a preset, or a folder elsewhere: the node's checks see it
    if (folder / HF_WEIGHTS).is_file() or (folder / HF_INDEX).is_file():
        return []
    return [(f"hyperparameters.model: {model} has a {HF_CONFIG} but no weights ({HF_WEIGHTS} "
             f"or {HF_INDEX}), which the recipe starts from; save the model there with "
             "save_pretrained (safetensors), or name a preset to start from random weights")]


def model_positions(model: str) -> int | None:
    """How many token positions ``model`` (a preset or a Hugging Face folder) takes; None when
    unknown (a path that is not here, a config without the field)."""
    config = presets.PRESETS.get(model)
    if config is None:
        try:
            config = json.loads((Path(model) / HF_CONFIG).read_text())
        except (OSError, ValueError):
            return None
    positions = config.get("max_position_embeddings") if isinstance(config, dict) else None
    if not isinstance(positions, int):
        return None
    # RoBERTa numbers positions after the padding id, so pad_token_id + 1 rows are never used.
    if config.get("model_type") == "roberta":
        positions -= int(config.get("pad_token_id", 1)) + 1
    return positions


def data_problems(path: Path, *, what: str) -> list[str]:
    """Problems of the recipe's data at ``path`` (``what`` names it: ``inputs.train``): an
    empty token file, a token file without its sidecar, text files that are binary or all
    empty."""
    try:
        if path.is_dir() and not (path / TOKENS_FILE).is_file():
            files = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
            if not files:
                return [f"{what}: {path} holds no text files and no {TOKENS_FILE}; add data"]
            if not any(file.stat().st_size for file in files):
                return [f"{what}: the text files in {path} are all empty; add data"]
            return [problem for file in files[:MAX_FILES_PROBED]
                    if (problem := _text_problem(file, what))][:3]
        tokens = path / TOKENS_FILE if path.is_dir() else path
        if tokens.suffix == ".bin":
            return _token_problems(tokens, what)
        if path.is_file() and path.stat().st_size == 0:
            return [f"{what}: {path} is empty; add data"]
        return [problem] if (problem := _text_problem(path, what)) else []
    except OSError as exc:
        return [f"{what}: cannot read {path}: {exc.strerror or exc}"]


def _token_problems(tokens: Path, what: str) -> list[str]:
    rebuild = "rebuild it with `python -m dtrain.runtime.train.tokenize`"
    if not tokens.with_suffix(".json").is_file():
        return [f"{what}: {tokens} has no {tokens.with_suffix('.json').name} beside it; {rebuild}"]
    if tokens.stat().st_size == 0:
        return [f"{what}: {tokens} is empty (no tokens); {rebuild}"]
    return []


def _text_problem(file: Path, what: str) -> str | None:
    with open(file, "rb") as f:
        head = f.read(BINARY_PROBE_BYTES)
    if b"\0" in head:
        return (f"{what}: {file} is binary, not text; give text files or a token channel "
                "(`python -m dtrain.runtime.train.tokenize`)")
    return None


def _positive_int(value: Any) -> int | None:
    """``value`` as the recipe's ``type=int`` argument reads it, when that is >= 1."""
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    elif isinstance(value, str) and value.strip().isdigit():
        number = int(value)
    else:
        return None
    return number if number >= 1 else None
