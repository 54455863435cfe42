"""kda as a drop-in for flash-linear-attention's KDA functions, on built-in inputs.

    python examples/drop_in.py

1. Parity: chunk_kda (forward and every gradient) and fused_recurrent_kda against kda's float64
   oracle, with Kimi-Linear-48B's options (the unbounded softplus gate fused in, sigmoid beta, q/k L2
   norm, a V-first state).
2. Prefill then decode: chunk_kda over a prompt, then fused_recurrent_kda token by token from its
   final state, against one chunk_kda call over the whole sequence.
3. Speed next to what Kimi Linear runs without kda on the CPU: transformers' torch fallback.
"""

import sys
import time

sys.modules["fla"] = None  # transformers' Kimi Linear then uses its torch fallbacks, the CPU peer

import kda  # noqa: E402
import torch  # noqa: E402


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm()).item()


def inputs(T, H, K, V, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return dict(
        q=torch.randn(1, T, H, K, generator=gen, dtype=dtype),
        k=torch.randn(1, T, H, K, generator=gen, dtype=dtype),
        v=torch.randn(1, T, H, V, generator=gen, dtype=dtype),
        g=torch.randn(1, T, H, K, generator=gen, dtype=dtype) * 2,  # raw gate input
        beta=torch.randn(1, T, H, generator=gen, dtype=dtype),  # logits
    ), dict(
        A_log=torch.log(8 + 24 * torch.rand(H, generator=gen)),  # exp(A_log) 8..32: decays to -1000
        dt_bias=torch.randn(H * K, generator=gen) * 0.5,
        initial_state=torch.randn(1, H, V, K, generator=gen) * 0.1,
    )


KIMI = dict(
    use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, use_qk_l2norm_in_kernel=True, state_v_first=True
)


def parity():
    t, side = inputs(T=300, H=4, K=64, V=64)
    leaves = {n: x.clone().requires_grad_() for n, x in {**t, **side}.items()}
    leaves64 = {n: x.detach().double().requires_grad_() for n, x in {**t, **side}.items()}
    for function in ("chunk_kda", "fused_recurrent_kda"):
        o, s = getattr(kda, function)(**leaves, output_final_state=True, **KIMI)
        o64, s64 = getattr(kda, function)(**leaves64, output_final_state=True, **KIMI)  # the float64 oracle
        w = torch.randn(o.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        ((o.double() * w).sum() + s.double().sum()).backward()
        ((o64 * w).sum() + s64.sum()).backward()
        worst = max((rel(leaves[n].grad, leaves64[n].grad), n) for n in leaves)
        print(
            f"  {function:<20} o {rel(o, o64):.1e}  final state {rel(s, s64):.1e}  "
            f"worst gradient {worst[0]:.1e} ({worst[1]})"
        )
        for x in (*leaves.values(), *leaves64.values()):
            x.grad = None


def prefill_then_decode():
    prompt, new = 200, 24
    t, side = inputs(T=prompt + new, H=8, K=128, V=128, seed=2)
    with torch.inference_mode():
        o_all, s_all = kda.chunk_kda(**t, output_final_state=True, **KIMI, **side)
        first = {n: x[:, :prompt] for n, x in t.items()}
        o, state = kda.chunk_kda(**first, output_final_state=True, **KIMI, **side)
        outs = [o]
        t0 = time.perf_counter()
        for i in range(prompt, prompt + new):
            step = {n: x[:, i : i + 1] for n, x in t.items()}
            o, state = kda.fused_recurrent_kda(
                **step,
                A_log=side["A_log"],
                dt_bias=side["dt_bias"],
                initial_state=state,
                output_final_state=True,
                **KIMI,
            )
            outs.append(o)
        per_token = (time.perf_counter() - t0) / new
    o_steps = torch.cat(outs, dim=1)
    print(
        f"  {prompt} prompt tokens with chunk_kda, then {new} decode steps with fused_recurrent_kda "
        f"({per_token * 1e6:.0f} us per step, H=8 K=V=128):"
    )
    print(
        f"  against one chunk_kda call over all {prompt + new} tokens: o {rel(o_steps, o_all):.1e}, "
        f"final state {rel(state, s_all):.1e}"
    )


def speed(T=1024, H=16, K=128, V=128):
    t, side = inputs(T, H, K, V, seed=3)
    # transformers' Kimi layer computes the gate, beta and norm itself and passes g and beta as is.
    g = kda.fused_kda_gate(t["g"], side["A_log"], side["dt_bias"])
    plain = dict(t, g=g, beta=torch.sigmoid(t["beta"]))

    def timed(fn, reps=3):
        fn()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return sorted(times)[len(times) // 2]

    with torch.no_grad():
        ours = timed(lambda: kda.chunk_kda(**plain, output_final_state=True, use_qk_l2norm_in_kernel=True))
        print(
            "  (this example hides flash-linear-attention from transformers on purpose, so that its Kimi "
            "Linear takes the torch fallback, the CPU peer: a warning that fla is not installed may follow)"
        )
        try:
            from transformers.models.kimi_linear import modeling_kimi_linear as kimi
        except ImportError:
            print(
                f"  kda chunk_kda forward, T={T} H={H} K=V={K}: {ours * 1e3:.0f} ms "
                "(transformers not installed)"
            )
            return
        theirs = timed(
            lambda: kimi.chunk_kimi_delta_attention(
                plain["q"],
                plain["k"],
                plain["v"],
                plain["g"],
                plain["beta"],
                output_final_state=True,
                use_qk_l2norm_in_kernel=True,
            ),
            reps=1,
        )
        o, _ = kda.chunk_kda(**plain, output_final_state=True, use_qk_l2norm_in_kernel=True)
        o_ref, _ = kimi.chunk_kimi_delta_attention(
            plain["q"],
            plain["k"],
            plain["v"],
            plain["g"],
            plain["beta"],
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )
    print(
        f"  forward, B=1 T={T} H={H} K=V={K} fp32, {torch.get_num_threads()} threads: kda chunk_kda "
        f"{ours * 1e3:.0f} ms, transformers' torch chunk_kimi_delta_attention {theirs * 1e3:.0f} ms: "
        f"{theirs / ours:.0f}x (outputs agree to {rel(o, o_ref):.1e})"
    )


def main():
    print(
        f"kda {kda.__version__}: flash-linear-attention's chunk_kda / fused_recurrent_kda on the CPU "
        f"(SIMD target {kda.simd_target()})\n"
    )
    print("1. parity with the float64 oracle (relative RMS), Kimi-Linear-48B options, T=300 H=4 K=V=64:")
    parity()
    print("\n2. prefill, then decode from the cached state:")
    prefill_then_decode()
    print("\n3. speed:")
    speed()


if __name__ == "__main__":
    main()
