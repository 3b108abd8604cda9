"""A module-zoo sweep: standard ``torch.nn`` layers and functional losses, each in a tiny
model trained a few AdamW steps through ``stoker.compile`` (default options: the aten
executor on the CPU, compiled autograd on) against eager, on fresh random inputs.  The
harness is `sweep_cases.py` (outputs, loss, every ``.grad`` with its None-ness, buffers
and parameters after every step); a subset also runs under bf16 autocast, and a few
with Triton kernels under the interpreter."""

from __future__ import annotations

import os
import textwrap
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch._dynamo
import torch.nn as nn
import torch.nn.functional as F
from interpret_script import run_interpreted
from sweep_cases import Batch, Case, dot_grads, run_case

import stoker

Params = dict[str, nn.Parameter]
Gen = torch.Generator


class Net(nn.Module):
    """Submodules by name and a forward `fn(net, *inputs)` (the case's whole model)."""

    def __init__(self, fn: Callable[..., Any], **mods: nn.Module) -> None:
        super().__init__()
        for k, m in mods.items():
            self.add_module(k, m)
        self.fn = fn

    def forward(self, *xs: Any) -> Any:
        return self.fn(self, *xs)


def _r(gen: Gen, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=gen)


def _ints(gen: Gen, hi: int, *shape: int) -> torch.Tensor:
    return torch.randint(0, hi, shape, generator=gen)


def _loss(out: Any) -> torch.Tensor:
    """Every floating output, weighted by a fixed pattern (so a normalized output still
    has a gradient) plus its square, summed to one fp32 scalar."""
    outs = out if isinstance(out, (tuple, list)) else (out,)
    total = torch.zeros(())
    for o in outs:
        if isinstance(o, (tuple, list)):
            total = total + _loss(o)
        elif isinstance(o, torch.Tensor) and o.is_floating_point():
            o = o.float()
            w = torch.cos(torch.arange(o.numel(), dtype=torch.float32) * 0.37).view(o.shape)
            total = total + (o * w).sum() / o.numel() ** 0.5 + o.pow(2).mean()
    return total


def zoo_step(model: Any, params: Params, b: Batch) -> Any:
    out = model(*b)
    loss = _loss(out)
    loss.backward()
    return (out, loss), dot_grads(params)


def bf16_step(model: Any, params: Params, b: Batch) -> Any:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(*b)
        loss = _loss(out)
    loss.backward()
    return (out, loss), dot_grads(params)


def clip_step(model: Any, params: Params, b: Batch) -> Any:
    """clip_grad_norm_ between backward and the optimizer step (the clipped grads compared)."""
    out = model(*b)
    loss = _loss(out)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(list(params.values()), max_norm=0.05)
    return (out, loss, norm), dot_grads(params)


@dataclass(frozen=True)
class Zoo:
    build: Callable[[], nn.Module]
    inputs: Callable[[int, Gen], Batch]
    bf16: bool = False  # also run under bf16 autocast
    # Dynamo graphs the model compiles to: 1, or (where a case says why) more after a
    # graph break, or 0 where Dynamo runs the model eagerly (docs/stoker.md, "module zoo")
    graphs: int = 1


# --- the zoo ------------------------------------------------------------------------------


def _rnn(kind: type[nn.RNNBase], **kw: Any) -> Zoo:
    return Zoo(
        lambda: Net(lambda n, x: n.rnn(x), rnn=kind(4, 5, **kw)),
        lambda n, g: (_r(g, n, 3, 4) if kw.get("batch_first") else _r(g, 3, n, 4),),
        graphs=0,  # Dynamo leaves nn.RNN/GRU/LSTM to eager unless config.allow_rnn
    )


def _gru_h0() -> Zoo:
    return Zoo(
        lambda: Net(lambda n, x, h: n.rnn(x, h), rnn=nn.GRU(4, 5, bidirectional=True)),
        lambda n, g: (_r(g, 3, n, 4), _r(g, 2, n, 5)),
        graphs=0,  # Dynamo leaves nn.RNN/GRU/LSTM to eager unless config.allow_rnn
    )


