"""kda.engine, the binding itself: any DLPack / buffer-protocol array (NumPy here), caller-allocated
outputs written in place, and errors that name the argument, raised before anything is written. A
call's problem is validated once, by engine.prepare(); every engine function takes its result."""

import kda
import numpy as np
import pytest
import torch
from harness import Case, as_oracle, make_inputs, rel_rms, tolerance
from kda import engine


def _numpy_call(case=None):
    case = case or Case(B=2, T=40, H=2, HV=2, K=16, V=8, regime="mild")
    tensors, options = make_inputs(case)
    arrays = {n: t.float().numpy() for n, t in tensors.items()}
    h0 = options["initial_state"].numpy()
    o = np.zeros(arrays["v"].shape, np.float32)
    final = np.zeros(h0.shape, np.float32)
    return tensors, options, arrays, h0, o, final


def _run(function, a, o, problem=None, **kw):
    """One engine call on the arrays `a` (q, k, v, g, beta by name): its problem prepared from q, v and
    the `problem` options, then the function."""
    q, k, v, g, beta = (a[n] for n in ("q", "k", "v", "g", "beta"))
    return function(engine.prepare(q, v, **(problem or {})), q, k, v, g, beta, o, **kw)


def test_numpy_arrays_give_the_torch_layer_results():
    tensors, options, a, h0, o, final = _numpy_call()
    _run(
        engine.chunk_forward,
        a,
        o,
        initial_state=h0,
        final_state=final,
    )
    with torch.no_grad():
        o_t, final_t = kda.chunk_kda(**tensors, output_final_state=True, **options)
    assert np.array_equal(o, o_t.numpy()) and np.array_equal(final, final_t.numpy())
    assert isinstance(kda.simd_target(), str) and kda.CHUNK_SIZE == 64 and kda.MAX_HEAD_DIM == 256
    assert kda.simd_target() in kda.simd_targets()


def test_read_only_inputs_are_accepted():
    _, _, a, h0, o, final = _numpy_call()
    for x in (*a.values(), h0):
        x.setflags(write=False)
    _run(
        engine.recurrent_forward,
        a,
        o,
        initial_state=h0,
        final_state=final,
    )
    assert np.isfinite(o).all() and np.abs(o).sum() > 0


def test_prepared_problem_shapes():
    q, v = np.zeros((2, 130, 1, 16), np.float32), np.zeros((2, 130, 3, 8), np.float32)
    p = engine.prepare(q, v)
    assert (p.num_sequences, p.num_chunks, p.state_shape, p.gate_dim) == (2, 6, (3, 16, 8), 16)
    assert engine.prepare(q, v, state_v_first=True).state_shape == (3, 8, 16)
    assert engine.prepare(q, v, gate_width="per_head").gate_dim == 1
    q1, v1 = q[:1], v[:1]
    p = engine.prepare(q1, v1, np.array([0, 1, 1, 65, 130]))
    assert (p.num_sequences, p.num_chunks) == (4, 1 + 0 + 1 + 2)
    assert engine.prepare(q1, v1, torch.tensor([0, 65, 130], dtype=torch.int32)).num_chunks == 4
    with pytest.raises(ValueError, match="'cu_seqlens'"):
        engine.prepare(q1, v1, np.array([0, 65, 129]))
    with pytest.raises(ValueError, match="'gate_width': expected 'per_key'"):
        engine.prepare(q, v, gate_width="per_token")


def test_one_validation_per_call_and_the_route():
    _, _, a, h0, o, final = _numpy_call()
    before = engine.validation_count()
    _run(
        engine.chunk_forward,
        a,
        o,
        initial_state=h0,
        final_state=final,
    )
    assert engine.validation_count() - before == 1
    p = engine.prepare(a["q"], a["v"])
    kernel, backend, reason = p.route("chunk_forward")
    assert (kernel, backend) == ("recurrent forward", "cpu") and reason
    assert p.route("chunk_backward", True)[0] == "chunked backward"
    with pytest.raises(ValueError, match="'entry'"):
        p.route("sideways")


