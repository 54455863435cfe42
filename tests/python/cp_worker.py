"""The spawned ranks of tests/python/test_cp.py (context parallelism over torch.distributed with gloo).

``spawn(job, world, directory)`` starts `world` processes that join a gloo group (file:// rendezvous in
`directory`), run ``JOBS[job]`` and write what each rank computed to ``directory/<job>-<rank>.pt``;
it fails (and kills them) when they do not all finish within the timeout: a rank left waiting in a
collective shows up as a timeout, not a hung test run.
"""

import gc
import time
import traceback
from datetime import timedelta
from pathlib import Path

import kda
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from harness import KIMI, LOWER_BOUND, Case, _draw, make_inputs
from kda.cp import build_cp_context

# ---- the cases -----------------------------------------------------------------------------------


def _lengths(total, seed, longest):
    """Many short sequences of random lengths (1..longest) adding up to `total`."""
    gen = torch.Generator().manual_seed(seed)
    offsets = [0]
    while offsets[-1] < total:
        offsets.append(min(total, offsets[-1] + int(torch.randint(1, longest + 1, (1,), generator=gen))))
    return offsets


def _case(offsets, function="chunk_kda", **fields):
    fields.setdefault("K", 32)
    fields.setdefault("V", 32)
    width = "per_head" if function == "chunk_gated_delta_rule" else "per_key"
    return function, Case(T=offsets[-1], cu_seqlens=offsets, initial_state=False, gate_width=width, **fields)


GDN = "chunk_gated_delta_rule"

# name: (function, Case); the splits are for the world size of the list.
CASES = {
    2: {
        "one_sequence": _case([0, 256], regime="mild"),
        "cut": _case([0, 100, 300, 400], regime="strong", H=1, HV=2, K=16, V=24),
        "aligned": _case([0, 60, 200, 320, 400], regime="spike"),
        "short": _case(_lengths(240, 1, 20), regime="mild", K=16, V=16),
        "kimi_cut": _case([0, 70, 290, 320], regime="unbounded", **KIMI),
        "lower_bound": _case([0, 150, 300], regime="strong", **LOWER_BOUND, K=16, V=32),
        "bf16_cut": _case([0, 90, 256], regime="mild", dtype=torch.bfloat16, seed=3),
        "gdn_one_sequence": _case([0, 256], GDN, regime="mild"),
        "gdn_cut": _case([0, 100, 300, 400], GDN, regime="unbounded", **KIMI),
    },
    4: {
        "one_sequence": _case([0, 384], regime="mild", K=16, V=16),
        "spans": _case([0, 250, 330, 384], regime="strong", K=16, V=16),
        "short": _case(_lengths(320, 2, 24), regime="unbounded", **KIMI, K=16, V=16),
        "aligned": _case([0, 80, 160, 200, 240, 320], regime="mild", K=16, V=16),
        "gdn_spans": _case([0, 250, 330, 384], GDN, regime="strong", K=16, V=16),
        "gdn_one_sequence": _case([0, 384], GDN, regime="unbounded", **KIMI, K=16, V=16),
        # bf16 through the middle ranks' adjoint (delta from the readout and a bf16 d_o)
        "bf16_spans": _case([0, 250, 330, 384], regime="spike", dtype=torch.bfloat16, K=16, V=16, seed=4),
    },
}


def case_inputs(case):
    """The global inputs of a case (harness.make_inputs) and the cotangent of o."""
    tensors, options = make_inputs(case)
    options = {n: x for n, x in options.items() if n not in ("initial_state", "state_v_first")}
    if case.gate_width == "per_head":
        options.pop("lower_bound", None)
    gen = torch.Generator().manual_seed(case.seed + 100)
    w_o = _draw("d_o", gen, *tensors["v"].shape).to(tensors["q"].dtype).double()
    return tensors, options, w_o