def _encoder(norm_first: bool, act: str) -> Zoo:
    def fwd(n: Net, x: torch.Tensor, pad: torch.Tensor) -> Any:
        causal = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        return n.enc(x, src_mask=causal, src_key_padding_mask=pad)

    def build() -> nn.Module:
        layer = nn.TransformerEncoderLayer(
            8, 2, 16, dropout=0.0, activation=act, batch_first=True, norm_first=norm_first
        )
        return Net(fwd, enc=layer)

    def inputs(n: int, g: Gen) -> Batch:
        pad = torch.zeros(n, 5, dtype=torch.bool)
        pad[:, -1] = True  # the last position padded (never a whole row: eager gives NaN)
        return _r(g, n, 5, 8), pad

    return Zoo(build, inputs, bf16=norm_first)


def _decoder(norm_first: bool) -> Zoo:
    def fwd(n: Net, x: torch.Tensor, mem: torch.Tensor, pad: torch.Tensor) -> Any:
        causal = nn.Transformer.generate_square_subsequent_mask(x.shape[0])
        return n.dec(x, mem, tgt_mask=causal, tgt_is_causal=True, memory_key_padding_mask=pad)

    def inputs(n: int, g: Gen) -> Batch:
        pad = torch.zeros(n, 3, dtype=torch.bool)
        pad[0, 0] = True
        return _r(g, 4, n, 8), _r(g, 3, n, 8), pad

    return Zoo(
        lambda: Net(fwd, dec=nn.TransformerDecoderLayer(8, 2, 16, 0.0, norm_first=norm_first)),
        inputs,
    )


def _mha(need_weights: bool) -> Zoo:
    def fwd(n: Net, q: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor) -> Any:
        if need_weights:  # float additive mask, weights per head
            return n.mha(q, kv, kv, attn_mask=mask, need_weights=True, average_attn_weights=False)
        out, w = n.mha(q, kv, kv, key_padding_mask=mask, need_weights=False)
        assert w is None
        return out

    def inputs(n: int, g: Gen) -> Batch:
        if need_weights:
            return _r(g, n, 4, 8), _r(g, n, 3, 8), _r(g, 4, 3)
        pad = torch.zeros(n, 3, dtype=torch.bool)
        pad[-1, 1] = True
        return _r(g, n, 4, 8), _r(g, n, 3, 8), pad

    kw: dict[str, Any] = {} if need_weights else {"kdim": 8, "vdim": 8, "bias": False}
    return Zoo(
        lambda: Net(fwd, mha=nn.MultiheadAttention(8, 2, batch_first=True, **kw)),
        inputs,
        bf16=not need_weights,
    )


def _seq(shape: tuple[int, ...], *mods: Callable[[], nn.Module], bf16: bool = False) -> Zoo:
    """The modules (from their factories) in order on one input of `shape` (batch first)."""
    return Zoo(lambda: nn.Sequential(*(m() for m in mods)), lambda n, g: (_r(g, n, *shape),), bf16)


def _embedding_bag(mode: str, weighted: bool) -> Zoo:
    def fwd(n: Net, ids: torch.Tensor, offsets: torch.Tensor, w: torch.Tensor) -> Any:
        psw = w if weighted else None
        return n.lin(n.bag(ids, offsets, per_sample_weights=psw))

    def inputs(n: int, g: Gen) -> Batch:
        ids = _ints(g, 10, 3 * n)
        offsets = torch.arange(0, 3 * n, 3)
        offsets[1] = 2  # bags of other lengths
        return ids, offsets, _r(g, 3 * n)

    return Zoo(lambda: Net(fwd, bag=nn.EmbeddingBag(10, 4, mode=mode), lin=nn.Linear(4, 3)), inputs)


def _embedding_padding_idx() -> Zoo:
    def inputs(n: int, g: Gen) -> Batch:
        ids = _ints(g, 7, n, 5)
        ids[0, :2] = 0  # the padding index: its row gets no gradient
        return (ids,)

    return Zoo(
        lambda: Net(
            lambda n, i: n.lin(n.emb(i)), emb=nn.Embedding(7, 4, padding_idx=0), lin=nn.Linear(4, 3)
        ),
        inputs,
    )


