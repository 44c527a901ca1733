"""Layers with PyTorch's parameter layouts and default initializations."""

from __future__ import annotations

import math

from zyx.autograd import no_grad
from zyx.nn import functional as F
from zyx.nn.conv import output_padding_for
from zyx.nn.module import Module, Parameter
from zyx.nn.norm import group_norm, rms_norm
from zyx.nn.resample import interpolate
from zyx.tensor import Tensor, rand, randn


def _uniform(shape, bound: float, device) -> Tensor:
    return rand(*shape, device=device) * (2 * bound) - bound


class Linear(Module):
    """y = x @ weight.T + bias, weight of shape (out_features, in_features)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device: str | None = None) -> None:
        bound = 1 / math.sqrt(in_features) if in_features else 0.0
        self.in_features, self.out_features = in_features, out_features
        self.weight = Parameter(_uniform((out_features, in_features), bound, device))
        self.bias = Parameter(_uniform((out_features,), bound, device)) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"Linear({self.in_features}, {self.out_features}) got input of shape {x.shape}")
        y = x @ self.weight.T
        return y + self.bias if self.bias is not None else y


class LayerNorm(Module):
    def __init__(self, normalized_shape, eps: float = 1e-5, elementwise_affine: bool = True,
                 device: str | None = None) -> None:
        self.normalized_shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
        self.eps = eps
        self.weight = Parameter(Tensor.ones(self.normalized_shape, device=device)) if elementwise_affine else None
        self.bias = Parameter(Tensor.zeros(self.normalized_shape, device=device)) if elementwise_affine else None

    def forward(self, x: Tensor) -> Tensor:
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)


class Embedding(Module):
    """A lookup table ``weight`` (num_embeddings, embedding_dim), initialized N(0, 1). The row ``padding_idx``
    starts at zero and never receives a gradient (PyTorch's)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None,
                 device: str | None = None) -> None:
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx = None if padding_idx is None else F._padding_index(padding_idx, num_embeddings)
        w = randn(num_embeddings, embedding_dim, device=device)
        if self.padding_idx is not None:
            rows = Tensor.arange(num_embeddings, device=w.device).reshape(num_embeddings, 1)
            w = (rows == self.padding_idx).where(0.0, w)
        self.weight = Parameter(w)

    def forward(self, idx: Tensor) -> Tensor:
        return F.embedding(idx, self.weight, self.padding_idx)


class Dropout(Module):
    def __init__(self, p: float = 0.5) -> None:
        if not 0 <= p < 1:
            raise ValueError(f"Dropout: p must be in [0, 1), got {p}")
        self.p = p

    def forward(self, x: Tensor) -> Tensor:
        return F.dropout(x, self.p, self.training)


class ReLU(Module):
    def forward(self, x: Tensor) -> Tensor:
        return x.relu()


class GELU(Module):
    def __init__(self, approximate: str = "none") -> None:
        self.approximate = approximate

    def forward(self, x: Tensor) -> Tensor:
        return x.gelu(self.approximate)


class Identity(Module):
    def __init__(self, *args, **kwargs) -> None:  # PyTorch's Identity ignores its arguments
        pass

    def forward(self, x: Tensor) -> Tensor:
        return x


class SiLU(Module):
    def forward(self, x: Tensor) -> Tensor:
        return x.silu()


class Sigmoid(Module):
    def forward(self, x: Tensor) -> Tensor:
        return x.sigmoid()


class Tanh(Module):
    def forward(self, x: Tensor) -> Tensor:
        return x.tanh()


class LeakyReLU(Module):
    def __init__(self, negative_slope: float = 0.01) -> None:
        self.negative_slope = negative_slope

    def forward(self, x: Tensor) -> Tensor:
        return x.leaky_relu(self.negative_slope)


class Softplus(Module):
    def __init__(self, beta: float = 1.0, threshold: float = 20.0) -> None:
        self.beta, self.threshold = beta, threshold

    def forward(self, x: Tensor) -> Tensor:
        return x.softplus(self.beta, self.threshold)


class Softmax(Module):
    def __init__(self, dim: int = -1) -> None:
        self.dim = dim

    def forward(self, x: Tensor) -> Tensor:
        return x.softmax(self.dim)


