"""The tiny multimodal Qwen3.5 hybrid target the hybrid tests build: the main target's layout (Gated
DeltaNet linear-attention layers between full-attention ones, a vision tower beside the text model) at
sizes a CPU test runs in seconds."""

from __future__ import annotations

from transformers import Qwen3_5Config


def tiny_hybrid_vlm_config(
    *, hidden: int, layers: int, linear_head_dim: int, full_attention_interval: int
) -> Qwen3_5Config:
    """``layers`` text layers, every ``full_attention_interval``-th one full attention, the others linear
    with heads of ``linear_head_dim`` (32 is fla's kernels' smallest: a test that runs them on CUDA needs
    it); a one-block vision tower."""
    return Qwen3_5Config(
        text_config=dict(
            vocab_size=4096,
            hidden_size=hidden,
            intermediate_size=64,
            num_hidden_layers=layers,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=2,
            linear_key_head_dim=linear_head_dim,
            linear_value_head_dim=linear_head_dim,
            linear_conv_kernel_dim=4,
            full_attention_interval=full_attention_interval,
            max_position_embeddings=1024,
            rope_parameters=dict(
                rope_type="default",
                rope_theta=10000.0,
                partial_rotary_factor=0.25,
                mrope_section=[1, 1, 0],
                mrope_interleaved=True,
            ),
        ),
        vision_config=dict(
            depth=1,
            hidden_size=16,
            intermediate_size=32,
            num_heads=2,
            out_hidden_size=hidden,
            patch_size=16,
            num_position_embeddings=64,
        ),
        image_token_id=4090,
        video_token_id=4091,
        vision_start_token_id=4092,
        vision_end_token_id=4093,
    )
