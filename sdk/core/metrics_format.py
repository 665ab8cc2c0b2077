"""The one definition of dtrain's metric line (stdlib only).

The trainer prints one line per logged step, for example::

    dtrain-metrics step=12 loss=2.345 lr=0.0003 grad_norm=0.9 tokens_per_s=1234 mfu=0.48

``key=value`` pairs are separated by single spaces, values are plain numbers (Python ``repr`` of
an int or float, ``nan``/``inf`` allowed), unknown keys are allowed and ignored by SageMaker.
The SageMaker launcher turns ``METRICS`` into ``MetricDefinitions`` (so the numbers appear in the
SageMaker console and CloudWatch), and ``parse_metrics`` reads the same lines back from logs, so
the writer, the console regexes and the reader cannot drift apart.
"""

from __future__ import annotations

import math
import re

PREFIX = "dtrain-metrics"
# The metrics SageMaker charts, in the order the trainer prints them.
METRICS = ("step", "loss", "eval_loss", "lr", "grad_norm", "tokens_per_s", "tflops_per_gpu",
           "mfu")
NUMBER = r"[-+]?(?:[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?|nan|inf)"
_PAIR = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)=(" + NUMBER + r")(?=\s|$)")
_LINE = re.compile(re.escape(PREFIX) + r"(?:\s|$)")


def metric_regex(name: str) -> str:
    """The regex whose first group captures ``name``'s value on a metric line.

    The whitespace before the key keeps ``loss`` from matching inside ``eval_loss``.
    """
    return PREFIX + r".*?\s" + re.escape(name) + "=(" + NUMBER + ")"


def metric_definitions() -> list[dict[str, str]]:
    """SageMaker ``AlgorithmSpecification.MetricDefinitions`` for every metric in ``METRICS``."""
    return [{"Name": name, "Regex": metric_regex(name)} for name in METRICS]


def format_metrics(step: int, **values: float) -> str:
    """The line the trainer prints: ``dtrain-metrics step=<step> key=value ...``."""
    parts = [PREFIX, f"step={int(step)}"]
    for key, value in values.items():
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            raise ValueError(f"metric name {key!r} must be letters, digits and underscores")
        parts.append(f"{key}={_number(value)}")
    return " ".join(parts)


def parse_metrics(line: str) -> dict[str, float] | None:
    """The numbers on a metric line (``step`` as int), or None when ``line`` is not one."""
    start = _LINE.search(line)
    if start is None:
        return None
    values: dict[str, float] = {}
    for key, raw in _PAIR.findall(line[start.end():]):
        values[key] = int(raw) if key == "step" else float(raw)
    return values


def _number(value: float) -> str:
    value = float(value)
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return repr(int(value)) if value.is_integer() and abs(value) < 1e15 else repr(value)
