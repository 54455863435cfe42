"""Where a bf16 vLLM engine's log-probabilities drift with batch composition (mixed prefill/decode steps).

Two tiny random checkpoints, written to a temporary folder:
  - Kimi Linear (tests/vllm/tiny_kimi.py; its KDA layers served by kda through the kda.vllm plugin);
  - Qwen3-Next (vLLM's native CPU Gated DeltaNet kernels; they take bf16 and head dim 128 only).
For each model and engine dtype, a 4-token and a 64-token prompt are served
  - solo: each alone in a fresh engine;
  - mixed: four other requests are submitted, and after three engine steps the two prompts join one
    step after the other, so that their prefills share steps with the others' decode rows;
and every generated token's log-probability is compared: solo against mixed, and each against
transformers' float32 model, teacher-forced on the same tokens; transformers' own bf16 model against
its float32 model on the same tokens gives the size of bf16 rounding alone.

Localization: forward hooks on every module of the model inside the engine record, for the step that
prefills the prompt, the module's input and output at the prompt's rows (found from the step's
``input_ids`` and ``positions``). The first module, in execution order, whose rows differ between the
solo and the mixed run is printed, with the largest difference there. A check of kda alone follows:
the same random KDA inputs of one request, alone and packed with other requests' rows, through
``kda.chunk_kda`` (prefill with decode rows, as in a mixed step) and ``kda.fused_recurrent_kda_fwd``
(decode rows) on a pool: the request's output and state must be bitwise equal; and a 4-token request
alone vs next to a 16- and a 17-token prefill (kda chooses its kernel per call from the longest
sequence: a 1-ulp state difference there is kda's).

    .venv-vllm/bin/python bench/vllm_batch_drift.py                 # all (about 10 minutes on 2 cores)
    .venv-vllm/bin/python bench/vllm_batch_drift.py --models kimi --dtypes bfloat16 --modules 12

Each (model, dtype, scenario) engine runs in its own process (``--run``; in-process engine core,
VLLM_ENABLE_V1_MULTIPROCESSING=0, so that the hooks run where the model runs); the reference runs in
another process, as vLLM registers its own Kimi Linear config class with transformers.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "vllm"))

import tiny_kimi  # noqa: E402

ENV = {
    **os.environ,
    "HF_HUB_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "TOKENIZERS_PARALLELISM": "false",
}

OTHERS = [
    "the cat sat on the mat and then it ran to the park",
    "a red fish saw two birds under the sea",
    "one two three four five six seven",
    "the dog ran over the small green house",
]
MAX_TOKENS = 8


def prompts():
    """The two prompts: 4 and 64 words (one token each), words no other prompt starts with."""
    words = tiny_kimi.WORDS
    long = " ".join(words[(7 * i + 3) % len(words)] for i in range(64))
    return {"p4": "hello world is big", "p64": long}


def qwen_config():
    return {
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        "vocab_size": tiny_kimi.VOCAB,
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32,
        "num_hidden_layers": 4,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "head_dim": 128,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 2,
        "linear_key_head_dim": 128,  # vLLM's CPU GDN kernels: head dim 128 only
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [0],
        "norm_topk_prob": True,
        "layer_types": ["linear_attention", "linear_attention", "full_attention", "linear_attention"],
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }


def write_qwen(path, seed=0):
    """A random Qwen3-Next checkpoint with weights of the scale tiny_kimi uses (far-from-flat logits)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(qwen_config(), f, indent=1)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=torch.float32)
    # Qwen3-Next's RMSNorm scales by 1 + weight (its gated norm by weight): ~1 either way
    tiny_kimi.far_from_flat(model, norm_center=lambda name: 1.0 if "linear_attn.norm" in name else 0.0)
    model.save_pretrained(path)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(qwen_config(), f, indent=1)
    tiny_kimi.write_tokenizer(path)
    return path


# ---------------------------------------------------------------------------------------------------
# In the engine process