_ACTS: tuple[Callable[[], nn.Module], ...] = (
    nn.PReLU,
    lambda: nn.GELU(approximate="tanh"),
    nn.SiLU,
    nn.Mish,
    nn.Hardswish,
    nn.ELU,
    lambda: nn.Softplus(beta=2.0, threshold=1.0),
    nn.LogSigmoid,
    nn.CELU,
    nn.SELU,
    nn.Hardsigmoid,
    lambda: nn.LeakyReLU(0.2),
    nn.Softsign,
    nn.Tanhshrink,
    lambda: nn.Hardtanh(-0.5, 0.5),
    nn.ReLU6,
    lambda: nn.Softmax(dim=-1),
    lambda: nn.LogSoftmax(dim=-1),
)


def _activations(acts: tuple[Callable[[], nn.Module], ...], bf16: bool) -> Zoo:
    def fwd(n: Net, x: torch.Tensor) -> Any:
        h = n.lin(x)
        outs = [act(h) for act in n.acts]
        return n.out(torch.stack(outs, 1).sum(1) / len(outs))

    return Zoo(
        lambda: Net(
            fwd, lin=nn.Linear(6, 6), acts=nn.ModuleList(a() for a in acts), out=nn.Linear(6, 3)
        ),
        lambda n, g: (_r(g, n, 6) * 2,),
        bf16=bf16,
    )


def _dropouts_in_eval() -> Zoo:
    def build() -> nn.Module:
        drops = nn.ModuleList(
            [nn.Dropout(0.5), nn.Dropout1d(0.5), nn.AlphaDropout(0.5), nn.FeatureAlphaDropout(0.5)]
        )
        drops.eval()  # the model trains; its dropouts are off

        def fwd(n: Net, x: torch.Tensor) -> Any:
            h = n.conv(x)
            for d in n.drops:
                h = d(h)
            return h

        return Net(fwd, conv=nn.Conv1d(2, 3, 3), drops=drops)

    return Zoo(build, lambda n, g: (_r(g, n, 2, 6),))


def _distances() -> Zoo:
    def fwd(n: Net, x: torch.Tensor, y: torch.Tensor) -> Any:
        a, b = n.lin(x), n.lin(y)
        u = n.unflat(n.flat(n.bil(x, y)))
        return (
            n.cos(a, b),
            n.pdist(a, b),
            torch.cdist(a, b),
            torch.cdist(a.unsqueeze(0), b.unsqueeze(0), p=1.0),
            u,
        )

    return Zoo(
        lambda: Net(
            fwd,
            lin=nn.Linear(5, 4),
            bil=nn.Bilinear(5, 5, 6),
            flat=nn.Flatten(),
            unflat=nn.Unflatten(1, (2, 3)),
            cos=nn.CosineSimilarity(dim=1),
            pdist=nn.PairwiseDistance(p=2.0),
        ),
        lambda n, g: (_r(g, n, 5), _r(g, n, 5)),
    )


def _fold() -> Zoo:
    def fwd(n: Net, x: torch.Tensor) -> Any:
        cols = n.unfold(n.conv(x))  # (N, 3*2*2, L)
        return n.fold(cols * n.scale)

    def build() -> nn.Module:
        net = Net(
            fwd,
            conv=nn.Conv2d(2, 3, 1),
            unfold=nn.Unfold(2, dilation=1, padding=1, stride=1),
            fold=nn.Fold((5, 5), 2, padding=1, stride=1),
        )
        net.scale = nn.Parameter(torch.randn(12, 1))
        return net

    return Zoo(build, lambda n, g: (_r(g, n, 2, 5, 5),))


def _upsample() -> Zoo:
    def fwd(n: Net, x: torch.Tensor) -> Any:
        h = n.conv(x)
        return (
            n.bilinear(h),
            n.nearest(h),
            F.interpolate(h, size=(5, 3), mode="bicubic", align_corners=False),
            n.shuffle(n.unshuffle(h)),
        )

    return Zoo(
        lambda: Net(
            fwd,
            conv=nn.Conv2d(2, 4, 1),
            bilinear=nn.Upsample(scale_factor=2, mode="bilinear", align_corners=True),
            nearest=nn.Upsample(size=(6, 5), mode="nearest"),
            unshuffle=nn.PixelUnshuffle(2),
            shuffle=nn.PixelShuffle(2),
        ),
        lambda n, g: (_r(g, n, 2, 4, 4),),
    )


