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
2017: start from ``lr / warmup_steps`` and ramp linearly to ``lr``), and
:class:`WarmupCosineLR` (linear warm-up, then cosine decay: GPT-3's schedule, Brown et al. 2020,
appendix B, which nanoGPT's training script follows).

:class:`Adam` (Kingma & Ba, "Adam: A Method for Stochastic Optimization", ICLR 2015) keeps two
running averages per parameter, of the gradient (m) and of its square (v), and steps by m
over sqrt(v), both corrected for starting at zero; :class:`AdamW` (Loshchilov & Hutter,
"Decoupled Weight Decay Regularization", ICLR 2019) shrinks the weights directly instead of
adding the decay to the gradient. Both follow ``torch.optim.Adam``/``AdamW`` operation for
operation, so float64 runs agree with torch to rounding.
"""
from __future__ import annotations

import math

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


def _check_params(name, params):
    params = list(params)
    if not params:
        raise ValueError(f"{name}: got an empty parameter list; pass model.parameters()")
    if not all(isinstance(p, Tensor) and p.requires_grad for p in params):
        raise ValueError(f"{name}: every parameter must be a Tensor with requires_grad=True")
    return params


class Adam:
    """Adam (Kingma & Ba 2015, Algorithm 1), with ``torch.optim.Adam``'s semantics.

    For every parameter p with gradient g, at its step t (counted per parameter, from 1)::

        g = g + weight_decay * p                  # L2 penalty in the gradient (Adam only)
        m = beta1 * m + (1 - beta1) * g           # first moment (m, v start at 0)
        v = beta2 * v + (1 - beta2) * g * g       # second moment
        p = p - lr / (1 - beta1**t) * m / (sqrt(v) / sqrt(1 - beta2**t) + eps)

    Args:
        params: iterable of Tensors with ``requires_grad=True`` (``model.parameters()``).
        lr: learning rate (>= 0; a schedule may change ``optimizer.lr`` between steps).
        betas: (beta1, beta2), each in [0, 1).
        eps: added to the denominator (>= 0).
        weight_decay: L2 factor (>= 0).

    State (``state_dict``): per parameter ``exp_avg`` (m), ``exp_avg_sq`` (v) and ``step``
    (t); a parameter whose ``.grad`` is None is skipped and its t does not advance. Updates
    are in place on ``p.data``. Memory: two arrays the size of the parameters.

    Raises:
        ValueError: bad hyperparameters or an empty parameter list.
    """

    decoupled_weight_decay = False

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
        name = type(self).__name__
        self.params = _check_params(name, params)
        if not lr >= 0:
            raise ValueError(f"{name}: lr must be >= 0, got {lr}")
        if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
            raise ValueError(f"{name}: betas must be two numbers in [0, 1), got {betas}")
        if not eps >= 0:
            raise ValueError(f"{name}: eps must be >= 0, got {eps}")
        if not weight_decay >= 0:
            raise ValueError(f"{name}: weight_decay must be >= 0, got {weight_decay}")
        self.lr, self.betas, self.eps, self.weight_decay = lr, (float(betas[0]), float(betas[1])), eps, weight_decay
        self.exp_avg = [None] * len(self.params)
        self.exp_avg_sq = [None] * len(self.params)
        self.step_count = [0] * len(self.params)
        self.steps = 0

    @no_grad()
    def step(self):
        """Apply one update to every parameter that has a gradient."""
        beta1, beta2 = self.betas
        lr, weight_decay = self.lr, self.weight_decay
        for i, p in enumerate(self.params):
            g = p.grad
            if g is None:
                continue
            xp = backend.get_array_module(p.data)
            if self.exp_avg[i] is None:
                self.exp_avg[i], self.exp_avg_sq[i] = xp.zeros_like(p.data), xp.zeros_like(p.data)
            self.step_count[i] += 1
            t = self.step_count[i]
            if weight_decay and self.decoupled_weight_decay:
                p.data *= 1 - lr * weight_decay
            elif weight_decay:
                g = g + weight_decay * p.data
            m, v = self.exp_avg[i], self.exp_avg_sq[i]
            m += (g - m) * (1 - beta1)  # torch's lerp: m + (1 - beta1)(g - m)
            v *= beta2
            v += (1 - beta2) * g * g
            denom = xp.sqrt(v)
            denom /= math.sqrt(1 - beta2**t)
            denom += self.eps
            p.data += (-lr / (1 - beta1**t)) * m / denom
        self.steps += 1

    def zero_grad(self):
        """Clear the gradients of all parameters (set to None)."""
        for p in self.params:
            p.grad = None

    def state_dict(self):
        """Hyperparameters, step counts and both moments of every parameter (copies; None
        before a parameter's first step). Round-trips through :meth:`load_state_dict` and a
        checkpoint file exactly, so a resumed run continues bit for bit."""
        return {
            "lr": self.lr, "betas": list(self.betas), "eps": self.eps, "weight_decay": self.weight_decay,
            "steps": self.steps, "step": list(self.step_count),
            "exp_avg": [None if m is None else m.copy() for m in self.exp_avg],
            "exp_avg_sq": [None if v is None else v.copy() for v in self.exp_avg_sq],
        }

    def load_state_dict(self, state):
        """Restore what :meth:`state_dict` saved (moments copied onto each parameter's device).
        Raises ValueError when the number of parameters differs."""
        name = type(self).__name__
        for key in ("exp_avg", "exp_avg_sq", "step"):
            if len(state[key]) != len(self.params):
                raise ValueError(f"{name}.load_state_dict: {len(state[key])} {key} entries for "
                                 f"{len(self.params)} parameters")
        self.lr, self.eps, self.weight_decay = state["lr"], state["eps"], state["weight_decay"]
        self.betas = (float(state["betas"][0]), float(state["betas"][1]))
        self.steps, self.step_count = int(state["steps"]), [int(t) for t in state["step"]]

        def moments(key):
            return [None if a is None else backend.to_device(a, p.device).copy()
                    for a, p in zip(state[key], self.params)]

        self.exp_avg, self.exp_avg_sq = moments("exp_avg"), moments("exp_avg_sq")


class AdamW(Adam):
    """AdamW (Loshchilov & Hutter 2019, Algorithm 2), with ``torch.optim.AdamW``'s semantics:
    Adam's update (see :class:`Adam`) with the weight decay *decoupled* from the gradient,
    applied to the weights first at each step::

        p = p * (1 - lr * weight_decay)
        ... then Adam's moments and step with the gradient g unchanged.

    With Adam's L2 penalty the decay passes through the moments and is divided by sqrt(v),
    so weights with large gradients are barely decayed; here every weight shrinks by the
    same factor. Arguments, state and errors as :class:`Adam`; ``weight_decay`` defaults to
    0.01 as torch's.
    """

    decoupled_weight_decay = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)


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


class WarmupCosineLR:
    """Linear warm-up, then cosine decay (GPT-3's schedule, Brown et al. 2020, appendix B: warm-up
    over 375 M tokens, cosine to 10 % of the peak; as nanoGPT's ``get_lr``; the cosine is
    Loshchilov & Hutter, "SGDR", ICLR 2017, without restarts).

    With ``lr`` the optimizer's lr when the schedule is created, the lr used at step t
    (counting from 1; call ``step()`` before each optimizer step, as :class:`WarmupLR`) is::

        t <= warmup_steps:             lr · t / warmup_steps
        warmup_steps < t <= max_steps: min_lr + (lr - min_lr) · (1 + cos(π r)) / 2,
                                       r = (t - warmup_steps) / (max_steps - warmup_steps)
        t > max_steps:                 min_lr

    Its state is plain numbers (checkpointed as the other schedules).

    Raises ValueError unless 0 <= warmup_steps < max_steps and 0 <= min_lr <= lr.
    """

    def __init__(self, optimizer, warmup_steps, max_steps, min_lr=0.0):
        if not 0 <= warmup_steps < max_steps:
            raise ValueError(f"WarmupCosineLR: need 0 <= warmup_steps < max_steps, got {warmup_steps}, {max_steps}")
        if not 0 <= min_lr <= optimizer.lr:
            raise ValueError(f"WarmupCosineLR: min_lr must be in [0, lr = {optimizer.lr}], got {min_lr}")
        self.optimizer, self.warmup_steps, self.max_steps = optimizer, warmup_steps, max_steps
        self.target_lr, self.min_lr, self.count = optimizer.lr, min_lr, 0

    def lr_at(self, t: int) -> float:
        """The lr of step ``t`` (from 1), by the formula above."""
        if t <= self.warmup_steps:
            return self.target_lr * t / self.warmup_steps
        if t > self.max_steps:
            return self.min_lr
        ratio = (t - self.warmup_steps) / (self.max_steps - self.warmup_steps)
        return self.min_lr + (self.target_lr - self.min_lr) * 0.5 * (1.0 + math.cos(math.pi * ratio))

    def step(self):
        self.count += 1
        self.optimizer.lr = self.lr_at(self.count)


def scale_lr(base_lr: float, global_batch: int, base_batch: int = 256) -> float:
    """The linear scaling rule (Goyal et al. 2017): when the batch grows k-fold, grow the
    learning rate k-fold. Returns base_lr * global_batch / base_batch."""
    if global_batch < 1 or base_batch < 1:
        raise ValueError(f"scale_lr: batch sizes must be >= 1, got {global_batch}, {base_batch}")
    return base_lr * global_batch / base_batch
