"""Context parallelism (CP) over ``torch.distributed``: one packed batch of sequences split across ranks.

The tokens of a varlen batch (B = 1, global ``cu_seqlens``) are cut into ``world_size`` equal
contiguous shards, one per rank; a sequence may run over several shards. ``build_cp_context``
describes this rank's shard, and ``chunk_kda(..., cp_context=ctx)`` /
``chunk_gated_delta_rule(..., cp_context=ctx)`` then compute, on each rank, exactly what the
single-process call computes for that rank's tokens, forward and backward::

    import torch.distributed as dist
    import kda
    from kda.cp import build_cp_context

    dist.init_process_group("gloo")                      # CPU tensors: gloo
    ctx = build_cp_context(cu_seqlens)                   # the GLOBAL offsets; group=None: WORLD
    s, e = ctx.token_range                               # this rank's tokens
    o, _ = kda.chunk_kda(q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], beta[:, s:e], cp_context=ctx)

The method (docs/math.md, "Segment transitions"): the state update is affine in the entering state,
so the part of a sequence on rank r maps the state entering it as ``S_out = M_r S_in + S_local_r``.
Forward: a rank whose last sequence runs on into the next rank computes that segment's transition
(``kda.engine.segment_transition``, ``HV * K * (K + V)`` fp32 values); the ranks all-gather them
(``torch.distributed.all_gather``); a rank whose first sequence came from earlier ranks chains their
maps in fp32 from a zero state to the true state entering its first sequence, and runs the ordinary
local forward from it. Backward: a rank whose first sequence came from earlier ranks computes
``delta``, the gradient of that sequence's entering state from its own outputs alone; the ranks
all-gather these; the gradient of the state leaving rank r's last sequence is chained back over the
later ranks of the sequence, ``G_r = M_{r+1}^T G_{r+1} + delta_{r+1}``, and the ordinary local
backward runs with it as the final state's gradient. ``delta`` is the adjoint of the first sequence's
transition: when a gradient is recorded, the forward also computes that transition's readout
``R_t = scale M_t^T q_t`` (``L * HV * K`` fp32 values for the first sequence's L tokens, kept for the
backward; one call with the maps on a rank whose only sequence runs over both its ends), before the
exchange, while the rank would otherwise wait for the earlier ranks' maps; the backward's
``delta = sum_t R_t dO_t^T`` is then one batched matrix product, so no rank's backward waits for
another rank's backward: each exchanges its delta at once and runs one local backward.

Restrictions (fla-core 0.6.0's, with its exception types): B = 1 varlen; ``initial_state`` and
``output_final_state`` are refused (``AssertionError``); the contiguous layout only. Every rank of the
group must make the same CP calls in the same order and backpropagate through each of them, since
both directions exchange data. A bad argument on any rank (a context built for another world size or
other ``cu_seqlens``, shards that do not add up to the global tokens, an initial or final state)
raises on every rank, naming the argument: each call first all-gathers a small status, so no rank is
left waiting in a collective. Gradients of ``A_log`` / ``dt_bias`` (the fused gate) are this rank's
part of the sum over ranks, like any data-parallel parameter: DistributedDataParallel's all-reduce
adds them up (it averages: scale each rank's loss by the world size, or normalise it by the global
token count times the world size, for the single-process gradient).
"""

from __future__ import annotations

import contextlib
import hashlib
import re
import time
from bisect import bisect_left, bisect_right
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from . import _ops
from ._arguments import check_tensors

__all__ = ["CPContext", "FLACPContext", "build_cp_context", "profile"]


# ---- the context -----------------------------------------------------------------------------------


