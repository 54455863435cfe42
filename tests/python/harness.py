"""Inputs, gate regimes and error measures shared by kda's Python tests.

The gate regimes, the input distributions and the tolerances are those of harness/definitions.txt,
which the C++ harness compiles in: a regime name and a limit mean one thing in every suite. The random
generator differs (torch.Generator here, splitmix64 in C++); the distributions and parameters do not.
A regime says how g (and A_log, dt_bias) are drawn; the gate mode (log_decay, or the fused softplus /
lower_bound gates), the beta mode and the in-kernel L2 norm are options of a case (``KIMI`` and
``LOWER_BOUND`` name the two option sets the suites use most).
The reference is kda's float64 oracle, reached through the same functions with float64 inputs.
"""

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path

import kda
import pytest
import torch
from kda._family import GDN, KDA

DEFINITIONS = Path(__file__).resolve().parents[2] / "harness" / "definitions.txt"


@dataclass(frozen=True)
class Distribution:
    """One row's distribution (definitions.txt): const X | normal MEAN STD | uniform LO HI |
    logsigmoid SCALE | sigmoid | softplus_gate (computed from the raw gate, not drawn)."""

    kind: str
    params: tuple = ()

    def draw(self, gen, *shape):
        if self.kind == "const":
            return torch.full(shape, self.params[0], dtype=torch.float64)
        if self.kind == "uniform":
            lo, hi = self.params
            return lo + (hi - lo) * torch.rand(*shape, generator=gen, dtype=torch.float64)
        z = torch.randn(*shape, generator=gen, dtype=torch.float64)
        if self.kind == "normal":
            return self.params[0] + self.params[1] * z
        if self.kind == "logsigmoid":
            return self.params[0] * torch.nn.functional.logsigmoid(z)
        if self.kind == "sigmoid":
            return torch.sigmoid(z)
        raise ValueError(f"{self.kind} is computed, not drawn")


_ARITY = {"const": 1, "normal": 2, "uniform": 2, "logsigmoid": 1, "sigmoid": 0, "softplus_gate": 0}


@dataclass
class Regime:
    name: str
    fields: dict = field(default_factory=dict)  # decay, raw, A_log, dt_bias: Distribution
    spikes: tuple | None = None  # (count, channel probability, log-decay value, raw value)


def _distribution(fields, where):
    if not fields or fields[0] not in _ARITY or len(fields) - 1 != _ARITY[fields[0]]:
        raise ValueError(f"{where}: bad distribution {' '.join(fields)!r}")
    return Distribution(fields[0], tuple(float(x) for x in fields[1:]))


def _read_definitions(path=DEFINITIONS):
    """The regimes (in the file's order), input distributions and tolerances of definitions.txt: the
    rows between the lines R"kda( and )kda"."""
    regimes, inputs, tolerances = {}, {}, {}
    inside = False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not inside:
            inside = line.startswith('R"kda(')
            continue
        if line.startswith(')kda"'):
            break
        f = line.split("#", 1)[0].split()
        if not f:
            continue
        where = f"{path.name} line {number}"
        if f[0] == "regime":
            r = regimes.setdefault(f[1], Regime(f[1]))
            if f[2] == "spikes":
                r.spikes = (int(f[3]), float(f[4]), float(f[5]), float(f[6]))
            elif f[2] in ("decay", "raw", "A_log", "dt_bias"):
                r.fields[f[2]] = _distribution(f[3:], where)
            else:
                raise ValueError(f"{where}: unknown regime field {f[2]!r}")
        elif f[0] == "input":
            inputs[f[1]] = _distribution(f[2:], where)
        elif f[0] == "tolerance":
            for quantity in f[3].split(","):
                tolerances[(f[1], f[2], quantity)] = float(f[4])
        else:
            raise ValueError(f"{where}: unknown row kind {f[0]!r}")
    for r in regimes.values():
        missing = {"decay", "raw", "A_log", "dt_bias"} - r.fields.keys()
        if missing:
            raise ValueError(f"{path.name}: regime {r.name} has no {', '.join(sorted(missing))}")
    return regimes, inputs, tolerances


_REGIMES, _INPUTS, _TOLERANCES = _read_definitions()
REGIMES = tuple(_REGIMES)  # mild, strong, zero, spike, unbounded

# The fused options of Kimi-Linear's layer (used with regime "unbounded") and the bounded gate with
# beta up to 2 (negative eigenvalues).
KIMI = dict(gate="softplus", beta="sigmoid", qk_l2norm=True)
LOWER_BOUND = dict(gate="lower_bound", beta="sigmoid_x2", qk_l2norm=True)
# Every regime with the options it is run with (unbounded: Kimi's layer), and the bounded gate on
# strong raw gates (the sigmoid pushed to both ends): (regime, options) pairs.
GATE_SETTINGS = tuple((r, KIMI if r == "unbounded" else {}) for r in REGIMES) + (("strong", LOWER_BOUND),)


