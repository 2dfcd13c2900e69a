"""Training across data centres: local SGD and DiLoCo, Streaming DiLoCo, replicas that come and go.

Read in this order: ``fragments`` (which parameters sync together, and when), ``replicas`` (the
quorum at each sync point, joining, the state a peer hands over), ``fp4`` (4-bit outer gradients),
``diloco`` (the inner and outer optimizers), ``strategy`` and ``train`` (``train --strategy diloco``).
"""
from minidist.parallel.local_sgd.diloco import DiLoCo, flatten, unflatten
from minidist.parallel.local_sgd.fp4 import decode_fp4, encode_fp4, fp4_compress_hook
from minidist.parallel.local_sgd.fragments import check_schedule, due_fragments, fragment_offsets, split_parameters
from minidist.parallel.local_sgd.replicas import (
    Quorum,
    ReplicaDropped,
    ReplicaGroup,
    ReplicaRefused,
    ReplicaSet,
    differing_fields,
    digest,
)

__all__ = ["DiLoCo", "Quorum", "ReplicaDropped", "ReplicaGroup", "ReplicaRefused", "ReplicaSet", "check_schedule",
           "decode_fp4", "differing_fields", "digest", "due_fragments", "encode_fp4", "flatten", "fp4_compress_hook",
           "fragment_offsets", "split_parameters", "unflatten"]
