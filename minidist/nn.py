"""Layers and losses with PyTorch's names (**contract**): Module, Linear, ReLU, Tanh,
Sigmoid, GELU, Dropout, Embedding, LayerNorm, Sequential, ModuleList, ModuleDict;
``nn.functional`` is :mod:`minidist.functions`; ``nn.utils`` holds ``clip_grad_norm_`` and
the flat-vector pair.

A :class:`Module` finds its parameters by looking at its own attributes: a
:class:`Parameter` (a Tensor that requires grad) or another Module assigned as
``self.name = ...`` is registered under that name, in assignment order. That order is
the order of ``parameters()``, ``state_dict()`` and so of everything built on them
(the data-parallel buckets, the parameter-server shards), and it is the same on every
rank.

Randomness: every layer that draws initial weights takes ``rng`` (an int seed or a
``numpy.random.Generator``). Without one it draws from this module's default
generator, seeded by :func:`manual_seed` (0 at import), so a script is reproducible.
Weights are drawn with NumPy on the host and then moved to the device, so the CPU and
GPU start from the same numbers.

Longer than 400 lines: every layer a learner meets in chapters 1-13 with PyTorch's names (Module's
registry of parameters, buffers and hooks, the layers, the losses, the utils), so ``nn.`` reads as
``torch.nn.`` does.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from types import SimpleNamespace

import numpy as _np  # host-side random initialisation only

from minidist import backend, recompute
from minidist import functions as functional  # nn.functional, as in PyTorch
from minidist.tensor import Tensor

_default_rng = _np.random.default_rng(0)


def manual_seed(seed: int) -> None:
    """Reseed the default generator used by layers created without ``rng``."""
    global _default_rng
    _default_rng = _np.random.default_rng(seed)


def default_generator() -> _np.random.Generator:
    """The generator layers created without ``rng`` draw from (``torch.default_generator``'s
    role): reseeded by :func:`manual_seed`; checkpoints save and restore its state."""
    return _default_rng


def as_generator(rng) -> _np.random.Generator:
    """The generator a layer draws from: ``rng`` itself when it is a ``numpy.random.Generator``,
    a new one seeded with it when it is an int (or a SeedSequence), the default generator
    (:func:`default_generator`) when it is None. Models that build many layers from one seed
    (``minidist.models.gpt``) pass the result on to each layer."""
    if rng is None:
        return _default_rng
    if isinstance(rng, _np.random.Generator):
        return rng
    return _np.random.default_rng(rng)




class Parameter(Tensor):
    """A Tensor that is a module's learnable weight: ``requires_grad=True`` by default
    and registered by the Module it is assigned to."""

    __slots__ = ()

    def __init__(self, data, requires_grad=True):
        super().__init__(data, requires_grad=requires_grad)


class Module:
    """Base class of layers and models (mirrors ``torch.nn.Module``).

    Subclasses assign parameters and submodules as attributes in ``__init__`` and
    define ``forward(*inputs)``; calling the module calls ``forward``.
    """

    def __init__(self):
        object.__setattr__(self, "_parameters", OrderedDict())
        object.__setattr__(self, "_modules", OrderedDict())
        object.__setattr__(self, "training", True)

    def __setattr__(self, name, value):
        if "_parameters" not in self.__dict__:
            raise AttributeError(f"{type(self).__name__}.__init__ must call super().__init__() "
                                 f"before assigning {name!r}")
        # A name assigned again keeps its place (as torch): tying lm_head.weight to the
        # embedding must not move it after lm_head's other parameters.
        if isinstance(value, Parameter):
            self._modules.pop(name, None)
            self._parameters[name] = value
        elif isinstance(value, Module):
            self._parameters.pop(name, None)
            self._modules[name] = value
        else:
            self._parameters.pop(name, None)
            self._modules.pop(name, None)
        object.__setattr__(self, name, value)

    def forward(self, *inputs):
        raise NotImplementedError(f"{type(self).__name__} must define forward()")

    def __call__(self, *inputs):
        return self.forward(*inputs)

    # -------------------------------------------------------------- traversal
    def named_parameters(self, prefix: str = "", remove_duplicate: bool = True):
        """Yield ``(name, Parameter)`` pairs, names dotted like PyTorch's (``0.weight``,
        ``transformer.h.0.attn.c_attn.weight``), depth first in assignment order.

        A Parameter shared by two modules (a language model's output layer tied to its token
        embedding) comes once, under the first name met, unless ``remove_duplicate=False``
        (then under every name; :meth:`state_dict` lists all names, as torch's)."""
        seen = set()
        for name, p in self._named_parameters_all(prefix):
            if remove_duplicate:
                if id(p) in seen:
                    continue
                seen.add(id(p))
            yield name, p

    def _named_parameters_all(self, prefix):
        for name, p in self._parameters.items():
            if p is not None:
                yield prefix + name, p
        for name, m in self._modules.items():
            yield from m._named_parameters_all(prefix + name + ".")

    def parameters(self):
        """List of the module's Parameters, in registration order."""
        return [p for _, p in self.named_parameters()]

    def modules(self):
        """This module and all submodules, depth first."""
        yield self
        for m in self._modules.values():
            yield from m.modules()

    def num_parameters(self) -> int:
        """Total number of scalar parameters."""
        return int(sum(p.size for p in self.parameters()))

    def train(self, mode: bool = True):
        for m in self.modules():
            object.__setattr__(m, "training", mode)
        return self

    def eval(self):
        return self.train(False)

    def zero_grad(self):
        """Clear every parameter's gradient (set to None, as PyTorch's default)."""
        for p in self.parameters():
            p.grad = None

    def to(self, device: str):
        """Move every parameter's data to ``device`` in place; returns self."""
        for p in self.parameters():
            p.data = backend.to_device(p.data, device)
            p.grad = None if p.grad is None else backend.to_device(p.grad, device)
        return self

    # -------------------------------------------------------------- state
    def state_dict(self):
        """An ordered dict name -> copy of the parameter's array (on its device). A shared
        (tied) Parameter is listed under each of its names, as torch does, so a model's state
        holds every name its layout has (``lm_head.weight`` beside ``transformer.wte.weight``)."""
        return OrderedDict((name, p.data.copy()) for name, p in self.named_parameters(remove_duplicate=False))

    def load_state_dict(self, state):
        """Copy arrays from ``state`` into the parameters.

        Raises:
            KeyError: missing or unexpected names (both listed).
            ValueError: a shape that does not match.
        """
        own = dict(self.named_parameters(remove_duplicate=False))
        missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
        if missing or unexpected:
            raise KeyError(f"load_state_dict: missing keys {missing}, unexpected keys {unexpected}")
        for name, p in own.items():
            value = state[name]
            value = value.data if isinstance(value, Tensor) else value
            if tuple(value.shape) != p.shape:
                raise ValueError(f"load_state_dict: {name} has shape {tuple(value.shape)} in the state, "
                                 f"{p.shape} in the module")
            xp = backend.get_array_module(p.data)
            p.data = xp.asarray(backend.to_device(value, p.device), dtype=p.dtype).copy()

    def __repr__(self):
        if not self._modules:
            return f"{type(self).__name__}({self.extra_repr()})"
        body = "\n".join(f"  ({name}): " + repr(m).replace("\n", "\n  ") for name, m in self._modules.items())
        return f"{type(self).__name__}(\n{body}\n)"

    def extra_repr(self) -> str:
        return ""


class Linear(Module):
    """``y = x @ weight.T + bias`` (**contract**, as ``torch.nn.Linear``).

    Args:
        in_features, out_features: sizes of the last axis of input and output.
        bias: learn an additive bias.
        rng: seed or Generator for the initial weights (default: the module generator).
        dtype: parameter dtype (default float32).
        device: ``"cpu"``/``"cuda"`` (default ``$MINIDIST_DEVICE`` or cpu).

    Shapes: input (..., in_features) -> output (..., out_features); ``weight`` is
    (out_features, in_features), ``bias`` (out_features,). Both start uniform in
    ±1/sqrt(in_features), PyTorch's default (He et al. 2015's Kaiming-uniform with
    a = sqrt(5)).
    """

    def __init__(self, in_features, out_features, bias=True, *, rng=None, dtype="float32", device=None):
        super().__init__()
        if in_features < 1 or out_features < 1:
            raise ValueError(f"Linear: in_features and out_features must be >= 1, got {in_features}, {out_features}")
        self.in_features, self.out_features = int(in_features), int(out_features)
        gen = as_generator(rng)
        bound = 1.0 / math.sqrt(in_features)
        xp = backend.module_for(device or backend.default_device())
        weight = gen.uniform(-bound, bound, size=(out_features, in_features)).astype(dtype)
        self.weight = Parameter(xp.asarray(weight))
        if bias:
            self.bias = Parameter(xp.asarray(gen.uniform(-bound, bound, size=(out_features,)).astype(dtype)))
        else:
            self.bias = None

    def forward(self, x):
        return functional.linear(x, self.weight, self.bias)

    def extra_repr(self):
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class ReLU(Module):
    """Elementwise max(x, 0)."""

    def forward(self, x):
        return functional.relu(x)


class Tanh(Module):
    """Elementwise tanh(x)."""

    def forward(self, x):
        return functional.tanh(x)


class Sigmoid(Module):
    """Elementwise 1 / (1 + exp(-x))."""

    def forward(self, x):
        return functional.sigmoid(x)


class GELU(Module):
    """Elementwise GELU(x) = x Φ(x) (Hendrycks & Gimpel 2016; ``torch.nn.GELU``).
    ``approximate``: "none" (torch's default, through erf) or "tanh" (GPT-2's). Raises
    ValueError for any other value."""

    def __init__(self, approximate="none"):
        super().__init__()
        if approximate not in ("none", "tanh"):
            raise ValueError(f"GELU: approximate must be 'none' or 'tanh', got {approximate!r}")
        self.approximate = approximate

    def forward(self, x):
        return functional.gelu(x, approximate=self.approximate)

    def extra_repr(self):
        return f"approximate={self.approximate!r}"


class Embedding(Module):
    """A lookup table (``torch.nn.Embedding``): integer indices of any shape (...) -> rows
    (..., embedding_dim) of ``weight`` (num_embeddings, embedding_dim), drawn N(0, 1) as torch.

    Args:
        num_embeddings: the number of rows V (a vocabulary, or a context length).
        embedding_dim: the row width C.
        rng, dtype, device: as :class:`Linear`.

    A repeated index gets the sum of its positions' gradients. Raises IndexError in forward
    for an index outside [0, num_embeddings) (the message names the limit), TypeError for
    non-integer indices, ValueError here for sizes < 1.
    """

    def __init__(self, num_embeddings, embedding_dim, *, rng=None, dtype="float32", device=None):
        super().__init__()
        if num_embeddings < 1 or embedding_dim < 1:
            raise ValueError(f"Embedding: num_embeddings and embedding_dim must be >= 1, got {num_embeddings}, "
                             f"{embedding_dim}")
        self.num_embeddings, self.embedding_dim = int(num_embeddings), int(embedding_dim)
        xp = backend.module_for(device or backend.default_device())
        weight = as_generator(rng).standard_normal((num_embeddings, embedding_dim)).astype(dtype)
        self.weight = Parameter(xp.asarray(weight))

    def forward(self, indices):
        return functional.embedding(indices, self.weight)

    def extra_repr(self):
        return f"{self.num_embeddings}, {self.embedding_dim}"


class LayerNorm(Module):
    """Layer normalisation over the trailing ``normalized_shape`` axes (Ba et al. 2016;
    ``torch.nn.LayerNorm``): (x - mean) / sqrt(var + eps) · weight + bias, one fused op that
    saves the mean and 1/std of each row (:class:`minidist.attention.LayerNorm`).

    Args:
        normalized_shape: int or tuple, the input's trailing axes (C for (B, T, C)).
        eps: added to the variance.
        elementwise_affine: learn ``weight`` (ones) and, with ``bias``, ``bias`` (zeros).
        bias: learn the bias (GPT-2 variants without biases set False; then ``bias`` is None).
        dtype, device: as :class:`Linear`.

    Shapes: input (..., *normalized_shape) -> the same. Raises ShapeError in forward when the
    trailing axes differ.
    """

    def __init__(self, normalized_shape, eps=1e-5, elementwise_affine=True, bias=True, *, dtype="float32",
                 device=None):
        super().__init__()
        shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
        self.normalized_shape, self.eps = shape, float(eps)
        xp = backend.module_for(device or backend.default_device())
        self.weight = Parameter(xp.ones(shape, dtype=dtype)) if elementwise_affine else None
        self.bias = Parameter(xp.zeros(shape, dtype=dtype)) if elementwise_affine and bias else None

    def forward(self, x):
        return functional.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)

    def extra_repr(self):
        return f"{self.normalized_shape}, eps={self.eps}, bias={self.bias is not None}"


