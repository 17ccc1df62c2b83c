"""relign: post-training language models toward reasoning."""


def _version() -> str:
    # The installed distribution's metadata is the one source of the version (pyproject.toml);
    # a source tree that was never installed has none.
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("relign")
    except PackageNotFoundError:
        return "0+unknown"


__version__ = _version()
