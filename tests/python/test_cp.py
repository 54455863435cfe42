"""Context parallelism (kda.cp) over torch.distributed with gloo, on 2 and 4 spawned ranks
(tests/python/cp_worker.py): outputs and every gradient against the single-process call and the
float64 oracle, splits that cut sequences, boundary-aligned splits, one sequence over every rank, many
short sequences, both gate widths; every bad input raises on every rank, with no rank left waiting;
a tiny model trains under DistributedDataParallel with the single-process gradients."""

import kda
import pytest
import torch
from cp_worker import CASES, TRAIN_STEPS, TinyModel, call, case_inputs, spawn, train
from harness import as_oracle, gate_parameter_magnitudes, rel_rms, sum_error, tolerance
from kda.cp import build_cp_context

ACTIVATIONS = ("q", "k", "v", "g", "beta")
GRADIENT_OF = dict(q="dq", k="dk", v="dv", g="dg", beta="dbeta")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """The results of a job on a world size, each job spawned once."""
    done = {}

    def results(job, world):
        if (job, world) not in done:
            done[job, world] = spawn(job, world, tmp_path_factory.mktemp(f"cp_{job}_{world}"))
        return done[job, world]

    return results


# ---- the context, without processes ------------------------------------------------------------------


@pytest.mark.parametrize(
    "offsets, world",
    [([0, 250, 330, 384], 4), ([0, 100, 300, 400], 2), ([0, 384], 4), ([0, 5, 5, 17, 40, 64, 64], 4)],
)
def test_context_matches_fla(offsets, world):
    """The shard metadata is fla's (fla.ops.cp's planner, when importable) and what the docs say."""
    cu = torch.tensor(offsets)
    part = offsets[-1] // world
    for rank in range(world):
        c = build_cp_context(cu, world_size=world, rank=rank)
        assert c.token_range == (rank * part, (rank + 1) * part)
        assert c.cu_seqlens.dtype == torch.int32 and c.cu_seqlens[0] == 0 and c.cu_seqlens[-1] == part
        assert c.continues_into_next == c.crossing[rank]
        if rank:
            assert c.continues_from_previous == c.crossing[rank - 1]
    fla_context = pytest.importorskip("fla.ops.cp.context")
    for rank in range(world):
        ours = build_cp_context(cu, world_size=world, rank=rank)
        theirs = fla_context.get_cp_cu_seqlens(cu, world_size=world, rank=rank)
        assert ours.cu_seqlens.tolist() == theirs.cu_seqlens.tolist()
        for name in (
            "is_first_rank",
            "is_last_rank",
            "pre_num_ranks",
            "post_num_ranks",
            "pre_num_conv_tokens",
        ):
            assert getattr(ours, name) == getattr(theirs, name), name


def test_build_errors():
    cu = torch.tensor([0, 100, 401])
    with pytest.raises(ValueError, match="'cu_seqlens'.*multiple of the world size"):
        build_cp_context(cu, world_size=2, rank=0)
    with pytest.raises(ValueError, match="fewer than the 8 ranks"):
        build_cp_context(torch.tensor([0, 4]), world_size=8, rank=0)
    with pytest.raises(NotImplementedError, match="zigzag"):
        build_cp_context(torch.tensor([0, 4]), world_size=2, rank=0, layout="zigzag")
    with pytest.raises(ValueError, match="'cu_seqlens'"):
        build_cp_context(torch.tensor([0, 6, 4]), world_size=2, rank=0)
    with pytest.raises(ValueError, match="'rank'"):
        build_cp_context(torch.tensor([0, 4]), world_size=2, rank=2)


def test_group_not_initialised():
    """Without torch.distributed initialised: the context builder and the call name 'group'."""
    assert not torch.distributed.is_initialized()
    with pytest.raises(ValueError, match="'group'.*not initialised"):
        build_cp_context(torch.tensor([0, 64]))
    ctx = build_cp_context(torch.tensor([0, 64]), world_size=2, rank=0)
    q = torch.randn(1, 32, 1, 16)
    with pytest.raises(ValueError, match="'group'.*not initialised"):
        kda.chunk_kda(q, q, q, -torch.rand(1, 32, 1, 16), torch.rand(1, 32, 1), cp_context=ctx)
    with pytest.raises(ValueError, match="'group'.*not initialised"):
        kda.chunk_gated_delta_rule(q, q, q, -torch.rand(1, 32, 1), torch.rand(1, 32, 1), cp_context=ctx)


# ---- outputs and gradients -------------------------------------------------------------------------


def _cases():
    return [pytest.param(world, name, id=f"{world}ranks-{name}") for world in CASES for name in CASES[world]]