class Dropout(Module):
    """Inverted dropout (as ``torch.nn.Dropout``; Srivastava et al., "Dropout: A Simple Way
    to Prevent Neural Networks from Overfitting", JMLR 2014): in training, each element is
    zeroed with probability ``p`` and the others are scaled by 1/(1-p), so the expected
    output equals the input and ``eval()`` can be the identity.

    Args:
        p: probability of zeroing an element, 0 <= p <= 1 (p = 1 zeroes everything).
        rng: seed or ``numpy.random.Generator`` for the masks. Each Dropout owns its
            ``generator``; without ``rng`` it is seeded from the module default generator
            (:func:`manual_seed`), so a script is reproducible.

    Shapes: any input shape; output the same shape and dtype. The mask is drawn with NumPy
    on the host (then moved to the input's device), so CPU and GPU runs draw the same masks.
    Each draw is announced to :func:`minidist.recompute.note_random_draw`, so a
    checkpointed segment replays the same mask when it is recomputed.

    Raises:
        ValueError: ``p`` outside [0, 1].
    """

    def __init__(self, p=0.5, *, rng=None):
        super().__init__()
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p <= 1:
            raise ValueError(f"Dropout: p must be a probability in [0, 1], got {p!r}")
        self.p = float(p)
        if rng is None:
            rng = int(_default_rng.integers(2**63))
        self.generator = as_generator(rng)

    def forward(self, x):
        if not self.training or self.p == 0:
            return x
        recompute.note_random_draw(self.generator)
        keep = self.generator.random(x.shape) >= self.p
        mask = keep * (1.0 / (1.0 - self.p)) if self.p < 1 else _np.zeros(x.shape)
        xp = backend.get_array_module(x.data)
        return functional.mul(x, xp.asarray(mask.astype(x.dtype)))

    def extra_repr(self):
        return f"p={self.p}"


