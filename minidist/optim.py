"""Stochastic gradient descent and learning-rate schedules (PyTorch's names, **contract**).

One SGD step, for every parameter p with gradient g (Sutskever et al., "On the
importance of initialization and momentum in deep learning", ICML 2013; the update
form is PyTorch's ``torch.optim.SGD``)::

    g = g + weight_decay * p            # L2 penalty, folded into the gradient
    v = momentum * v + g                # velocity (v = g on the first step)
    p = p - lr * v                      # (nesterov: p = p - lr * (g + momentum * v))

With ``momentum=0`` this is plain SGD, p = p - lr * g.

Schedules change ``optimizer.lr`` once per step: :class:`StepLR` (decay by ``gamma``
every ``step_size`` steps) and :class:`WarmupLR` (the linear scaling rule with gradual
warm-up of Goyal et al., "Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour",
2017: start from ``lr / warmup_steps`` and ramp linearly to ``lr``).
"""
from __future__ import annotations

from minidist import backend
from minidist.tensor import Tensor, no_grad


class SGD:
    """SGD with optional momentum, Nesterov momentum and weight decay.

    Args:
        params: iterable of Tensors with ``requires_grad=True`` (``model.parameters()``).
        lr: learning rate (> 0).
        momentum: momentum factor in [0, 1).
        weight_decay: L2 penalty factor (>= 0).
        nesterov: use Nesterov momentum (needs momentum > 0).

    ``step()`` skips parameters whose ``.grad`` is None. Updates are in place on
    ``p.data`` (so anything holding the parameter sees the new value).

    Raises:
        ValueError: bad hyperparameters or an empty parameter list.
    """

    def __init__(self, params, lr, momentum=0.0, weight_decay=0.0, nesterov=False):
        self.params = list(params)
        if not self.params:
            raise ValueError("SGD: got an empty parameter list; pass model.parameters()")
        if not all(isinstance(p, Tensor) and p.requires_grad for p in self.params):
            raise ValueError("SGD: every parameter must be a Tensor with requires_grad=True")
        if lr <= 0:
            raise ValueError(f"SGD: lr must be > 0, got {lr}")
        if not 0 <= momentum < 1:
            raise ValueError(f"SGD: momentum must be in [0, 1), got {momentum}")
        if weight_decay < 0:
            raise ValueError(f"SGD: weight_decay must be >= 0, got {weight_decay}")
        if nesterov and momentum == 0:
            raise ValueError("SGD: nesterov=True needs momentum > 0")
        self.lr, self.momentum, self.weight_decay, self.nesterov = lr, momentum, weight_decay, nesterov
        self.velocity = [None] * len(self.params)
        self.steps = 0

    @no_grad()
    def step(self):
        """Apply one update to every parameter that has a gradient."""
        for i, p in enumerate(self.params):
            g = p.grad
            if g is None:
                continue
            if self.weight_decay:
                g = g + self.weight_decay * p.data
            if self.momentum:
                v = self.velocity[i]
                if v is None:
                    v = self.velocity[i] = g.copy()
                else:
                    v *= self.momentum
                    v += g
                g = g + self.momentum * v if self.nesterov else v
            p.data -= self.lr * g
        self.steps += 1

    def zero_grad(self):
        """Clear the gradients of all parameters (set to None)."""
        for p in self.params:
            p.grad = None

    def state_dict(self):
        """Hyperparameters, step count and momentum buffers (copies)."""
        return {
            "lr": self.lr, "momentum": self.momentum, "weight_decay": self.weight_decay,
            "nesterov": self.nesterov, "steps": self.steps,
            "velocity": [None if v is None else v.copy() for v in self.velocity],
        }

    def load_state_dict(self, state):
        """Restore what :meth:`state_dict` saved. Raises ValueError when the number of
        momentum buffers differs from the number of parameters."""
        if len(state["velocity"]) != len(self.params):
            raise ValueError(f"SGD.load_state_dict: {len(state['velocity'])} buffers for {len(self.params)} parameters")
        self.lr, self.momentum = state["lr"], state["momentum"]
        self.weight_decay, self.nesterov, self.steps = state["weight_decay"], state["nesterov"], state["steps"]
        self.velocity = [None if v is None else backend.to_device(v, p.device).copy()
                         for v, p in zip(state["velocity"], self.params)]


class StepLR:
    """Multiply the optimizer's lr by ``gamma`` every ``step_size`` calls of ``step()``."""

    def __init__(self, optimizer, step_size, gamma=0.1):
        if step_size < 1:
            raise ValueError(f"StepLR: step_size must be >= 1, got {step_size}")
        self.optimizer, self.step_size, self.gamma = optimizer, step_size, gamma
        self.base_lr, self.count = optimizer.lr, 0

    def step(self):
        self.count += 1
        self.optimizer.lr = self.base_lr * self.gamma ** (self.count // self.step_size)


class WarmupLR:
    """Linear warm-up to ``optimizer.lr`` over ``warmup_steps`` steps (Goyal et al. 2017,
    section 2.2): the lr used at step t (counting from 1) is lr · min(1, t / warmup_steps).
    Create it after setting the target lr (for example the linear scaling rule
    lr = base_lr · global_batch / 256) and call ``step()`` before each optimizer step."""

    def __init__(self, optimizer, warmup_steps):
        if warmup_steps < 0:
            raise ValueError(f"WarmupLR: warmup_steps must be >= 0, got {warmup_steps}")
        self.optimizer, self.warmup_steps = optimizer, warmup_steps
        self.target_lr, self.count = optimizer.lr, 0

    def step(self):
        self.count += 1
        fraction = 1.0 if self.warmup_steps == 0 else min(1.0, self.count / self.warmup_steps)
        self.optimizer.lr = self.target_lr * fraction


def scale_lr(base_lr: float, global_batch: int, base_batch: int = 256) -> float:
    """The linear scaling rule (Goyal et al. 2017): when the batch grows k-fold, grow the
    learning rate k-fold. Returns base_lr * global_batch / base_batch."""
    if global_batch < 1 or base_batch < 1:
        raise ValueError(f"scale_lr: batch sizes must be >= 1, got {global_batch}, {base_batch}")
    return base_lr * global_batch / base_batch