def tolerance(path, dtype, quantity):
    """The limit on the relative RMS error against the float64 oracle (definitions.txt) of `quantity`
    (o, state, dq, dk, dv, dg, dbeta, dh0, dA_log, ddt_bias) on `path` (forward, backward, decode),
    stored in `dtype`."""
    stored = "bf16" if dtype == torch.bfloat16 else "f32"
    try:
        return _TOLERANCES[(path, stored, quantity)]
    except KeyError:
        raise KeyError(f"no tolerance for {path} {stored} {quantity} in {DEFINITIONS.name}") from None


# The gradient quantity of each input of kda's functions.
GRADIENT_OF = dict(
    q="dq", k="dk", v="dv", g="dg", beta="dbeta", initial_state="dh0", A_log="dA_log", dt_bias="ddt_bias"
)


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
    gate: str = "log_decay"  # or the fused gates "softplus", "lower_bound"
    lower_bound: float = -5.0
    dt_bias: bool = True  # fused gates: pass a dt_bias
    beta: str = "given"  # or "sigmoid", "sigmoid_x2": beta passed as logits
    qk_l2norm: bool = False
    gate_width: str = "per_key"  # or "per_head": the gated delta rule's g [B, T, HV], dt_bias [HV]
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.regime not in _REGIMES:
            raise ValueError(
                f"regime {self.regime!r} is not defined in {DEFINITIONS.name} ({', '.join(REGIMES)})"
            )
        if self.gate_width not in ("per_key", "per_head"):
            raise ValueError(f"gate_width {self.gate_width!r}: expected per_key or per_head")

    def __str__(self):
        shape = f"B{self.B}T{self.T}H{self.H}HV{self.HV}K{self.K}V{self.V}"
        parts = [shape, self.regime, str(self.dtype).replace("torch.", "")]
        if self.gate != "log_decay":
            parts.append(self.gate if self.gate == "softplus" else f"lb{self.lower_bound:g}")
            if not self.dt_bias:
                parts.append("nobias")
        if self.beta != "given":
            parts.append(self.beta)
        if self.qk_l2norm:
            parts.append("l2")
        if self.gate_width == "per_head":
            parts.append("perhead")
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
    def gate_dim(self):
        """g's last dimension: K per key channel, 1 per head (then dropped: g [B, T, HV])."""
        return 1 if self.gate_width == "per_head" else self.K

    @property
    def num_sequences(self):
        return self.B if self.cu_seqlens is None else len(self.cu_seqlens) - 1


# The operator families whose kernels the suites test (kda._family; GV, the gate per value channel, has
# only the oracle): a shared case runs for each family it applies to.
FAMILIES = (KDA, GDN)


def applies(case, family):
    """Whether a case is a problem of `family`: the bounded gate (lower_bound) is KDA's alone."""
    return case.gate != "lower_bound" or family.lower_bound_gate


def of_family(case, family):
    """The case with the family's gate: g [B, T, HV, K] (KDA) or [B, T, HV] (GDN)."""
    return dataclasses.replace(case, gate_width=family.gate_width)


def family_params(families=FAMILIES):
    """pytest parameters over the families, each named by its family (KDA, GDN)."""
    return [pytest.param(f, id=f.name) for f in families]


def family_cases(rows, families=FAMILIES):
    """pytest parameters (family, case, *values): every case for every family it applies to, with that
    family's gate, named 'FAMILY-case'. A row is a case, or a tuple (case, *values) of a case and the
    test's other arguments."""
    params = []
    for f in families:
        for row in rows:
            case, *values = row if isinstance(row, tuple) else (row,)
            if applies(case, f):
                params.append(pytest.param(f, of_family(case, f), *values, id=f"{f.name}-{case}"))
    return params


# transformers' models of each family, which the transformers suites run on kda's hub layers: the
# check that builds them (run in its own process; it prints {model: report}), its time limit in
# seconds and the models' names.
MODEL_CHECKS = {
    KDA.name: ("kimi_linear_check.py", 600, ("kimi_linear",)),
    GDN.name: ("gdn_models_check.py", 900, ("qwen3_next", "qwen3_5", "qwen3_5_moe", "olmo_hybrid")),
}


def family_models(families=FAMILIES):
    """pytest parameters (family, model) over every family's transformers models, named
    'FAMILY-model'."""
    return [pytest.param(f, m, id=f"{f.name}-{m}") for f in families for m in MODEL_CHECKS[f.name][2]]


def function_of(family, kind):
    """The name of the family's kda function of a kind: chunk, recurrent (fla's) or decode (serving)."""
    return getattr(family, f"{kind}_function")


def _draw(name, gen, *shape):
    return _INPUTS[name].draw(gen, *shape)


