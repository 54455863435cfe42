"""Runs one vLLM engine scenario (or the transformers reference) in its own process; prints JSON.

``python engine_run.py engine CHECKPOINT JSON``: JSON has ``llm`` (LLM keyword arguments), ``batch`` (a
list of prompts submitted together), ``later`` (prompts added one at a time after ``after`` engine
steps, so that they prefill while the batch decodes: mixed batches), ``warm`` (prompts run to the end
first, so that later requests get recycled state slots) and ``max_tokens``. Prints, per request, its
token ids and the log-probability of each generated token, and kda's counts.

``python engine_run.py reference CHECKPOINT JSON``: JSON is a list of token-id sequences; prints, per
sequence, the log-probability transformers' float32 model gives each token after the first (teacher
forcing) and the largest log-probability at each of those positions.

The engine runs in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so that kda's counters are this
process's; the reference runs in another process because vLLM registers its own Kimi Linear config
class with transformers' AutoConfig.
"""

import json
import os
import sys


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
        llm.generate(spec["warm"], params, use_tqdm=False)
    start = kda.engine.validation_count()
    engine = llm.llm_engine
    names = []
    for i, prompt in enumerate(spec["batch"]):
        engine.add_request(f"b{i}", prompt, params)
        names.append(f"b{i}")
    later = list(spec.get("later", []))
    finished, steps = {}, 0
    while engine.has_unfinished_requests() or later:
        if later and steps >= spec.get("after", 2):
            name = f"l{len(names)}"
            engine.add_request(name, later.pop(0), params)
            names.append(name)
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
                "text": completion.text,
                "ids": list(out.prompt_token_ids) + list(completion.token_ids),
                "logprobs": [
                    d[t].logprob for d, t in zip(completion.logprobs, completion.token_ids, strict=True)
                ],
            }
        )
    counts = dict(kda.vllm.counts)
    counts["validations"] = kda.engine.validation_count() - start
    return {"results": results, "counts": counts}


def reference(checkpoint, sequences):
    """Per sequence: ``logprobs`` (transformers' float32 log-probability of each token after the first,
    teacher-forced) and ``top`` (the largest log-probability at each of those positions: a greedy
    token is right when its own is within rounding of it)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for ids in sequences:
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)[:-1]
            chosen = logp.gather(1, torch.tensor(ids[1:]).view(-1, 1)).view(-1)
            out.append({"logprobs": chosen.tolist(), "top": logp.max(-1).values.tolist()})
    return out


if __name__ == "__main__":
    mode, checkpoint, argument = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    result = engine(checkpoint, argument) if mode == "engine" else reference(checkpoint, argument)
    print("RESULT " + json.dumps(result))