def call(function, tensors, options, w_o, cp_context=None, start=0, end=None, grad=True, **extra):
    """o and every gradient of the loss sum(o * w_o) for the tokens [start, end) (all with no context);
    `extra`: more keyword arguments of the function."""
    end = tensors["q"].shape[1] if end is None else end
    inputs = {n: t[:, start:end].detach().clone().requires_grad_(grad) for n, t in tensors.items()}
    opts = dict(options)
    for name in ("A_log", "dt_bias"):
        if name in opts:
            opts[name] = opts[name].detach().clone().requires_grad_(grad)
    if cp_context is not None:
        opts.pop("cu_seqlens")
    o, _ = getattr(kda, function)(**inputs, **opts, **extra, cp_context=cp_context)
    grads = {}
    if grad:
        (o.double() * w_o[:, start:end]).sum().backward()
        grads = {n: t.grad for n, t in inputs.items()}
        grads.update({n: opts[n].grad for n in ("A_log", "dt_bias") if n in opts})
    return o.detach(), grads


# ---- the jobs --------------------------------------------------------------------------------------


def job_parity(rank, world):
    """Every case of the world size: this rank's o and gradients."""
    results = {}
    for name, (function, case) in CASES[world].items():
        tensors, options, w_o = case_inputs(case)
        ctx = build_cp_context(options["cu_seqlens"])
        s, e = ctx.token_range
        results[name] = call(function, tensors, options, w_o, ctx, s, e)
    return results


def _attempt(action):
    try:
        action()
    except Exception as error:  # noqa: BLE001 - every rank's outcome is recorded, whatever it is
        return type(error).__name__, str(error)
    return "ok", ""


def job_errors(rank, world):
    """Bad inputs, each on every rank or on one rank only: what each rank raised. A valid call closes
    the list, to show that the ranks' collectives stayed in step."""
    function, case = _case([0, 100, 300, 400], regime="mild", K=16, V=16)
    tensors, options, w_o = case_inputs(case)
    cu = options["cu_seqlens"]
    ctx = build_cp_context(cu)
    s, e = ctx.token_range
    last = world - 1

    def run(context=ctx, start=s, end=e, grad=False, fn=function, tens=tensors, **extra):
        return call(fn, tens, options, w_o, context, start, end, grad=grad, **extra)

    def gdn_tensors():
        return {**tensors, "g": tensors["g"][..., 0]}

    scenarios = {
        "world_size": lambda: run(build_cp_context(cu, world_size=2 * world, rank=rank)),
        "other_cu_seqlens": lambda: run(
            build_cp_context(torch.tensor([0, 100, 300, 400]) if rank else torch.tensor([0, 200, 400]))
        ),
        "cu_seqlens_argument": lambda: run(cu_seqlens=torch.tensor([0, 50, 400])),
        "shards": lambda: run(end=e - 1 if rank == last else e),
        "initial_state_one_rank": lambda: run(
            initial_state=torch.zeros(ctx.num_seqs, case.HV, case.K, case.V) if rank == last else None
        ),
        "output_final_state": lambda: run(output_final_state=True),
        "batch": lambda: call(
            function,
            {n: t.expand(2, *t.shape[1:]) if rank == 0 else t for n, t in tensors.items()},
            options,
            w_o.expand(2, *w_o.shape[1:]),
            ctx,
            s,
            e,
            grad=False,
        ),
        "context_type": lambda: run(context="not a context" if rank == last else ctx),
        "gradient_one_rank": lambda: run(grad=rank == 0),
        "gdn_initial_state": lambda: run(
            fn=GDN, tens=gdn_tensors(), initial_state=torch.zeros(ctx.num_seqs, case.HV, case.K, case.V)
        ),
        "not_divisible": lambda: build_cp_context(torch.tensor([0, 3, 401])),
        "valid_after": lambda: run(grad=True),
    }
    return {name: _attempt(action) for name, action in scenarios.items()}


class TinyModel(torch.nn.Module):
    """Embedding -> one KDA layer (Kimi Linear's fused gate, beta logits, q/k L2 norm) -> vocabulary."""

    def __init__(self, vocab=40, d=32, heads=2, head_dim=16):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        width = heads * head_dim
        self.embed = torch.nn.Embedding(vocab, d)
        self.q, self.k, self.v, self.g = (torch.nn.Linear(d, width, bias=False) for _ in range(4))
        self.b = torch.nn.Linear(d, heads, bias=False)
        self.A_log = torch.nn.Parameter(torch.log(torch.linspace(1.0, 4.0, heads)))
        self.dt_bias = torch.nn.Parameter(torch.zeros(width))
        self.o = torch.nn.Linear(width, d, bias=False)
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, tokens, cu_seqlens=None, cp_context=None):
        x = self.embed(tokens)  # [1, T, d]
        shape = (*x.shape[:2], self.heads, self.head_dim)
        o, _ = kda.chunk_kda(
            self.q(x).view(shape),
            self.k(x).view(shape),
            self.v(x).view(shape),
            self.g(x).view(shape),
            self.b(x),
            A_log=self.A_log,
            dt_bias=self.dt_bias,
            use_gate_in_kernel=True,
            use_qk_l2norm_in_kernel=True,
            use_beta_sigmoid_in_kernel=True,
            cu_seqlens=cu_seqlens,
            cp_context=cp_context,
        )
        return self.head(x + self.o(o.flatten(2)))


