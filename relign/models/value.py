"""A critic: a causal-LM backbone with a scalar value head on every position.

Saved as the backbone's ``save_pretrained`` folder plus ``value_head.safetensors``, so the
critic of a checkpoint reloads without relign-specific pickles.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def _backbone(lm: torch.nn.Module) -> torch.nn.Module:
    """The decoder stack without the LM head (``model.model`` for Llama/Qwen-style models)."""
    base = lm.get_base_model() if hasattr(lm, "get_base_model") else lm
    return getattr(base, base.base_model_prefix, base) if hasattr(base, "base_model_prefix") else base


class ValueModel(torch.nn.Module):
    """V(s_t) for every token position: Linear(hidden -> 1) on the last hidden state."""

    HEAD_FILE = "value_head.safetensors"

    def __init__(self, lm: torch.nn.Module):
        super().__init__()
        self.lm = lm
        hidden = lm.config.hidden_size
        dtype = next(lm.parameters()).dtype
        self.head = torch.nn.Linear(hidden, 1, dtype=dtype, device=next(lm.parameters()).device)
        # Zero init: the critic starts predicting 0 everywhere instead of noise, which keeps
        # the first advantages equal to the (centred) returns.
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)

    @property
    def config(self):
        return self.lm.config

    def forward(self, input_ids, attention_mask=None, position_ids=None, shifted: bool = True) -> torch.Tensor:
        """values [B, T] (fp32), aligned like ``token_logps``: ``values[:, t] = V(x_<t)``, the
        value of the state in which token t is chosen (read off the hidden state at t - 1);
        ``values[:, 0] = 0``. Rewards, log-probs and values of an action then share an index.
        ``shifted=False``: the value after reading each token, unaligned (context parallel
        aligns a chunk's values itself: its first target's state is the previous chunk's)."""
        out = _backbone(self.lm)(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
        h = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        # the head's dtype: a bf16-compute backbone hands back bf16 hidden states
        v = self.head(h.to(self.head.weight.dtype)).squeeze(-1).float()  # [B, T], V after reading token t
        return torch.nn.functional.pad(v[:, :-1], (1, 0), value=0.0) if shifted else v

    def save_pretrained(self, path, safe_serialization: bool = True, state_dict=None) -> None:
        """The backbone as a HF folder plus the head's file. ``state_dict``: this module's full
        state (``lm.*``, ``head.*``) gathered from FSDP shards; else the module's own tensors."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        if state_dict is None:
            self.lm.save_pretrained(path, safe_serialization=True)
            head = self.head.state_dict()
        else:
            self.lm.save_pretrained(path, safe_serialization=True,
                                    state_dict={k[3:]: v for k, v in state_dict.items() if k.startswith("lm.")})
            head = {k[5:]: v for k, v in state_dict.items() if k.startswith("head.")}
        save_file({k: v.detach().contiguous().cpu() for k, v in head.items()}, str(path / self.HEAD_FILE))

    def load_head(self, path) -> None:
        sd = load_file(str(Path(path) / self.HEAD_FILE))
        self.head.load_state_dict(sd)
