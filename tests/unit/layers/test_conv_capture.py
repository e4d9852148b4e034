"""The convolution factor terms (channels-last patch Gram permuted to the
weight's order, the G Gram of the ``[N, C, L]`` gradient) against the
formulation they replace — ``F.unfold`` rows, a transpose, a ``cat`` with the
ones column, one Gram — in float64, for a grid of configurations."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kaisa import KFACPreconditioner
from kaisa.core.specs import FactorKind, FactorSource
from kaisa.core.statistics import _features_first_gram, contribution_features_first
from kaisa.layers import Conv1dAdapter, Conv2dAdapter
from kaisa.layers import patches as patches_module
from kaisa.layers.convolution import ConvAdapter

from kfac_reference import conv_patches, rel_err

EXACT = 1e-12

pytestmark = pytest.mark.usefixtures("float64_default")


# -- the formulation being replaced (kaisa before issue 10), kept here only ------
def unfolded_rows(conv: nn.Conv1d | nn.Conv2d, x: Tensor) -> Tensor:
    """``[N, L, C·K (+1)]``: F.unfold of the padded input, transposed, ones appended."""
    pad, mode = conv._reversed_padding_repeated_twice, conv.padding_mode
    if any(pad):
        x = F.pad(x, pad, mode="constant" if mode == "zeros" else mode)
    if isinstance(conv, nn.Conv1d):
        cols = F.unfold(
            x.unsqueeze(2),
            kernel_size=(1, conv.kernel_size[0]),
            dilation=(1, conv.dilation[0]),
            stride=(1, conv.stride[0]),
        )
    else:
        cols = F.unfold(x, conv.kernel_size, dilation=conv.dilation, stride=conv.stride)
    rows = cols.transpose(1, 2)
    if conv.bias is not None:
        rows = torch.cat([rows, rows.new_ones(*rows.shape[:-1], 1)], dim=-1)
    return rows


def gram(rows: Tensor, dtype: torch.dtype) -> Tensor:
    flat = rows.reshape(-1, rows.shape[-1]).to(dtype)
    return flat.t() @ flat


def old_a_term(conv: nn.Module, x: Tensor, reduce: bool, dtype: torch.dtype) -> tuple:
    rows = unfolded_rows(conv, x)
    if reduce and rows.shape[1] > 1:
        rows = rows.mean(1, keepdim=True)
    return gram(rows, dtype), float(rows.shape[0] * rows.shape[1])


def old_g_term(g: Tensor, reduce: bool, dtype: torch.dtype) -> tuple:
    rows = g.flatten(2).transpose(1, 2)
    if reduce and rows.shape[1] > 1:
        rows = rows.sum(1, keepdim=True)
    return gram(rows, dtype), float(rows.shape[0] * rows.shape[1])


# -- the grid ---------------------------------------------------------------------
CONV2D_CASES = [
    dict(kernel_size=3, padding=1),
    dict(kernel_size=3, stride=2),
    dict(kernel_size=(3, 2), stride=(2, 1), padding=(1, 2)),
    dict(kernel_size=3, padding=2, dilation=2),
    dict(kernel_size=(2, 3), padding="same", dilation=(1, 2)),
    dict(kernel_size=4, padding="same"),
    dict(kernel_size=3, stride=2, padding="valid"),
    dict(kernel_size=1),
    dict(kernel_size=3, padding=1, padding_mode="reflect"),
    dict(kernel_size=3, stride=2, padding=(2, 1), padding_mode="replicate", dilation=(1, 2)),
    dict(kernel_size=3, padding="same", padding_mode="circular"),
    dict(kernel_size=(1, 3), stride=(1, 2), padding=(0, 2), padding_mode="circular", dilation=2),
]
CONV1D_CASES = [
    dict(kernel_size=3, padding=1),
    dict(kernel_size=3, stride=2),
    dict(kernel_size=2, padding="same", dilation=2),
    dict(kernel_size=3, padding=2, padding_mode="reflect", dilation=2),
    dict(kernel_size=3, padding=1, padding_mode="circular"),
    dict(kernel_size=4, stride=3, padding=2, padding_mode="replicate"),
]
#: (bias, in/out channels, batch, reduce)
VARIANTS = list(itertools.product([True, False], [1, 3], [1, 4], [False, True]))


def case_id(case: dict) -> str:
    return "-".join(f"{k}={v}" for k, v in case.items())


def variant_id(v: tuple) -> str:
    bias, channels, batch, reduce = v
    return f"bias={bias}-C={channels}-N={batch}-{'reduce' if reduce else 'expand'}"


def make(kind: str, case: dict, bias: bool, channels: int) -> tuple[nn.Module, ConvAdapter]:
    torch.manual_seed(0)
    if kind == "2d":
        conv: nn.Module = nn.Conv2d(channels, channels + 1, bias=bias, **case)
        adapter: ConvAdapter = Conv2dAdapter("conv", conv)
    else:
        conv = nn.Conv1d(channels, channels + 1, bias=bias, **case)
        adapter = Conv1dAdapter("conv", conv)
    return conv, adapter


def inputs(kind: str, batch: int, channels: int) -> Tensor:
    g = torch.Generator().manual_seed(3)
    shape = (batch, channels, 7, 6) if kind == "2d" else (batch, channels, 9)
    return torch.randn(shape, generator=g)


def spec_of(adapter: ConvAdapter, source: FactorSource):
    return next(s for s in adapter.factor_specs() if s.source is source)


def check_terms(conv: nn.Module, adapter: ConvAdapter, x: Tensor, reduce: bool) -> None:
    adapter.reduce = reduce
    with torch.no_grad():
        out = conv(x)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(4))
    a_spec, g_spec = (
        spec_of(adapter, FactorSource.INPUT),
        spec_of(adapter, FactorSource.OUTPUT_GRAD),
    )
    A, a_count = adapter.factor_term(a_spec, x, torch.float64, 1.0)
    A_ref, a_count_ref = old_a_term(conv, x, reduce, torch.float64)
    assert A.shape == A_ref.shape == (adapter.a_dim, adapter.a_dim)
    assert rel_err(A, A_ref) <= EXACT
    assert a_count == a_count_ref
    G, g_count = adapter.factor_term(g_spec, g, torch.float64, 1.0)
    G_ref, g_count_ref = old_g_term(g, reduce, torch.float64)
    assert rel_err(G, G_ref) <= EXACT
    assert g_count == g_count_ref
    scaled, _ = adapter.factor_term(g_spec, g, torch.float64, 2.5)
    assert rel_err(scaled, 2.5 * G_ref) <= EXACT


@pytest.mark.parametrize("variant", VARIANTS, ids=variant_id)
@pytest.mark.parametrize("case", CONV2D_CASES, ids=case_id)
def test_conv2d_terms_equal_unfolded_rows(
    case: dict, variant: tuple, monkeypatch: pytest.MonkeyPatch
) -> None:
    bias, channels, batch, reduce = variant
    conv, adapter = make("2d", case, bias, channels)
    x = inputs("2d", batch, channels)
    # the reference rows are the convolution's own patches
    direct = conv_patches(x, conv) @ conv.weight.reshape(conv.out_channels, -1).t()
    with torch.no_grad():
        expected = conv(x) - (conv.bias.view(-1, 1, 1) if bias else 0)
    assert rel_err(direct, expected.permute(0, 2, 3, 1).reshape(direct.shape)) <= EXACT
    check_terms(conv, adapter, x, reduce)
    monkeypatch.setattr(patches_module, "CPU_CHUNK_BYTES", 1)  # one data point per chunk
    check_terms(conv, adapter, x, reduce)


@pytest.mark.parametrize("variant", VARIANTS, ids=variant_id)
@pytest.mark.parametrize("case", CONV1D_CASES, ids=case_id)
def test_conv1d_terms_equal_unfolded_rows(
    case: dict, variant: tuple, monkeypatch: pytest.MonkeyPatch
) -> None:
    bias, channels, batch, reduce = variant
    conv, adapter = make("1d", case, bias, channels)
    x = inputs("1d", batch, channels)
    check_terms(conv, adapter, x, reduce)
    monkeypatch.setattr(patches_module, "CPU_CHUNK_BYTES", 1)
    check_terms(conv, adapter, x, reduce)


@pytest.mark.parametrize("kind", ["2d", "1d"])
def test_input_rows_are_the_unfolded_rows(kind: str) -> None:
    case = dict(kernel_size=3, stride=2, padding=2, dilation=2, padding_mode="reflect")
    conv, adapter = make(kind, case, bias=False, channels=3)
    x = inputs(kind, 4, 3)
    assert torch.equal(adapter.input_rows(x), unfolded_rows(conv, x))
    assert torch.equal(adapter.input_rows(x[0]), unfolded_rows(conv, x[:1]))  # unbatched


def test_unbatched_channels_last_and_float32_inputs() -> None:
    conv, adapter = make("2d", dict(kernel_size=3, padding=1), bias=True, channels=3)
    x = inputs("2d", 4, 3)
    a_spec, g_spec = (
        spec_of(adapter, FactorSource.INPUT),
        spec_of(adapter, FactorSource.OUTPUT_GRAD),
    )
    A_ref, _ = old_a_term(conv, x, False, torch.float64)
    # channels-last memory format: the padded copy is then a plain copy
    A, _ = adapter.factor_term(
        a_spec, x.contiguous(memory_format=torch.channels_last), torch.float64, 1.0
    )
    assert rel_err(A, A_ref) <= EXACT
    # unbatched [C, H, W]: one data point
    A1, count = adapter.factor_term(a_spec, x[1], torch.float64, 1.0)
    assert rel_err(A1, old_a_term(conv, x[1:2], False, torch.float64)[0]) <= EXACT
    assert count == 7 * 6 and adapter.batch_size(x[1]) == 1
    # float32 rows, float64 factor: converted as they are, summed in float64
    x32 = x.float()
    A32, _ = adapter.factor_term(a_spec, x32, torch.float64, 1.0)
    assert A32.dtype == torch.float64
    assert rel_err(A32, old_a_term(conv, x32, False, torch.float64)[0]) <= EXACT
    # a channels-last output gradient takes the rows path (its rows are a view)
    g = torch.randn(4, 4, 7, 6).contiguous(memory_format=torch.channels_last)
    G, _ = adapter.factor_term(g_spec, g, torch.float64, 1.0)
    assert rel_err(G, old_g_term(g, False, torch.float64)[0]) <= EXACT
    G1, _ = adapter.factor_term(g_spec, g[0], torch.float64, 1.0)
    assert rel_err(G1, old_g_term(g[:1], False, torch.float64)[0]) <= EXACT


def test_contribution_features_first() -> None:
    cols = torch.randn(5, 4, 11, generator=torch.Generator().manual_seed(0))
    rows = cols.transpose(1, 2).reshape(-1, 4)
    scale = torch.tensor(3.0)
    dense = contribution_features_first(cols, FactorKind.DENSE, torch.float64, scale)
    assert rel_err(dense, 3.0 * rows.t() @ rows) <= EXACT
    diag = contribution_features_first(cols, FactorKind.DIAGONAL, torch.float64)
    assert rel_err(diag, (rows * rows).sum(0)) <= EXACT


@pytest.mark.parametrize("per_point", [True, False])
def test_features_first_gram_both_forms(per_point: bool) -> None:
    """Per data point without a copy (CPU) or one product of the copied rows
    (an accelerator, where ``addbmm`` is a product per data point): both
    equal the float64 Gram of the rows, with the scale folded in."""
    cols = torch.randn(6, 5, 9, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    rows = cols.transpose(1, 2).reshape(-1, 5)
    got = _features_first_gram(cols, 0.25, per_point)
    assert rel_err(got, 0.25 * rows.t() @ rows) <= EXACT


def cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1, padding_mode="reflect"),
        nn.Tanh(),
        nn.Conv2d(4, 5, 3, stride=2, dilation=2, padding=2),
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(5 * 4 * 4, 3),
    )


@pytest.mark.parametrize("approx", ["expand", "reduce"])
def test_deferred_capture_matches_in_hook(approx: str) -> None:
    """``update_factors_in_hook=False`` keeps the raw input and forms the same
    terms at ``step()``; both equal factors built from the unfolded rows."""
    x = torch.randn(6, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 3, (6,), generator=torch.Generator().manual_seed(2))
    model = cnn()
    factors = {}
    for in_hook in (True, False):
        precond = KFACPreconditioner(
            copy.deepcopy(model),
            damping=0.01,
            kl_clip=None,
            kfac_approx=approx,
            update_factors_in_hook=in_hook,
        )
        F.cross_entropy(precond.model(x), y).backward()
        precond.step()
        factors[in_hook] = {
            name: (layer.factor("A"), layer.factor("G")) for name, layer in precond.layers.items()
        }
    for name, (A, G) in factors[True].items():
        assert rel_err(factors[False][name][0], A) <= EXACT
        assert rel_err(factors[False][name][1], G) <= EXACT
    # the first conv's A against the unfolded rows of the batch
    reference, count = old_a_term(model[0], x, approx == "reduce", torch.float64)
    assert rel_err(factors[True]["0"][0], reference / count) <= EXACT