def _pools() -> Zoo:
    def fwd(n: Net, x: torch.Tensor) -> Any:
        h = n.conv(x)
        return (
            n.maxp(h),
            n.avgp(h),
            n.amax(h),
            n.aavg(h),
            F.max_pool1d(h.flatten(2), 3, 2, ceil_mode=True),
            F.avg_pool1d(h.flatten(2), 4, 3, padding=2, ceil_mode=True),
            F.adaptive_max_pool1d(h.flatten(2), 5),
            F.lp_pool2d(h, 2.0, 2),
        )

    return Zoo(
        lambda: Net(
            fwd,
            conv=nn.Conv2d(2, 3, 2),
            maxp=nn.MaxPool2d(2, 2, padding=1, ceil_mode=True),
            avgp=nn.AvgPool2d(3, 2, padding=1, ceil_mode=True, count_include_pad=False),
            amax=nn.AdaptiveMaxPool2d((2, 3)),
            aavg=nn.AdaptiveAvgPool2d((3, 2)),
        ),
        lambda n, g: (_r(g, n, 2, 6, 7),),
    )


def _pools3d() -> Zoo:
    return _seq(
        (2, 5, 4, 4),
        lambda: nn.Conv3d(2, 2, 1),
        lambda: nn.MaxPool3d(2, 1, padding=1),
        lambda: nn.AvgPool3d(2, 2, ceil_mode=True),
        lambda: nn.AdaptiveAvgPool3d((2, 1, 2)),
    )


# losses computed inside the compiled model: fwd(net, logits-input, targets...) -> (logits, loss)
def _loss_case(
    d_in: int,
    d_out: int,
    targets: Callable[[int, Gen], Batch],
    fn: Callable[..., Any],
    bf16: bool = False,
) -> Zoo:
    def fwd(n: Net, x: torch.Tensor, *t: torch.Tensor) -> Any:
        y = n.lin(x)
        return y, fn(y, *t)

    return Zoo(
        lambda: Net(fwd, lin=nn.Linear(d_in, d_out)),
        lambda n, g: (_r(g, n, d_in), *targets(n, g)),
        bf16,
    )


def _ce_weighted(y: torch.Tensor, t: torch.Tensor, w: torch.Tensor) -> Any:
    return F.cross_entropy(y, t, weight=w, ignore_index=2, label_smoothing=0.1)


def _ce_targets(n: int, g: Gen) -> Batch:
    t = _ints(g, 5, n)
    t[0] = 2  # the ignored class
    return t, torch.rand(5, generator=g) + 0.5


def _ce_probs(y: torch.Tensor, p: torch.Tensor) -> Any:
    return F.cross_entropy(y, p.softmax(-1), label_smoothing=0.2) + F.cross_entropy(
        y, p.softmax(-1), reduction="sum"
    )


def _nll_2d() -> Zoo:
    def fwd(n: Net, x: torch.Tensor, t: torch.Tensor) -> Any:
        y = n.conv(x)  # (N, 4 classes, 3, 3)
        w = torch.tensor([1.0, 2.0, 0.5, 1.5])
        return y, F.nll_loss(F.log_softmax(y, 1), t, weight=w, ignore_index=1)

    return Zoo(
        lambda: Net(fwd, conv=nn.Conv2d(2, 4, 2)),
        lambda n, g: (_r(g, n, 2, 4, 4), _ints(g, 4, n, 3, 3)),
        bf16=True,
    )


def _bce(y: torch.Tensor, t: torch.Tensor) -> Any:
    pw = torch.tensor([1.0, 3.0, 0.5])
    return (
        F.binary_cross_entropy_with_logits(y, t, pos_weight=pw)
        + F.binary_cross_entropy(torch.sigmoid(y), t, reduction="sum")
        + F.binary_cross_entropy_with_logits(y, t, weight=t + 0.5, reduction="sum")
    )


