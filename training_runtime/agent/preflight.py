"""Checks the node agent runs before it starts any worker: a built-in recipe's inputs.

:mod:`dtrain.core.recipe_inputs` holds the checks; ``dtrain validate`` ran them on what the spec
said, and here they run on what this host has: the recipe's default model, a Hugging Face folder,
the channel as it arrived. A problem ends the agent at once with the field or file named.
"""

from __future__ import annotations

from pathlib import Path

from dtrain.core import contract as c
from dtrain.core import recipe_inputs


def input_problems(contract: c.Contract) -> list[str]:
    entry = contract.settings.entry_point
    if not entry.startswith(c.RECIPE_PREFIX):
        return []  # a user's script: its inputs are its own business
    hps = contract.hyperparameters
    problems = recipe_inputs.hyperparameter_problems(hps, recipe=entry[len(c.RECIPE_PREFIX):])
    data = str(hps.get("data", recipe_inputs.DEFAULTS["data"]))
    if Path(data).exists():  # the recipe's own order: a path first, then a channel
        return problems + recipe_inputs.data_problems(Path(data), what="hyperparameters.data")
    channel = recipe_inputs.find_channel(data, contract.channels)
    if channel is not None:
        return problems + recipe_inputs.data_problems(Path(contract.channels[channel]),
                                                      what=f"inputs.{data}")
    return [*problems, recipe_inputs.missing_data(data, contract.channels,
                                                  host=contract.current_host,
                                                  default="data" not in hps)]
