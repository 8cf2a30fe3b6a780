"""AgileML: an elastic parameter-server runtime for data-parallel PyTorch training.

This first slice holds the wire protocol (`wire`), the fixed partitioning of model state
(`partitions`), a parameter server with partition hand-off (`server`), a stateless worker
(`worker`), small example models (`examples`) and the pure elasticity decisions: stage choice,
role plans, partition assignment and the node lifecycle (`elasticity`). The live elasticity
controller and ActivePS -> BackupPS replication come later.
"""