class Sequential(Module):
    """Modules applied in order; submodules are named "0", "1", ... as in PyTorch.
    Indexing returns a layer (an int) or a new Sequential over the same layers (a slice),
    which the pipeline chapters use to cut a model into stages."""

    def __init__(self, *layers):
        super().__init__()
        for i, layer in enumerate(layers):
            if not isinstance(layer, Module):
                raise TypeError(f"Sequential: argument {i} is a {type(layer).__name__}, not a Module")
            setattr(self, str(i), layer)

    def forward(self, x):
        for layer in self._modules.values():
            x = layer(x)
        return x

    def __len__(self):
        return len(self._modules)

    def __iter__(self):
        return iter(self._modules.values())

    def __getitem__(self, index):
        layers = list(self._modules.values())
        return Sequential(*layers[index]) if isinstance(index, slice) else layers[index]


class ModuleList(Module):
    """A list of modules, registered under "0", "1", ... (``torch.nn.ModuleList``): their
    parameters are named ``h.0.attn.c_attn.weight`` when the list is the attribute ``h``.
    Unlike :class:`Sequential` it has no forward; the owner decides how to call them.
    Indexing with an int returns a module (negative ints count from the end), with a slice a
    new ModuleList. Raises TypeError for an element that is not a Module."""

    def __init__(self, modules=()):
        super().__init__()
        for m in modules:
            self.append(m)

    def append(self, module):
        if not isinstance(module, Module):
            raise TypeError(f"ModuleList: element {len(self)} is a {type(module).__name__}, not a Module")
        setattr(self, str(len(self)), module)
        return self

    def __len__(self):
        return len(self._modules)

    def __iter__(self):
        return iter(self._modules.values())

    def __getitem__(self, index):
        modules = list(self._modules.values())
        return ModuleList(modules[index]) if isinstance(index, slice) else modules[index]