def test_a_per_head_gate_runs_as_the_per_key_gate_repeated():
    _, _, a, h0, o, final = _numpy_call()
    g3 = np.ascontiguousarray(a["g"][..., 0])  # [B, T, HV]: one log decay per head
    wide = np.ascontiguousarray(np.repeat(g3[..., None], a["g"].shape[-1], axis=-1))
    for function in (engine.chunk_forward, engine.recurrent_forward):
        o[...] = 7.0
        _run(function, {**a, "g": g3}, o, problem=dict(gate_width="per_head"))
        head = o.copy()
        _run(function, {**a, "g": wide}, o)
        np.testing.assert_allclose(head, o, rtol=1e-5, atol=1e-6)
    o[...] = 7.0
    with pytest.raises(ValueError, match="'g': expected a 3-D"):
        _run(
            engine.chunk_forward,
            a,
            o,
            problem=dict(gate_width="per_head"),
        )


def test_binding_errors_name_the_argument_and_write_nothing():
    _, _, a, h0, o, final = _numpy_call()
    q, k, v, g, beta = (a[n] for n in ("q", "k", "v", "g", "beta"))
    sentinel = np.full_like(o, 7.0)

    def call(**over):
        args = dict(a, o=o)
        kw = dict(initial_state=h0, final_state=final)
        for name, value in over.items():
            (args if name in args else kw)[name] = value
        o[...] = 7.0
        _run(engine.chunk_forward, args, args["o"], **kw)

    cases = [
        (TypeError, "'q': expected dtype float32 or bfloat16, got float64", dict(q=q.astype(np.float64))),
        (TypeError, "'v': expected dtype float32 or bfloat16, got float16", dict(v=v.astype(np.float16))),
        (ValueError, "'k': the last dimension must be contiguous", dict(k=np.repeat(k, 2, axis=3)[..., ::2])),
        (ValueError, "'g': expected B = 2 and T = 40", dict(g=g[:, :39])),
        (ValueError, "'beta': expected a 3-D", dict(beta=beta[..., None])),
        (ValueError, "'o': expected B = 2", dict(o=np.zeros((1, 40, 2, 8), np.float32))),
        (ValueError, "'initial_state': expected shape \\[2, 2, 16, 8\\]", dict(initial_state=h0[:, :, :8])),
        (TypeError, "'final_state': expected dtype float32", dict(final_state=final.astype(np.float64))),
        (
            ValueError,
            "'final_state': expected a contiguous array",
            dict(final_state=np.asfortranarray(final)),
        ),
        (ValueError, "'o': shares memory with 'v'", dict(o=v)),
        (
            ValueError,
            "'value_heads': expected a multiple of heads",
            dict(v=np.zeros((2, 40, 3, 8), np.float32)),
        ),
    ]
    for error, message, over in cases:
        with pytest.raises(error, match=message):
            call(**over)
        if over.get("o") is None:
            assert np.array_equal(o, sentinel), message  # nothing written
    with pytest.raises(ValueError, match="'o': expected dtype f32"):
        _run(
            engine.chunk_forward,
            {n: torch.from_numpy(x) for n, x in a.items()},
            torch.zeros(o.shape, dtype=torch.bfloat16),
        )
    with pytest.raises(ValueError, match="'gate': expected 'log_decay'"):
        _run(engine.chunk_forward, a, o, problem=dict(gate="softplus_x"))
    with pytest.raises(ValueError, match="'A_log': required by the fused gate"):
        _run(engine.chunk_forward, a, o, problem=dict(gate="softplus"))
    with pytest.raises(ValueError, match="'num_threads'"):
        _run(engine.chunk_forward, a, o, num_threads=-1)
    # A tensor DLPack cannot export (the meta device has no data) is refused by nanobind's conversion.
    with pytest.raises(TypeError, match="incompatible function arguments"):
        engine.chunk_forward(engine.prepare(q, v), torch.zeros(q.shape, device="meta"), k, v, g, beta, o)


def test_oracle_binding_needs_float64():
    _, _, a, h0, o, final = _numpy_call()
    with pytest.raises(TypeError, match="'q': expected dtype float64"):
        _run(engine.reference_forward, a, o.astype(np.float64))
    a64 = {n: x.astype(np.float64) for n, x in a.items()}
    o64 = np.zeros(o.shape)
    _run(engine.reference_forward, a64, o64)
    _run(engine.chunk_forward, a, o)
    assert np.abs(o64 - o).max() <= 1e-5 * np.abs(o64).max()