@dataclass(eq=False)
class CPContext:
    """This rank's shard of a packed batch and what its neighbours share with it (build_cp_context).

    fla's fields: ``group``, ``cu_seqlens`` (this rank's offsets, int32, from 0 to its token count;
    ``cu_seqlens_cpu`` the same tensor), ``is_first_rank`` (its first sequence starts on this rank),
    ``is_last_rank`` (its last sequence ends on this rank), ``pre_num_ranks`` / ``post_num_ranks``
    (how many earlier / later ranks the first / last sequence runs over), ``conv1d_kernel_size`` and
    ``pre_num_conv_tokens`` (the tokens of the first sequence on earlier ranks, for a short
    convolution), ``layout``. kda's: ``world_size``, ``rank``, ``start`` / ``end`` (this rank's tokens
    ``[start, end)`` of the global batch, also ``token_range``), ``total_tokens``, ``global_cu_seqlens``
    (int64), ``crossing`` (for every rank, whether its last sequence runs on into the next rank)."""

    group: object = None
    cu_seqlens: torch.Tensor | None = None
    cu_seqlens_cpu: torch.Tensor | None = None
    is_first_rank: bool = True
    is_last_rank: bool = True
    pre_num_ranks: int = 0
    post_num_ranks: int = 0
    conv1d_kernel_size: int | None = None
    pre_num_conv_tokens: int = 0
    layout: str = "contiguous"
    world_size: int = 1
    rank: int = 0
    start: int = 0
    end: int = 0
    total_tokens: int = 0
    global_cu_seqlens: torch.Tensor | None = None
    crossing: tuple = ()
    fingerprint: int = field(default=0, repr=False)

    @property
    def num_seqs(self) -> int:
        """The number of sequences (or parts of sequences) on this rank."""
        return 0 if self.cu_seqlens is None else len(self.cu_seqlens) - 1

    @property
    def is_cp_enabled(self) -> bool:
        return self.world_size > 1

    @property
    def token_range(self) -> tuple[int, int]:
        """``(start, end)``: this rank's tokens of the global batch."""
        return self.start, self.end

    @property
    def continues_from_previous(self) -> bool:
        """Whether this rank's first sequence began on an earlier rank."""
        return not self.is_first_rank

    @property
    def continues_into_next(self) -> bool:
        """Whether this rank's last sequence runs on into the next rank."""
        return not self.is_last_rank


FLACPContext = CPContext  # fla's name


def _group_size_and_rank(group):
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            "kda: argument 'group': torch.distributed is not initialised; call "
            "torch.distributed.init_process_group('gloo', ...) on every rank first"
        )
    size, rank = dist.get_world_size(group=group), dist.get_rank(group=group)
    if rank < 0:
        raise ValueError("kda: argument 'group': this process is not a member of the group")
    return size, rank


def _offsets(cu_seqlens):
    if not torch.is_tensor(cu_seqlens):
        raise TypeError(
            f"kda: argument 'cu_seqlens': expected a tensor of N+1 offsets, got {type(cu_seqlens)}"
        )
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2:
        raise ValueError(
            "kda: argument 'cu_seqlens': expected a 1-D tensor of N+1 offsets, got shape "
            f"{list(cu_seqlens.shape)}"
        )
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(
            f"kda: argument 'cu_seqlens': expected int32 or int64 offsets, got {cu_seqlens.dtype}"
        )
    offsets = cu_seqlens.detach().cpu().to(torch.int64)
    values = offsets.tolist()
    if values[0] != 0 or any(b < a for a, b in zip(values, values[1:], strict=False)):
        raise ValueError("kda: argument 'cu_seqlens': offsets must start at 0 and never decrease")
    return offsets, values


