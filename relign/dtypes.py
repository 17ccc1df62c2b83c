"""``model.dtype``'s table: each name's parameter and compute dtypes and its compute mode. Torch-free,
so the checks and the memory plan read it without loading torch."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Dtype:
    """One ``model.dtype``: what the parameters are stored in (their gradients and AdamW's moments
    too), what the forward computes in, and how it gets there."""

    param: str
    """torch's name of the parameters' dtype: float32 or bfloat16."""
    compute: str
    """torch's name of the forward's dtype."""
    mode: str = ""
    """"": the parameters' own dtype; "autocast": bf16 products under autocast, the residual stream and
    norms fp32 (bf16-mixed); "cast": the forward on bf16 copies of all the weights (bf16-compute)."""


DTYPES: dict[str, Dtype] = {  # model.dtype (models/precision.py does the compute modes; plan.py counts their bytes)
    "fp32": Dtype("float32", "float32"),
    "float32": Dtype("float32", "float32"),
    "bf16": Dtype("bfloat16", "bfloat16"),
    "bfloat16": Dtype("bfloat16", "bfloat16"),
    "bf16-mixed": Dtype("float32", "bfloat16", "autocast"),
    "bf16-compute": Dtype("float32", "bfloat16", "cast"),
}
