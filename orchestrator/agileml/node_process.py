"""The entry point of a node process started on a machine that runs other nodes of the job
(`LocalJob`): the runtime's imports (torch first) happen at the lowest CPU priority, then the
node runs as `python -m orchestrator.agileml.node` would, but loads its model and data (a
built-in model's) and warms up at that priority too (see `lowprio`).

    python -m orchestrator.agileml.node_process --node-id t4 --job-id j --tier transient ...
"""

from __future__ import annotations

import importlib
import sys

from orchestrator.agileml.lowprio import at_low_priority


def main(argv: list[str] | None = None) -> int:
    """Run the node of `argv` (the command line's when None): see the module docstring. A
    node forked with the imports done (`forked`) only loads at low priority."""
    node = at_low_priority(lambda: importlib.import_module("orchestrator.agileml.node"))
    return int(node.main(argv, low_priority_load=True))


if __name__ == "__main__":
    sys.exit(main())