def build_cp_context(
    cu_seqlens,
    group=None,
    conv1d_kernel_size=None,
    cu_seqlens_cpu=None,
    use_tf32x3_affine_chain=True,
    layout="contiguous",
    *,
    world_size=None,
    rank=None,
) -> CPContext:
    """This rank's shard of the packed batch with GLOBAL offsets ``cu_seqlens`` ``[N+1]``, split evenly
    over the ``world_size`` ranks of ``group`` (default: the WORLD group): rank r holds the tokens
    ``[r * T / world_size, (r + 1) * T / world_size)``, T = ``cu_seqlens[-1]``, which must be a
    multiple of ``world_size`` (``ValueError``, as in fla). ``world_size`` and ``rank`` (keywords) plan
    a shard without asking the group (a context used with a group of another size is refused at the
    call). fla's arguments: ``conv1d_kernel_size`` is recorded; ``cu_seqlens_cpu`` is accepted (the
    offsets are read on the CPU anyway); ``use_tf32x3_affine_chain`` must stay True (kda chains in
    IEEE fp32); ``layout`` 'contiguous' (fla's 'zigzag': ``NotImplementedError``). No collective runs:
    every rank builds its own context from the same global offsets."""
    if use_tf32x3_affine_chain is False:
        raise ValueError(
            "kda: use_tf32x3_affine_chain=False is not supported: kda chains the maps in IEEE fp32"
        )
    if layout == "zigzag":
        raise NotImplementedError("kda: layout='zigzag' is not supported; use layout='contiguous'")
    if layout != "contiguous":
        raise ValueError(f"kda: argument 'layout': expected 'contiguous' or 'zigzag', got {layout!r}")
    if world_size is None or rank is None:
        size, me = _group_size_and_rank(group)
        world_size = size if world_size is None else world_size
        rank = me if rank is None else rank
    if not (isinstance(world_size, int) and world_size >= 1):
        raise ValueError(f"kda: argument 'world_size': expected a positive integer, got {world_size!r}")
    if not (isinstance(rank, int) and 0 <= rank < world_size):
        raise ValueError(f"kda: argument 'rank': expected an integer in [0, {world_size}), got {rank!r}")
    offsets, values = _offsets(cu_seqlens if cu_seqlens_cpu is None else cu_seqlens_cpu)
    if cu_seqlens_cpu is not None and not torch.equal(offsets, _offsets(cu_seqlens)[0]):
        raise ValueError("kda: argument 'cu_seqlens_cpu': differs from cu_seqlens")
    total = values[-1]
    if total < world_size:
        raise ValueError(
            f"kda: argument 'cu_seqlens': {total} tokens in all, fewer than the {world_size} ranks; context "
            "parallelism needs at least one token per rank"
        )
    if total % world_size:
        raise ValueError(
            f"kda: argument 'cu_seqlens': {total} tokens in all, not a multiple of the world size "
            f"{world_size}; pad the batch so that every rank holds the same number of tokens"
        )
    part = total // world_size
    start, end = rank * part, (rank + 1) * part
    first = bisect_right(values, start) - 1  # the sequence holding token `start`
    last = bisect_left(values, end) - 1  # the sequence holding token `end - 1`
    inner = sorted({o - start for o in values[first + 1 : last + 1] if start < o < end})
    local = torch.tensor([0, *inner, part], dtype=torch.int32)
    boundaries = set(values)
    crossing = tuple((s + 1) * part not in boundaries for s in range(world_size - 1)) + (False,)
    fingerprint = int.from_bytes(hashlib.blake2b(offsets.numpy().tobytes(), digest_size=7).digest(), "little")
    return CPContext(
        group=group,
        cu_seqlens=local,
        cu_seqlens_cpu=local,
        is_first_rank=values[first] == start,
        is_last_rank=values[last + 1] == end,
        pre_num_ranks=rank - values[first] // part,
        post_num_ranks=(values[last + 1] - 1) // part - rank,
        conv1d_kernel_size=conv1d_kernel_size,
        pre_num_conv_tokens=start - values[first],
        layout=layout,
        world_size=world_size,
        rank=rank,
        start=start,
        end=end,
        total_tokens=total,
        global_cu_seqlens=offsets,
        crossing=crossing,
        fingerprint=fingerprint,
    )


# ---- timings, for bench/bench_cp.py --------------------------------------------------------------

_STATS = None


@contextlib.contextmanager
def profile():
    """Collects, over the CP calls inside the block, the seconds spent in the segment transitions
    (``transition``), the status and data all-gathers (``exchange``), the chaining (``chain``), the
    local forward and backward passes and a middle rank's ``delta = R^T dO`` (``local``), and the
    bytes received (``bytes``)."""
    global _STATS
    previous, _STATS = _STATS, dict(transition=0.0, exchange=0.0, chain=0.0, local=0.0, bytes=0)
    try:
        yield _STATS
    finally:
        _STATS = previous


@contextlib.contextmanager
def _timed(key):
    if _STATS is None:
        yield
        return
    t0 = time.perf_counter()
    try:
        yield
    finally:
        _STATS[key] += time.perf_counter() - t0