class Recorder:
    """Forward hooks on every module: inputs and outputs at the rows of the step that prefills
    ``target`` (token ids at positions 0..len-1), the first such step only."""

    def __init__(self, model, targets):
        import torch

        self.torch = torch
        self.targets = targets  # name -> prompt ids
        self.rows = None  # (name, index tensor) while a target's prefill step runs
        self.total = 0
        self.records = {name: {} for name in targets}
        self.order = {name: [] for name in targets}
        model.register_forward_pre_hook(self._top, with_kwargs=True)
        for name, module in model.named_modules():
            if name:
                module.register_forward_pre_hook(self._pre(name), with_kwargs=True)
                module.register_forward_hook(self._post(name))

    def _top(self, module, args, kwargs):
        torch = self.torch
        ids = kwargs.get("input_ids", args[0] if args else None)
        pos = kwargs.get("positions", args[1] if len(args) > 1 else None)
        self.rows = None
        if ids is None or pos is None:
            return
        self.total = ids.shape[0]
        for name, target in self.targets.items():
            if self.records[name]:
                continue
            n = len(target)
            starts = (pos == 0).nonzero().view(-1).tolist()
            for s in starts:
                if s + n <= ids.shape[0] and ids[s : s + n].tolist() == target:
                    if pos[s : s + n].tolist() == list(range(n)):
                        self.rows = (name, torch.arange(s, s + n))
                        break
            if self.rows is not None:
                break

    def _take(self, x):
        torch = self.torch
        if isinstance(x, (tuple, list)):
            x = next((t for t in x if isinstance(t, torch.Tensor)), None)
        if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() == 0:
            return None
        idx = self.rows[1]
        if x.shape[0] == self.total:
            return x.detach()[idx].float().clone()
        if x.dim() > 1 and x.shape[0] == 1 and x.shape[1] == self.total:
            return x.detach()[0, idx].float().clone()
        return None

    def _store(self, key, value):
        if value is None:
            return
        name = self.rows[0]
        rec = self.records[name]
        if key in rec:  # a module called twice in one step: number the calls
            i = 2
            while f"{key}#{i}" in rec:
                i += 1
            key = f"{key}#{i}"
        rec[key] = value
        self.order[name].append(key)

    def _pre(self, mod):
        def hook(module, args, kwargs):
            if self.rows is not None:
                self._store(f"{mod} [in]", self._take(args[0] if args else next(iter(kwargs.values()), None)))

        return hook

    def _post(self, mod):
        def hook(module, args, output):
            if self.rows is not None:
                self._store(f"{mod} [out]", self._take(output))

        return hook


def run_engine(checkpoint, dtype, scenario, save):
    """One engine scenario; returns {prompt name: {"ids", "logprobs"}} and saves the module records."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import torch
    from vllm import LLM, SamplingParams

    try:
        import kda.vllm

        kda.vllm.register()
    except ImportError:
        pass
    llm = LLM(
        checkpoint,
        dtype=dtype,
        enforce_eager=True,
        enable_prefix_caching=False,
        max_model_len=256,
        max_num_seqs=8,
        max_num_batched_tokens=512,
        seed=0,
    )
    tok = llm.get_tokenizer()
    named = prompts()
    targets = {k: tok(p, add_special_tokens=False)["input_ids"] for k, p in named.items()}
    if scenario in named:
        targets = {scenario: targets[scenario]}
    recorders = llm.apply_model(lambda model: Recorder(model, targets))
    recorder = recorders[0]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, logprobs=0, ignore_eos=True)
    engine = llm.llm_engine
    names = []
    if scenario in named:
        later = []
        engine.add_request(scenario, named[scenario], params)
        names.append(scenario)
    else:
        for i, p in enumerate(OTHERS):
            engine.add_request(f"o{i}", p, params)
        later = list(named.items())
    finished, steps = {}, 0
    while engine.has_unfinished_requests() or later:
        if later and steps >= 3:
            name, p = later.pop(0)
            engine.add_request(name, p, params)
            names.append(name)
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        steps += 1
    results = {}
    for name in names:
        out = finished[name]
        c = out.outputs[0]
        results[name] = {
            "ids": list(out.prompt_token_ids) + list(c.token_ids),
            "logprobs": [d[t].logprob for d, t in zip(c.logprobs, c.token_ids, strict=True)],
        }
    torch.save({"records": recorder.records, "order": recorder.order}, save)
    return results


def run_reference(checkpoint, sequences):
    """transformers' log-probability of each token after the first (teacher forcing), per dtype:
    {"float32": {name: [...]}, "bfloat16": {...}} (bf16: transformers' own bf16 noise)."""
    import torch
    from transformers import AutoModelForCausalLM

    out = {}
    for dtype in ("float32", "bfloat16"):
        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=getattr(torch, dtype)).eval()
        out[dtype] = {}
        with torch.no_grad():
            for name, ids in sequences.items():
                logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)[:-1]
                out[dtype][name] = logp.gather(1, torch.tensor(ids[1:]).view(-1, 1)).view(-1).tolist()
    return out


