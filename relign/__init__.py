"""relign: post-training language models toward reasoning."""

__version__ = "0.1.0"