def _all_gather(tensor, group, size):
    parts = [torch.empty_like(tensor) for _ in range(size)]
    with _timed("exchange"):
        dist.all_gather(parts, tensor, group=group)
    if _STATS is not None:
        _STATS["bytes"] += tensor.numel() * tensor.element_size() * (size - 1)
    return parts


# ---- one call: the status exchange ----------------------------------------------------------------

# What a rank's status says went wrong: the exception type and the argument, by index.
_ERRORS = (None, ValueError, TypeError, AssertionError, NotImplementedError, RuntimeError)
_ARGUMENTS = (
    "the arguments",
    "cp_context",
    "cu_seqlens",
    "initial_state",
    "output_final_state",
    "q",
    "k",
    "v",
    "g",
    "beta",
    "A_log",
    "dt_bias",
    "scale",
    "group",
    "return_intermediate_states",
    "ssm_state_indices",
    "chunk_size",
    "lower_bound",
)
_QUOTED = re.compile(r"['`](\w+)['`]")


def _argument_of(error) -> int:
    """The index in _ARGUMENTS of the argument an error names (0 when it names none)."""
    name = getattr(error, "kda_argument", None)
    if name in _ARGUMENTS:
        return _ARGUMENTS.index(name)
    for found in _QUOTED.findall(str(error)):
        if found in _ARGUMENTS:
            return _ARGUMENTS.index(found)
    return 0


def _error(kind, argument, message):
    error = kind(message)
    error.kda_argument = argument
    return error


