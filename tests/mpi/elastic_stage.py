"""One stage of an elastic run under real mpiexec (run by tests/test_elastic_mpi.py): the MLP in
float64 on a random data set of unique rows, trained by ddp, ddp --zero or fsdp with a fixed
global batch on however many ranks mpiexec started, stopped after a step or run to the end.

Every rank writes the sample indices its forward passes read, batch by batch, to
``OUT/reads-<ranks>-<rank>.json``; rank 0 writes the final weights to ``OUT/final.npz`` when the
run ends. Usage: ``mpiexec -n N python -m mpi4py elastic_stage.py NAME G CKPT OUT STOP RESUME``
(STOP 0: to the end; RESUME 0 or 1). :func:`dataset` and :func:`probe` are also the test's
single-process reference, so both sides train the same model on the same data.
"""
import contextlib
import dataclasses
import json
import sys
from pathlib import Path
from unittest import mock

import numpy as np

from minidist import data, fault, nn, train

SAMPLES, FEATURES = 240, 8


def dataset() -> data.Dataset:
    rng = np.random.default_rng(0)
    X, y = rng.standard_normal((SAMPLES, FEATURES)), rng.integers(0, 3, SAMPLES)
    return data.Dataset(X, y, X[:30], y[:30])


@contextlib.contextmanager
def probe(d: data.Dataset, reads: list):
    """The MLP in float64 (16 hidden units), every forward's sample indices appended to ``reads``."""
    index = {row.tobytes(): i for i, row in enumerate(d.X_train)}
    forward = train.ClassifierWorkload.forward

    def recording_forward(self, model, x):
        reads.append([index[row.tobytes()] for row in np.asarray(x)])
        return forward(self, model, x)

    with mock.patch.object(train.ClassifierWorkload, "forward", recording_forward), \
            mock.patch.object(train.ClassifierWorkload, "model",
                              lambda self: nn.mlp([FEATURES, 16, 3], rng=self.config.seed, dtype="float64")):
        yield


def config(name: str, g: int, checkpoint_dir) -> train.TrainConfig:
    return train.TrainConfig(strategy="fsdp" if name == "fsdp" else "ddp", zero=name == "zero", epochs=1,
                             global_batch_size=g, lr=0.1, hidden=(16,), progress=False, checkpoint_every=5,
                             timeout=60, checkpoint_dir=None if checkpoint_dir is None else str(checkpoint_dir))


def main(argv):
    from mpi4py import MPI

    from minidist.cli.train import DRIVERS
    from minidist.parallel.zero.train import train_zero

    name, g, ckpt, out, stop, resume = argv
    comm = MPI.COMM_WORLD
    c = dataclasses.replace(config(name, int(g), ckpt), stop_after_steps=int(stop) or None, resume=resume == "1")
    run = train_zero if name == "zero" else DRIVERS[name][0]
    d, reads = dataset(), []
    with probe(d, reads), contextlib.redirect_stdout(sys.stderr):
        try:
            result = run(comm, c, d)
        except fault.TrainingStopped:
            result = None
    out = Path(out)
    (out / f"reads-{comm.Get_size()}-{comm.Get_rank()}.json").write_text(json.dumps(reads))
    if result is not None:
        np.savez(out / "final.npz", **{k: np.asarray(v) for k, v in result.model.state_dict().items()})


if __name__ == "__main__":
    main(sys.argv[1:])
