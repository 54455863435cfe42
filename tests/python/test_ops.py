"""kda's torch.library custom ops, for every family: opcheck for every op, torch.compile(fullgraph=True)
with a dynamic sequence length, gradcheck through the float64 oracle path, and what the forward keeps
for autograd."""

import dataclasses

import kda
import pytest
import torch
import torch._dynamo.testing
from harness import (
    KIMI,
    LOWER_BOUND,
    Case,
    as_oracle,
    family_cases,
    function_of,
    make_inputs,
    rel_rms,
    run,
)
from kda import _ops
from torch.utils._python_dispatch import TorchDispatchMode


def _op_args(case, requires_grad, keep_chunk_states, dtype=None):
    """Arguments of a forward op for a harness case (the ones kda.functional passes)."""
    tensors, options = make_inputs(case)
    if dtype is not None:
        tensors, options = as_oracle(tensors, options) if dtype == torch.float64 else (tensors, options)
    t = {n: x.detach().clone().requires_grad_(requires_grad) for n, x in tensors.items()}
    side = {
        n: (options[n].detach().clone().requires_grad_(requires_grad) if options.get(n) is not None else None)
        for n in ("A_log", "dt_bias", "initial_state")
    }
    fused = options.get("use_gate_in_kernel", False)
    gate = ("lower_bound" if options.get("lower_bound") is not None else "softplus") if fused else "log_decay"
    beta_mode = "given"
    if options.get("use_beta_sigmoid_in_kernel"):
        beta_mode = "sigmoid_x2" if options.get("allow_neg_eigval") else "sigmoid"
    return (
        t["q"],
        t["k"],
        t["v"],
        t["g"],
        t["beta"],
        side["A_log"],
        side["dt_bias"],
        side["initial_state"],
        options.get("cu_seqlens"),
        float(case.K**-0.5),
        case.state_v_first,
        bool(options.get("use_qk_l2norm_in_kernel")),
        gate,
        float(options.get("lower_bound") or -5.0),
        beta_mode,
        case.gate_width,
        True,
        keep_chunk_states,
    )


_OP_CASES = [
    Case(B=2, T=70, H=1, HV=2, K=16, V=8, regime="unbounded", **KIMI),
    *(
        Case(T=90, cu_seqlens=[0, 20, 20, 90], H=1, HV=1, K=8, V=16, regime="strong", **g, state_v_first=True)
        for g in (LOWER_BOUND, {})
    ),
    Case(T=33, K=8, V=8, regime="mild", initial_state=False),
]


@pytest.mark.parametrize("path", ("chunk", "chunk_bf16", "recurrent", "reference"))
@pytest.mark.parametrize("family, case", family_cases(_OP_CASES))
def test_opcheck_forward(family, case, path):
    dtype = torch.float64 if path == "reference" else None
    for keep in (False, True):
        torch.library.opcheck(_ops.PATHS[path].forward_op, _op_args(case, True, keep, dtype))


@pytest.mark.parametrize("path", ("chunk", "chunk_bf16", "recurrent", "reference"))
@pytest.mark.parametrize("family, case", family_cases(_OP_CASES))
def test_opcheck_backward(family, case, path):
    dtype = torch.float64 if path == "reference" else None
    args = _op_args(case, False, True, dtype)
    o, final, chunks = _ops.PATHS[path].forward_op(*args)
    d_o = torch.randn_like(o)
    d_final = torch.randn_like(final)
    q, k, v, g, beta, A_log, dt_bias, h0, cu = args[:9]
    bwd_args = (q, k, v, g, beta, A_log, dt_bias, h0, cu, chunks, d_o, d_final, *args[9:-2], h0 is not None)
    torch.library.opcheck(_ops.PATHS[path].backward_op, bwd_args)
    no_chunks = bwd_args[:9] + (None,) + bwd_args[10:]  # the backward recomputes the chunk states
    torch.library.opcheck(_ops.PATHS[path].backward_op, no_chunks)


def test_ops_are_registered_under_the_package_namespace():
    assert _ops.NAMESPACE == "kda"
    for path in ("chunk", "chunk_bf16", "recurrent", "reference"):
        for kind in ("fwd", "bwd"):
            assert hasattr(getattr(torch.ops.kda, f"{path}_{kind}"), "default")