class Call:
    """One CP call of chunk_kda / chunk_gated_delta_rule on this rank: its context, group and status
    exchange. The function runs with a Call in place of the context (run())."""

    def __init__(self, context):
        self.context, self.exchanged, self.error = context, False, None
        if not isinstance(context, CPContext):
            group = None
            if not (dist.is_available() and dist.is_initialized()):  # no other rank to tell
                raise TypeError(
                    "kda: argument 'cp_context': expected the context of kda.cp.build_cp_context, got "
                    f"{type(context)}"
                )
            self.error = _error(
                TypeError,
                "cp_context",
                "kda: argument 'cp_context': expected the context of kda.cp.build_cp_context, got "
                f"{type(context)}",
            )
        else:
            group = context.group
        self.group = group
        self.size, self.rank = _group_size_and_rank(group)  # raises on every rank alike: no collective yet
        self.facts = [0] * 6  # tokens, HV, K, V, gate dim, gradient recorded

    @classmethod
    def run(cls, function, arguments):
        """Calls `function` with the arguments (its locals(): ``kwargs`` merged) and a Call in place of
        the context. An error before the status exchange is exchanged before it is raised."""
        arguments = dict(arguments)
        arguments.update(arguments.pop("kwargs", {}))
        call = cls(arguments["cp_context"])
        arguments["cp_context"] = call
        try:
            if call.error is not None:
                raise call.error
            return function(**arguments)
        except Exception as error:
            if not call.exchanged:
                call.exchange(error)
            raise

    # -- checks every rank makes of its own arguments

    def begin(self, family, tensors, output_final_state, cu_seqlens):
        """fla's CP restrictions and the context's agreement with this rank's arguments (a call of the
        operator family ``family``, kda._family; ``tensors``: q, k, v, g, beta, A_log, dt_bias,
        initial_state); returns the rank-local offsets (which replace cu_seqlens, as in fla)."""
        q, k, v, g, beta, A_log, dt_bias, initial_state = tensors
        c = self.context
        if q.dim() == 4 and q.shape[0] != 1:
            raise _error(
                ValueError,
                "q",
                f"The batch size is expected to be 1 rather than {q.shape[0]} when using `cu_seqlens`."
                "Please flatten variable-length inputs before processing.",
            )
        if initial_state is not None:
            raise _error(AssertionError, "initial_state", "Initial state is not supported for CP")
        if output_final_state:
            raise _error(AssertionError, "output_final_state", "Output final state is not supported for CP")
        if c.cu_seqlens is None:
            raise _error(AssertionError, "cp_context", "cu_seqlens is required for CP")
        if c.world_size != self.size:
            raise _error(
                ValueError,
                "cp_context",
                f"kda: argument 'cp_context': built for a world size of {c.world_size}, but its group has "
                f"{self.size} ranks; build it with build_cp_context(cu_seqlens, group) on every rank",
            )
        if c.rank != self.rank:
            raise _error(
                ValueError,
                "cp_context",
                f"kda: argument 'cp_context': built for rank {c.rank}, used on rank {self.rank}",
            )
        if cu_seqlens is not None:
            same = torch.is_tensor(cu_seqlens) and cu_seqlens.dim() == 1
            same = same and any(
                cu_seqlens.shape == ref.shape
                and torch.equal(cu_seqlens.cpu().to(torch.int64), ref.to(torch.int64))
                for ref in (c.global_cu_seqlens, c.cu_seqlens)
            )
            if not same:
                raise _error(
                    ValueError,
                    "cu_seqlens",
                    "kda: argument 'cu_seqlens': differs from the offsets cp_context was built for (pass "
                    "none with cp_context: the context's rank-local offsets are used)",
                )
        check_tensors(family, q, k, v, g, beta, None, c.cu_seqlens, A_log, dt_bias)
        if q.shape[1] != c.end - c.start:
            raise _error(
                ValueError,
                "q",
                f"kda: argument 'q': holds {q.shape[1]} tokens, but this rank's shard of the "
                f"{c.total_tokens} tokens of cp_context is [{c.start}, {c.end}) ({c.end - c.start} tokens); "
                "the shards must add up to the global tokens",
            )
        gate_dim = 1 if g.dim() == 3 else g.shape[3]
        self.facts = [q.shape[1], v.shape[2], q.shape[3], v.shape[3], gate_dim, 0]
        return c.cu_seqlens

    # -- the exchange

    def exchange(self, error=None):
        """All-gathers every rank's status; raises on every rank if any rank failed or the ranks
        disagree. With `error` (this rank's), returns after the exchange so the caller raises it."""
        self.exchanged = True
        c = self.context
        code = (
            0 if error is None else next((i for i, t in enumerate(_ERRORS) if t and isinstance(error, t)), 5)
        )
        known = isinstance(c, CPContext)
        row = torch.tensor(
            [
                code,
                _argument_of(error) if error is not None else 0,
                c.world_size if known else -1,
                c.fingerprint if known else -1,
                c.total_tokens if known else -1,
                *self.facts,
            ],
            dtype=torch.int64,
        )
        table = torch.stack(_all_gather(row, self.group, self.size)).tolist()
        if error is not None:
            return
        for r, (code, argument, *_rest) in enumerate(table):
            if code:
                kind, name = _ERRORS[code], _ARGUMENTS[argument]
                raise _error(
                    kind,
                    name,
                    f"kda: context parallelism: rank {r} refused argument '{name}' ({kind.__name__}; its own "
                    "error says why); no rank computed anything",
                )
        # What every rank checks alike, from the gathered rows.
        fingerprints = {row[3] for row in table}
        if len(fingerprints) > 1 or len({row[4] for row in table}) > 1:
            raise _error(
                ValueError,
                "cu_seqlens",
                "kda: argument 'cu_seqlens': the ranks' cp_context were built from different global "
                "cu_seqlens; build every rank's context from the same offsets",
            )
        tokens = sum(row[5] for row in table)
        if tokens != c.total_tokens:
            raise _error(
                ValueError,
                "q",
                f"kda: argument 'q': the ranks' shards hold {tokens} tokens in all, cp_context's cu_seqlens "
                f"{c.total_tokens}",
            )
        for index, name in ((6, "v"), (7, "q"), (8, "v"), (9, "g")):
            if len({row[index] for row in table}) > 1:
                raise _error(
                    ValueError,
                    name,
                    f"kda: argument '{name}': the ranks' shapes differ (heads, head dims and gate width "
                    "must be the same on every rank)",
                )
        if len({row[10] for row in table}) > 1:
            raise _error(
                ValueError,
                "q",
                "kda: context parallelism: some ranks record a gradient and others do not; the backward "
                "exchanges data, so every rank must record one or none",
            )

    # -- the computation

    def forward(self, path, q, k, v, g, beta, A_log, dt_bias, options, grad):
        """The CP forward on the prepared tensors (kda.functional._run): returns o."""
        c = self.context
        transition = readout = None
        try:
            if q.dtype == torch.float64:
                raise _error(
                    NotImplementedError,
                    "q",
                    "kda: argument 'q': float64 inputs (the oracle) are not supported with cp_context",
                )
            if path != "chunk":
                raise _error(NotImplementedError, "cp_context", f"kda: cp_context on the {path} path")
            # The local problem, validated here (before any collective), with K-first states: no state
            # leaves the call, so its layout is free.
            options = options._replace(state_v_first=False)
            problem = _ops.prepare(q, v, options)
            self.facts[5] = int(grad)
            first_length = int(c.cu_seqlens[1])
            if c.continues_into_next:
                # A rank whose only sequence continues both ways takes its readout from this call.
                last = problem.num_sequences - 1
                middle = grad and c.continues_from_previous and last == 0
                with torch.no_grad(), _timed("transition"):
                    M, S_local, readout = _ops.segment_transition(
                        problem,
                        q,
                        k,
                        v,
                        g,
                        beta,
                        A_log,
                        dt_bias,
                        last,
                        readout_length=first_length if middle else None,
                    )
                transition = (M, S_local)
            if grad and c.continues_from_previous and readout is None:
                # The first sequence's readout, for the backward's delta: computed now, before the
                # exchange, where this rank would wait for the earlier ranks' maps.
                with torch.no_grad(), _timed("transition"):
                    readout = _ops.segment_transition(
                        problem, q, k, v, g, beta, A_log, dt_bias, 0, readout_length=first_length
                    )[2]
        except Exception as error:
            self.exchange(error)
            raise
        self.exchange()
        plan = _Plan(self, options, problem, transition, readout)
        return _Parallel.apply(plan, q, k, v, g, beta, A_log, dt_bias)