def _kl(y: torch.Tensor, t: torch.Tensor) -> Any:
    lp = F.log_softmax(y, -1)
    return F.kl_div(lp, F.log_softmax(t, -1), reduction="batchmean", log_target=True) + F.kl_div(
        lp, F.softmax(t, -1), reduction="sum"
    )


def _regression(y: torch.Tensor, t: torch.Tensor) -> Any:
    return (
        F.smooth_l1_loss(y, t, beta=0.5)
        + F.huber_loss(y, t, delta=0.7)
        + F.l1_loss(y, t, reduction="sum")
        + F.poisson_nll_loss(y, t.abs())
        + F.gaussian_nll_loss(y, t, torch.ones_like(t) * 0.5)
    )


def _regression_case() -> Zoo:
    z = _loss_case(6, 3, lambda n, g: (_r(g, n, 3),), _regression)
    # gaussian_nll_loss checks `torch.any(var < 0)` in Python: a graph break (3 graphs)
    return Zoo(z.build, z.inputs, graphs=3)


def _margins(y: torch.Tensor, c: torch.Tensor, s: torch.Tensor, ml: torch.Tensor) -> Any:
    return (
        F.multi_margin_loss(y, c)
        + F.multi_margin_loss(y, c, p=2, margin=0.5, weight=torch.linspace(0.5, 1.5, 4))
        + F.multilabel_margin_loss(y, ml)
        + F.multilabel_soft_margin_loss(y, (s > 0).float())
        + F.soft_margin_loss(y, s)
        + F.hinge_embedding_loss(y, s, margin=0.5)
        + F.margin_ranking_loss(y[:, 0], y[:, 1], s[:, 0], margin=0.1)
    )


def _margin_targets(n: int, g: Gen) -> Batch:
    ml = torch.full((n, 4), -1, dtype=torch.long)
    ml[:, 0] = _ints(g, 4, n)
    ml[0, 1] = (ml[0, 0] + 1) % 4
    return _ints(g, 4, n), torch.randint(0, 2, (n, 4), generator=g).float() * 2 - 1, ml


