"""BidBrain: cost-per-work model, acquisition policies and budgets (seed 002 §4.3)."""
