"""The hand-derived backward pass (M20 §11), op by op, composed for the whole model and every objective.

This is the *reference* backward used to "compare autodiff to analytic formulas" (DESIGN §5: gradient tests
compare ``jax.grad``, these formulas and central differences, with ``mlx_llm.gradcheck``). It is not used for
training: training uses ``jax.grad``. No automatic differentiation (grad, vjp, jvp, custom_vjp) appears in this
package; every derivative is a formula, written as a small public function that the tests check against autodiff
of the matching forward function.

- ``primitives``: one backward per op of M20 §11 (cross-entropy, linear map, residual, SiLU, SwiGLU, RMSNorm,
  softmax, RoPE and scaled RoPE, attention, embedding).
- ``blocks``: the attention mixer (biases, q/k norms, every RoPE scaling, causal, bidirectional and
  sliding-window masks) and the SwiGLU FFN branch, forward with a tape and backward; the dense block of M20 §7.
- ``moe``: M20 §15's mixture-of-experts FFN, the selected set held fixed.
- ``mamba``: the Mamba-1 mixer, its selective scan sent back as the reverse-time recurrence (M20 §19).
- ``model``: ``analytic_grad`` for any ``ModelConfig`` (tied or untied, uniform or mixed stacks), z-loss and the
  chunked loss, the diffusion NELBO through the denoiser, and LoRA adapters' A and B.
- ``losses``: the objectives on their own inputs (logits, log-probabilities, rewards, values).
"""

from mlx_llm.objectives.grads.blocks import (AttentionTape, BlockTape, FFNTape, attention_branch_backward,
                                             attention_branch_forward, block_backward, block_forward,
                                             moe_branch_forward, rope_for_backward, swiglu_branch_backward,
                                             swiglu_branch_forward)
from mlx_llm.objectives.grads.losses import (bt_loss_backward, chunked_lm_loss_and_backward, dpo_loss_backward,
                                             gae_backward, leash_backward, leashed_loss_backward,
                                             lm_loss_and_backward, nelbo_logits_backward, nelbo_loss_and_backward,
                                             ppo_backward, reward_head_backward, sequence_log_likelihood_backward,
                                             z_loss_backward)
from mlx_llm.objectives.grads.mamba import (MambaTape, causal_conv_backward, mamba_branch_backward,
                                            mamba_branch_forward, selective_scan_backward)
from mlx_llm.objectives.grads.model import (analytic_grad, analytic_lora_value_and_grad, analytic_value_and_grad,
                                            diffusion_value_and_grad, layer_backward, layer_forward, lora_backward,
                                            restack, value_and_grad_with_head)
from mlx_llm.objectives.grads.moe import (moe_branch_backward, moe_ffn_backward, router_weights_backward)
from mlx_llm.objectives.grads.primitives import (attention_backward, cross_entropy_backward, embedding_backward,
                                                 linear_backward, residual_backward, rms_norm_backward, rope_backward,
                                                 rope_rotate_backward, silu_backward, softmax_backward,
                                                 swiglu_backward)

__all__ = [
    "AttentionTape", "BlockTape", "FFNTape", "MambaTape", "analytic_grad", "analytic_lora_value_and_grad",
    "analytic_value_and_grad", "attention_backward", "attention_branch_backward", "attention_branch_forward",
    "block_backward", "block_forward", "bt_loss_backward", "causal_conv_backward", "chunked_lm_loss_and_backward",
    "cross_entropy_backward", "diffusion_value_and_grad", "dpo_loss_backward", "embedding_backward", "gae_backward",
    "layer_backward", "layer_forward", "leash_backward", "leashed_loss_backward", "linear_backward",
    "lm_loss_and_backward", "lora_backward", "mamba_branch_backward", "mamba_branch_forward", "moe_branch_backward",
    "moe_branch_forward", "moe_ffn_backward", "nelbo_logits_backward", "nelbo_loss_and_backward", "ppo_backward",
    "residual_backward", "restack", "reward_head_backward", "rms_norm_backward", "rope_backward",
    "rope_for_backward", "rope_rotate_backward", "router_weights_backward", "selective_scan_backward",
    "sequence_log_likelihood_backward", "silu_backward", "softmax_backward", "swiglu_backward",
    "swiglu_branch_backward", "swiglu_branch_forward", "value_and_grad_with_head", "z_loss_backward",
]
