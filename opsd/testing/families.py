"""Tiny random float32 models of the architecture families the method is meant to train, for exactness tests.

Every model has the size `opsd.testing.tiny.TINY_SIZE` (hidden 64, 2 attention heads of head_dim 32: vLLM's CPU
attention rejects 16), sits next to the `opsd.testing.tiny.build_tokenizer` tokenizer, and reloads with
`AutoModelForCausalLM` / `AutoTokenizer`.
The layouts put every layer kind of a family into a few layers, with windows and kernels short enough to matter
on test sequences of a few dozen tokens:

- qwen3: 2 full-attention layers (`opsd.testing.tiny.tiny_qwen3_shape`, as `build_qwen3` builds it).
- qwen3_5 (text-only `Qwen3_5ForCausalLM`): Gated DeltaNet, full attention, Gated DeltaNet, full attention;
  DeltaNet heads 1 key / 2 value of dim 128, conv kernel 4; partial RoPE (a quarter of head_dim) with the
  interleaved M-RoPE sections of the real configs. vLLM's CPU engine runs it in bfloat16 only (its Gated
  DeltaNet kernel refuses float32), and its Qwen3.5 module needs torchvision to import.
- olmo3: sliding (window 4), sliding, sliding, full attention.
- smollm3: a RoPE attention layer, then a NoPE one (`no_rope_layers=[1, 0]`).
- gemma3 (text `Gemma3ForCausalLM`): sliding (window 4), full, sliding, full attention, with
  `final_logit_softcapping=5.0` (logits = 5 tanh(z / 5)).
- lfm2: short conv (kernel 3), full attention, short conv, full attention; the config also carries the
  `block_dim` / `conv_dim` widths that vLLM reads.
- granitemoehybrid: Mamba2, attention, Mamba2, attention (no RoPE, as in Granite 4.0-H; conv kernel 4, scan
  chunk 16); every layer has a 4-expert top-2 MoE beside its shared MLP; `logits_scaling=8.0` divides the
  logits (the other multipliers keep their default 1.0).
- nemotron_h: Mamba2, MLP, attention (no RoPE, as in Nemotron-H), MLP (conv kernel 4, scan chunk 16).

Ten more families, held out from the first list and measured after it (docs/families.md):

- llama: 2 attention layers with an untied lm_head (Llama 3 8B's).
- granite: 2 attention layers, tied, with Granite 3's multipliers: embeddings x12, residuals x0.22, attention
  scaled by 1/head_dim, and `logits_scaling=8.0` dividing the logits; random weights of std 0.1.
- cohere: 2 layers of attention beside the MLP (one shared LayerNorm), tied, `logit_scale=4.0` multiplying
  the logits (Command-R's is 0.0625; 4 makes the transform large on logits of random weights).
- cohere2: sliding (window 4) x3, full attention (Command R7B's pattern), tied, `logit_scale=4.0`.
- gemma2: sliding (window 4), full, sliding, full attention, tied, with both of Gemma 2's soft-caps:
  `final_logit_softcapping=5.0` on the logits, `attn_logit_softcapping=50.0` on attention scores.
- falcon_h1: 2 hybrid layers, each with attention and a Mamba2 mixer side by side (conv kernel 4, scan chunk
  16), untied, `lm_head_multiplier=0.25` multiplying the logits.
- phi3: 2 attention layers with fused `qkv_proj` and `gate_up_proj` projections, untied.
- deepseek_v3: a dense-MLP layer, then a MoE layer (4 routed experts, top-2, one shared expert; the router's
  `noaux_tc` top-k with its score-correction bias, as the released config.json sets it, which vLLM reads); MLA
  attention with a latent of rank 512 plus 64 rotary dims (vLLM's CPU MLA kernel takes only that size), untied.
  Its qk_nope_head_dim of 16 is one vLLM's AMX MLA kernel (its choice on a CPU with AMX) refuses: the trainer's
  engine runs MLA on the CPU_MLA kernel on every CPU (`opsd.method.engine_env.cpu_mla_backend`).
- qwen3_moe: a dense-MLP layer (`mlp_only_layers=[0]`), then a MoE layer of 4 experts top-2, untied.
- bamba: Mamba2, then attention (conv kernel 4, scan chunk 16), untied.

`build_family(name, dir, shape="real")` (`build_real`) writes instead a random-weight model of the released shape in
`REAL_SHAPES` (bfloat16, built on the GPU when there is one), beside the same tokenizer padded to its vocabulary:
what the GPU benchmark `bench/families_gpu.py` trains.
"""

from __future__ import annotations