# ---- the exchange of maps and the chained states ----------------------------------------------------


class _Plan:
    """What a CP call's forward and backward share: the context, the problem options, the maps, and
    the readout R [L, HV, K] of the first sequence's transition when it began on an earlier rank and a
    gradient is recorded (the adjoint: delta = R^T dO)."""

    def __init__(self, call, options, problem, transition, readout):
        self.call, self.options, self.problem = call, options, problem
        self.transition, self.readout = transition, readout
        self.context = call.context
        self.HV, self.S = problem.state_shape[0], problem.state_shape[1:]  # (K, V), K-first
        self.any_crossing = any(self.context.crossing)
        self.maps = {}  # rank -> M of the ranks after this one that the backward chains through

    def entering_state(self):
        """Exchanges the transitions; returns the state entering this rank's first sequence (K-first
        [HV, K, V], zeros unless it began on an earlier rank)."""
        c, HV, (K, V) = self.context, self.HV, self.S
        state = torch.zeros(HV, K, V)
        if not self.any_crossing:
            return state
        width = HV * K * (K + V)
        mine = torch.zeros(width)
        if self.transition is not None:
            M, S_local = self.transition
            mine[: HV * K * K] = M.reshape(-1)
            mine[HV * K * K :] = S_local.reshape(-1)
        parts = _all_gather(mine, self.call.group, self.call.size)
        with _timed("chain"):
            if c.continues_from_previous:
                for s in range(c.rank - c.pre_num_ranks, c.rank):
                    M = parts[s][: HV * K * K].view(HV, K, K)
                    S_local = parts[s][HV * K * K :].view(HV, K, V)
                    state = torch.baddbmm(S_local, M, state)
            if c.continues_into_next:
                # the maps of the later ranks the last sequence runs through whole (the backward's)
                for s in range(c.rank + 1, c.rank + c.post_num_ranks):
                    self.maps[s] = parts[s][: HV * K * K].view(HV, K, K).clone()
        return state

    def leaving_gradient(self, delta):
        """Exchanges the deltas; returns the gradient of the state leaving this rank's last sequence
        (K-first [HV, K, V]; zeros unless it runs on into the next rank)."""
        c, HV, (K, V) = self.context, self.HV, self.S
        G = torch.zeros(HV, K, V)
        if not self.any_crossing:
            return G
        mine = torch.zeros(HV, K, V) if delta is None else delta.reshape(HV, K, V).contiguous()
        parts = _all_gather(mine, self.call.group, self.call.size)
        with _timed("chain"):
            if c.continues_into_next:
                last = c.rank + c.post_num_ranks
                G = parts[last].clone()
                for s in range(last - 1, c.rank, -1):
                    G = torch.baddbmm(parts[s], self.maps[s].transpose(1, 2), G)
        return G