class LogSoftmax(Module):
    def __init__(self, dim: int = -1) -> None:
        self.dim = dim

    def forward(self, x: Tensor) -> Tensor:
        return x.log_softmax(self.dim)


class GroupNorm(Module):
    """PyTorch's ``GroupNorm``: ``weight`` ones and ``bias`` zeros (num_channels,) when ``affine``."""

    def __init__(self, num_groups: int, num_channels: int, eps: float = 1e-5, affine: bool = True,
                 device: str | None = None) -> None:
        if num_groups < 1 or num_channels % num_groups:
            raise ValueError(f"GroupNorm: num_channels {num_channels} must be divisible by num_groups {num_groups}")
        self.num_groups, self.num_channels, self.eps = num_groups, num_channels, eps
        self.weight = Parameter(Tensor.ones((num_channels,), device=device)) if affine else None
        self.bias = Parameter(Tensor.zeros((num_channels,), device=device)) if affine else None

    def forward(self, x: Tensor) -> Tensor:
        return group_norm(x, self.num_groups, self.weight, self.bias, self.eps)


class RMSNorm(Module):
    """PyTorch's ``RMSNorm``: ``weight`` ones of ``normalized_shape`` when ``elementwise_affine``."""

    def __init__(self, normalized_shape, eps: float | None = None, elementwise_affine: bool = True,
                 device: str | None = None) -> None:
        self.normalized_shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
        self.eps = eps
        self.weight = Parameter(Tensor.ones(self.normalized_shape, device=device)) if elementwise_affine else None

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.normalized_shape, self.weight, self.eps)


class Upsample(Module):
    """PyTorch's ``Upsample`` (``F.interpolate`` with the same arguments)."""

    def __init__(self, size=None, scale_factor=None, mode: str = "nearest", align_corners: bool | None = None,
                 recompute_scale_factor: bool | None = None) -> None:
        self.size, self.scale_factor, self.mode = size, scale_factor, mode
        self.align_corners, self.recompute_scale_factor = align_corners, recompute_scale_factor

    def forward(self, x: Tensor) -> Tensor:
        return interpolate(x, self.size, self.scale_factor, self.mode, self.align_corners,
                           self.recompute_scale_factor)