def _embedding_losses(a: torch.Tensor, p: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> Any:
    return (
        F.cosine_embedding_loss(a, p, s, margin=0.2)
        + F.triplet_margin_loss(a, p, q, margin=0.5, swap=True)
        + F.triplet_margin_with_distance_loss(
            a, p, q, distance_function=lambda u, v: 1 - F.cosine_similarity(u, v)
        )
    )


def _embedding_loss_case() -> Zoo:
    def fwd(n: Net, x: torch.Tensor, y: torch.Tensor, z: torch.Tensor, s: torch.Tensor) -> Any:
        a, p, q = n.lin(x), n.lin(y), n.lin(z)
        return a, _embedding_losses(a, p, q, s)

    return Zoo(
        lambda: Net(fwd, lin=nn.Linear(5, 4)),
        lambda n, g: (_r(g, n, 5), _r(g, n, 5), _r(g, n, 5), torch.tensor([1.0, -1.0] * n)[:n]),
    )


def _ctc() -> Zoo:
    def fwd(n: Net, x: torch.Tensor, t: torch.Tensor, il: torch.Tensor, tl: torch.Tensor) -> Any:
        lp = F.log_softmax(n.lin(x), -1)  # (T, N, C)
        return lp, F.ctc_loss(lp, t, il, tl, blank=0, zero_infinity=True)

    def inputs(n: int, g: Gen) -> Batch:
        t = torch.randint(1, 5, (n, 3), generator=g)
        il = torch.full((n,), 7, dtype=torch.long)
        il[0] = 6
        tl = torch.full((n,), 3, dtype=torch.long)
        tl[-1] = 2
        return _r(g, 7, n, 4), t, il, tl

    return Zoo(lambda: Net(fwd, lin=nn.Linear(4, 5)), inputs)


def _parametrized() -> Zoo:
    def build() -> nn.Module:
        P = nn.utils.parametrizations
        return nn.Sequential(
            P.weight_norm(nn.Linear(5, 6)), nn.Tanh(), P.spectral_norm(nn.Linear(6, 3))
        )

    return Zoo(build, lambda n, g: (_r(g, n, 5),))


ZOO: dict[str, Zoo] = {
    "lstm_2layer_bidir_batch_first": _rnn(
        nn.LSTM, num_layers=2, bidirectional=True, batch_first=True
    ),
    "gru_bidir_h0": _gru_h0(),
    "rnn_relu_2layer": _rnn(nn.RNN, num_layers=2, nonlinearity="relu"),
    "encoder_post_norm_relu": _encoder(False, "relu"),
    "encoder_pre_norm_gelu": _encoder(True, "gelu"),
    "decoder_post_norm": _decoder(False),
    "decoder_pre_norm": _decoder(True),
    "mha_weights_float_mask": _mha(True),
    "mha_no_weights_padding": _mha(False),
    "groupnorm": _seq((2, 4, 4), lambda: nn.Conv2d(2, 4, 1), lambda: nn.GroupNorm(2, 4)),
    "instancenorm2d_affine_running": _seq(
        (2, 4, 4),
        lambda: nn.Conv2d(2, 3, 1),
        lambda: nn.InstanceNorm2d(3, affine=True, track_running_stats=True),
    ),
    "instancenorm1d_plain": _seq((2, 6), lambda: nn.Conv1d(2, 3, 1), lambda: nn.InstanceNorm1d(3)),
    "layernorm_no_affine_rmsnorm": _seq(
        (4, 6),
        lambda: nn.Linear(6, 8),
        lambda: nn.LayerNorm(8, elementwise_affine=False),
        nn.ReLU,
        lambda: nn.RMSNorm(8),
        bf16=True,
    ),
    "batchnorm1d_cumulative": Zoo(
        lambda: nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5, momentum=None)),
        lambda n, g: (_r(g, n, 6),),
        # its forward reads float(num_batches_tracked): a graph break inside torch.nn code,
        # which Dynamo then runs eagerly, frame and all
        graphs=0,
    ),
    "batchnorm2d_no_affine": _seq(
        (2, 4, 4), lambda: nn.Conv2d(2, 3, 3, padding=1), lambda: nn.BatchNorm2d(3, affine=False)
    ),
    "batchnorm3d_conv3d_groups": _seq(
        (2, 3, 3, 3), lambda: nn.Conv3d(2, 4, 2, groups=2), lambda: nn.BatchNorm3d(4)
    ),
    "conv1d_groups_dilation_same": _seq(
        (4, 9), lambda: nn.Conv1d(4, 6, 3, groups=2, dilation=2, padding="same")
    ),
    "conv2d_reflect_stride": _seq(
        (2, 5, 6), lambda: nn.Conv2d(2, 3, 3, stride=2, padding=1, padding_mode="reflect")
    ),
    "conv2d_circular_same": _seq(
        (2, 5, 5), lambda: nn.Conv2d(2, 2, (3, 2), padding="same", padding_mode="circular")
    ),
    "conv2d_replicate_depthwise": _seq(
        (2, 5, 5),
        lambda: nn.Conv2d(2, 4, 3, padding=2, groups=2, padding_mode="replicate", bias=False),
    ),
    "convtranspose1d_output_padding": _seq(
        (2, 5), lambda: nn.ConvTranspose1d(2, 3, 3, stride=2, padding=1, output_padding=1)
    ),
    "convtranspose2d_groups_dilation": _seq(
        (4, 3, 3),
        lambda: nn.ConvTranspose2d(4, 2, 2, stride=2, output_padding=1, groups=2, dilation=2),
        bf16=True,
    ),
    "pools_1d_2d_adaptive": _pools(),
    "pools_3d": _pools3d(),
    "upsample_pixelshuffle": _upsample(),
    "fold_unfold": _fold(),
    "embedding_bag_mean_offsets": _embedding_bag("mean", False),
    "embedding_bag_sum_per_sample_weights": _embedding_bag("sum", True),
    "embedding_bag_max": _embedding_bag("max", False),
    "embedding_padding_idx": _embedding_padding_idx(),
    "activations_a": _activations(_ACTS[:9], bf16=True),
    "activations_b": _activations(_ACTS[9:], bf16=False),
    "dropouts_in_eval": _dropouts_in_eval(),
    "bilinear_distances_flatten": _distances(),
    "cross_entropy_weighted_ignore_smoothing": _loss_case(
        6, 5, _ce_targets, _ce_weighted, bf16=True
    ),
    "cross_entropy_prob_targets": _loss_case(6, 5, lambda n, g: (_r(g, n, 5),), _ce_probs),
    "nll_loss_2d_weighted": _nll_2d(),
    "bce_pos_weight": _loss_case(6, 3, lambda n, g: (torch.rand(n, 3, generator=g),), _bce),
    "kl_div_log_target": _loss_case(6, 4, lambda n, g: (_r(g, n, 4),), _kl),
    "regression_losses": _regression_case(),
    "margin_losses": _loss_case(6, 4, _margin_targets, _margins),
    "embedding_losses": _embedding_loss_case(),
    "ctc_loss": _ctc(),
    "weight_norm_spectral_norm": _parametrized(),
}