from pathlib import Path

from opsd.testing.tiny import (
    TINY_HEAD_DIM,
    TINY_SIZE,
    build_tokenizer,
    qwen3_1p7b_shape,
    save_random,
    tiny_qwen3_shape,
    with_token_ids,
)

# Each family's tiny layout: (config class, model class, what it sets beside `TINY_SIZE`).
FAMILIES: dict[str, tuple[str, str, dict]] = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", tiny_qwen3_shape()),
    "qwen3_5": (
        "Qwen3_5TextConfig",
        "Qwen3_5ForCausalLM",
        dict(
            num_hidden_layers=4,
            layer_types=["linear_attention", "full_attention"] * 2,
            head_dim=TINY_HEAD_DIM,
            linear_conv_kernel_dim=4,
            # The released head dims: vLLM's CPU Gated DeltaNet kernel rejects 32 ("Unexpected head dim size").
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            linear_num_key_heads=1,
            linear_num_value_heads=2,
            # 8 rotary dims = 4 frequencies, split over the (text, height, width) sections as the real configs do.
            rope_parameters=dict(
                rope_type="default",
                rope_theta=10000.0,
                partial_rotary_factor=0.25,
                mrope_section=[2, 1, 1],
                mrope_interleaved=True,
            ),
            tie_word_embeddings=True,
        ),
    ),
    "olmo3": (
        "Olmo3Config",
        "Olmo3ForCausalLM",
        dict(
            num_hidden_layers=4,
            sliding_window=4,
            layer_types=["sliding_attention"] * 3 + ["full_attention"],
        ),
    ),
    "smollm3": (
        "SmolLM3Config",
        "SmolLM3ForCausalLM",
        dict(
            num_hidden_layers=2,
            no_rope_layers=[1, 0],  # 1 = this layer uses RoPE
            tie_word_embeddings=True,
        ),
    ),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            num_hidden_layers=4,
            head_dim=TINY_HEAD_DIM,
            query_pre_attn_scalar=TINY_HEAD_DIM,  # the released checkpoints scale queries by their head_dim
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention"] * 2,
            final_logit_softcapping=5.0,
        ),
    ),
    "lfm2": (
        "Lfm2Config",
        "Lfm2ForCausalLM",
        dict(
            block_auto_adjust_ff_dim=False,  # else the MLP width is rounded up to a multiple of 256
            num_hidden_layers=4,
            layer_types=["conv", "full_attention"] * 2,
            conv_L_cache=3,
            # Widths the released config.json files carry and vLLM's Lfm2 reads; transformers ignores them.
            block_dim=TINY_SIZE["hidden_size"],
            conv_dim=TINY_SIZE["hidden_size"],
            conv_dim_out=TINY_SIZE["hidden_size"],
        ),
    ),
    "granitemoehybrid": (
        "GraniteMoeHybridConfig",
        "GraniteMoeHybridForCausalLM",
        dict(
            intermediate_size=64,  # per expert
            shared_intermediate_size=128,
            num_local_experts=4,
            num_experts_per_tok=2,
            num_hidden_layers=4,
            layer_types=["linear_attention", "full_attention"] * 2,
            position_embedding_type=None,
            mamba_n_heads=4,
            mamba_d_head=32,
            mamba_n_groups=1,
            mamba_d_state=16,
            mamba_d_conv=4,
            mamba_expand=2,
            mamba_chunk_size=16,
            logits_scaling=8.0,
            tie_word_embeddings=True,
        ),
    ),
    "nemotron_h": (
        "NemotronHConfig",
        "NemotronHForCausalLM",
        dict(
            layers_block_type=["linear_attention", "mlp", "full_attention", "mlp"],
            head_dim=TINY_HEAD_DIM,
            mamba_num_heads=4,
            mamba_head_dim=32,
            n_groups=1,
            ssm_state_size=16,
            conv_kernel=4,
            expand=2,
            chunk_size=16,
            tie_word_embeddings=True,
        ),
    ),
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(num_hidden_layers=2, head_dim=TINY_HEAD_DIM)),
    "granite": (
        "GraniteConfig",
        "GraniteForCausalLM",
        dict(
            num_hidden_layers=2,
            embedding_multiplier=12.0,
            residual_multiplier=0.22,
            attention_multiplier=1 / TINY_HEAD_DIM,
            logits_scaling=8.0,
            # At the default 0.02, the layers' share of a hidden state (residuals x0.22 beside embeddings x12)
            # is too small for positions or padding to move the logits measurably.
            initializer_range=0.1,
            tie_word_embeddings=True,
        ),
    ),
    "cohere": ("CohereConfig", "CohereForCausalLM", dict(num_hidden_layers=2, logit_scale=4.0)),
    "cohere2": (
        "Cohere2Config",
        "Cohere2ForCausalLM",
        dict(
            num_hidden_layers=4,
            sliding_window=4,
            layer_types=["sliding_attention"] * 3 + ["full_attention"],
            logit_scale=4.0,
        ),
    ),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(
            num_hidden_layers=4,
            head_dim=TINY_HEAD_DIM,
            query_pre_attn_scalar=TINY_HEAD_DIM,
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention"] * 2,
            final_logit_softcapping=5.0,
            attn_logit_softcapping=50.0,
        ),
    ),
    "falcon_h1": (
        "FalconH1Config",
        "FalconH1ForCausalLM",
        dict(
            num_hidden_layers=2,
            head_dim=TINY_HEAD_DIM,
            mamba_d_ssm=128,
            mamba_n_heads=4,
            mamba_d_head=32,
            mamba_n_groups=1,
            mamba_d_state=16,
            mamba_d_conv=4,
            mamba_chunk_size=16,
            lm_head_multiplier=0.25,
        ),
    ),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(num_hidden_layers=2)),
    "deepseek_v3": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        dict(
            num_hidden_layers=2,
            first_k_dense_replace=1,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_shared_experts=1,
            moe_intermediate_size=64,
            n_group=1,
            topk_group=1,
            # Not transformers fields (its DeepSeek-V3 always routes so): the released config.json's, which vLLM
            # reads, defaulting to another router without them.
            topk_method="noaux_tc",
            scoring_func="sigmoid",
            num_key_value_heads=2,
            q_lora_rank=32,
            kv_lora_rank=512,
            qk_rope_head_dim=64,
            qk_nope_head_dim=16,
            v_head_dim=32,
        ),
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            num_hidden_layers=2,
            head_dim=TINY_HEAD_DIM,
            mlp_only_layers=[0],
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
        ),
    ),
    "bamba": (
        "BambaConfig",
        "BambaForCausalLM",
        dict(
            num_hidden_layers=2,
            attn_layer_indices=[1],
            mamba_n_heads=4,
            mamba_d_head=32,
            mamba_n_groups=1,
            mamba_d_state=16,
            mamba_d_conv=4,
            mamba_chunk_size=16,
        ),
    ),
}


