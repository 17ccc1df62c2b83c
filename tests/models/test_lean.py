"""model.lean_activations: the SwiGLU MLP saves g and u for backward, not g, silu(g), u and
silu(g) * u, and Llama/Qwen RMSNorms save x and 1/rms, not the normalized x. Outputs are bitwise
the modules' own; the MLP's gradients are bitwise autograd's, the norms' equal to float rounding."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from relign.models import lean
from relign.models.loading import apply_lora, load_causal_lm
from relign.models.logprobs import token_logps
from relign.models.tiny import build_tiny_model

IDS = torch.tensor([[5, 17, 300, 42, 8, 9, 1000, 77, 3, 250], [61, 2, 90, 14, 500, 33, 7, 120, 41, 19]])
MASK = torch.tensor([[1] * 10, [1] * 6 + [0] * 4])


def _loss(model) -> torch.Tensor:
    logps, _ = token_logps(model, IDS, attention_mask=MASK)
    return -(logps * MASK).sum()


def _grads(model) -> dict[str, torch.Tensor]:
    model.zero_grad()
    _loss(model).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _saved_bytes(model) -> int:
    """Bytes autograd keeps for backward over one forward (each storage counted once)."""
    seen: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _loss(model)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(n for ptr, n in seen.items() if ptr not in params)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_same_outputs_and_gradients_and_less_saved(arch):
    plain, _ = build_tiny_model(arch=arch, size="micro", seed=3)
    c = plain.config
    mlp_only, lean_model = copy.deepcopy(plain), copy.deepcopy(plain)
    assert sum(lean.lean_activations(layer.mlp) for layer in mlp_only.model.layers) == c.num_hidden_layers
    assert lean.lean_activations(lean_model) == c.num_hidden_layers * 3 + 1  # MLPs, two norms a layer, the final norm
    with torch.no_grad():  # without gradients it is the module's own forward
        assert torch.equal(plain(IDS, attention_mask=MASK).logits, lean_model(IDS, attention_mask=MASK).logits)
    # with gradients: the same ops in the same order, so the loss is bitwise equal
    assert torch.equal(_loss(plain), _loss(lean_model))
    g_plain, g_mlp, g_lean = _grads(plain), _grads(mlp_only), _grads(lean_model)
    assert g_plain.keys() == g_lean.keys() == g_mlp.keys() and len(g_plain) == len(list(plain.parameters()))
    for k in g_plain:
        # the MLP's backward runs autograd's kernels on the same shapes: bitwise
        assert torch.equal(g_mlp[k], g_plain[k]), k
        # the norm's is autograd's op for op too, but x's gradient terms (two from the norm, one
        # from the residual) are added in another order: float32 rounding
        torch.testing.assert_close(g_lean[k], g_plain[k], rtol=1e-5, atol=1e-6, msg=k)
    # what is no longer kept, per token: silu(g) and silu(g) * u in each MLP (2 x I floats), the
    # normalized x in each RMSNorm (H floats)
    tokens = IDS.numel()
    assert _saved_bytes(plain) - _saved_bytes(mlp_only) == c.num_hidden_layers * 2 * tokens * c.intermediate_size * 4
    norms = 2 * c.num_hidden_layers + 1
    assert _saved_bytes(mlp_only) - _saved_bytes(lean_model) == norms * tokens * c.hidden_size * 4


def test_bf16_mixed_gradients_match_autograds(tiny_model_dir):
    """Under autocast the backward runs in bf16 as autograd's would (x's two gradient terms are
    cast to fp32 before they are added, as autograd adds the gradients of x's two casts)."""
    plain = load_causal_lm(str(tiny_model_dir), dtype="bf16-mixed", lean_activations=False)
    lean_model = load_causal_lm(str(tiny_model_dir), dtype="bf16-mixed")
    assert getattr(lean_model.model.layers[0].mlp, lean._ATTR) and not hasattr(plain.model.layers[0].mlp, lean._ATTR)
    assert torch.equal(_loss(plain), _loss(lean_model))
    g_plain, g_lean = _grads(plain), _grads(lean_model)
    for k in g_plain:
        assert g_lean[k].dtype == torch.float32
        # the MLP alone is bitwise (as in fp32); the norms' float32 rounding differences (see
        # above) can flip a bf16 rounding in the matrix products behind them
        torch.testing.assert_close(g_lean[k], g_plain[k], rtol=1e-2, atol=1e-5, msg=k)


def test_lora_falls_back_to_the_modules_forward(tiny_model_dir):
    """peft swaps the projections for its own layers: the lean forward must not read past the
    adapter to the base weight, so the MLP runs its own forward and the adapter trains."""
    plain = apply_lora(load_causal_lm(str(tiny_model_dir), lean_activations=False), r=4, alpha=8, dropout=0.0,
                       target_modules=["all-linear"])
    lean_model = apply_lora(load_causal_lm(str(tiny_model_dir)), r=4, alpha=8, dropout=0.0, target_modules=["all-linear"])
    lean_model.load_state_dict(plain.state_dict())
    for (n, p), q in zip(plain.named_parameters(), lean_model.parameters()):
        if "lora_B" in n:  # peft starts B at zero; move it so the adapter changes the output
            with torch.no_grad():
                p.normal_(0, 0.02, generator=torch.Generator().manual_seed(len(n)))
                q.copy_(p)
    assert torch.equal(_loss(plain), _loss(lean_model))
    g_plain, g_lean = _grads(plain), _grads(lean_model)
    assert any("mlp.gate_proj.lora_A" in k for k in g_lean)
    for k in g_plain:  # the norms (not adapted) are still lean: float32 rounding
        torch.testing.assert_close(g_lean[k], g_plain[k], rtol=1e-5, atol=1e-6, msg=k)


def test_deepcopy_keeps_its_own_weights():
    """The forward is bound to each module: a copy (the engine's replica) uses its own weights."""
    model, _ = build_tiny_model(size="micro", seed=1)
    lean.lean_activations(model)
    replica = copy.deepcopy(model)
    with torch.no_grad():
        for p in replica.parameters():
            p.mul_(0.5)
    assert not torch.equal(_loss(model), _loss(replica))
    assert lean.lean_activations(replica) == 0  # already lean: not wrapped twice


def test_second_derivatives_error_or_run_plain():
    """TRPO differentiates twice. The lean backward refuses that loudly (its saved g and u are
    not inputs, so a second derivative through them would be wrong); inside ``plain()`` the
    module's own forward runs and gives autograd's second derivatives."""
    plain_model, _ = build_tiny_model(size="micro", seed=2)
    model = copy.deepcopy(plain_model)
    lean.lean_activations(model)

    def hvp(m):
        params = [p for n, p in m.named_parameters() if "mlp" in n]
        with sdpa_kernel([SDPBackend.MATH]):  # the fused attention kernels have no double backward either
            g = torch.autograd.grad(_loss(m), params, create_graph=True)
            return torch.autograd.grad(sum((x * x).sum() for x in g), params)

    with pytest.raises(RuntimeError, match="once_differentiable|not have been used in the graph"):
        hvp(model)
    with lean.plain():
        got = hvp(model)
    for a, b in zip(got, hvp(plain_model)):
        assert torch.equal(a, b)
