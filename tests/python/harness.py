"""Inputs, gate regimes and error measures shared by kda's Python tests.

The regimes are those of the C++ suite: ``mild``, ``strong`` and ``zero`` log decays, ``spike`` (one
token of each sequence decays by e^-1000), ``unbounded`` (the fused softplus gate with exp(A_log) of
8..32, sigmoid beta and in-kernel q/k L2 norm: the gate Kimi-Linear-48B uses, unbounded below) and
``lower_bound`` (the fused lower-bound gate, lb = -5, with 2 sigmoid beta: negative eigenvalues).
The reference is kda's float64 oracle, reached through the same functions with float64 inputs.
"""

import math
from dataclasses import dataclass, field

import kda
import torch

REGIMES = ("mild", "strong", "zero", "spike", "unbounded", "lower_bound")

# Limits on the relative RMS error against the float64 oracle. fp32 quantities (fp32 activations and,
# whatever the activations' dtype, states, A_log / dt_bias gradients) meet the fp32 limits; bf16
# tensors carry one bf16 rounding (up to 2^-8 relative: 3.9e-3) plus fp32 work.
FP32_FORWARD = 2e-6
FP32_BACKWARD = 1e-5
BF16_FORWARD = 4e-3
BF16_BACKWARD = 1e-2


@dataclass
class Case:
    B: int = 1
    T: int = 37
    H: int = 2
    HV: int = 2
    K: int = 32
    V: int = 32
    regime: str = "mild"
    dtype: torch.dtype = torch.float32
    cu_seqlens: list | None = None  # then B must be 1 and T == cu_seqlens[-1]
    state_v_first: bool = False
    initial_state: bool = True
    scale: float | None = None
    seed: int = 0
    extra: dict = field(default_factory=dict)

    def __str__(self):
        shape = f"B{self.B}T{self.T}H{self.H}HV{self.HV}K{self.K}V{self.V}"
        parts = [shape, self.regime, str(self.dtype).replace("torch.", "")]
        if self.cu_seqlens is not None:
            parts.append("varlen" + "-".join(map(str, self.cu_seqlens)))
        if self.state_v_first:
            parts.append("vfirst")
        if not self.initial_state:
            parts.append("noh0")
        if self.scale is not None:
            parts.append(f"scale{self.scale}")
        return "_".join(parts)

    @property
    def num_sequences(self):
        return self.B if self.cu_seqlens is None else len(self.cu_seqlens) - 1


