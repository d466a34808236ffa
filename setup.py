"""Build of quamba: the Python package always; the CUDA extension ``quamba._C`` when it can be built.

The extension is built from every ``csrc/**/*.cu`` and ``csrc/**/*.cpp`` (or the kernel families
named in ``QUAMBA_CUDA_FAMILIES``) when PyTorch with CUDA and nvcc are present and the environment variable ``QUAMBA_BUILD_CUDA`` is not ``"0"``. Without
them (a CPU machine, or build isolation without torch) ``pip install -e .`` installs the pure
Python package and every op runs on its torch reference.

``TORCH_CUDA_ARCH_LIST`` (e.g. ``"8.0;8.6;8.9;9.0a"``, entries may end in ``+PTX``) picks the
targets; unset, the visible GPU's capability is used, else all supported ones. ``9.0`` is built
as ``9.0a``: the Hopper GEMM needs wgmma, and sm_90a machine code runs on every 9.0 device.

The extension must load libstdc++ as a shared library, as torch does: with a static copy of its
own, every error a kernel's input check raises (a C++ exception crossing into torch) kills the
process with a segmentation fault. Some toolchains link it statically (the lent H100 image's
``CXX=/opt/gcc/bin/g++`` did); the build then takes the first ``g++`` on PATH that links it
dynamically, says so, and checks the built library either way.
"""
from __future__ import annotations

import glob
import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import tempfile

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))
DEFAULT_ARCHS = ["8.0", "8.6", "8.9", "9.0a"]
MIN_ARCH = (8, 0)


# loading an export (quamba.export) in transformers and its tests: 0.20.1 is the version tested
# with transformers 5.24 (which needs >= 0.15); writing an export needs neither
EXPORT_REQUIRES = ["compressed-tensors==0.20.1"]


def read_version() -> str:
    with open(os.path.join(ROOT, "quamba", "version.py")) as f:
        return re.search(r'__version__\s*=\s*"([^"]+)"', f.read()).group(1)


def load_torch_build_tools():
    """torch.utils.cpp_extension if torch with CUDA and nvcc are here, else None."""
    if os.environ.get("QUAMBA_BUILD_CUDA", "1") == "0":
        return None
    try:  # torch is imported lazily: build isolation without torch must still work
        import torch
        from torch.utils import cpp_extension
    except ImportError:
        return None
    if torch.version.cuda is None or cpp_extension.CUDA_HOME is None:
        return None
    if not os.path.exists(os.path.join(cpp_extension.CUDA_HOME, "bin", "nvcc")):
        return None
    return cpp_extension


def cutlass_include_dirs() -> list[str]:
    """Header folders of the nvidia-cutlass pip package (found without importing it)."""
    spec = importlib.util.find_spec("cutlass_library")
    roots = list(spec.submodule_search_locations or []) if spec else []
    for root in roots:
        dirs = [os.path.join(root, "source", "include"),
                os.path.join(root, "source", "tools", "util", "include")]
        if all(os.path.isdir(d) for d in dirs):
            return dirs
    raise RuntimeError(
        "Building quamba's CUDA extension needs the CUTLASS headers of the nvidia-cutlass package "
        "(pip install nvidia-cutlass==4.2.0.0), or set QUAMBA_BUILD_CUDA=0 to skip the extension.")


def requested_archs() -> list[str]:
    env = os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip()
    if env:
        return [a for a in re.split(r"[;\s,]+", env) if a]
    import torch
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return [f"{major}.{minor}"]
    return DEFAULT_ARCHS


def gencode_flags(archs: list[str]) -> tuple[list[str], bool]:
    """nvcc -gencode flags for the arch list, and whether sm_90a is among them."""
    flags, has_sm90a = [], False
    for entry in archs:
        match = re.fullmatch(r"(\d+)\.(\d+)(a?)(\+PTX)?", entry)
        if not match:
            raise RuntimeError(f"TORCH_CUDA_ARCH_LIST: cannot read {entry!r} (expected e.g. 8.6 or 9.0a)")
        major, minor, suffix, ptx = int(match[1]), int(match[2]), match[3], match[4]
        if (major, minor) < MIN_ARCH:
            raise RuntimeError(f"TORCH_CUDA_ARCH_LIST: {entry} is below compute capability 8.0, "
                               "the oldest quamba's int8 kernels support")
        if (major, minor) == (9, 0):
            suffix = "a"
        code = f"{major}{minor}{suffix}"
        has_sm90a |= code == "90a"
        flags.append(f"-gencode=arch=compute_{code},code=sm_{code}")
        if ptx:
            flags.append(f"-gencode=arch=compute_{code},code=compute_{code}")
    return sorted(set(flags)), has_sm90a


def extension_sources() -> list[str]:
    """csrc/module.cpp and the kernel families (csrc/<family>/); QUAMBA_CUDA_FAMILIES (e.g.
    "gemm,conv1d") limits the build to some of them while one family is being worked on."""
    sources = sorted(glob.glob("csrc/**/*.cu", recursive=True) + glob.glob("csrc/**/*.cpp", recursive=True))
    families = [f for f in os.environ.get("QUAMBA_CUDA_FAMILIES", "").split(",") if f]
    if not families:
        return sources
    return [s for s in sources if os.path.dirname(s) == "csrc" or s.split(os.sep)[1] in families]