@pytest.mark.parametrize("world, name", _cases())
def test_matches_single_process_and_oracle(ranks, world, name):
    function, case = CASES[world][name]
    results = [r[name] for r in ranks("parity", world)]
    tensors, options, w_o = case_inputs(case)
    o_cp = torch.cat([o for o, _ in results], dim=1)
    grads_cp = {n: torch.cat([g[n] for _, g in results], dim=1) for n in ACTIVATIONS}
    for n in ("A_log", "dt_bias"):  # each rank's share of the sum over tokens
        if n in options:
            grads_cp[n] = sum(g[n] for _, g in results)
    o_one, grads_one = call(function, tensors, options, w_o)  # one process, the same call
    o_ref, grads_ref = call(function, *as_oracle(tensors, options), w_o)  # the float64 oracle

    dtype = tensors["q"].dtype
    assert o_cp.dtype == dtype
    for want in (o_ref, o_one):
        assert rel_rms(o_cp, want) <= tolerance("forward", dtype, "o")
    for n in ACTIVATIONS:
        assert grads_cp[n].dtype == dtype
        limit = tolerance("backward", dtype, GRADIENT_OF[n])
        assert rel_rms(grads_cp[n], grads_ref[n]) <= limit, n
        assert rel_rms(grads_cp[n], grads_one[n]) <= limit, n
    if "A_log" in options:
        mag_A, mag_bias = gate_parameter_magnitudes(grads_ref["g"], tensors, options)
        for want in (grads_ref, grads_one):
            assert sum_error(grads_cp["A_log"], want["A_log"], mag_A) <= tolerance(
                "backward", torch.float32, "dA_log"
            )
            assert sum_error(grads_cp["dt_bias"], want["dt_bias"], mag_bias) <= tolerance(
                "backward", torch.float32, "ddt_bias"
            )


# ---- bad input: every rank raises, none waits ----------------------------------------------------------

# scenario: (exception type, the argument every rank's message names, the ranks whose own argument is bad:
# "all" or "one" (rank 0 for the batch, the last rank otherwise))
BAD_INPUTS = {
    "world_size": (ValueError, "cp_context", "all"),
    "other_cu_seqlens": (ValueError, "cu_seqlens", "all"),
    "cu_seqlens_argument": (ValueError, "cu_seqlens", "all"),
    "shards": (ValueError, "q", "one"),
    "initial_state_one_rank": (AssertionError, "initial_state", "one"),
    "output_final_state": (AssertionError, "output_final_state", "all"),
    "batch": (ValueError, "q", "one"),
    "context_type": (TypeError, "cp_context", "one"),
    "gradient_one_rank": (ValueError, "gradient", "all"),
    "gdn_initial_state": (AssertionError, "initial_state", "all"),
    "not_divisible": (ValueError, "cu_seqlens", "all"),
}
# what the message of a rank whose own argument is bad says (default: the argument's name, quoted)
_OWN_MESSAGE = {
    "initial_state_one_rank": "Initial state is not supported for CP",
    "gdn_initial_state": "Initial state is not supported for CP",
    "output_final_state": "Output final state is not supported for CP",
    "batch": "The batch size is expected to be 1",
    "gradient_one_rank": "some ranks record a gradient and others do not",
}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("scenario", list(BAD_INPUTS))
def test_bad_input_raises_on_every_rank(ranks, world, scenario):
    kind, argument, who = BAD_INPUTS[scenario]
    outcomes = [r[scenario] for r in ranks("errors", world)]  # (exception type name, message) per rank
    bad = 0 if scenario == "batch" else world - 1
    for rank, (raised, message) in enumerate(outcomes):
        assert raised == kind.__name__, (rank, raised, message)
        if who == "all" or rank == bad:
            assert _OWN_MESSAGE.get(scenario, f"'{argument}'") in message, (rank, message)
        else:  # told which rank refused which argument
            assert f"rank {bad} refused argument '{argument}'" in message, (rank, message)


@pytest.mark.parametrize("world", [2, 4])
def test_valid_call_after_bad_inputs(ranks, world):
    """After every refusal the ranks' collectives are still in step: a valid call then succeeds."""
    assert all(r["valid_after"] == ("ok", "") for r in ranks("errors", world))


# ---- training under DistributedDataParallel -------------------------------------------------------------


def test_ddp_training_matches_single_process(ranks):
    """Two ranks, CP over both, DistributedDataParallel over both (gloo): every step's gradients (after
    DDP's all-reduce, the same on both ranks) and the final parameters equal the single-process run's.
    Limit 2e-5 relative RMS: both runs are within the fp32 backward tolerance (1e-5) of the exact
    gradient; they differ by the order of fp32 sums (DDP adds the ranks' shares of every parameter
    gradient) and the fp32 chaining of the entering state; measured ~4e-7."""
    results = ranks("training", 2)
    torch.manual_seed(0)
    model = TinyModel()
    history = train(model, TRAIN_STEPS)
    for step, want in enumerate(history):
        for r in results:
            got = r["history"][step]
            for name in want:
                assert rel_rms(got[name], want[name]) <= 2e-5, (step, name)
    final = dict(model.named_parameters())
    for name, p in results[0]["parameters"].items():
        assert rel_rms(p, final[name]) <= 2e-5, name
