"""FlexRR: straggler mitigation (RapidReassignment protocol, worker groups) and injected straggler
patterns."""
