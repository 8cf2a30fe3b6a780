"""AgileML: an elastic parameter-server runtime for data-parallel PyTorch training.

This first slice holds the wire protocol (`wire`), the fixed partitioning of model state
(`partitions`), a parameter server (`server`), a stateless worker (`worker`) and small example
models (`examples`). The elasticity controller and the ActivePS/BackupPS tiers come later.
"""