class ModuleDict(Module):
    """Modules by name, in insertion order (``torch.nn.ModuleDict``): ``ModuleDict(wte=...)``
    or ``ModuleDict({"wte": ...})``; each is also an attribute (``d.wte``) and its parameters
    are named ``wte.weight``. Raises TypeError for a value that is not a Module, KeyError for
    a name that is not an identifier or would hide one of Module's attributes."""

    def __init__(self, modules=None, **named):
        super().__init__()
        for name, module in {**dict(modules or {}), **named}.items():
            self[name] = module

    def __setitem__(self, name, module):
        if not isinstance(module, Module):
            raise TypeError(f"ModuleDict: {name!r} is a {type(module).__name__}, not a Module")
        if not isinstance(name, str) or not name.isidentifier() or hasattr(type(self), name) or name == "training":
            raise KeyError(f"ModuleDict: {name!r} cannot name a module (use an identifier that is not one of "
                           "Module's attributes, like 'wte' or 'ln_f')")
        setattr(self, name, module)

    def __getitem__(self, name):
        return self._modules[name]

    def __contains__(self, name):
        return name in self._modules

    def __len__(self):
        return len(self._modules)

    def __iter__(self):
        return iter(self._modules)

    def keys(self):
        return self._modules.keys()

    def values(self):
        return self._modules.values()

    def items(self):
        return self._modules.items()