def test_pooled_prefill_flags_are_one_per_sequence():
    _, _, a, h0, o, final = _numpy_call()  # B = 2 sequences
    pool = np.zeros((4, *h0.shape[1:]), np.float32)
    slots = np.array([3, 1])
    o[...] = 7.0
    for flags in (np.array([True]), np.array([True, False, True])):
        with pytest.raises(ValueError, match="'has_initial_state': expected 2 flags"):
            _run(engine.chunk_forward, a, o, pool=pool, pool_indices=slots, has_initial_state=flags)
    assert (o == 7.0).all() and not pool.any()
    _run(engine.chunk_forward, a, o, pool=pool, pool_indices=slots, has_initial_state=np.array([True, False]))
    assert pool[3].any() and pool[1].any() and not pool[0].any()


def test_segment_transition_readout_is_the_adjoint():
    """The readout R [L, HV, K] of a varlen batch's last sequence (L from cu_seqlens): sum_t R_t dO_t^T
    is the float64 oracle's gradient of the state entering that sequence; a readout of another shape
    is refused, naming it, before anything is written."""
    case = Case(
        T=150, cu_seqlens=[0, 40, 150], H=1, HV=2, K=16, V=8, regime="spike", initial_state=True, seed=7
    )
    tensors, options = make_inputs(case)
    q, k, v, g, beta = (tensors[n].numpy() for n in ("q", "k", "v", "g", "beta"))
    p = engine.prepare(q, v, options["cu_seqlens"].numpy())
    M, S = np.zeros((2, 16, 16), np.float32), np.zeros((2, 16, 8), np.float32)
    wrong = np.full((150, 2, 16), 7.0, np.float32)
    with pytest.raises(ValueError, match=r"'readout': expected shape \[110, 2, 16\]"):
        engine.segment_transition(p, q, k, v, g, beta, 1, M, S, readout=wrong)
    assert (wrong == 7.0).all() and not M.any() and not S.any()
    R = np.zeros((110, 2, 16), np.float32)
    engine.segment_transition(p, q, k, v, g, beta, 1, M, S, readout=R)

    t64, o64 = as_oracle(tensors, options)
    h0 = o64.pop("initial_state").requires_grad_()
    o, _ = kda.chunk_kda(**t64, initial_state=h0, **o64)
    d_o = torch.randn(o.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    (o * d_o).sum().backward()
    got = torch.einsum("thk,thv->hkv", torch.from_numpy(R).double(), d_o[0, 40:])
    assert rel_rms(got, h0.grad[1]) <= tolerance("forward", torch.float32, "state")


def test_workers_run_on_torchs_openmp_threads_and_a_forked_child_still_computes():
    """The extension's workers are torch's OpenMP threads (one libgomp in the process); GNU OpenMP
    does not survive a fork, so a child forked after kda ran uses kda's own threads: it must finish,
    with the parent's bits."""
    import os
    import time

    extension = kda._engine.__file__
    with open(extension, "rb") as f:
        assert b"libgomp.so.1" in f.read(), "the extension is built without GNU OpenMP"
    libraries = {line.split()[-1] for line in open("/proc/self/maps") if "gomp" in line or "libomp" in line}
    assert len(libraries) == 1, libraries
    tensors, options = make_inputs(Case(B=1, T=300, H=2, HV=2, K=32, V=32, regime="strong"))
    with torch.no_grad():
        torch.mm(torch.randn(256, 256), torch.randn(256, 256))  # torch's OpenMP threads started
        o, _ = kda.chunk_kda(**tensors, **options)
        pid = os.fork()
        if pid == 0:  # the child: exit status 0 only with the same bits
            try:
                o_child, _ = kda.chunk_kda(**tensors, **options)
                os._exit(0 if torch.equal(o_child, o) else 1)
            except BaseException:
                os._exit(2)
    deadline = time.monotonic() + 120
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the forked child's kda call did not finish in 120 s")
        time.sleep(0.05)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
