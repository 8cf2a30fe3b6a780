"""AgileML: an elastic parameter-server runtime for data-parallel PyTorch training.

`wire` (authenticated messages), `partitions` (fixed partitions of model state), `roster`
(worker sets by clock, batch shares), `server` (ParamServ / ActivePS / BackupPS), `worker`
(stateless workers), `elasticity` (stages, roles, assignment, node lifecycle), `control` (the
training spec, views, control messages), `coordinator` (the elasticity controller), `agent` (a
node), `local` (a job on this machine), `examples` (models and generated data), `token`.
"""
