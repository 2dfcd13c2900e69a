"""3-D parallelism (Megatron-LM's PTD-P): data, pipeline and tensor parallelism on one mesh.

- ``train``  the driver of ``train --model gpt --strategy 3d --dp D --tp T``: a (dp, pp, tp)
             :class:`~minidist.parallel.mesh.DeviceMesh`, the GPT split over tp, cut into
             stages over pp, replicated over dp; :class:`ThreeDStep`, the pipeline step whose
             clipping knows the shards; :class:`ThreeDRun`, what the one loop
             (``train.train_parallel``) runs
- ``report`` pipeline 0's shards joined into a dense GPT, the interval's line, the figures

Source: Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", SC 2021.
"""
from minidist.parallel.three_d.train import MESH_NAMES, ThreeDStep, check_3d, layout_3d, train_3d

__all__ = ["MESH_NAMES", "ThreeDStep", "check_3d", "layout_3d", "train_3d"]
