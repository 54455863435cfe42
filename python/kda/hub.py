"""Writes this installed package as a Hugging Face ``kernels`` hub repository folder.

    python -m kda.hub OUT_DIR [--version N]

``OUT_DIR/build/<variant>/`` then holds ``metadata.json`` and a copy of the package (the compiled
engine included), which ``kernels.get_local_kernel(OUT_DIR)`` and ``kernels.LocalLayerRepository``
(kernels 0.17.2) load. The variant is the one kernels computes for the running torch, e.g.
``torch213-cpu-x86_64-linux``; the engine is not compiled against torch, so the same files serve any
torch of that Python version and machine. ``kernels`` imports the copy under the name in
``metadata.json``'s ``id``, so it never collides with the installed ``kda`` (its custom ops get their
own namespace too).
"""

import argparse
import hashlib
import json
import platform
import shutil
import sys
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
NAME = "kda"
LICENSE = "Apache-2.0"


def variant_name() -> str:
    """kernels' variant name of a CPU kernel for the running torch: torch<MAJOR><MINOR>-cpu-<arch>-<os>."""
    import torch

    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    arch = {"amd64": "x86_64", "arm64": "aarch64"}.get(platform.machine().lower(), platform.machine().lower())
    system = {"darwin": "darwin", "win32": "windows"}.get(sys.platform, "linux")
    return f"torch{major}{minor}-cpu-{arch}-{system}"


def _package_files():
    """The package's files as they are installed: Python modules and the compiled engine."""
    for path in sorted(PACKAGE_DIR.iterdir()):
        if path.is_file() and (path.suffix == ".py" or path.name.startswith("_engine.")):
            yield path


def build(out_dir, version: int = 1) -> Path:
    """Writes the hub folder under ``out_dir``; returns the variant directory."""
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise ValueError(f"kda.hub: version must be a positive integer, got {version!r}")
    files = list(_package_files())
    if not any(f.name.startswith("_engine.") for f in files):
        raise FileNotFoundError(f"kda.hub: the compiled engine (_engine.*) is missing from {PACKAGE_DIR}")
    digest = hashlib.sha256()
    for f in files:
        digest.update(f.name.encode())
        digest.update(f.read_bytes())
    variant_dir = Path(out_dir) / "build" / variant_name()
    package_dir = variant_dir / NAME
    if variant_dir.exists():
        shutil.rmtree(variant_dir)
    package_dir.mkdir(parents=True)
    for f in files:
        shutil.copy2(f, package_dir / f.name)
    metadata = {
        # The module name kernels imports the copy under: unique per content.
        "id": f"_{NAME}_{digest.hexdigest()[:12]}",
        "name": NAME,
        "version": version,
        "license": LICENSE,
        "backend": {"type": "cpu"},
        "python-depends": [],
    }
    (variant_dir / "metadata.json").write_text(json.dumps(metadata, indent=2) + "\n")
    return variant_dir


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kda.hub", description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", help="folder to write (its build/<variant>/ is replaced)")
    parser.add_argument("--version", type=int, default=1, help="the kernel's integer version (default 1)")
    args = parser.parse_args(argv)
    variant_dir = build(args.out_dir, args.version)
    print(f"kda.hub: wrote {variant_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