@pytest.fixture(autouse=True)
def fresh_stoker() -> Iterator[None]:
    stoker.reset()
    yield
    stoker.reset()


def zoo_case(name: str, step: Any = zoo_step, bf16: bool = False) -> Case:
    z = ZOO[name]
    return Case(z.build, z.inputs, step, batch_sizes=(3, 3, 3), bf16=bf16, optimizer="adamw_eps")


def _check_compiled(compiled: Any, graphs: int = 1) -> None:
    """The model compiled to the case's number of graphs (one: no graph break), none
    failed, no op left to aten."""
    rep = compiled.stoker_report
    assert len(rep.compiles) == graphs, [c.frame for c in rep.compiles]
    assert not [c.error for c in rep.compiles if c.error]
    assert not [f for c in rep.compiles for f in c.fallbacks]


@pytest.mark.parametrize("name", list(ZOO))
def test_module_zoo(name: str) -> None:
    _check_compiled(run_case(zoo_case(name)), ZOO[name].graphs)


@pytest.mark.parametrize("name", [k for k, z in ZOO.items() if z.bf16])
def test_module_zoo_bf16_autocast(name: str) -> None:
    _check_compiled(run_case(zoo_case(name, bf16_step, bf16=True)), ZOO[name].graphs)


@pytest.mark.parametrize("name", ["gru_bidir_h0", "rnn_relu_2layer"])
def test_recurrent_layers_with_allow_rnn(name: str) -> None:
    """With Dynamo's (experimental) allow_rnn the recurrent layers are traced: their
    decomposition, unrolled over time, compiles to one graph with eager's numbers."""
    with torch._dynamo.config.patch(allow_rnn=True):
        _check_compiled(run_case(zoo_case(name)))


def test_clip_grad_norm_between_backward_and_step() -> None:
    _check_compiled(run_case(zoo_case("encoder_pre_norm_gelu", clip_step)))


# under the interpreter: each compiles to Triton kernels only (no op left to aten)
INTERPRETED = (
    "margin_losses",
    "weight_norm_spectral_norm",
    "instancenorm2d_affine_running",
    "conv2d_circular_same",
)


@pytest.mark.slow
def test_interpreted_triton_kernels_zoo() -> None:
    """A few zoo cases with Triton kernels under the interpreter (a fresh process: the
    interpreter must be on before Triton jits anything)."""
    run_interpreted(
        f"import sys; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})\n"
        + textwrap.dedent(
            """
            import stoker, test_stoker_sweep_modules as t
            from sweep_cases import run_case
            for name in t.INTERPRETED:
                stoker.reset()
                compiled = run_case(t.zoo_case(name), backend="interpret")
                t._check_compiled(compiled)
                rep = compiled.stoker_report
                assert {c.executor for c in rep.compiles} == {"interpret"}, rep.compiles
                assert rep.n_kernels > 0
            print("ok")
            """
        )
    )
