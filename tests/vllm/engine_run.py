"""Runs one vLLM engine scenario (or the transformers reference) in its own process; prints JSON.

``python engine_run.py engine CHECKPOINT JSON``: JSON has ``llm`` (LLM keyword arguments), ``warm``
(prompts run to the end first, so that later requests get recycled state slots), ``max_tokens``, and
``solo`` (then each request is served once more, alone, after the phases), and ``phases``, run one
after the other, each to its end: a phase has ``batch`` (prompts submitted
together) and ``later`` (prompts added one a step after ``after`` engine steps, so that they prefill
while the batch decodes: mixed batches). A prompt is text or a list of token ids. Without ``phases``,
the JSON's own ``batch``, ``later`` and ``after`` make the one phase. Prints, per request, its token ids
and the log-probability of each generated token, and kda's counts.

``python engine_run.py reference CHECKPOINT JSON``: JSON is a list of token-id sequences (or
``{"sequences": [...], "bf16": true}``); prints, per sequence, the log-probability transformers' float32
model gives each token after the first (teacher forcing), the largest log-probability at each of those
positions and, with ``bf16``, the bf16 model's log-probability of each token.

The engine runs in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so that kda's counters are this
process's; the reference runs in another process because vLLM registers its own Kimi Linear config
class with transformers' AutoConfig.
"""

import json
import os
import sys
import time


def engine(checkpoint, spec):
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import kda
    import kda.vllm
    from vllm import LLM, SamplingParams

    llm_kwargs = dict(
        enforce_eager=True,
        max_model_len=256,
        enable_prefix_caching=False,
        max_num_seqs=8,
        max_num_batched_tokens=512,
        dtype="bfloat16",
        seed=0,
    )
    llm_kwargs.update(spec.get("llm", {}))
    llm = LLM(checkpoint, **llm_kwargs)
    params = SamplingParams(max_tokens=spec.get("max_tokens", 8), temperature=0, logprobs=0)
    if spec.get("warm"):
        llm.generate([_prompt(p) for p in spec["warm"]], params, use_tqdm=False)
    start = kda.engine.validation_count()
    phases = spec.get("phases") or [{k: spec[k] for k in ("batch", "later", "after") if k in spec}]
    results = []
    for i, phase in enumerate(phases):
        prefix = f"p{i}." if len(phases) > 1 else ""
        began = time.time()
        results += _run_phase(llm.llm_engine, phase, params, prefix)
        print(
            f"engine_run: phase {i} ({phase.get('name', '')}) took {time.time() - began:.1f} s",
            file=sys.stderr,
        )
    if spec.get("solo"):
        # each request again, alone in the engine: what it must equal whatever it was batched with
        began = time.time()
        for r in results:
            alone = _run_phase(llm.llm_engine, {"batch": [r["ids"][: r["prompt_len"]]]}, params, "solo.")[0]
            r["solo_ids"], r["solo_logprobs"] = alone["ids"], alone["logprobs"]
        print(f"engine_run: {len(results)} solo runs took {time.time() - began:.1f} s", file=sys.stderr)
    counts = dict(kda.vllm.counts)
    counts["validations"] = kda.engine.validation_count() - start
    return {"results": results, "counts": counts}


def _prompt(p):
    """A prompt given as text, or as a list of token ids (exact lengths)."""
    return {"prompt_token_ids": p} if isinstance(p, list) else p


def _run_phase(engine, phase, params, prefix):
    """Submits ``batch`` together, then ``later`` one a step from step ``after`` on, and steps the
    engine until every request of the phase finished; returns each request's result."""
    names = []
    for i, prompt in enumerate(phase.get("batch", [])):
        names.append(f"{prefix}b{i}")
        engine.add_request(names[-1], _prompt(prompt), params)
    later = list(phase.get("later", []))
    finished, steps = {}, 0
    while engine.has_unfinished_requests() or later:
        if later and steps >= phase.get("after", 2):
            names.append(f"{prefix}l{len(names)}")
            engine.add_request(names[-1], _prompt(later.pop(0)), params)
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        steps += 1
    results = []
    for name in names:
        out = finished[name]
        completion = out.outputs[0]
        results.append(
            {
                "name": name,
                "prompt_len": len(out.prompt_token_ids),
                "ids": list(out.prompt_token_ids) + list(completion.token_ids),
                "logprobs": [
                    d[t].logprob for d, t in zip(completion.logprobs, completion.token_ids, strict=True)
                ],
            }
        )
    return results


def reference(checkpoint, sequences, bf16=False):
    """Per sequence, from transformers' model, teacher-forced on the tokens after the first:
    ``logprobs`` (float32: each token's log-probability), ``top`` (float32: the largest log-probability
    at each of those positions: a greedy token is right when its own is within rounding of it) and
    with ``bf16``, ``bf16_logprobs`` (the same model in bfloat16: the size of bf16 rounding on these
    tokens)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    out = [{} for _ in sequences]
    with torch.no_grad():
        for dtype in (torch.float32, torch.bfloat16) if bf16 else (torch.float32,):
            model = model.to(dtype)
            for ids, record in zip(sequences, out, strict=True):
                logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)[:-1]
                chosen = logp.gather(1, torch.tensor(ids[1:]).view(-1, 1)).view(-1).tolist()
                if dtype == torch.float32:
                    record.update(logprobs=chosen, top=logp.max(-1).values.tolist())
                else:
                    record["bf16_logprobs"] = chosen
    return out


if __name__ == "__main__":
    mode, checkpoint, argument = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    if mode == "engine":
        result = engine(checkpoint, argument)
    elif isinstance(argument, dict):  # {"sequences": [...], "bf16": true}
        result = reference(checkpoint, argument["sequences"], argument.get("bf16", False))
    else:
        result = reference(checkpoint, argument)
    print("RESULT " + json.dumps(result))
