"""The instance agent: the one process on every instance of a job, on AWS and offline alike.

identity.py   who the instance is (its metadata service and tags)
instance.py   `InstanceAgent`: the AgileML node, the spot-notice watcher, the work account
work.py       the offline world's account of an instance's work on its faster clock
aws.py        `orchestrator worker start` (IMDS, Secrets Manager, systemd)
offline.py    `python -m orchestrator.agent`, started by the offline world's local fleet
"""