TRAIN_OFFSETS = [0, 90, 200, 256]
TRAIN_STEPS = 3


def training_data():
    gen = torch.Generator().manual_seed(11)
    tokens = torch.randint(40, (1, TRAIN_OFFSETS[-1]), generator=gen)
    targets = torch.roll(tokens, -1, dims=1)
    for end in TRAIN_OFFSETS[1:]:  # a sequence's last token predicts nothing
        targets[0, end - 1] = -100
    return tokens, targets


def train(model, steps, world=1, ctx=None):
    """SGD steps on the packed batch (its shard with ctx); the loss is the mean over the global tokens.
    DistributedDataParallel averages the ranks' gradients, so each rank's share is scaled by the
    world size: the average of the ranks' gradients is then the single-process gradient. Returns the
    gradients of every step."""
    tokens, targets = training_data()
    count = int((targets != -100).sum())
    s, e = (0, tokens.shape[1]) if ctx is None else ctx.token_range
    cu = torch.tensor(TRAIN_OFFSETS) if ctx is None else None
    optimiser = torch.optim.SGD(model.parameters(), lr=0.5)
    history = []
    for _ in range(steps):
        optimiser.zero_grad()
        logits = model(tokens[:, s:e], cu_seqlens=cu, cp_context=ctx)
        loss = F.cross_entropy(logits[0], targets[0, s:e], ignore_index=-100, reduction="sum")
        (loss * world / count).backward()
        inner = getattr(model, "module", model)  # (DistributedDataParallel's wrapped module)
        history.append({n: p.grad.detach().clone() for n, p in inner.named_parameters()})
        optimiser.step()
    return history


def job_training(rank, world):
    torch.manual_seed(0)
    model = TinyModel()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    ctx = build_cp_context(torch.tensor(TRAIN_OFFSETS))
    history = train(ddp, TRAIN_STEPS, world, ctx)
    result = {"history": history, "parameters": {n: p.detach().clone() for n, p in model.named_parameters()}}
    # DDP's reducer holds the process group and sits in reference cycles: free it now, not during the
    # interpreter's shutdown after destroy_process_group, where gloo's threads were seen to abort.
    del ddp
    gc.collect()
    return result


JOBS = {"parity": job_parity, "errors": job_errors, "training": job_training}


# ---- the processes ---------------------------------------------------------------------------------


def _main(rank, world, job, directory):
    torch.set_num_threads(1)  # the ranks share the machine's cores
    directory = Path(directory)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{directory / 'rendezvous'}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )
    try:
        result = JOBS[job](rank, world)
    except Exception:
        result = {"crashed": traceback.format_exc()}
    torch.save(result, directory / f"{job}-{rank}.pt")
    dist.barrier()  # no rank tears its connections down while another still uses them
    dist.destroy_process_group()


def spawn(job, world, directory, timeout=150):
    """Runs `job` on `world` spawned ranks; returns their results, rank by rank. Fails when a rank has
    not finished after `timeout` seconds (it is then killed)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    context = mp.start_processes(
        _main, args=(world, job, str(directory)), nprocs=world, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + timeout
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for p in context.processes:
                if p.is_alive():
                    p.kill()
            raise AssertionError(
                f"cp job {job!r} on {world} ranks did not finish in {timeout} s: a rank hung"
            )
    results = [torch.load(directory / f"{job}-{r}.pt", weights_only=False) for r in range(world)]
    for r, result in enumerate(results):
        if isinstance(result, dict) and "crashed" in result:
            raise AssertionError(f"rank {r} of cp job {job!r} crashed:\n{result['crashed']}")
    return results