def mlp(sizes, activation=ReLU, *, rng=None, dtype="float32", device=None) -> Sequential:
    """A multilayer perceptron: Linear layers of the given ``sizes`` (e.g.
    ``[64, 128, 10]``) with ``activation`` between them (none after the last).
    ``rng`` seeds all layers in order, so the same seed gives the same network."""
    if len(sizes) < 2:
        raise ValueError(f"mlp: sizes needs at least an input and an output size, got {sizes}")
    gen = as_generator(rng)
    layers = []
    for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(Linear(n_in, n_out, rng=gen, dtype=dtype, device=device))
        if i < len(sizes) - 2:
            layers.append(activation())
    return Sequential(*layers)


# ----------------------------------------------------------------------------- flat vectors
# torch.nn.utils.parameters_to_vector / vector_to_parameters: the parameters laid end to end
# in order, each flattened row-major. Data parallelism broadcasts this vector, a parameter
# server shards it, the checks compare it; one pair of functions instead of a copy in each.


def parameters_to_vector(parameters):
    """The parameters laid end to end as one 1-D array (``torch.nn.utils.parameters_to_vector``).

    parameters: an iterable of Tensors (``model.parameters()``) or of raw arrays (e.g.
        ``(p.grad for p in params)``: our ``.grad`` is a raw array, torch's a Tensor), all of
        one dtype and on one device.
    Returns a new 1-D array (numpy or cupy, as the inputs; their dtype) of length
    ``sum(p.size)``: element k of parameter i sits at ``offset_i + k`` with ``offset_i`` the
    sizes of parameters 0..i-1 added up and k the row-major index. Unlike torch, the result
    is a raw array, not a Tensor in the autograd graph (nothing here differentiates through it).

    Raises ValueError for no parameters, a None (a missing gradient), or mixed dtypes or
    devices (one flat vector has one of each).
    """
    arrays = [p.data if isinstance(p, Tensor) else p for p in parameters]
    if not arrays:
        raise ValueError("parameters_to_vector: no parameters (pass model.parameters())")
    if any(a is None for a in arrays):
        raise ValueError("parameters_to_vector: got None (a parameter without a gradient? call "
                         "loss.backward() first)")
    kinds = sorted({(str(a.dtype), backend.device_of(a)) for a in arrays})
    if len(kinds) > 1:
        raise ValueError(f"parameters_to_vector: the parameters mix dtypes or devices {kinds}; one flat "
                         "vector holds one dtype on one device (convert them, or flatten each group apart)")
    return backend.get_array_module(arrays[0]).concatenate([a.reshape(-1) for a in arrays])


