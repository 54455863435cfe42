"""The Hugging Face `kernels` hub layout written by `python -m kda.hub`, loaded by kernels 0.17.2."""

import inspect
import json
import subprocess
import sys

import kda
import pytest
import torch
from harness import KIMI, Case, make_inputs
from kda import hub

kernels = pytest.importorskip("kernels")
kernels_variants = pytest.importorskip("kernels.variants")


def test_folder_layout_and_metadata(hub_folder):
    variant_dir = hub_folder / "build" / hub.variant_name()
    metadata = json.loads((variant_dir / "metadata.json").read_text())
    assert metadata["name"] == "kda" and metadata["id"].startswith("_kda_") and metadata["id"].isidentifier()
    assert isinstance(metadata["version"], int) and metadata["license"]
    assert metadata["backend"] == {"type": "cpu"} and metadata["python-depends"] == []
    assert (variant_dir / "kda" / "__init__.py").exists() and (variant_dir / "kda" / "layers.py").exists()
    assert list((variant_dir / "kda").glob("_engine.*"))


def test_kernels_picks_a_variant_for_every_supported_torch(hub_folder):
    # One engine serves every torch (it is not compiled against torch): the stable-ABI variant of the
    # lowest torch the package declares, which kernels prefers, and one per torch minor up to this one.
    names = hub.variant_names()
    major, minor = torch.__version__.split(".")[:2]
    assert names[0] == "torch-stable-abi26-" + hub.variant_name().split("-", 1)[1]
    assert names[1].startswith("torch26-cpu-") and names[-1] == hub.variant_name()
    assert hub.variant_name().startswith(f"torch{major}{minor}-cpu-")
    assert sorted(p.name for p in (hub_folder / "build").iterdir()) == sorted(names)
    found = kernels_variants.get_variants_local(hub_folder / "build")
    chosen, _ = kernels_variants.resolve_variant(found)
    assert chosen is not None and chosen.variant_str == names[0]
    assert {v.variant_str for v in found} == set(names)


def test_folder_carries_the_engines_libraries(hub_folder):
    # Loaded alone in a fresh process, the hub's engine maps Highway from the folder, not the system's.
    code = (
        "import kernels, pathlib, sys; m = kernels.get_local_kernel(pathlib.Path(sys.argv[1])); "
        "print([l.split()[-1] for l in open('/proc/self/maps') if '/libhwy' in l][0]); "
        "print(m.engine.__file__)"
    )
    command = [sys.executable, "-c", code, str(hub_folder)]
    run = subprocess.run(command, capture_output=True, text=True, check=True)
    hwy, engine = run.stdout.split()
    variant_dir = hub_folder / "build" / hub.variant_names()[0]
    assert engine.startswith(str(variant_dir / "kda")), engine
    assert hwy.startswith(str(variant_dir / hub.LIBS_DIR)), hwy


def test_loaded_module_is_a_separate_copy_with_bitwise_equal_results(hub_folder):
    module = kernels.get_local_kernel(hub_folder)
    assert module.__name__ != "kda" and module.ops.NAMESPACE == module.__name__
    assert module.engine is not kda.engine  # its own copy of the extension
    case = Case(B=2, T=90, H=2, HV=4, K=16, V=16, regime="unbounded", **KIMI)
    tensors, options = make_inputs(case)
    for function in ("chunk_kda", "fused_recurrent_kda"):
        ours = {n: t.clone().requires_grad_() for n, t in tensors.items()}
        theirs = {n: t.clone().requires_grad_() for n, t in tensors.items()}
        o, s = getattr(kda, function)(**ours, output_final_state=True, **options)
        o_hub, s_hub = getattr(module, function)(**theirs, output_final_state=True, **options)
        assert torch.equal(o, o_hub) and torch.equal(s, s_hub)
        (o.sum() + s.sum()).backward()
        (o_hub.sum() + s_hub.sum()).backward()
        for n in tensors:
            assert torch.equal(ours[n].grad, theirs[n].grad), n


def test_layers_have_the_reference_signatures(hub_folder):
    module = kernels.get_local_kernel(hub_folder)
    chunk = module.layers.chunk_kimi_delta_attention
    recurrent = module.layers.recurrent_kimi_delta_attention
    for layer in (chunk, recurrent):
        assert issubclass(layer, torch.nn.Module) and layer.__init__ is torch.nn.Module.__init__
        assert layer.has_backward is True and layer.can_torch_compile is True
    assert list(inspect.signature(chunk.forward).parameters) == [
        "self",
        "query",
        "key",
        "value",
        "g",
        "beta",
        "chunk_size",
        "initial_state",
        "output_final_state",
        "use_qk_l2norm_in_kernel",
        "kwargs",
    ]
    assert list(inspect.signature(recurrent.forward).parameters) == [
        "self",
        "query",
        "key",
        "value",
        "g",
        "beta",
        "initial_state",
        "output_final_state",
        "use_qk_l2norm_in_kernel",
        "kwargs",
    ]
    transformers_kimi = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")
    for layer, reference in (
        (chunk, "chunk_kimi_delta_attention"),
        (recurrent, "recurrent_kimi_delta_attention"),
    ):
        ref = getattr(transformers_kimi, reference)
        # names, kinds and defaults: the models pass chunk_size and the rest by keyword or position
        assert _parameters(layer.forward) == _parameters(
            inspect.unwrap(ref.forward if hasattr(ref, "forward") else ref)
        )


def _parameters(function):
    return [(n, p.kind, p.default) for n, p in inspect.signature(function).parameters.items() if n != "self"]


def test_command_line(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "kda.hub", str(tmp_path), "--version", "3"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert hub.variant_name() in result.stdout
    metadata = json.loads((tmp_path / "build" / hub.variant_name() / "metadata.json").read_text())
    assert metadata["version"] == 3
    with pytest.raises(ValueError, match="positive integer"):
        hub.build(tmp_path, version=0)


def test_gated_delta_rule_layers_have_transformers_signatures(hub_folder):
    module = kernels.get_local_kernel(hub_folder)
    qwen = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    for layer, reference in (
        (module.layers.chunk_gated_delta_rule, qwen.torch_chunk_gated_delta_rule),
        (module.layers.recurrent_gated_delta_rule, qwen.torch_recurrent_gated_delta_rule),
    ):
        assert issubclass(layer, torch.nn.Module) and layer.__init__ is torch.nn.Module.__init__
        assert layer.has_backward is True and layer.can_torch_compile is True
        # transformers' decorator makes the function a kernels module whose forward has its signature
        ours = inspect.signature(layer.forward).parameters
        theirs = inspect.signature(type(reference).forward).parameters
        assert [(n, p.kind, p.default) for n, p in ours.items()] == [
            (n, p.kind, p.default) for n, p in theirs.items()
        ]