def build_tiny(name: str, out_dir: str | Path, tok, seed: int = 0, **layout_changes) -> Path:
    """Write the float32 tiny model of family `name` (`TINY_SIZE` and its layout in FAMILIES, with
    `layout_changes` replacing values of that layout) and `tok` to `out_dir`."""
    import transformers

    config_cls, model_cls, layout = FAMILIES[name]
    config = getattr(transformers, config_cls)(
        **with_token_ids({**TINY_SIZE, **layout, **layout_changes}, tok), dtype="float32"
    )
    return save_random(getattr(transformers, model_cls), config, out_dir, tokenizer=tok, seed=seed)


def _pattern(unit: list[str], n: int) -> list[str]:
    return (unit * (n // len(unit) + 1))[:n]


_LFM2_ATTENTION = {2, 5, 9, 13, 17, 21, 24, 27}
# Each family's released text-model shape: (config class, model class, public repo whose config.json it copies,
# config values). Values that only matter to training (init ranges, dropout) keep the class defaults.
REAL_SHAPES: dict[str, tuple[str, str, str, dict]] = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", "Qwen/Qwen3-1.7B", qwen3_1p7b_shape()),
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", "Qwen/Qwen3.5-2B (text_config)", dict(
        vocab_size=248320, hidden_size=2048, intermediate_size=6144, num_hidden_layers=24,
        layer_types=_pattern(["linear_attention"] * 3 + ["full_attention"], 24),
        num_attention_heads=8, num_key_value_heads=2, head_dim=256, linear_conv_kernel_dim=4,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=16,
        rope_parameters=dict(rope_type="default", rope_theta=10000000.0, partial_rotary_factor=0.25,
                             mrope_section=[11, 11, 10], mrope_interleaved=True),
        max_position_embeddings=262144, rms_norm_eps=1e-6, tie_word_embeddings=True,
    )),
    "olmo3": ("Olmo3Config", "Olmo3ForCausalLM", "allenai/Olmo-3-1025-7B", dict(
        vocab_size=100278, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=32, sliding_window=4096,
        layer_types=_pattern(["sliding_attention"] * 3 + ["full_attention"], 32),
        # The released config's yarn `rope_scaling` applies to the full-attention layers (as transformers reads it).
        rope_parameters={
            "full_attention": dict(rope_type="yarn", rope_theta=500000.0, factor=8.0,
                                   original_max_position_embeddings=8192, attention_factor=1.2079441541679836,
                                   beta_fast=32.0, beta_slow=1.0),
            "sliding_attention": dict(rope_type="default", rope_theta=500000.0),
        },
        max_position_embeddings=65536, rms_norm_eps=1e-6, tie_word_embeddings=False,
    )),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", "HuggingFaceTB/SmolLM3-3B", dict(
        vocab_size=128256, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
        num_attention_heads=16, num_key_value_heads=4, no_rope_layers=_pattern([1, 1, 1, 0], 36),
        rope_parameters=dict(rope_type="default", rope_theta=5000000.0),
        max_position_embeddings=65536, rms_norm_eps=1e-6, tie_word_embeddings=True,
    )),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", "google/gemma-3-4b-it (text_config)", dict(
        vocab_size=262208, hidden_size=2560, intermediate_size=10240, num_hidden_layers=34,
        num_attention_heads=8, num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256,
        sliding_window=1024, layer_types=_pattern(["sliding_attention"] * 5 + ["full_attention"], 34),
        rope_parameters={
            "full_attention": dict(rope_type="linear", factor=8.0, rope_theta=1000000.0),
            "sliding_attention": dict(rope_type="default", rope_theta=10000.0),
        },
        final_logit_softcapping=None, attn_logit_softcapping=None,  # Gemma 3 dropped Gemma 2's soft-caps
        max_position_embeddings=131072, rms_norm_eps=1e-6, tie_word_embeddings=True,
    )),
    "lfm2": ("Lfm2Config", "Lfm2ForCausalLM", "LiquidAI/LFM2-2.6B", dict(
        vocab_size=65536, hidden_size=2048, intermediate_size=10752, block_auto_adjust_ff_dim=False,
        num_hidden_layers=30, num_attention_heads=32, num_key_value_heads=8, conv_L_cache=3,
        layer_types=["full_attention" if i in _LFM2_ATTENTION else "conv" for i in range(30)],
        block_dim=2048, block_ff_dim=10752, conv_dim=2048, conv_dim_out=2048,  # read by vLLM
        rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
        max_position_embeddings=128000, norm_eps=1e-5, tie_word_embeddings=True,
    )),
}  # fmt: skip


