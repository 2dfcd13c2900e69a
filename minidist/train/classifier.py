"""``--model mlp``'s workload (:class:`ClassifierWorkload`) beside its helpers: scoring, the
report line, the data set, the MLP, the warm-up."""
from __future__ import annotations

import numpy as np

from minidist import backend, data, nn, optim, workloads
from minidist.functions import cross_entropy
from minidist.tensor import Tensor, no_grad
from minidist.train.config import TrainConfig

# ---------------------------------------------------------------------------------------
# Scoring and reporting, shared by every strategy and by evaluate
# ---------------------------------------------------------------------------------------


def count_correct(model, X, y, batch_size: int = 1024, device: str = "cpu") -> int:
    """How many samples of (X, y) the model's argmax prediction gets right.
    X (n, features) float array, y (n,) int array. Runs under ``no_grad``."""
    correct = 0
    with no_grad():
        for start in range(0, len(X), batch_size):
            logits = model(Tensor(X[start : start + batch_size], device=device)).data
            predicted = backend.to_numpy(logits.argmax(axis=1))
            correct += int((predicted == np.asarray(y[start : start + batch_size])).sum())
    return correct


def accuracy(model, X, y, batch_size: int = 1024, device: str = "cpu") -> float:
    """Fraction of samples in (X, y) whose argmax prediction equals the label (NaN for
    an empty set). X (n, features) float array, y (n,) int array."""
    if len(X) == 0:
        return float("nan")
    return count_correct(model, X, y, batch_size, device) / len(X)


def report_epoch(model, dataset, config: TrainConfig, epoch, loss, seconds, log=print, extra: str = "") -> dict:
    """Score the model after an epoch and log the line every strategy prints (``extra``, the
    strategy's own figures, at its end); returns the history row (epoch, loss,
    train_accuracy, test_accuracy, seconds)."""
    row = {
        "epoch": epoch,
        "loss": loss,
        "train_accuracy": accuracy(model, dataset.X_train, dataset.y_train, device=config.device),
        "test_accuracy": accuracy(model, dataset.X_test, dataset.y_test, device=config.device),
        "seconds": seconds,
    }
    log(f"epoch {epoch}/{config.epochs}  loss={loss:.4f}  train_accuracy={row['train_accuracy']:.4f}  "
        f"test_accuracy={row['test_accuracy']:.4f}  time={seconds:.2f}s{extra}")
    return row


def load_dataset(config: TrainConfig):
    """The dataset named by ``config.dataset``: a ``data.Dataset`` (``digits``, split by
    ``config.seed``, or ``mnist`` from ``config.data_dir``) or, for ``shakespeare``, a
    ``workloads.TextDataset`` (the plays tokenized by character, split 90/10). Raises
    FileNotFoundError or ValueError for missing or malformed MNIST files, ModuleNotFoundError
    (naming the install command) when the plays' package is missing."""
    if config.dataset == "mnist":
        return data.load_mnist(config.data_dir)
    if config.dataset == "shakespeare":
        return workloads.load_text()
    return data.load_digits(seed=config.seed)


def build_model(config: TrainConfig, dataset: data.Dataset) -> nn.Sequential:
    """An MLP features -> hidden... -> classes, initialised from ``config.seed``."""
    sizes = [dataset.num_features, *config.hidden, dataset.num_classes]
    return nn.mlp(sizes, rng=config.seed, device=config.device)


def warmup_schedule(optimizer, config: TrainConfig, steps_per_epoch: int) -> optim.WarmupLR | None:
    """The lr warm-up over ``config.warmup_epochs`` epochs of ``steps_per_epoch`` steps
    (:class:`minidist.optim.WarmupLR`, Goyal et al. 2017), or None when there is none."""
    if config.warmup_epochs <= 0:
        return None
    return optim.WarmupLR(optimizer, max(1, round(config.warmup_epochs * steps_per_epoch)))


# ---------------------------------------------------------------------------------------
# Workloads: what the drivers train (minidist.workloads explains; the MLP's is here, beside its helpers)
# ---------------------------------------------------------------------------------------


class ClassifierWorkload:
    """``--model mlp``: the MLP of :func:`build_model` trained with SGD on digits or MNIST
    (:class:`data.Dataset`), scored by accuracy after each epoch; the other workload is
    ``workloads.LanguageModelWorkload`` and :mod:`minidist.workloads` lists what each part is."""

    name = "mlp"
    grad_clip = None
    scale_lr_by_default = True  # ddp and --dp: SGD's lr x the data-parallel ranks (Goyal et al. 2017)

    def __init__(self, config: TrainConfig, dataset: data.Dataset):
        self.config, self.dataset, self.epochs = config, dataset, config.epochs

    def model(self) -> nn.Sequential:
        return build_model(self.config, self.dataset)

    def loader(self, rank: int | None = None, world_size: int | None = None, min_batch: int = 1) -> data.DataLoader:
        """The training set reshuffled each epoch from ``config.seed``: whole (``rank`` None) or
        this rank's shard of ``world_size`` (``data.DistributedSampler``), in batches of
        ``config.batch_size``; an epoch's last batch is dropped when it has fewer than
        ``min_batch`` samples (a pipeline's micro-batches). With ``config.global_batch_size`` G:
        ``data.GlobalBatchSampler``'s steps of G, this rank's G / world_size of each."""
        c, d = self.config, self.dataset
        if c.global_batch_size is not None:  # the same global steps on any number of ranks
            sampler = data.GlobalBatchSampler(len(d.X_train), c.global_batch_size, world_size or 1, rank or 0,
                                              seed=c.seed)
            return data.DataLoader(d.X_train, d.y_train, batch_size=sampler.batch_size, sampler=sampler)
        if rank is None:
            return data.DataLoader(d.X_train, d.y_train, batch_size=c.batch_size, shuffle=True, seed=c.seed)
        sampler = data.DistributedSampler(len(d.X_train), world_size, rank, shuffle=True, seed=c.seed)
        return data.DataLoader(d.X_train, d.y_train, batch_size=c.batch_size, sampler=sampler,
                               drop_last=0 < len(sampler) % c.batch_size < min_batch)

    def optimizer(self, params, lr: float) -> optim.SGD:
        return optim.SGD(params, lr=lr, momentum=self.config.momentum, weight_decay=self.config.weight_decay)

    def lr_schedule(self, optimizer, steps_per_epoch: int) -> optim.WarmupLR | None:
        return warmup_schedule(optimizer, self.config, steps_per_epoch)

    def forward(self, model, x):
        return model(Tensor(x, device=self.config.device))

    def loss(self, logits, y):
        return cross_entropy(logits, backend.to_device(y, self.config.device))

    def checkpoint_state(self, loader) -> dict:
        return {}  # the loader's position is fit's (epoch, step), its shuffle a function of (seed, epoch)

    def metadata(self) -> None:
        return None

    def begin(self, position):
        return position

    bar_label = None  # fit's default, "epoch 3/20"

    def report(self, model, epoch, loss, seconds, log, extra: str = "", world_size: int = 1) -> dict:
        return report_epoch(model, self.dataset, self.config, epoch, loss, seconds, log, extra)

    def final(self, model, history: list) -> dict:
        """``{"test_accuracy"}``: the last epoch's, or scored now when no epoch was reported."""
        accuracy_ = history[-1].get("test_accuracy") if history else None
        if accuracy_ is None:
            accuracy_ = accuracy(model, self.dataset.X_test, self.dataset.y_test, device=self.config.device)
        return {"test_accuracy": accuracy_}
