"""What a job gives a training script besides ``init()``: its hyperparameters, decoded.

The script's command line carries them the SageMaker training toolkit's way, for scripts
written against it: ``--key value`` with each value as Python's ``str()``, so lists and mappings
arrive as Python text (``--opt "betas=[0.9, 0.99],name=adam"``). A dtrain-native script reads
them here instead, as the JSON values the spec gave. Torch-free.
"""

from __future__ import annotations

import json
import os
from typing import Any

HPS_ENV = "SM_HPS"  # set by the node agent on every target, as the toolkit does


def hyperparameters() -> dict[str, Any]:
    """The job's hyperparameters as the spec gave them (numbers, booleans, strings, lists and
    mappings), without dtrain's own settings; ``{}`` outside a job (no ``SM_HPS``)."""
    raw = os.environ.get(HPS_ENV)
    if not raw:
        return {}
    values = json.loads(raw)
    if not isinstance(values, dict):
        raise TypeError(f"{HPS_ENV} holds {type(values).__name__}, not a JSON object; it is "
                         "the node agent's to set: do not set it yourself")
    return values