def build_real(
    name: str, out_dir: str | Path, seed: int = 0, *, dtype: str = "bfloat16", device=None
) -> Path:
    """Write a random-weight model of family `name` at its released shape (`REAL_SHAPES`) in `dtype`, and the
    `build_tokenizer` tokenizer padded to its vocabulary, to `out_dir` (safetensors). The weights are created on
    `device` (default: the GPU if there is one), where initialising billions of parameters takes seconds."""
    import torch
    import transformers

    if name not in REAL_SHAPES:
        raise ValueError(f"family={name!r} has no real shape; choose one of {sorted(REAL_SHAPES)}")
    config_cls, model_cls, _, shape = REAL_SHAPES[name]
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(out_dir, pad_vocab_to=shape["vocab_size"])
    config = getattr(transformers, config_cls)(**with_token_ids(shape, tok), dtype=dtype)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, dtype))  # parameters are created in dtype, not cast afterwards
    try:
        with torch.device(device):
            model = getattr(transformers, model_cls)(config)
    finally:
        torch.set_default_dtype(default)
    model.generation_config.eos_token_id = config.eos_token_id
    model.save_pretrained(str(out_dir))
    return Path(out_dir)


def build_family(
    name: str, out_dir: str | Path, seed: int = 0, *, tokenizer=None, shape: str = "tiny", **real
) -> Path:
    """Write the tiny random model of family `name` (a key of FAMILIES) and its tokenizer to `out_dir`.

    `tokenizer` reuses an already trained `build_tokenizer` tokenizer (training one takes a few seconds).
    `shape="real"` writes the released shape instead (`build_real`, which takes `real`: dtype, device).
    """
    if shape == "real":
        return build_real(name, out_dir, seed, **real)
    if shape != "tiny":
        raise ValueError(f"shape={shape!r} is not one of tiny, real")
    if name not in FAMILIES:
        raise ValueError(f"family={name!r} is unknown; choose one of {sorted(FAMILIES)}")
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    tok = tokenizer if tokenizer is not None else build_tokenizer(out_dir)
    return build_tiny(name, out_dir, tok, seed)
