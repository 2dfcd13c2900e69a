"""Training: one loop, :func:`fit`, driven by each strategy's step function.

Every strategy trains the same way: for each epoch, for each mini-batch ``(x, y)`` of a
loader, do one step and note its loss. What a step *is* differs:

- ``single``: forward, loss, backward, optimizer step (:func:`supervised_step`);
- ``ddp``: the same on a :class:`~minidist.parallel.data_parallel.DistributedDataParallel`
  model, whose backward averages the gradients over the ranks;
- ``ps``: pull the parameters from the servers, forward and backward, push the gradient
  (``parameter_server.train_parameter_server``);
- a pipeline: a whole schedule of micro-batches per mini-batch.

So :func:`fit` takes the step as a function ``step_fn(x, y) -> loss`` and owns what is
common: the epoch loop (telling a distributed sampler the epoch, as PyTorch's
``DistributedSampler.set_epoch`` needs), the progress bar, the mean loss per epoch, a
per-epoch callback (evaluation, logging), and stopping with :class:`NonFiniteLossError`
when the loss becomes NaN or infinite, instead of training on garbage.

The drivers of ``python -m minidist train`` (**contract**) take a :class:`TrainConfig` and
return a :class:`TrainResult`. The one-process reference is :func:`train_single`. Every
strategy that trains on a communicator runs through :func:`train_parallel` (``run``): the
same order every time (the wing's parallelize step, then loader, lr schedule, log, loss
scaler, step, checkpointer, :func:`fit`, the dense model, the figures), with what differs
written by each wing as a :class:`ParallelRun` beside the mechanism it drives
(``minidist.parallel.data_parallel.train``, ``zero.train``, ``fsdp.train``,
``tensor_parallel.train``, ``pipeline.train``, ``three_d.train``); the parameter servers and
PipeDream keep drivers of their own (``parameter_server.train``, ``pipeline.train_pipedream``).
The command line (``minidist.cli``) parses the flags, builds the config, picks the driver from
the strategy's record (``minidist.strategy``) and prints the result (per-epoch lines, the
strategy's figures, last ``final test_accuracy=0.xxxx``). Checkpoints of the training state:
:class:`minidist.fault.Checkpointer`.

What a driver trains is a workload (:mod:`minidist.workloads`, ``config.model``): the MLP
classifier's, :class:`ClassifierWorkload`, sits in ``classifier`` beside the helpers it uses
(:func:`build_model`, :func:`report_epoch`, ...), which the parameter server's and PipeDream's
drivers call directly (they train the MLP only); the GPT's is ``workloads.LanguageModelWorkload``,
and :func:`workload_for` picks one.

This package's face gives every name its modules define, so ``from minidist.train import fit``
reads as it always did. Read it in this order:

- ``config``      ``TrainConfig``, the fields that shape a run and their digest, ``TrainResult``
- ``loop``        :func:`fit`, the step functions it drives, the log and the deadline
- ``batch``       the lr's scaling and the global batch cut over the ranks; ``workload_for``
- ``classifier``  the MLP's workload and its scoring
- ``run``         :func:`train_parallel`, the one run every strategy on a communicator goes
                  through, and :class:`ParallelRun`, what a wing's parallelize step hands it
- ``single``      :func:`train_single`, the one-process reference
"""
from minidist import backend, data, nn, optim, p2p, precision, workloads  # noqa: F401  (the old module's names)
from minidist.train.batch import (  # noqa: F401
    batch_description,
    check_global_batch,
    data_parallel_lr,
    global_batch,
    loss_weight,
    per_rank_config,
    workload_for,
)
from minidist.train.classifier import (  # noqa: F401
    ClassifierWorkload,
    accuracy,
    build_model,
    count_correct,
    load_dataset,
    report_epoch,
    warmup_schedule,
)
from minidist.train.config import (  # noqa: F401
    DATASETS,
    GPT_BATCH_SIZE,
    GPT_LR,
    GPT_WEIGHT_DECAY,
    MODEL_DEFAULTS,
    MODELS,
    NOT_RUN_FIELDS,
    PIPEDREAM_MOMENTUM,
    PIPEDREAM_SCHEDULES,
    PIPELINE_HIDDEN,
    PIPELINE_LR,
    PIPELINE_SCHEDULES,
    PS_MODES,
    TrainConfig,
    TrainResult,
    run_digest,
    run_fields,
)
from minidist.train.loop import (  # noqa: F401
    NonFiniteLossError,
    StepBytes,
    checkpoint_parts,
    collective_deadline,
    fit,
    rank_logger,
    sharded_step,
    silent,
    supervised_step,
    workload_step,
)
from minidist.train.run import (  # noqa: F401
    ParallelRun,
    train_parallel,
)
from minidist.train.single import (  # noqa: F401
    train_single,
)