class _Parallel(torch.autograd.Function):
    """The local pass from the chained entering state, with the cross-rank backward."""

    @staticmethod
    def forward(ctx, plan, q, k, v, g, beta, A_log, dt_bias):
        entering = plan.entering_state()
        h0 = torch.zeros(plan.problem.num_sequences, plan.HV, *plan.S)
        h0[0] = entering
        keep = bool(plan.call.facts[5])  # a gradient is recorded: keep the chunk states for the backward
        with _timed("local"):
            named = dict(q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias)
            o, _, chunks = _ops.engine_forward(
                "chunk",
                **named,
                initial_state=h0,
                options=plan.options,
                problem=plan.problem,  # validated once, in Call.forward
                output_final_state=False,
                keep_chunk_states=keep,
            )
        ctx.plan = plan
        ctx.save_for_backward(q, k, v, g, beta, A_log, dt_bias, h0, chunks)
        return o

    @staticmethod
    def backward(ctx, d_o):
        plan = ctx.plan
        q, k, v, g, beta, A_log, dt_bias, h0, chunks = ctx.saved_tensors
        c = plan.context
        d_o = d_o.contiguous() if d_o.stride(-1) != 1 else d_o
        cu = c.cu_seqlens.tolist()
        n, T = len(cu) - 1, cu[-1]
        # delta, the gradient of the state entering the first sequence (when it began on an earlier
        # rank) from this rank's outputs alone: the adjoint of its transition, sum_t R_t dO_t^T per
        # value head (K-first), exchanged before any local backward runs.
        delta = None
        if c.continues_from_previous:
            with _timed("local"):
                R = plan.readout.permute(1, 2, 0)  # [HV, K, L]
                delta = torch.bmm(R, d_o[0, : cu[1]].transpose(0, 1).to(torch.float32))  # [HV, K, V]
        G = plan.leaving_gradient(delta)
        d_final = None
        if c.continues_into_next:
            d_final = torch.zeros(n, plan.HV, *plan.S)
            d_final[-1] = G
        dq, dk, dv, dg, dbeta, _, dA_part, dbias_part = _backward(
            plan, (q, k, v, g, beta, d_o), A_log, dt_bias, h0, chunks, 0, T, d_final, False
        )
        fused = plan.options.gate != "log_decay"
        dA = dbias = None
        if fused and A_log is not None:
            dA = dA_part
        if fused and dt_bias is not None:
            dbias = dbias_part
        return None, dq, dk, dv, dg, dbeta, dA, dbias


def _backward(plan, activations, A_log, dt_bias, h0, chunks, a, b, d_final, want_d_h0):
    """The local backward over tokens [a, b) of this rank (whole sequences)."""
    cu = plan.context.cu_seqlens.tolist()
    i, j = cu.index(a), cu.index(b)
    offsets = torch.tensor([x - a for x in cu[i : j + 1]], dtype=torch.int64)
    if chunks is not None:
        size = _ops.CHUNK_SIZE
        ca = sum((cu[s + 1] - cu[s] + size - 1) // size for s in range(i))
        cb = ca + sum((cu[s + 1] - cu[s] + size - 1) // size for s in range(i, j))
        chunks = chunks[ca:cb]
    q, k, v, g, beta, d_o = (t[:, a:b] for t in activations)
    with _timed("local"):
        named = dict(q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias)
        return _ops.engine_backward(
            "chunk",
            **named,
            initial_state=h0[i:j],
            options=plan.options._replace(cu_seqlens=offsets),
            chunk_states=chunks,
            d_o=d_o,
            d_final_state=d_final,
            want_d_initial_state=want_d_h0,
        )
