"""Writes this installed package as a Hugging Face ``kernels`` hub repository folder.

    python -m kda.hub OUT_DIR [--version N]

``OUT_DIR/build/<variant>/`` then holds ``metadata.json``, a copy of the package (the compiled engine
included) and the shared libraries the engine loads from beside it (``kda_kernels.libs/``: Highway),
so that the folder runs on machines that have no Highway installed; the OpenMP runtime comes from the
process (torch's), as for the wheel. ``kernels.get_local_kernel(OUT_DIR)`` and
``kernels.LocalLayerRepository`` (kernels 0.17.2) load it.

The engine is not compiled against torch, so the same files serve every torch the torch layer supports:
one variant per torch minor version from the lowest the package declares (``torch>=2.6``) to the
running one (``torch26-cpu-x86_64-linux`` ... ``torch213-cpu-x86_64-linux``), plus the torch stable-ABI
variant of that lowest version (``torch-stable-abi26-...``), which kernels prefers and accepts for every
later torch. ``kernels`` imports the copy under the name in ``metadata.json``'s ``id``, so it never
collides with the installed ``kda`` (its custom ops get their own namespace too). ``--version N`` is
the integer that ``kernels.get_kernel(repo, version=N)`` resolves to the repository's branch ``vN``:
push the folder to that branch, and raise N only when the layers' interface changes.
"""

import argparse
import hashlib
import json
import platform
import re
import shutil
import sys
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
NAME = "kda"
DISTRIBUTION = "kda-kernels"
LICENSE = "Apache-2.0"
LIBS_DIR = "kda_kernels.libs"  # where auditwheel grafts the engine's libraries; its RUNPATH names it
LOWEST_TORCH = (2, 6)  # when the installed metadata does not say (pyproject.toml: torch>=2.6)


def _platform() -> str:
    arch = {"amd64": "x86_64", "arm64": "aarch64"}.get(platform.machine().lower(), platform.machine().lower())
    system = {"darwin": "darwin", "win32": "windows"}.get(sys.platform, "linux")
    return f"cpu-{arch}-{system}"


def _running_torch() -> tuple[int, int]:
    import torch

    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def variant_name() -> str:
    """kernels' variant name of a CPU kernel for the running torch: torch<MAJOR><MINOR>-cpu-<arch>-<os>."""
    major, minor = _running_torch()
    return f"torch{major}{minor}-{_platform()}"


def _lowest_torch() -> tuple[int, int]:
    """The lowest torch the installed distribution declares (its `torch` extra), else LOWEST_TORCH."""
    from importlib.metadata import PackageNotFoundError, requires

    try:
        for requirement in requires(DISTRIBUTION) or ():
            found = re.match(r"torch\s*>=\s*(\d+)\.(\d+)", requirement)
            if found:
                return int(found.group(1)), int(found.group(2))
    except PackageNotFoundError:
        pass
    return LOWEST_TORCH


def variant_names() -> list[str]:
    """Every variant the folder holds: the stable-ABI one, then one per torch minor, lowest to running."""
    lowest, (major, running) = _lowest_torch(), _running_torch()
    minors = range(lowest[1], running + 1) if lowest[0] == major else [running]
    return [f"torch-stable-abi{lowest[0]}{lowest[1]}-{_platform()}"] + [
        f"torch{major}{m}-{_platform()}" for m in minors
    ]


def _package_files():
    """The package's files as they are installed: Python modules and the compiled engine."""
    for path in sorted(PACKAGE_DIR.iterdir()):
        if path.is_file() and (path.suffix == ".py" or path.name.startswith("_engine.")):
            yield path


def _engine_libraries() -> list[Path]:
    """The libraries the engine loads from beside the package: a wheel's grafted copies, or (a source
    build, linked to the system's Highway) the Highway library this process loaded."""
    grafted = PACKAGE_DIR.parent / LIBS_DIR
    if grafted.is_dir():
        return sorted(p for p in grafted.iterdir() if p.is_file())
    from . import _engine  # noqa: F401 - maps the libraries the engine needs

    loaded = set()
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if re.search(r"/libhwy[^/]*\.so", path):
                loaded.add(Path(path))
    return sorted(loaded)


def build(out_dir, version: int = 1) -> Path:
    """Writes the hub folder under ``out_dir``; returns the running torch's variant directory."""
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise ValueError(f"kda.hub: version must be a positive integer, got {version!r}")
    files = list(_package_files())
    if not any(f.name.startswith("_engine.") for f in files):
        raise FileNotFoundError(f"kda.hub: the compiled engine (_engine.*) is missing from {PACKAGE_DIR}")
    libraries = _engine_libraries()
    digest = hashlib.sha256()
    for f in files + libraries:
        digest.update(f.name.encode())
        digest.update(f.read_bytes())
    metadata = {
        # The module name kernels imports the copy under: unique per content.
        "id": f"_{NAME}_{digest.hexdigest()[:12]}",
        "name": NAME,
        "version": version,
        "license": LICENSE,
        "backend": {"type": "cpu"},
        "python-depends": [],
    }
    for variant in variant_names():
        variant_dir = Path(out_dir) / "build" / variant
        if variant_dir.exists():
            shutil.rmtree(variant_dir)
        (variant_dir / NAME).mkdir(parents=True)
        for f in files:
            shutil.copy2(f, variant_dir / NAME / f.name)
        if libraries:
            (variant_dir / LIBS_DIR).mkdir()
            for lib in libraries:
                # Under the name the engine asks for: a grafted copy's own, else the soname (libhwy.so.1).
                name = lib.name if lib.parent.name == LIBS_DIR else re.sub(r"(\.so\.\d+).*$", r"\1", lib.name)
                shutil.copy2(lib, variant_dir / LIBS_DIR / name)
        (variant_dir / "metadata.json").write_text(json.dumps(metadata, indent=2) + "\n")
    return Path(out_dir) / "build" / variant_name()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kda.hub", description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", help="folder to write (its build/<variant>/ is replaced)")
    parser.add_argument("--version", type=int, default=1, help="the kernel's integer version (default 1)")
    args = parser.parse_args(argv)
    variant_dir = build(args.out_dir, args.version)
    print(f"kda.hub: wrote {variant_dir.parent} ({', '.join(variant_names())}), version {args.version}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
