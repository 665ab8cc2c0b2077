"""``python -m dtrain.runtime [--root DIR]``: the node agent (one per host).

The root defaults to ``$DTRAIN_ROOT`` or ``/opt/ml``, the SageMaker container layout.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from dtrain.core import logformat


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dtrain.runtime",
                                     description="dtrain node agent: run this host's workers")
    parser.add_argument("--root", default=None,
                        help="contract root (default: $DTRAIN_ROOT or /opt/ml)")
    parser.add_argument("--grace-period", type=int, default=None,
                        help="seconds workers get after SIGTERM before SIGKILL (default 30)")
    args = parser.parse_args(argv)
    drain = None
    if os.environ.get(logformat.STAMP_ENV):
        from dtrain.runtime.agent.stamp import stamp_output

        drain = stamp_output()
    logging.basicConfig(level=int(os.environ.get("SM_LOG_LEVEL", logging.INFO)),
                        format="%(asctime)s dtrain-agent %(levelname)s %(message)s")
    from dtrain.runtime.agent import node  # torch is imported only once arguments are valid

    try:
        return node.run(args.root, grace_period_s=args.grace_period)
    finally:
        if drain is not None:
            drain()


if __name__ == "__main__":
    sys.exit(main())
