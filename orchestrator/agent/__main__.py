"""`python -m orchestrator.agent`: the offline world's instance agent (see `agent.offline`)."""

import sys

from orchestrator.agent.offline import main

sys.exit(main())