def _conv_parameters(layer: Module, in_channels: int, out_channels: int, kernel_size, groups: int, bias: bool,
                     device: str | None, transposed: bool) -> None:
    """A (transposed) convolution layer's channels, kernel size, weight ((out, in / groups, *kernel), transposed
    (in, out / groups, *kernel)) and bias (out,), uniform in +-1/sqrt(fan_in) with PyTorch's fan_in: the weight's
    second axis times the kernel size (kaiming_uniform with a = sqrt(5))."""
    if groups < 1 or in_channels % groups or out_channels % groups:
        raise ValueError(f"{type(layer).__name__}: in_channels {in_channels} and out_channels {out_channels} "
                         f"must be divisible by groups {groups}")
    kernel = (kernel_size,) * layer.nd if isinstance(kernel_size, int) else tuple(kernel_size)
    layer.in_channels, layer.out_channels, layer.kernel_size = in_channels, out_channels, kernel
    shape = (in_channels, out_channels // groups) if transposed else (out_channels, in_channels // groups)
    fan_in = shape[1] * math.prod(kernel)
    bound = 1 / math.sqrt(fan_in) if fan_in else 0.0
    layer.weight = Parameter(_uniform((*shape, *kernel), bound, device))
    layer.bias = Parameter(_uniform((out_channels,), bound, device)) if bias else None


class _ConvNd(Module):
    """PyTorch's ``Conv{n}d``: weight (out_channels, in_channels / groups, *kernel_size) and bias (out_channels,),
    both uniform in +-1/sqrt(fan_in) (PyTorch's default, kaiming_uniform with a = sqrt(5))."""

    nd = 0

    def __init__(self, in_channels: int, out_channels: int, kernel_size, stride=1, padding=0, dilation=1,
                 groups: int = 1, bias: bool = True, device: str | None = None) -> None:
        _conv_parameters(self, in_channels, out_channels, kernel_size, groups, bias, device, transposed=False)
        self.stride, self.padding, self.dilation, self.groups = stride, padding, dilation, groups

    def forward(self, x: Tensor) -> Tensor:
        conv = (F.conv1d, F.conv2d, F.conv3d)[self.nd - 1]
        return conv(x, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups)


class Conv1d(_ConvNd):
    nd = 1


class Conv2d(_ConvNd):
    nd = 2


class Conv3d(_ConvNd):
    nd = 3


class _ConvTransposeNd(Module):
    """PyTorch's ``ConvTranspose{n}d``: weight (in_channels, out_channels / groups, *kernel_size) and bias
    (out_channels,), both uniform in +-1/sqrt(fan_in) with PyTorch's fan_in (out_channels / groups * kernel size).
    ``forward(x, output_size)`` picks the output padding that gives ``output_size``, as PyTorch does."""

    nd = 0

    def __init__(self, in_channels: int, out_channels: int, kernel_size, stride=1, padding=0, output_padding=0,
                 groups: int = 1, bias: bool = True, dilation=1, device: str | None = None) -> None:
        _conv_parameters(self, in_channels, out_channels, kernel_size, groups, bias, device, transposed=True)
        self.stride, self.padding, self.output_padding = stride, padding, output_padding
        self.groups, self.dilation = groups, dilation

    def forward(self, x: Tensor, output_size=None) -> Tensor:
        conv = (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)[self.nd - 1]
        op = self.output_padding if output_size is None else output_padding_for(
            x.shape, output_size, self.kernel_size, self.stride, self.padding, self.dilation, type(self).__name__)
        return conv(x, self.weight, self.bias, self.stride, self.padding, op, self.groups, self.dilation)


class ConvTranspose1d(_ConvTransposeNd):
    nd = 1


class ConvTranspose2d(_ConvTransposeNd):
    nd = 2


class ConvTranspose3d(_ConvTransposeNd):
    nd = 3


class _MaxPoolNd(Module):
    nd = 0

    def __init__(self, kernel_size, stride=None, padding=0, dilation=1, ceil_mode: bool = False) -> None:
        self.kernel_size, self.stride, self.padding, self.dilation = kernel_size, stride, padding, dilation
        self.ceil_mode = ceil_mode

    def forward(self, x: Tensor) -> Tensor:
        pool = (F.max_pool1d, F.max_pool2d)[self.nd - 1]
        return pool(x, self.kernel_size, self.stride, self.padding, self.dilation, self.ceil_mode)


class MaxPool1d(_MaxPoolNd):
    nd = 1


class AvgPool1d(Module):
    def __init__(self, kernel_size, stride=None, padding=0, ceil_mode: bool = False,
                 count_include_pad: bool = True) -> None:
        self.kernel_size, self.stride, self.padding, self.ceil_mode = kernel_size, stride, padding, ceil_mode
        self.count_include_pad = count_include_pad

    def forward(self, x: Tensor) -> Tensor:
        return F.avg_pool1d(x, self.kernel_size, self.stride, self.padding, self.ceil_mode, self.count_include_pad)


class MaxPool2d(_MaxPoolNd):
    nd = 2


class AvgPool2d(Module):
    def __init__(self, kernel_size, stride=None, padding=0, ceil_mode: bool = False, count_include_pad: bool = True,
                 divisor_override: int | None = None) -> None:
        self.kernel_size, self.stride, self.padding, self.ceil_mode = kernel_size, stride, padding, ceil_mode
        self.count_include_pad, self.divisor_override = count_include_pad, divisor_override

    def forward(self, x: Tensor) -> Tensor:
        return F.avg_pool2d(x, self.kernel_size, self.stride, self.padding, self.ceil_mode, self.count_include_pad,
                            self.divisor_override)


class _AdaptivePool(Module):
    """PyTorch's adaptive pooling layers: ``F.adaptive_{avg,max}_pool{1,2,3}d`` of ``output_size``."""

    fn = staticmethod(F.adaptive_avg_pool2d)

    def __init__(self, output_size) -> None:
        self.output_size = output_size

    def forward(self, x: Tensor) -> Tensor:
        return self.fn(x, self.output_size)


class AdaptiveAvgPool1d(_AdaptivePool):
    fn = staticmethod(F.adaptive_avg_pool1d)


class AdaptiveAvgPool2d(_AdaptivePool):
    fn = staticmethod(F.adaptive_avg_pool2d)


class AdaptiveAvgPool3d(_AdaptivePool):
    fn = staticmethod(F.adaptive_avg_pool3d)


class _AdaptiveMaxPool(_AdaptivePool):
    def __init__(self, output_size, return_indices: bool = False) -> None:
        if return_indices:
            raise NotImplementedError(f"{type(self).__name__}: return_indices=True is not supported")
        super().__init__(output_size)


class AdaptiveMaxPool1d(_AdaptiveMaxPool):
    fn = staticmethod(F.adaptive_max_pool1d)


class AdaptiveMaxPool2d(_AdaptiveMaxPool):
    fn = staticmethod(F.adaptive_max_pool2d)


class AdaptiveMaxPool3d(_AdaptiveMaxPool):
    fn = staticmethod(F.adaptive_max_pool3d)


class Flatten(Module):
    def __init__(self, start_dim: int = 1, end_dim: int = -1) -> None:
        self.start_dim, self.end_dim = start_dim, end_dim

    def forward(self, x: Tensor) -> Tensor:
        return x.flatten(self.start_dim, self.end_dim)


class _BatchNorm(Module):
    """PyTorch's batch normalization over every axis but the channels (axis 1). Training normalizes by the batch's
    mean and biased variance and moves ``running_mean`` / ``running_var`` (the unbiased variance) by
    ``momentum``; evaluation uses the running statistics. ``num_batches_tracked`` counts the updates."""

    dims: tuple[int, ...] = ()  # the accepted input ranks

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float = 0.1, affine: bool = True,
                 track_running_stats: bool = True, device: str | None = None) -> None:
        self.num_features, self.eps, self.momentum = num_features, eps, momentum
        self.weight = Parameter(Tensor.ones((num_features,), device=device)) if affine else None
        self.bias = Parameter(Tensor.zeros((num_features,), device=device)) if affine else None
        if track_running_stats:
            self.running_mean = Tensor.zeros((num_features,), device=device).realize()
            self.running_var = Tensor.ones((num_features,), device=device).realize()
            self.num_batches_tracked = Tensor.zeros((), dtype="int64", device=device).realize()
        else:
            self.running_mean = self.running_var = self.num_batches_tracked = None

    def forward(self, x: Tensor) -> Tensor:
        if x.ndim not in self.dims or x.shape[1] != self.num_features:
            raise ValueError(f"{type(self).__name__}({self.num_features}): expected an input of rank "
                             f"{' or '.join(map(str, self.dims))} with {self.num_features} channels on axis 1, got "
                             f"shape {x.shape}")
        axes = (0, *range(2, x.ndim))
        shape = (1, self.num_features) + (1,) * (x.ndim - 2)
        if self.training or self.running_mean is None:
            count = x.numel() // self.num_features
            if self.training and count < 2:
                raise ValueError(f"{type(self).__name__}: training needs more than one value per channel, got input "
                                 f"shape {x.shape}")
            mean, var = x.mean(axes), x.var(axes)
            if self.training and self.running_mean is not None:
                with no_grad():
                    m = self.momentum
                    self.running_mean.assign(self.running_mean * (1 - m) + mean.detach() * m)
                    self.running_var.assign(self.running_var * (1 - m) + var.detach() * (m * count / (count - 1)))
                    self.num_batches_tracked.assign(self.num_batches_tracked + 1)
        else:
            mean, var = self.running_mean, self.running_var
        y = (x - mean.reshape(shape)) * (var.reshape(shape) + self.eps).rsqrt()
        if self.weight is not None:
            y = y * self.weight.reshape(shape) + self.bias.reshape(shape)
        return y