def _gates(case, gen):
    """g as the case's regime draws it, and (fused gate) A_log and dt_bias: definitions.txt's rules
    (a per-head gate is drawn as one of a single key channel, as the C++ harness does)."""
    r = _REGIMES[case.regime]
    B, T, HV, K = case.B, case.T, case.HV, case.gate_dim
    fused = case.gate != "log_decay"
    computed = r.fields["decay"].kind == "softplus_gate"
    A_log = dt_bias = None
    if fused or computed:
        A_log = r.fields["A_log"].draw(gen, HV).float().double()
        dt_bias = (
            r.fields["dt_bias"].draw(gen, HV * K).float().double() if case.dt_bias else torch.zeros(HV * K)
        )
    spike = torch.zeros(B, T, HV, K, dtype=torch.bool)
    if r.spikes is not None and T > 0:
        count, channel_p = r.spikes[:2]
        tokens = torch.randint(T, (B, HV, count), generator=gen)
        channels = torch.rand(B, HV, count, K, generator=gen) < channel_p
        channels[:, :, 0] = True  # the first spike in every channel
        for b in range(B):
            for hv in range(HV):
                for s in range(count):
                    spike[b, tokens[b, hv, s], hv] |= channels[b, hv, s]
    if fused:
        g = r.fields["raw"].draw(gen, B, T, HV, K)
    elif computed:
        raw = r.fields["raw"].draw(gen, B, T, HV, K)
        g = -A_log.exp().view(HV, 1) * torch.nn.functional.softplus(raw + dt_bias.view(HV, K))
    else:
        g = r.fields["decay"].draw(gen, B, T, HV, K)
    if r.spikes is not None:
        g[spike] = r.spikes[3] if fused else r.spikes[2]
    if case.gate_width == "per_head":
        g = g.squeeze(-1)
    if not fused:
        return g, {}
    options = {"use_gate_in_kernel": True, "A_log": A_log.float()}
    if case.dt_bias:
        options["dt_bias"] = dt_bias.float()
    if case.gate == "lower_bound":
        options["lower_bound"] = case.lower_bound
    elif case.gate != "softplus":
        raise ValueError(f"gate {case.gate!r}: expected log_decay, softplus or lower_bound")
    return g, options


def make_inputs(case: Case):
    """Random inputs of a case: (tensors, options) for kda.chunk_kda / fused_recurrent_kda. Tensors are
    in the case's dtype (states, A_log, dt_bias in float32); options are the keyword arguments."""
    gen = torch.Generator().manual_seed(case.seed)
    B, T, H, HV, K, V = case.B, case.T, case.H, case.HV, case.K, case.V
    q, k = _draw("q", gen, B, T, H, K), _draw("k", gen, B, T, H, K)
    if case.qk_l2norm:  # rows of varied norm for the kernel to normalise
        q = q * _draw("qk_row_norm", gen, B, T, H, 1)
        k = k * _draw("qk_row_norm", gen, B, T, H, 1)
    else:  # unit keys keep the delta rule stable (queries stay as drawn)
        k = torch.nn.functional.normalize(k, dim=-1)
    v = _draw("v", gen, B, T, HV, V)
    if case.beta not in ("given", "sigmoid", "sigmoid_x2"):
        raise ValueError(f"beta {case.beta!r}: expected given, sigmoid or sigmoid_x2")
    beta = _draw("beta" if case.beta == "given" else "beta_logit", gen, B, T, HV)
    g, options = _gates(case, gen)
    options.update(scale=case.scale, state_v_first=case.state_v_first)
    if case.beta != "given":
        options.update(use_beta_sigmoid_in_kernel=True, allow_neg_eigval=case.beta == "sigmoid_x2")
    if case.qk_l2norm:
        options["use_qk_l2norm_in_kernel"] = True
    if case.cu_seqlens is not None:
        options["cu_seqlens"] = torch.tensor(case.cu_seqlens, dtype=torch.int64)
    if case.initial_state:
        state = (V, K) if case.state_v_first else (K, V)
        options["initial_state"] = _draw("initial_state", gen, case.num_sequences, HV, *state).float()
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
    if g.dim() == 3:  # a per-head gate: one channel
        g = g.unsqueeze(-1)
        dg_raw = dg_raw.unsqueeze(-1)
    HV, K = g.shape[-2:]
    bias = options.get("dt_bias")
    u = g if bias is None else g + bias.double().reshape(HV, K)
    if options.get("lower_bound") is None:
        r = torch.nn.functional.softplus(u) / torch.sigmoid(u)
    else:
        r = u
    dA = (dg_raw.double() * r).abs().sum(dim=(0, 1, 3))
    dbias = dg_raw.double().abs().sum(dim=(0, 1)).reshape(-1)
    return dA, dbias


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
    w_o = _draw("d_o", gen, *o.shape)
    if round_to is not None:
        w_o = w_o.to(round_to).double()
    w_s = _draw("d_final_state", gen, *final.shape)
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