def kda_isolation():
    """One request's KDA rows alone and packed with others' rows, bf16, through kda on a pool: the
    largest difference of its output and of its final state (0 when kda is batch-invariant)."""
    import kda
    import torch

    torch.manual_seed(0)
    report = {}
    for H, D in ((2, 32), (4, 128)):
        A_log = torch.rand(H).mul(3).add(0.5).log()
        dt_bias = torch.randn(H * D) * 0.5
        options = dict(
            A_log=A_log,
            dt_bias=dt_bias,
            use_gate_in_kernel=True,
            use_beta_sigmoid_in_kernel=True,
            use_qk_l2norm_in_kernel=True,
            state_v_first=True,
        )

        def inputs(T, H=H, D=D):
            q, k, v, g = (torch.randn(1, T, H, D).to(torch.bfloat16) for _ in range(4))
            return q, k, v, g, torch.randn(1, T, H).to(torch.bfloat16)

        slots = 16
        base_pool = torch.randn(slots, H, D, D) * 0.1
        for L in (4, 64):
            target = inputs(L)
            others = [inputs(1) for _ in range(4)] + [inputs(37)]
            for pool_dtype in (torch.float32, torch.bfloat16):
                # solo: the target alone, slot 9, fresh
                pool = base_pool.to(pool_dtype).clone()
                o_solo, _ = kda.chunk_kda(
                    *target,
                    initial_state=pool,
                    cu_seqlens=torch.tensor([0, L], dtype=torch.int32),
                    ssm_state_indices=torch.tensor([9], dtype=torch.int32),
                    has_initial_state=torch.tensor([False]),
                    **options,
                )
                s_solo = pool[9].clone()
                # packed: four decode rows (slots 1-4, with state), the target, another prefill (slot 5)
                seqs = others[:4] + [target] + others[4:]
                lens = [s[0].shape[1] for s in seqs]
                cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
                packed = [torch.cat([s[i] for s in seqs], dim=1) for i in range(5)]
                pool = base_pool.to(pool_dtype).clone()
                o_mix, _ = kda.chunk_kda(
                    *packed,
                    initial_state=pool,
                    cu_seqlens=cu,
                    ssm_state_indices=torch.tensor([1, 2, 3, 4, 9, 5], dtype=torch.int32),
                    has_initial_state=torch.tensor([True, True, True, True, False, False]),
                    **options,
                )
                t0 = int(cu[4])
                key = f"chunk_kda H={H} D={D} L={L} pool={str(pool_dtype)[6:]}"
                report[key] = (
                    (o_mix[:, t0 : t0 + L].float() - o_solo.float()).abs().max().item(),
                    (pool[9].float() - s_solo.float()).abs().max().item(),
                )
            # decode rows: the target's slot stepped alone and with four other rows
            q, k, v, g, b = (t[:, :1] for t in target)
            row = [t.transpose(0, 1) for t in (q, k, v, g)] + [b.transpose(0, 1)]
            pool = base_pool.clone()
            o_solo, _ = kda.fused_recurrent_kda_fwd(
                *row, initial_state=pool, ssm_state_indices=torch.tensor([9], dtype=torch.int32), **options
            )
            s_solo = pool[9].clone()
            rows = [torch.cat([o[i][:, :1].transpose(0, 1) for o in others[:2]] + [row[i]]
                              + [o[i][:, :1].transpose(0, 1) for o in others[2:4]], dim=0)
                    for i in range(5)]  # fmt: skip
            pool = base_pool.clone()
            o_mix, _ = kda.fused_recurrent_kda_fwd(
                *rows,
                initial_state=pool,
                ssm_state_indices=torch.tensor([1, 2, 9, 3, 4], dtype=torch.int32),
                **options,
            )
            key = f"fused_recurrent_kda_fwd H={H} D={D} (decode row {L})"
            report[key] = (
                (o_mix[2].float() - o_solo[0].float()).abs().max().item(),
                (pool[9] - s_solo).abs().max().item(),
            )
        # kda picks its kernel per call from the call's longest sequence (<= 16 tokens: the decode
        # kernel, else the recurrent one): a short request's rows alone vs next to a 17-token prefill
        for other in (16, 17):
            t = [x.float() for x in inputs(4)]
            o_other = [x.float() for x in inputs(other)]
            outs = []
            for seqs in ([t], [t, o_other]):
                cu = torch.tensor([0] + list(torch.tensor([s[0].shape[1] for s in seqs]).cumsum(0)))
                pool = base_pool.clone()
                o, _ = kda.chunk_kda(
                    *[torch.cat([s[i] for s in seqs], dim=1) for i in range(5)],
                    initial_state=pool,
                    cu_seqlens=cu.to(torch.int32),
                    ssm_state_indices=torch.tensor([9, 5][: len(seqs)], dtype=torch.int32),
                    has_initial_state=torch.tensor([True, False][: len(seqs)]),
                    **options,
                )
                outs.append((o[:, :4], pool[9].clone()))
            key = f"chunk_kda H={H} D={D} L=4 float32, alone vs next to a {other}-token prefill"
            report[key] = (
                (outs[0][0] - outs[1][0]).abs().max().item(),
                (outs[0][1] - outs[1][1]).abs().max().item(),
            )
    return report


# ---------------------------------------------------------------------------------------------------
# The driver