class BatchNorm1d(_BatchNorm):
    dims = (2, 3)


class BatchNorm2d(_BatchNorm):
    dims = (4,)


class Sequential(Module):
    def __init__(self, *layers: Module) -> None:
        self._layers = list(layers)

    def forward(self, x):
        for layer in self._layers:
            x = layer(x)
        return x

    def __getitem__(self, i: int) -> Module:
        return self._layers[i]

    def __len__(self) -> int:
        return len(self._layers)


class ModuleList(Module):
    """PyTorch's ``ModuleList``: submodules named by position ("0.weight", ...)."""

    def __init__(self, modules=()) -> None:
        self._layers = list(modules)

    def append(self, module: Module) -> ModuleList:
        self._layers.append(module)
        return self

    def extend(self, modules) -> ModuleList:
        self._layers.extend(modules)
        return self

    def insert(self, index: int, module: Module) -> None:
        self._layers.insert(index, module)

    def __getitem__(self, i):
        return ModuleList(self._layers[i]) if isinstance(i, slice) else self._layers[i]

    def __setitem__(self, i: int, module: Module) -> None:
        self._layers[i] = module

    def __len__(self) -> int:
        return len(self._layers)

    def __iter__(self):
        return iter(self._layers)

    def forward(self, *args, **kwargs):
        raise NotImplementedError("ModuleList has no forward(); iterate over it")


