"""bench/ab/varlen.py, the GPU check of varlen attention (a section of bench/gpu_ab.py), in its
smoke shape on the CPU: the device run's code, with the dense reference in the flash kernel's
place, gives the old path's log-probs and aligns continuations at the bottom right."""

from __future__ import annotations

import json

from relign.models import varlen

from .conftest import load_script


def test_varlen_section_smoke_on_cpu():
    mod = load_script("bench/ab/varlen.py", "ab_varlen")
    res = mod.run(smoke=True, device="cpu", budget_s=60.0)
    json.dumps(res)  # JSON-able
    assert res["skipped"] == [] and set(res["sync"].values()) == {"skipped (cpu)"}
    # fp32: the layout path is the position-id path to rounding, and so are the shared-prefix rows
    assert res["packed"]["dlogp_max"] < 1e-5 and res["packed"]["within_spec"]
    assert res["gqa"]["dlogp_max"] < 1e-5 and res["groups"]["dlogp_max"] < 1e-5
    assert res["groups"]["packed_tokens"] == 6 + sum(res["groups"]["responses"]) + 7  # the prompt once, its last token 7 more times
    assert res["compile"]["fullgraph"] == "ok" and res["compile"]["max_abs"] < 1e-6
    assert res["alignment"]["bottom_right_max_abs"] < 1e-6 < 0.1 < res["alignment"]["top_left_max_abs"]
    assert not varlen._FLASH and varlen.CPU_KERNEL is None and not varlen.REPEAT_KV  # the module is left as it was
