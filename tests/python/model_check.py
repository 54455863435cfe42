"""What the transformers model checks of every family share (kimi_linear_check.py,
gdn_models_check.py, harness.MODEL_CHECKS): an op counter, the relative error, a training step,
greedy generation with the cache and the namespace of the hub's copy of kda. It imports torch only:
the checks make fla unimportable before transformers is imported."""

import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class OpLog(TorchDispatchMode):
    """Counts the ops of a namespace the dispatcher runs."""

    def __init__(self, namespace):
        super().__init__()
        self.namespace, self.counts = namespace, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == self.namespace:
            name = func.__name__.split(".")[0]
            self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    den = b.norm().item()
    return (a - b).norm().item() / den if den > 0 else (a - b).norm().item()


def train_step(model, ids):
    model.train()
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.logits.detach(), {
        n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None
    }


def generate(model, prompt, new_tokens):
    model.eval()
    with torch.no_grad():
        return model.generate(
            prompt, max_new_tokens=new_tokens, do_sample=False, use_cache=True, min_new_tokens=new_tokens
        )


def namespace_of_the_hub_copy():
    return next(
        m.ops.NAMESPACE
        for name, m in sys.modules.items()
        if name.startswith("_kda_") and hasattr(m, "ops") and m.__name__ == name
    )
