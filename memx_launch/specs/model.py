"""What is trained: ModelSpec, a transformer's shape (the catalog: ``catalog.py``; Hugging Face
configs: ``hf_config.py``)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, fields, replace
from functools import cached_property
from typing import Any, Mapping

from memx_launch.errors import ConfigError
from memx_launch.specs.checks import reject_unknown
from memx_launch.specs.hybrid import HYBRID_LAYER_KINDS, NO_EXPERTS, deltanet_params, mamba_params
from memx_launch.specs.model_checks import MAX_DIMENSION, check_shape  # noqa: F401 (callers import MAX_DIMENSION here)


# Fields that change no time or memory: a model's profiles and plans stay its own whatever they hold.
_NOT_SHAPE = ("name", "rope_theta", "norm_eps", "tensor_parallel_blocks", "router_aux_loss")
# The fields profiles were first keyed by. Every later one joins a shape's signature only off its
# default, so the profiles and predictors of LLaMA-style models stay valid as fields are added.
_KEYED_ALWAYS = ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "ffn_hidden_size", "vocab_size", "seq_len",
                 "gated_mlp", "tie_embeddings")


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a decoder-only transformer (LLaMA style unless ``gated_mlp`` is off)."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    ffn_hidden_size: int
    vocab_size: int
    seq_len: int
    """Default training sequence length."""
    gated_mlp: bool = True
    """SwiGLU (three FFN matrices) when true, an MLP of two (GELU unless ``relu_mlp``) when false."""
    relu_mlp: bool = False
    """An ungated MLP of ReLU (OPT): its backward needs only the ReLU's output, which the second
    linear keeps as its input, so the MLP keeps one tensor of its width where GELU keeps two."""
    tanh_gelu_ops: bool = False
    """An ungated MLP's GELU as torch ops of its tanh form (Transformers' ``gelu_new``: GPT-2, GPT-J,
    Phi, CodeGen): run eager, it keeps five tensors of the MLP's width where a GELU kernel keeps two."""
    squared_relu_ops: bool = False
    """An ungated MLP of squared ReLU (``relu2``: Arcee, Nemotron-H): run eager, as relu and square, its
    backward holds three tensors of the MLP's width where GELU's holds one (``planning/activation_ops.py``)."""
    bloom_gelu_ops: bool = False
    """BLOOM's GELU (``GeLUFunction``): its input kept as GELU's kernel keeps it, its forward and backward torch ops,
    which hold five tensors of the MLP's width at once (``planning/activation_ops.py``)."""
    xielu_ops: bool = False
    """An ungated MLP of xIELU (Apertus): run eager (Transformers' Python path), its fp32 slopes and two
    branches keep, hold and move more than GELU (``planning/activation_ops.py``)."""
    tie_embeddings: bool = False
    rope_theta: float = 10000.0
    """RoPE base (Llama 3: 500000); it and ``norm_eps`` change nothing priced: exports state them."""
    norm_eps: float = 1e-5
    layer_norm: bool = False
    """LayerNorm (a weight and a bias per norm), else RMSNorm (a weight)."""
    linear_biases: bool = False
    """A bias on every linear layer of the blocks (GPT-2, OPT, Phi)."""
    qkv_bias: bool = False
    """Biases on the query, key and value linears alone (the Qwen2 family; Megatron's ``--add-qkv-bias``)."""
    position_embeddings: int = 0
    """Rows of a learned position table beside the word embeddings (GPT-2: n_positions); 0: rotary."""
    parallel_blocks: bool = False
    """Attention and MLP side by side (GPT-J, GPT-NeoX/Pythia, Falcon, PaLM): both read one normed
    input and their outputs join the residual together, so a block keeps one norm input and one
    normed tensor, and TP reduces the two outputs (and the two input gradients) in one all-reduce."""
    lm_head: bool = True
    """An output layer over the vocabulary, with its loss, on the last stage. Off: a model without one (a reward
    or value model, a classifier, a base model feeding another): no projection, logits, loss or tied copy."""
    tensor_parallel_blocks: bool = True
    """memx's runtime splits these blocks by TP (its LLaMA, Hugging Face's Llama family); memx-run plans TP 1 else."""
    attention_head_dim: int = 0
    """Width of one attention head where it is not ``hidden_size / num_heads`` (Qwen3, Gemma,
    GPT-OSS: Hugging Face's ``head_dim``); the queries and the attention output are then
    ``num_heads x attention_head_dim`` wide. 0: ``hidden_size / num_heads``."""
    num_experts: int = 0
    """Routed experts of every block's MLP (a mixture of experts: Mixtral, Qwen3-MoE, GPT-OSS);
    0: a dense MLP of ``ffn_hidden_size``."""
    experts_per_token: int = 0
    """Experts each token is routed to (top-k), with ``num_experts``."""
    expert_ffn_hidden_size: int = 0
    """Each expert's MLP width (Hugging Face's ``moe_intermediate_size``); 0: ``ffn_hidden_size``."""
    shared_expert_ffn_hidden_size: int = 0
    """Width of the MLP every token also runs through beside its routed experts (a shared expert); 0: none."""
    shared_expert_gate: bool = False
    """A sigmoid gate on the shared expert's output, a weight per hidden unit (Qwen2-MoE; ``--moe-shared-expert-gate``)."""
    experts_take_every_token: bool = False
    """Transformers' blocks run every token through every expert, pre-scaled by its sigmoid router score (0 off its
    top-k), rather than route it (Llama 4's ``Llama4TextMoe``: ``hidden_states.repeat(num_experts, 1)`` and
    ``torch.bmm``): ``num_experts`` copies a token, not ``experts_per_token`` (``experts.kept_units``).
    Megatron-Core's blocks route it."""
    logit_softcapping: bool = False
    """The head's logits soft-capped, ``cap * tanh(logits / cap)`` (Gemma 2 and 3's ``final_logit_softcapping``)."""
    attention_softcapping: bool = False
    """Attention scores soft-capped (Gemma 2's ``attn_logit_softcapping``): unfused attention (activations.py)."""
    attention_sinks: bool = False
    """A learned logit per head beside each query's scores in its softmax (GPT-OSS's sinks): Transformers runs such
    attention eager (its SDPA has no sink), Megatron's cuDNN kernel takes it (activations.training_as_run)."""
    alibi_attention: bool = False
    """ALiBi (BLOOM): Transformers runs it as torch ops on copies of q, k and v (``baddbmm`` on the bias, torch's
    softmax in fp32 cast back, ``bmm``), keeping its probabilities (activations.training_as_run)."""
    attention_sink_scale: bool = False
    """With ``attention_sinks``: the sink scales the attention's output after the softmax, ``out * sigmoid(lse -
    sink)`` (Granite SWA's eager attention): its logsumexp keeps the raw scores and its result, the multiply the
    unscaled output and the fp32 scale (and its cast), beyond what GPT-OSS's sink joined to the softmax keeps."""
    clamped_glu: bool = False
    """GPT-OSS's experts' GLU: gate clamped from above, up from both sides, ``gate * sigmoid(1.702 gate) * (up + 1)``;
    as torch ops it keeps and moves more than SwiGLU (``elementwise.clamped_glu_extra_bytes``)."""
    expert_biases: bool = False
    """Biases on the experts' linears (GPT-OSS): megatron-core (``--setup megatron``, or none) adds the down
    projection's after the grouped GEMM, weighed by the routing, as eager ops in fp32
    (``elementwise.EXPERT_BIAS_BYTES``)."""
    router_aux_loss: bool = False
    """The routers' load-balancing loss joins the loss (Transformers' ``output_router_logits``): memx-run's
    stages send its running sums on with the hidden state, 2 x ``num_experts`` fp32 (models/router_loss.py)."""
    sliding_window: int = 0
    """Keys each query attends back to in a block with sliding-window attention (Mistral-7B v0.1,
    Gemma 2 and 3, GPT-OSS); 0: every block attends to the whole (causal) sequence."""
    full_attention_layers: int = 0
    """With ``sliding_window`` or ``attention_chunk_size``: the blocks that attend to the whole
    sequence all the same (GPT-OSS every other one, Gemma 3 one in six, Llama 4 one in four); the
    others attend within the window or the chunk."""
    attention_chunk_size: int = 0
    """Tokens of a chunk in a block with chunked attention (Llama 4): the sequence is cut into
    chunks of this many tokens and each query attends causally within its own chunk. 0: none."""
    pre_norms: bool = True
    post_norms: bool = False
    """Norms on the attention's and the MLP's outputs too (Gemma 2 and 3), or alone (OLMo 2: no ``pre_norms``)."""
    norm_weight_in_fp32: bool = False
    """Run as torch ops (unfused), a norm multiplies its weight in fp32 and keeps that fp32 product, casting
    after (Hugging Face's Gemma norms, ``x * (1 + w)``, OLMo 2's, GPT-OSS's), where Llama's keeps the 16-bit."""
    weightless_norms: bool = False
    """The block's norms multiply no weight (nanochat's ``x.float() * rsqrt(...)``, cast back): as torch ops each
    keeps its fp32 input alone (what reads its output keeps that), and they hold no parameters."""
    qk_norm: bool = False
    """A norm on every query and key head before attention (Qwen3, Gemma 3, OLMo 2, GLM-4.5's and Llama 4's
    ``use_qk_norm``; Megatron's ``--qk-layernorm``): a head's width of weights, and the q and k it keeps."""
    qk_norm_weightless: bool = False
    """With ``qk_norm``: the query and key norms multiply no weight (Llama 4's L2 norm, nanochat's): as torch ops
    they keep their fp32 input alone, and they hold no parameters."""
    qk_norm_after_rope: bool = False
    """The query and key norms run on the rotated heads (HunYuan): under autocast RoPE's fp32 cos and sin
    promote q and k to fp32, so a torch-op norm keeps an fp32 normalised tensor (4 + 4 bytes)."""
    value_norm: bool = False
    """A norm without a weight on every value head before attention (Gemma 4's ``v_norm``): as torch ops it keeps
    its input in fp32 (the attention keeps its output, as V), a fused kernel its input."""
    experts_beside_mlp_norms: bool = False
    """With ``num_experts``: Gemma 4's block runs its dense MLP (``shared_expert_ffn_hidden_size``) and its experts
    side by side, with three norms more (each output's, the experts' input's) and its router's weightless one."""
    per_layer_input_size: int = 0
    """Gemma 4's per-layer embeddings (``hidden_size_per_layer_input``): each block gates an input this wide computed
    from the tokens (``gelu(gate(x)) * input``), projects it back and adds its norm: two linears and a norm more."""
    per_layer_input_vocab: int = 0
    """With ``per_layer_input_size``: rows of the per-layer table, ``num_layers x per_layer_input_size`` wide."""
    clipped_qkv: bool = False
    """Queries, keys and values clamped in place after their projections (OLMo 1's ``clip_qkv``): Transformers'
    ``clamp_`` keeps a copy of each unclamped projection output for its backward, q + 2kv wide."""
    centred_norm_ops: bool = False
    """The norms subtract the mean in torch ops (Cohere's LayerNorm without bias): each keeps ``x - mean``
    twice, the variance's and the scaling's, beside its scale and result (Transformers' blocks)."""
    rotary_concatenates: bool = False
    """The rotary embedding concatenates each head's turned and passed parts (partial rotary: StableLM, GLM,
    GPT-NeoX; Phi-3's code even whole): a query laid out by head, whose attention output Transformers copies."""
    kv_lora_rank: int = 0
    """Multi-head latent attention (DeepSeek-V2 and V3): keys and values come up from a shared
    latent of this width (Hugging Face's ``kv_lora_rank``); ``attention_head_dim`` is then a head's
    part without positions (``qk_nope_head_dim``). 0: ordinary attention."""
    q_lora_rank: int = 0  # with kv_lora_rank: the queries' latent width (0: projected from the hidden state)
    rope_head_dim: int = 0  # with kv_lora_rank: a head's rotary part (qk_rope_head_dim), one rotary key for all
    v_head_dim: int = 0  # with kv_lora_rank: one value head's width; 0: head_dim
    dense_layers: int = 0  # with num_experts: the first blocks' MLP is dense (DeepSeek's first_k_dense_replace)
    moe_layer_step: int = 1
    """With ``num_experts``: block ``i`` (from 0) runs the experts where ``(i + 1) % moe_layer_step``
    is 0, the others a dense MLP of ``ffn_hidden_size`` (Llama 4 Maverick's
    ``interleave_moe_layer_step``, Qwen's ``decoder_sparse_step``). 1: every block."""
    expert_groups: int = 0
    """With ``num_experts``: group-limited routing (DeepSeek's ``n_group``): the experts fall in this
    many equal groups, and a token's top-k come from ``expert_groups_per_token`` of them. 0: any."""
    expert_groups_per_token: int = 0  # with expert_groups: the groups a token's experts come from (topk_group)
    mtp_layers: int = 0
    """Multi-token prediction modules after the last block (DeepSeek-V3's ``num_nextn_predict_layers``):
    each one more block, a projection of 2h to h and a loss of its own over the shared head."""
    hybrid_pattern: str = ""
    """A hybrid model's layers, one character each (Megatron's ``--hybrid-override-pattern``, Hugging Face's
    ``hybrid_override_pattern``: Nemotron-H): ``M`` a Mamba-2 mixer, ``*`` attention, ``-`` an MLP, each a layer of
    its own behind one pre-norm and a residual add. '': every layer a block of attention and MLP."""
    mamba_heads: int = 0
    """With ``M`` layers: the Mamba-2 mixer's heads (its inner width is ``mamba_heads x mamba_head_dim``)."""
    mamba_head_dim: int = 64
    mamba_state_size: int = 128
    """The state each head keeps per channel (Mamba-2's d_state, Hugging Face's ``ssm_state_size``)."""
    mamba_groups: int = 8  # groups sharing one B and C projection (Hugging Face's n_groups)
    mamba_conv_kernel: int = 4
    mamba_chunk_size: int = 128  # tokens of a chunk of the chunked scan (SSD; Megatron-Core's MambaMixer: 128)
    linear_key_heads: int = 0
    """With ``G`` layers (Gated DeltaNet, Qwen3-Next's linear attention): its query and key heads;
    its value heads ``linear_value_heads`` (a multiple), each head's widths ``linear_key_head_dim``
    and ``linear_value_head_dim``, its convolution's kernel and the chunk of its chunked delta rule
    (the FLA kernels Megatron-Core runs: 64 tokens)."""
    linear_value_heads: int = 0
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel: int = 4
    linear_chunk_size: int = 64
    attention_output_gate: bool = False
    """Attention multiplies its output by a sigmoid gate its query projection also computes
    (Qwen3-Next; Megatron's ``--attention-output-gate``): that projection is twice as wide."""
    output_gate_linear: bool = False
    """With ``attention_output_gate``: the gate is a linear of its own beside q, k and v (AFMoE's ``gate_proj``),
    not half of the query projection (Qwen3-Next's): under autocast it keeps its own 16-bit cast of the normed input."""
    layer_kind: str = ""
    """One layer of a hybrid model (:attr:`layer_kinds` sets it): ``mamba``, ``gated_deltanet``,
    ``attention``, ``mlp`` or ``moe``; '' a block of attention and MLP."""

    def __post_init__(self):
        check_shape(self)

    @property
    def has_attention(self) -> bool:
        """A block or layer with attention: every one but a hybrid model's Mamba and MLP layers."""
        return self.layer_kind in ("", "attention")

    @property
    def has_mlp(self) -> bool:
        """A block or layer with an MLP (or experts): every one but a hybrid model's Mamba and attention layers."""
        return self.layer_kind in ("", "mlp", "moe")

    @cached_property  # the cost model builds one per kind
    def layer_kinds(self) -> tuple[tuple["ModelSpec", int], ...]:
        """A hybrid model's kinds of layers, each with how many of its layers are of that kind
        (Mamba, attention, MLP, experts where the pattern has them; only the expert layers keep the
        experts); none for a transformer."""
        return tuple((replace(self, hybrid_pattern="", layer_kind=kind, **({} if kind == "moe" else NO_EXPERTS)),
                      self.hybrid_pattern.count(char))
                     for char, kind in HYBRID_LAYER_KINDS.items() if char in self.hybrid_pattern)

    @property
    def head_dim(self) -> int:
        return self.attention_head_dim or self.hidden_size // self.num_heads

    @property
    def qk_head_dim(self) -> int:
        """Width of one query and key head: ``head_dim``, and latent attention's rotary part."""
        return self.head_dim + self.rope_head_dim

    @property
    def q_hidden_size(self) -> int:
        """Width of the queries (``hidden_size`` unless ``attention_head_dim`` or latent attention);
        0 in a layer without attention."""
        return self.num_heads * self.qk_head_dim if self.has_attention else 0

    @property
    def value_hidden_size(self) -> int:
        """Width of the attention output, the output projection's input (``q_hidden_size`` but
        with latent attention's ``v_head_dim``)."""
        return self.num_heads * (self.v_head_dim or self.head_dim) if self.kv_lora_rank else self.q_hidden_size

    @property
    def kv_hidden_size(self) -> int:
        """Width of the keys and of the values each; latent attention (every head its own key and
        value, of different widths): their mean, so that keys and values together are twice it."""
        if self.kv_lora_rank:
            return (self.q_hidden_size + self.value_hidden_size) // 2
        return self.num_kv_heads * self.head_dim if self.has_attention else 0

    @property
    def latent_attention_params(self) -> int:
        """Latent attention's down projections and their norms, which Megatron keeps whole on every
        TP rank (none in ordinary attention)."""
        if not self.kv_lora_rank:
            return 0
        h, q_rank, kv_rank = self.hidden_size, self.q_lora_rank, self.kv_lora_rank
        return (h * q_rank + q_rank if q_rank else 0) + h * (kv_rank + self.rope_head_dim) + kv_rank

    @cached_property  # the search asks the sizes of a block thousands of times
    def attention_params(self) -> int:
        """Wq, Wk, Wv, Wo (no biases); latent attention's down and up projections and norms."""
        h, q, value = self.hidden_size, self.q_hidden_size, self.value_hidden_size
        if not self.kv_lora_rank:  # an output gate: the query projection computes it too
            return h * ((2 if self.attention_output_gate else 1) * q + 2 * self.kv_hidden_size) + value * h
        keys_values_up = self.kv_lora_rank * self.num_heads * (self.head_dim + (self.v_head_dim or self.head_dim))
        return self.latent_attention_params + (self.q_lora_rank or h) * q + keys_values_up + value * h

    @property
    def moe_ffn_hidden_size(self) -> int:
        """One routed expert's MLP width."""
        return self.expert_ffn_hidden_size or self.ffn_hidden_size

    def _mlp_of(self, width: int) -> int:
        return (3 if self.gated_mlp else 2) * self.hidden_size * width

    @property
    def expert_params(self) -> int:
        """The routed experts' parameters of one block (none in a dense model)."""
        return self.num_experts * self._mlp_of(self.moe_ffn_hidden_size)

    @property
    def mlp_params(self) -> int:
        """One block's MLP: a dense MLP, or the router, the shared expert and every routed expert."""
        if not self.has_mlp:
            return 0
        if not self.num_experts:
            return self._mlp_of(self.ffn_hidden_size)
        return (self.hidden_size * (self.num_experts + self.shared_expert_gate)
                + self._mlp_of(self.shared_expert_ffn_hidden_size) + self.expert_params)

    @property
    def active_ffn_hidden_size(self) -> int:
        """The MLP width one token runs through: ``ffn_hidden_size``, or its top-k experts' and
        the shared expert's together."""
        if not self.has_mlp:
            return 0
        if not self.num_experts:
            return self.ffn_hidden_size
        return self.experts_per_token * self.moe_ffn_hidden_size + self.shared_expert_ffn_hidden_size

    @property
    def active_mlp_params(self) -> int:
        """The MLP parameters one token's matmuls read: the router, the shared expert and its top-k experts."""
        if not self.num_experts:
            return self.mlp_params
        return self.mlp_params - self.expert_params + self.experts_per_token * self._mlp_of(self.moe_ffn_hidden_size)

    @property
    def norm_params(self) -> int:
        return 0 if self.weightless_norms else (2 if self.layer_norm else 1) * self.hidden_size

    @property
    def bias_params(self) -> int:
        """The biases of one block's linear layers (QKV, output, MLP)."""
        if not self.linear_biases:
            return self.q_hidden_size + 2 * self.kv_hidden_size if self.qkv_bias else 0
        mlp = (2 if self.gated_mlp else 1) * self.ffn_hidden_size + self.hidden_size
        return self.q_hidden_size + self.hidden_size + 2 * self.kv_hidden_size + mlp

    @cached_property
    def layer_params(self) -> float:
        """Parameters of one transformer block, its norms (one with parallel blocks, else two, four
        with ``post_norms``; the query and key heads' with ``qk_norm``) and the biases included; a
        hybrid model's layer: the mean of its layers' (:attr:`block_params`)."""
        if self.hybrid_pattern:
            return self.block_params / self.num_layers
        qk_norms = 2 * self.qk_head_dim if self.qk_norm and not self.qk_norm_weightless and self.has_attention else 0
        per_layer = (2 * self.hidden_size * self.per_layer_input_size + self.norm_params) * bool(
            self.per_layer_input_size)  # Gemma 4's gate, projection and norm; three norms, router's and experts' scales
        per_layer += (4 * self.norm_params + self.num_experts) * (self.experts_beside_mlp_norms and self.num_experts > 0)
        return (self.attention_params + self.mlp_params + mamba_params(self) + deltanet_params(self) + self.bias_params
                + self.norms_per_block * self.norm_params + qk_norms + per_layer)

    @property
    def block_params(self) -> int:
        """Parameters of all the blocks (or a hybrid model's layers), a mixture of experts' dense ones included."""
        if self.hybrid_pattern:
            return sum(count * kind.layer_params for kind, count in self.layer_kinds)
        dense = self.dense_block_count * (self.dense_block.layer_params - self.layer_params) if self.num_experts else 0
        return self.num_layers * self.layer_params + dense

    @property
    def pre_norms_per_block(self) -> int:
        """Norms whose output a block's linears read: one feeding parallel attention and MLP, or a hybrid
        model's layer, else one before each (what Megatron's ``layernorm`` recompute module runs again)."""
        return 1 if self.parallel_blocks or self.layer_kind else 2

    @property
    def residual_adds(self) -> int:
        """Adds into the residual stream per block: after attention and after the MLP; one in a hybrid layer."""
        return 1 if self.layer_kind else 2

    @property
    def norms_per_block(self) -> int:
        """Norms over the hidden size in one block: the pre-norms (unless off), and two with ``post_norms``."""
        return self.pre_norms_per_block * self.pre_norms + (2 if self.post_norms else 0)

    @property
    def word_embedding_params(self) -> int:
        """The token embedding: the weight tied to the head when ``tie_embeddings``."""
        return self.vocab_size * self.hidden_size

    @property
    def embedding_params(self) -> int:
        """What the first stage holds before the blocks: the token and position embeddings."""
        p = self.per_layer_input_size  # Gemma 4's per-layer table, its projection and norm
        per_layer = (self.per_layer_input_vocab + self.hidden_size) * self.num_layers * p + p
        return self.word_embedding_params + self.position_embeddings * self.hidden_size + per_layer

    @property
    def output_vocab(self) -> int:
        """Logits per token the last stage computes: the vocabulary, none without an LM head."""
        return self.vocab_size if self.lm_head else 0

    @property
    def ties_head(self) -> bool:
        """The output projection is the token embedding's weight."""
        return self.tie_embeddings and self.lm_head

    @property
    def last_stage_reads_embedding(self) -> bool:
        """The last stage needs the word embeddings too: a tied head, or multi-token prediction's
        lookups (Megatron keeps a copy there and sums its gradient with the first stage's)."""
        return self.ties_head or self.mtp_layers > 0

    @property
    def head_params(self) -> int:
        """Final norm plus the output projection (zero extra when tied or without an LM head)."""
        return self.norm_params + (0 if self.ties_head else self.output_vocab * self.hidden_size)

    @property
    def dense_block_count(self) -> int:
        """A mixture of experts' blocks with a dense MLP: its first ones (``dense_layers``) or those
        between its expert ones (``moe_layer_step``); 0 for a dense model."""
        return self.dense_layers + self.num_layers - self.num_layers // self.moe_layer_step

    @cached_property  # scoring asks it for every group of a search
    def dense_block(self) -> "ModelSpec":
        """The shape of a mixture of experts' dense block (:attr:`dense_block_count`): experts replaced
        by a dense MLP of ``ffn_hidden_size``, every block so."""
        return replace(self, **NO_EXPERTS, dense_layers=0, moe_layer_step=1, mtp_layers=0)

    @property
    def mtp_params(self) -> int:
        """Multi-token prediction's modules: each a block, two input norms, a 2h x h projection and a final norm."""
        return self.mtp_layers * (self.layer_params + 2 * self.hidden_size ** 2 + 3 * self.norm_params)

    @property
    def total_params(self) -> int:
        """The model's parameters as published: blocks, embedding and head (not ``mtp_params``, which training adds)."""
        return self.block_params + self.embedding_params + self.head_params

    def signature(self) -> str:
        """Short stable hash of the shape; keys profiles, caches and predictors."""
        defaults = {f.name: f.default for f in fields(self)}
        shape = {k: v for k, v in asdict(self).items()
                 if k not in _NOT_SHAPE and (k in _KEYED_ALWAYS or v != defaults[k])}
        payload = json.dumps(shape, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:16]

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "model") -> "ModelSpec":
        if not isinstance(data, Mapping):
            raise ConfigError(where, "must be a mapping of the model's sizes")
        reject_unknown(data, {f for f in cls.__dataclass_fields__}, where)
        return cls(**data)