def vector_to_parameters(vector, parameters) -> None:
    """Set the parameters' values from one flat vector (``torch.nn.utils.vector_to_parameters``),
    the inverse of :func:`parameters_to_vector`.

    vector: a 1-D array or Tensor of ``sum(p.size)`` elements, the parameters' dtype.
    parameters: an iterable of Tensors (``model.parameters()``), in the order of the vector.
    Each parameter's ``.data`` becomes a copy of its slice, reshaped to its shape and moved
    to its device (so a host receive buffer can load a GPU model, and the caller may reuse
    ``vector``; torch's makes each parameter a view of the vector instead). ``.grad`` is left alone.

    Raises ValueError when ``vector`` is not 1-D, its length differs from the parameters'
    total, or its dtype differs from a parameter's; TypeError when a parameter is not a Tensor.
    """
    params = list(parameters)
    vector = vector.data if isinstance(vector, Tensor) else vector
    for i, p in enumerate(params):
        if not isinstance(p, Tensor):
            raise TypeError(f"vector_to_parameters: parameter {i} is a {type(p).__name__}, not a Tensor "
                            "(pass model.parameters())")
    total = sum(p.size for p in params)
    if getattr(vector, "ndim", None) != 1 or vector.size != total:
        raise ValueError(f"vector_to_parameters: expected a 1-D vector of {total} elements (the parameters' "
                         f"total), got shape {getattr(vector, 'shape', type(vector).__name__)}")
    other = next((p.dtype for p in params if p.dtype != vector.dtype), None)
    if other is not None:  # checked before any parameter changes
        raise ValueError(f"vector_to_parameters: the vector is {vector.dtype}, a parameter is {other}; "
                         "convert the vector first (vector.astype(...))")
    offset = 0
    for p in params:
        piece = vector[offset:offset + p.size].reshape(p.shape)
        p.data = backend.to_device(piece, p.device).copy()
        offset += p.size


# ----------------------------------------------------------------------------- gradient clipping


def clip_grad_norm_(parameters, max_norm, norm_type=2.0) -> float:
    """Scale all gradients together so their joint norm is at most ``max_norm``
    (``torch.nn.utils.clip_grad_norm_``; Pascanu et al., "On the difficulty of training
    recurrent neural networks", ICML 2013).

    The total norm is the ``norm_type``-norm of all gradients laid end to end (parameters
    whose ``.grad`` is None are skipped; a Parameter listed twice counts once). When it
    exceeds ``max_norm`` every gradient is multiplied, in place, by
    max_norm / (total + 1e-6), torch's factor; otherwise nothing changes.

    Args:
        parameters: a Tensor or an iterable of Tensors (``model.parameters()``).
        max_norm: the largest norm allowed (> 0).
        norm_type: p of the p-norm (a float >= 1, or ``float("inf")`` for the largest |g|).

    Returns the total norm before clipping, a Python float (inf or nan when a gradient is).

    Raises ValueError for max_norm <= 0 or norm_type < 1.
    """
    params = [parameters] if isinstance(parameters, Tensor) else list(parameters)
    if not max_norm > 0:
        raise ValueError(f"clip_grad_norm_: max_norm must be > 0, got {max_norm}")
    norm_type = float(norm_type)
    if not norm_type >= 1:
        raise ValueError(f"clip_grad_norm_: norm_type must be >= 1 (or inf), got {norm_type}")
    grads = list({id(p): p.grad for p in params if p.grad is not None}.values())
    if not grads:
        return 0.0
    xp = backend.get_array_module(grads[0])
    if norm_type == math.inf:
        total = max(float(xp.abs(g).max()) if g.size else 0.0 for g in grads)
    elif norm_type == 2.0:
        total = math.sqrt(sum(float(xp.vdot(g.ravel(), g.ravel())) for g in grads))
    else:
        total = sum(float((xp.abs(g) ** norm_type).sum()) for g in grads) ** (1.0 / norm_type)
    coefficient = max_norm / (total + 1e-6)
    if coefficient < 1:
        for g in grads:
            g *= g.dtype.type(coefficient)
    return total


# nn.utils: the names of torch.nn.utils this engine has (torch's is a module; here a namespace).
utils = SimpleNamespace(clip_grad_norm_=clip_grad_norm_, parameters_to_vector=parameters_to_vector,
                        vector_to_parameters=vector_to_parameters)