def _sub(args, timeout=900):
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--run", json.dumps(args)],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=timeout,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{args} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def first_difference(solo, mixed, name, show):
    """The first module (execution order of the solo run) whose rows differ, and the first ``show``."""
    a, b = solo["records"][name], mixed["records"][name]
    found = []
    for key in solo["order"][name]:
        if key not in b or a[key].shape != b[key].shape:
            continue
        d = (a[key] - b[key]).abs().max().item()
        if d > 0:
            found.append((key, d))
            if len(found) >= max(show, 1):
                break
    return found


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", default="kimi,qwen")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--modules", type=int, default=4, help="differing modules listed per row")
    parser.add_argument("--dir", default=None, help="checkpoints and records here (default: a temp dir)")
    parser.add_argument("--reuse", action="store_true", help="reuse the engine runs found in --dir")
    parser.add_argument("--run", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run is not None:
        a = json.loads(args.run)
        if a["mode"] == "engine":
            result = run_engine(a["checkpoint"], a["dtype"], a["scenario"], a["save"])
        elif a["mode"] == "reference":
            result = run_reference(a["checkpoint"], a["sequences"])
        else:
            result = kda_isolation()
        print("RESULT " + json.dumps(result))
        return

    import torch

    work = args.dir or tempfile.mkdtemp(prefix="vllm-batch-drift-")
    os.makedirs(work, exist_ok=True)
    rows = []
    for model in args.models.split(","):
        path = os.path.join(work, model)
        if model == "kimi":
            tiny_kimi.write_checkpoint(path)
        elif not os.path.exists(os.path.join(path, "tokenizer.json")):
            write_qwen(path)
        for dtype in args.dtypes.split(","):
            if model == "qwen" and dtype != "bfloat16":
                continue  # vLLM's CPU GDN kernels take bf16 only
            runs, saves = {}, {}
            for scenario in ("p4", "p64", "mixed"):
                saves[scenario] = os.path.join(work, f"{model}-{dtype}-{scenario}.pt")
                cached = saves[scenario] + ".json"
                if args.reuse and os.path.exists(cached):
                    with open(cached) as f:
                        runs[scenario] = json.load(f)
                    continue
                runs[scenario] = _sub(
                    dict(mode="engine", checkpoint=path, dtype=dtype, scenario=scenario, save=saves[scenario])
                )
                with open(cached, "w") as f:
                    json.dump(runs[scenario], f)
                print(f"  ran {model} {dtype} {scenario}", file=sys.stderr, flush=True)
            sequences = {f"{s}/{n}": r["ids"] for s, run in runs.items() for n, r in run.items()}
            ref = _sub(dict(mode="reference", checkpoint=path, sequences=sequences))
            mixed_rec = torch.load(saves["mixed"])
            for name in ("p4", "p64"):
                solo, mixed = runs[name][name], runs["mixed"][name]
                same_ids = solo["ids"] == mixed["ids"]
                diff = max(abs(x - y) for x, y in zip(solo["logprobs"], mixed["logprobs"], strict=True))

                def err(run_name, r, ref=ref, name=name):
                    want = ref["float32"][f"{run_name}/{name}"][-len(r["logprobs"]) :]
                    return max(abs(x - y) for x, y in zip(r["logprobs"], want, strict=True))

                n = len(solo["logprobs"])
                tf32, tf16 = (ref[d][f"{name}/{name}"][-n:] for d in ("float32", "bfloat16"))
                tf_noise = max(abs(x - y) for x, y in zip(tf32, tf16, strict=True))

                found = first_difference(torch.load(saves[name]), mixed_rec, name, args.modules)
                rows.append(
                    dict(
                        model=model,
                        dtype=dtype,
                        prompt=name,
                        same_ids=same_ids,
                        solo_vs_mixed=diff,
                        solo_vs_ref=err(name, solo),
                        mixed_vs_ref=err("mixed", mixed),
                        tf_noise=tf_noise,
                        first=found,
                    )
                )
    print(f"checkpoints and records: {work}\n")
    print("| model | dtype | prompt | same tokens | solo vs mixed | solo vs fp32 ref | mixed vs fp32 ref "
          "| transformers bf16 vs fp32 | first modules that differ (solo vs mixed, max abs) |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        first = "; ".join(f"{k} {d:.2g}" for k, d in r["first"]) or "none (bitwise equal)"
        print(
            f"| {r['model']} | {r['dtype']} | {r['prompt']} | {r['same_ids']} | {r['solo_vs_mixed']:.2g} "
            f"| {r['solo_vs_ref']:.2g} | {r['mixed_vs_ref']:.2g} | {r['tf_noise']:.2g} | {first} |"
        )
    print("\nkda alone: one request's rows alone vs packed with others (max |diff|: output, state)")
    for key, (o, s) in _sub(dict(mode="kda")).items():
        print(f"  {key}: {o:.3g}, {s:.3g}")


if __name__ == "__main__":
    main()
