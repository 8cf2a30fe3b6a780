"""The chaos soak's parts (`benchmarks.chaos_soak` runs them): the control plane (`world`)
and the AgileML runtime (`runtime`) under random faults, and what they share (`faults`)."""