def cuda_extensions(cpp_extension):
    sources = extension_sources()
    arch_flags, has_sm90a = gencode_flags(requested_archs())
    defines = ["-DQUAMBA_HAS_SM90A"] if has_sm90a else []
    common = ["-DNDEBUG", "-O3", "-std=c++17"] + defines
    nvcc = common + ["--expt-relaxed-constexpr", "-lineinfo"] + arch_flags
    include_dirs = [os.path.join(ROOT, "csrc")] + cutlass_include_dirs()
    return [cpp_extension.CUDAExtension(
        name="quamba._C", sources=sources, include_dirs=include_dirs,
        extra_compile_args={"cxx": common, "nvcc": nvcc})]


def needs_shared_libstdcxx(library: str) -> bool | None:
    """Whether the shared library loads libstdc++ dynamically (None: readelf cannot tell)."""
    try:
        dynamic = subprocess.run(["readelf", "-d", library], capture_output=True, text=True,
                                 check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return "libstdc++.so" in dynamic


def links_libstdcxx_dynamically(cxx: str) -> bool | None:
    """Whether a C++ shared library linked by the compiler ``cxx`` loads libstdc++ dynamically
    (None: the probe could not be built or read)."""
    with tempfile.TemporaryDirectory() as tmp:
        source, library = os.path.join(tmp, "probe.cpp"), os.path.join(tmp, "probe.so")
        with open(source, "w") as f:
            f.write("#include <stdexcept>\n#include <string>\n"
                    "void probe(int n) { throw std::runtime_error(std::to_string(n)); }\n")
        try:
            subprocess.run([*shlex.split(cxx), "-shared", "-fPIC", source, "-o", library],
                           capture_output=True, check=True)
        except (OSError, subprocess.CalledProcessError):
            return None
        return needs_shared_libstdcxx(library)


def use_compilers_with_shared_libstdcxx() -> None:
    """Keep the environment's CXX unless it links libstdc++ statically; then take the first g++
    on PATH that does not (and the gcc beside it as CC)."""
    cxx = os.environ.get("CXX", "c++")
    if links_libstdcxx_dynamically(cxx) is not False:
        return
    for candidate in filter(None, (shutil.which("g++"), shutil.which("c++"))):
        if links_libstdcxx_dynamically(candidate):
            gcc = os.path.join(os.path.dirname(candidate), "gcc")
            print(f"quamba setup: CXX={cxx} links libstdc++ statically, so kernel errors would crash "
                  f"the process; building with CXX={candidate} instead")
            os.environ["CXX"] = candidate
            if os.path.exists(gcc):
                os.environ["CC"] = gcc
            return
    raise RuntimeError(f"CXX={cxx} links libstdc++ statically (kernel errors would crash the "
                       "process) and no g++ on PATH links it dynamically; set CXX and CC to one that "
                       "does, or QUAMBA_BUILD_CUDA=0 to skip the extension")


def checked_build_ext(cpp_extension):
    """torch's BuildExtension, refusing a built extension that carries its own libstdc++."""
    class BuildExtension(cpp_extension.BuildExtension):
        def build_extension(self, ext):
            super().build_extension(ext)
            library = self.get_ext_fullpath(ext.name)
            if needs_shared_libstdcxx(library) is False:
                raise RuntimeError(f"{library} links libstdc++ statically: kernel errors would "
                                   "crash the process; build with a CXX that links it dynamically")
    return BuildExtension


def extension_kwargs() -> dict:
    cpp_extension = load_torch_build_tools()
    if cpp_extension is None:
        return {}
    use_compilers_with_shared_libstdcxx()
    return {"ext_modules": cuda_extensions(cpp_extension),
            "cmdclass": {"build_ext": checked_build_ext(cpp_extension)}}


setup(
    name="quamba",
    version=read_version(),
    description="Post-training quantization of Mamba language models (W8A8, CUDA kernels)",
    packages=find_packages(include=["quamba*"]),
    python_requires=">=3.10",
    install_requires=[
        "torch",
        "transformers",  # tokenizers and the reference MambaForCausalLM of the equivalence tests
        "tokenizers",  # the test model's BPE (scripts/train_tiny_mamba.py)
        "safetensors",  # checkpoints: raw int8 codes and fp32 scales, no pickle
        "huggingface_hub",  # Hub model ids
        "datasets",  # Hub calibration sets (streamed) and lm-eval's task data
        "lm-eval==0.4.13",  # zero-shot evaluation; pinned, its task YAMLs are included by path
        "tqdm",  # progress of calibration and evaluation
        "matplotlib",  # mode-comparison charts
        "numpy",
        "scikit-learn",  # its bundled 8x8 digits: the offline image set of the Vision Mamba tests
        "pillow",  # ImageFolder image sets for Vision Mamba evaluation
    ],
    extras_require={"dev": [
        "pytest",
        # the equivalence tests' reference models: before 5.23, transformers' torch path of Mamba2
        # (Bamba's, Granite-4.0-H's, Zamba2's too) takes the gated RMSNorm over all n_groups at once
        "transformers>=5.23",
        # the SentencePiece tokenizer of Megatron-LM checkpoints (NVIDIA's Mamba2-8B) in
        # tests/models/test_megatron.py; reading such a tokenizer needs it, nothing else does
        "sentencepiece",
        *EXPORT_REQUIRES,  # the export round-trip tests (tests/export) run in CI too
        "scipy",  # cont2discrete and solve_ivp: the references of tests/ops/test_discretization.py
        # its interpreter runs the Triton kernels' small tests on CPU (TRITON_INTERPRET, set by
        # tests/conftest.py); on a GPU the triton that torch's CUDA wheels pin satisfies it
        "triton; platform_system == 'Linux'",
    ],
        "export": EXPORT_REQUIRES},
    **extension_kwargs(),
)