class _OpLog(TorchDispatchMode):
    """Records every kda op the dispatcher runs, with its arguments."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == _ops.NAMESPACE:
            self.calls.append((func.__name__.split(".")[0], args))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("family, case", family_cases([Case(T=100, regime="unbounded", **KIMI)]))
def test_forward_keeps_chunk_states_only_for_a_gradient(family, case):
    tensors, options = make_inputs(case)
    with _OpLog() as log, torch.no_grad():
        run(family.chunk_function, tensors, options, requires_grad=True)
    with _OpLog() as log_grad:
        o, final, _ = run(family.chunk_function, tensors, options, requires_grad=True)
        (o.sum() + final.sum()).backward()
    assert [c[0] for c in log.calls] == ["chunk_fwd"] and log.calls[0][1][-1] is False
    assert [c[0] for c in log_grad.calls] == ["chunk_fwd", "chunk_bwd"] and log_grad.calls[0][1][-1] is True


def _loss(function, tensors, options):
    o, final = getattr(kda, function)(**tensors, output_final_state=True, **options)
    return (o * o).sum() + final.sum()


@pytest.mark.parametrize("kind", ("chunk", "recurrent"))
@pytest.mark.parametrize(
    "family, case, lengths, backend",
    family_cases(  # (a case at its first length, the lengths, the backend: "dynamo" alone or "aot_eager")
        [
            (Case(T=70, regime="unbounded", **KIMI, K=16, V=16), (70, 100, 131), "aot_eager"),
            (Case(T=70, regime="mild", K=16, V=16), (70, 100, 131), "aot_eager"),
            # (aot_eager's trace from T <= 64 holds only up to 64: a recompilation past it)
            (Case(T=40, H=1, HV=2, regime="unbounded", **KIMI, K=16, V=16), (40, 77), "dynamo"),
        ]
    ),
)
def test_compile_fullgraph_dynamic_sequence_length(family, case, lengths, backend, kind):
    function = function_of(family, kind)
    torch._dynamo.reset()  # (every case compiles the same lambda: no recompilation limit across them)
    if backend == "dynamo":
        counter = torch._dynamo.testing.CompileCounter()
    else:
        counter = torch._dynamo.testing.CompileCounterWithBackend(backend)
    compiled = torch.compile(
        lambda t, o: _loss(function, t, o), backend=counter, fullgraph=True, dynamic=True
    )
    for T in lengths:
        tensors, options = make_inputs(dataclasses.replace(case, T=T))
        eager = {n: t.clone().requires_grad_() for n, t in tensors.items()}
        traced = {n: t.clone().requires_grad_() for n, t in tensors.items()}
        loss_eager = _loss(function, eager, options)
        loss_eager.backward()
        loss_compiled = compiled(traced, options)
        loss_compiled.backward()
        assert torch.equal(loss_eager, loss_compiled)
        for n in tensors:
            assert torch.equal(eager[n].grad, traced[n].grad), n
    assert counter.frame_count == 1  # one graph for every length


def test_compile_inductor_varlen():
    """The inductor backend, varlen (a data-dependent chunk count in the fake implementation)."""
    case = Case(T=90, cu_seqlens=[0, 30, 90], regime="unbounded", **KIMI, K=16, V=16)
    tensors, options = make_inputs(case)
    compiled = torch.compile(lambda t, o: _loss("chunk_kda", t, o), fullgraph=True)
    eager = {n: t.clone().requires_grad_() for n, t in tensors.items()}
    traced = {n: t.clone().requires_grad_() for n, t in tensors.items()}
    loss_eager = _loss("chunk_kda", eager, options)
    loss_eager.backward()
    loss_compiled = compiled(traced, options)
    loss_compiled.backward()
    assert rel_rms(loss_compiled, loss_eager) <= 1e-6
    for n in tensors:
        assert rel_rms(traced[n].grad, eager[n].grad) <= 1e-5, n


@pytest.mark.parametrize("kind", ("chunk", "recurrent"))
@pytest.mark.parametrize(
    "family, case",
    family_cases(
        [
            Case(T=9, H=1, HV=2, K=3, V=2, regime="unbounded", **KIMI),
            Case(T=6, H=1, HV=2, K=4, V=3, regime="unbounded", **KIMI),
            Case(T=7, K=2, V=3, regime="strong", **LOWER_BOUND, state_v_first=True),
            Case(T=6, cu_seqlens=[0, 2, 6], K=2, V=2, regime="mild"),
            Case(T=7, cu_seqlens=[0, 3, 7], H=1, HV=1, K=3, V=4, regime="spike", state_v_first=True),
            Case(T=5, K=3, V=2, regime="spike"),
        ]
    ),
)
def test_gradcheck_float64(family, case, kind):
    """Float64 inputs run kda's float64 oracle through the same ops and autograd wiring as the kernels,
    so torch.autograd.gradcheck checks every gradient the layer routes: raw gate (A_log, dt_bias), beta
    logits, raw q/k under the L2 norm, the initial state."""
    tensors, options = as_oracle(*make_inputs(case))
    names = ["q", "k", "v", "g", "beta"] + [n for n in ("A_log", "dt_bias", "initial_state") if n in options]
    inputs = tuple((tensors[n] if n in tensors else options[n]).clone().requires_grad_() for n in names)

    def fn(*xs):
        t = dict(zip(names, xs, strict=True))
        opts = dict(options, **{n: t.pop(n) for n in ("A_log", "dt_bias", "initial_state") if n in t})
        return getattr(kda, function_of(family, kind))(**t, output_final_state=True, **opts)

    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-7, rtol=1e-5)
