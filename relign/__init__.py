"""relign: post-training language models toward reasoning."""

import os as _os

# oneDNN, which runs PyTorch's bf16 matrix products on CPU, builds and caches a kernel for every
# new shape (up to 1,024 in each of two caches), and a run's shapes change all the time: every
# decode step attends over one more cached token, every micro-batch has its own length. Measured
# on this project's CPU: 1,200 bf16 linear layers of distinct shapes grew the process by 680 MB,
# and a 600-token decode under model.dtype=bf16-mixed by 1.6 GB. 64 entries keep the memory
# bounded at the same speed. Set here, before torch's first CPU matmul reads them; a value the
# user exported wins. fp32 and GPU runs do not use these caches.
_os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "64")
_os.environ.setdefault("LRU_CACHE_CAPACITY", "64")


def _version() -> str:
    # The installed distribution's metadata is the one source of the version (pyproject.toml);
    # a source tree that was never installed has none.
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("relign")
    except PackageNotFoundError:
        return "0+unknown"


__version__ = _version()
