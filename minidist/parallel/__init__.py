"""Parallel training: one file per way of splitting the work.

- ``data_parallel``     DistributedDataParallel: replicas, bucketed gradient all-reduce
- ``parameter_server``  workers push gradients to sharded servers (sync, async, bounded staleness)
- ``inference``         data-parallel evaluation: shard the test set, gather once
"""