def make_inputs(case: Case):
    """Random inputs of a case: (tensors, options) for kda.chunk_kda / fused_recurrent_kda. Tensors are
    in the case's dtype (states, A_log, dt_bias in float32); options are the keyword arguments."""
    gen = torch.Generator().manual_seed(case.seed)
    B, T, H, HV, K, V = case.B, case.T, case.H, case.HV, case.K, case.V

    def randn(*shape, std=1.0):
        return torch.randn(*shape, generator=gen, dtype=torch.float64) * std

    def uniform(lo, hi, *shape):
        return lo + (hi - lo) * torch.rand(*shape, generator=gen, dtype=torch.float64)

    r = case.regime
    fused_gate = r in ("unbounded", "lower_bound")
    q, k = randn(B, T, H, K), randn(B, T, H, K)
    if not fused_gate:  # without the in-kernel L2 norm the keys must be normalised for a stable delta rule
        q, k = (torch.nn.functional.normalize(x, dim=-1) for x in (q, k))
    v = randn(B, T, HV, V)
    options = {"scale": case.scale, "state_v_first": case.state_v_first}
    if r == "mild":
        g = -uniform(0.005, 0.1, B, T, HV, K)
    elif r == "strong":
        g = -uniform(0.5, 4.0, B, T, HV, K)
    elif r == "zero":
        g = torch.zeros(B, T, HV, K, dtype=torch.float64)
    elif r == "spike":
        g = -uniform(0.005, 0.1, B, T, HV, K)
        starts = [0] if case.cu_seqlens is None else case.cu_seqlens[:-1]
        ends = [T] if case.cu_seqlens is None else case.cu_seqlens[1:]
        for s, e in zip(starts, ends, strict=True):
            if e > s:
                g[:, s + (e - s) // 2, :, :] = -1000.0
    elif r in ("unbounded", "lower_bound"):
        g = randn(B, T, HV, K, std=2.0)
    else:
        raise ValueError(r)
    if fused_gate:
        beta = randn(B, T, HV, std=2.0)  # logits
        options.update(use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, use_qk_l2norm_in_kernel=True)
        if r == "unbounded":
            options["A_log"] = torch.log(uniform(8.0, 32.0, HV)).float()
        else:
            options["A_log"] = uniform(-1.0, 1.0, HV).float()
            options.update(lower_bound=-5.0, allow_neg_eigval=True)
        options["dt_bias"] = randn(HV * K, std=0.5).float()
    else:
        beta = uniform(0.05, 0.95, B, T, HV)
    if case.cu_seqlens is not None:
        options["cu_seqlens"] = torch.tensor(case.cu_seqlens, dtype=torch.int64)
    if case.initial_state:
        state = (V, K) if case.state_v_first else (K, V)
        options["initial_state"] = randn(case.num_sequences, HV, *state, std=0.1).float()
    tensors = dict(q=q, k=k, v=v, g=g, beta=beta)
    return {n: t.to(case.dtype) for n, t in tensors.items()}, options


def as_oracle(tensors, options):
    """The same call in float64 (kda computes float64 inputs with its oracle); exact widening."""
    t64 = {n: t.detach().double() for n, t in tensors.items()}
    o64 = {
        n: (x.detach().double() if torch.is_tensor(x) and x.is_floating_point() else x)
        for n, x in options.items()
    }
    return t64, o64


def rel_rms(got, want):
    """Relative RMS error ||got - want|| / ||want|| (absolute when want is 0)."""
    got, want = got.detach().double(), want.detach().double()
    assert got.shape == want.shape, (got.shape, want.shape)
    assert torch.isfinite(got).all(), "non-finite values"
    den = want.norm()
    num = (got - want).norm()
    return (num / den).item() if den > 0 else num.item()


def sum_error(got, want, magnitude):
    """Error of a sum over tokens against the sum of its terms' magnitudes: cancellation in the true
    sum is the problem's conditioning, not the kernel's error."""
    got, want = got.detach().double(), want.detach().double()
    assert torch.isfinite(got).all(), "non-finite values"
    den = magnitude.double().norm()
    num = (got - want).norm()
    return (num / den).item() if den > 0 else num.item()


def gate_parameter_magnitudes(dg_raw, tensors, options):
    """Magnitudes of the terms summed into dA_log [HV] and ddt_bias [HV*K], from the float64 gradient
    of the raw gate: ddt_bias sums dg_raw over tokens; dA_log sums dg_raw * r with r = softplus(u) /
    sigmoid(u) (softplus gate) or r = u (lower-bound gate), u = g + dt_bias."""
    g = tensors["g"].double()
    HV, K = g.shape[-2:]
    u = g + options["dt_bias"].double().reshape(HV, K)
    if options.get("lower_bound") is None:
        r = torch.nn.functional.softplus(u) / torch.sigmoid(u)
    else:
        r = u
    dA = (dg_raw.double() * r).abs().sum(dim=(0, 1, 3))
    dbias = dg_raw.double().abs().sum(dim=(0, 1)).reshape(-1)
    return dA, dbias


def limits(dtype):
    """(forward, backward) relative limits of tensors stored in `dtype`."""
    if dtype == torch.bfloat16:
        return BF16_FORWARD, BF16_BACKWARD
    return FP32_FORWARD, FP32_BACKWARD


def run(function, tensors, options, requires_grad=False):
    """Calls kda's `function` ("chunk_kda" or "fused_recurrent_kda"); with requires_grad every floating
    input gets a gradient. Returns (o, final_state, inputs by name)."""
    inputs = {n: t.detach().clone().requires_grad_(requires_grad) for n, t in tensors.items()}
    opts = dict(options)
    for name in ("initial_state", "A_log", "dt_bias"):
        if opts.get(name) is not None:
            opts[name] = opts[name].detach().clone().requires_grad_(requires_grad)
            inputs[name] = opts[name]
    activations = {n: inputs[n] for n in ("q", "k", "v", "g", "beta")}
    o, final = getattr(kda, function)(**activations, output_final_state=True, **opts)
    return o, final, inputs


def loss_weights(o, final, seed=7, round_to=None):
    """Random cotangents for o and the final state (a loss sum(o * w) + sum(final * w_s)). w is rounded to
    `round_to` (the kernel's o dtype): the gradient reaching a bf16 o is bf16, and the oracle must see
    the same values."""
    gen = torch.Generator().manual_seed(seed)
    w_o = torch.randn(o.shape, generator=gen, dtype=torch.float64)
    if round_to is not None:
        w_o = w_o.to(round_to).double()
    w_s = torch.randn(final.shape, generator=gen, dtype=torch.float64)
    return w_o, w_s


def gradients(function, tensors, options, seed=7, round_to=None):
    """Output, final state and the gradient of every input of a random linear loss (its o cotangent
    rounded to `round_to`, default o's dtype)."""
    o, final, inputs = run(function, tensors, options, requires_grad=True)
    w_o, w_s = loss_weights(o, final, seed, o.dtype if round_to is None else round_to)
    loss = (o.double() * w_o).sum() + (final.double() * w_s).sum()
    loss.backward()
    return o.detach(), final.detach(), {n: t.grad for n, t in inputs.items()}


def finite(*tensors):
    return all(t is None or bool(torch.isfinite(t).all()) for t in tensors)


def fmt(x):
    return f"{x:.2e}" if math.isfinite(x) else str(x)
