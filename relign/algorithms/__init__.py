"""Pure math: tensors in, tensors (and metric dicts) out. No config, logging or distributed calls."""