class ModuleDict(Module):
    """PyTorch's ``ModuleDict``: submodules named by key ("encoder.weight", ...), in insertion order."""

    def __init__(self, modules=None) -> None:
        self._modules: dict[str, Module] = dict(modules or {})

    def _children(self):
        yield from self._modules.items()
        for name, value in super()._children():
            if name != "_modules":
                yield name, value

    def __getitem__(self, key: str) -> Module:
        return self._modules[key]

    def __setitem__(self, key: str, module: Module) -> None:
        self._modules[key] = module

    def __delitem__(self, key: str) -> None:
        del self._modules[key]

    def __contains__(self, key: str) -> bool:
        return key in self._modules

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self):
        return iter(self._modules)

    def keys(self):
        return self._modules.keys()

    def values(self):
        return self._modules.values()

    def items(self):
        return self._modules.items()

    def update(self, modules) -> None:
        self._modules.update(modules)

    def forward(self, *args, **kwargs):
        raise NotImplementedError("ModuleDict has no forward(); index it by name")


class MultiheadAttention(Module):
    """PyTorch's ``nn.MultiheadAttention`` (kdim = vdim = embed_dim): parameters ``in_proj_weight`` (3E, E),
    ``in_proj_bias`` (3E,) and ``out_proj`` (Linear E -> E), with the same names, layouts and initialization.

    Inputs are (L, N, E) (or (N, L, E) with ``batch_first``) or unbatched (L, E). In the masks, True means
    *not allowed* (the opposite of ``scaled_dot_product_attention``); float masks are added to the scores.
    """

    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0, bias: bool = True,
                 batch_first: bool = False, device: str | None = None) -> None:
        if num_heads <= 0 or embed_dim % num_heads:
            raise ValueError(f"MultiheadAttention: embed_dim {embed_dim} must be divisible by num_heads {num_heads}")
        if not 0 <= dropout < 1:
            raise ValueError(f"MultiheadAttention: dropout must be in [0, 1), got {dropout}")
        self.embed_dim, self.num_heads, self.head_dim = embed_dim, num_heads, embed_dim // num_heads
        self.dropout, self.batch_first = dropout, batch_first
        # xavier_uniform_ over (3E, E), zero biases: as PyTorch's _reset_parameters
        self.in_proj_weight = Parameter(_uniform((3 * embed_dim, embed_dim), math.sqrt(6 / (4 * embed_dim)),
                                                 device))
        self.in_proj_bias = Parameter(Tensor.zeros(3 * embed_dim, device=device)) if bias else None
        self.out_proj = Linear(embed_dim, embed_dim, bias=bias, device=device)
        if bias:
            self.out_proj.bias = Parameter(Tensor.zeros(embed_dim, device=device))

    def forward(self, query: Tensor, key: Tensor, value: Tensor, key_padding_mask: Tensor | None = None,
                need_weights: bool = True, attn_mask: Tensor | None = None,
                average_attn_weights: bool = True) -> tuple[Tensor, Tensor | None]:
        """(output like ``query``, attention weights (N, L, S) — (N, H, L, S) without averaging — or None)."""
        E, H, hd = self.embed_dim, self.num_heads, self.head_dim  # noqa: N806
        batched = query.ndim == 3
        if query.ndim not in (2, 3) or key.ndim != query.ndim or value.ndim != query.ndim:
            raise ValueError(f"MultiheadAttention: query, key and value must all be 3-D (batched) or 2-D, got "
                             f"shapes {query.shape}, {key.shape} and {value.shape}")
        if query.shape[-1] != E or key.shape[-1] != E or value.shape[-1] != E:
            raise ValueError(f"MultiheadAttention(embed_dim={E}): query, key and value must end with {E}, got "
                             f"shapes {query.shape}, {key.shape} and {value.shape}")
        if key.shape != value.shape:
            raise ValueError(f"MultiheadAttention: key of shape {key.shape} and value of shape {value.shape} differ")

        def to_nle(x: Tensor) -> Tensor:  # (N, L, E)
            if not batched:
                return x.unsqueeze(0)
            return x if self.batch_first else x.transpose(0, 1)

        self_attention = query is key and key is value
        q, k, v = to_nle(query), to_nle(key), to_nle(value)
        if q.shape[0] != k.shape[0]:
            raise ValueError(f"MultiheadAttention: query of shape {query.shape} and key of shape {key.shape} "
                             "have different batch sizes")
        N, L, S = q.shape[0], q.shape[1], k.shape[1]  # noqa: N806
        w, b = self.in_proj_weight, self.in_proj_bias
        if self_attention:
            q, k, v = F.linear(q, w, b).chunk(3, -1)
        else:
            bq, bk, bv = (None, None, None) if b is None else (b[:E], b[E:2 * E], b[2 * E:])
            q, k, v = F.linear(q, w[:E], bq), F.linear(k, w[E:2 * E], bk), F.linear(v, w[2 * E:], bv)

        def heads(x: Tensor, n: int) -> Tensor:  # (N, n, E) -> (N, H, n, hd)
            return x.reshape(N, n, H, hd).transpose(1, 2)

        mask = self._merge_masks(key_padding_mask, attn_mask, batched, (N, L, S))
        p = self.dropout if self.training else 0.0
        out, weights = F._attention(heads(q, L), heads(k, S), heads(v, S), mask, p, False, None)
        out = self.out_proj(out.transpose(1, 2).reshape(N, L, E))
        out = (out if self.batch_first else out.transpose(0, 1)) if batched else out.reshape(L, E)
        if not need_weights:
            return out, None
        if average_attn_weights:
            weights = weights.mean(1)
        return out, (weights if batched else weights.reshape(weights.shape[1:]))

    def _merge_masks(self, key_padding_mask: Tensor | None, attn_mask: Tensor | None, batched: bool,
                     shape: tuple[int, int, int]) -> Tensor | None:
        """One scaled_dot_product_attention mask over (N, H, L, S), ``shape`` = (N, L, S): bool (True = allowed)
        when every mask given is bool, else float (bool masks become -inf / 0, then all are added, as PyTorch
        merges them)."""
        N, L, S = shape  # noqa: N806
        H = self.num_heads  # noqa: N806
        masks = []
        if key_padding_mask is not None:
            want = (N, S) if batched else (S,)
            if tuple(key_padding_mask.shape) != want:
                raise ValueError(f"MultiheadAttention: key_padding_mask must have shape {want}, got "
                                 f"{key_padding_mask.shape}")
            masks.append(key_padding_mask.reshape(N, 1, 1, S))
        if attn_mask is not None:
            if attn_mask.shape == (L, S):
                masks.append(attn_mask.reshape(1, 1, L, S))
            elif attn_mask.shape == (N * H, L, S):
                masks.append(attn_mask.reshape(N, H, L, S))
            else:
                raise ValueError(f"MultiheadAttention: attn_mask must have shape {(L, S)} or {(N * H, L, S)}, "
                                 f"got {attn_mask.shape}")
        for m in masks:
            if not (m.dtype.is_float or m.dtype.kind == "b"):
                raise TypeError(f"MultiheadAttention: masks must be bool or float, got {m.dtype.name}")
        if not masks:
            return None
        if all(m.dtype.kind == "b" for m in masks):
            allowed = masks[0].logical_not()
            for m in masks[1:]:
                allowed = allowed & m.logical_not()
            return allowed
        total = None
        for m in masks:
            m = m.where(-math.inf, 0.0) if m.dtype.kind == "b" else m
            total = m if total is None else total + m
        return total
