"""What is trained: ModelSpec (a transformer's shape) and the catalog of named models.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
from dataclasses import asdict, dataclass
from typing import Any, Mapping


from memx_launch.errors import ConfigError
from memx_launch.specs.checks import reject_unknown, require_name, require_number, require_type
from memx_launch.specs.inputs import load_json

MAX_DIMENSION = 2**24
"""Bound on every size of a model (layers, hidden, heads, vocabulary, sequence)."""


# Fields that change no time or memory: a model's profiles and plans stay its own whatever they hold.
_NOT_SHAPE = ("name", "rope_theta", "norm_eps", "tensor_parallel_blocks")
# Fields added after profiles were keyed by the shape: at these defaults a shape keeps the
# signature it had, so the profiles and predictors of LLaMA-style models stay valid.
_KEYED_UNLESS_DEFAULT = {"layer_norm": False, "linear_biases": False, "position_embeddings": 0,
                         "parallel_blocks": False, "lm_head": True, "attention_head_dim": 0, "num_experts": 0,
                         "experts_per_token": 0, "expert_ffn_hidden_size": 0, "shared_expert_ffn_hidden_size": 0,
                         "sliding_window": 0, "full_attention_layers": 0}
# Model types whose blocks are GPT-2 style: LayerNorm with a bias, a bias on every linear layer.
GPT_STYLE = ("gpt2", "opt", "gpt_neo", "phi")
# Hugging Face model types whose blocks memx's runtime splits by TP (models/adapters.py's Llama family).
TP_MODEL_TYPES = ("llama", "mistral", "qwen2", "gemma")
# Model types whose config class ties the head to the embedding unless told otherwise.
TIED_BY_DEFAULT = ("gpt2", "opt", "gemma")
# Model types with a gated MLP whose activation is not SiLU (Gemma: GeGLU).
GATED_GELU = ("gemma",)
# Model types whose attention and MLP read one normed input side by side, and the config key
# that turns it off (GPT-J always; GPT-NeoX's use_parallel_residual, Falcon's parallel_attn).
PARALLEL_BLOCK_KEYS = {"gptj": None, "gpt_neox": "use_parallel_residual", "falcon": "parallel_attn"}


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
    """SwiGLU (three FFN matrices) when true, GELU MLP (two) when false."""
    tie_embeddings: bool = False
    rope_theta: float = 10000.0
    """RoPE base (Llama 3: 500000). Neither it nor ``norm_eps`` changes time or memory: they are
    kept so that exports state them (Megatron-LM's --rotary-base, --norm-epsilon)."""
    norm_eps: float = 1e-5
    layer_norm: bool = False
    """LayerNorm (a weight and a bias per norm), else RMSNorm (a weight)."""
    linear_biases: bool = False
    """A bias on every linear layer of the blocks (GPT-2, OPT, Phi)."""
    position_embeddings: int = 0
    """Rows of a learned position table beside the word embeddings (GPT-2: n_positions); 0: rotary."""
    parallel_blocks: bool = False
    """Attention and MLP side by side (GPT-J, GPT-NeoX/Pythia, Falcon, PaLM): both read one normed
    input and their outputs join the residual together, so a block keeps one norm input and one
    normed tensor, and TP reduces the two outputs (and the two input gradients) in one all-reduce."""
    lm_head: bool = True
    """An output layer over the vocabulary, with its loss, on the last stage. Off: a model
    without one (a reward or value model, a classifier, a base model feeding another): no output
    projection, logits or loss, and no tied copy of the embeddings."""
    tensor_parallel_blocks: bool = True
    """memx's runtime splits these blocks by TP (its LLaMA, the Hugging Face Llama family);
    memx-run plans TP 1 otherwise (a plan for another framework may still use TP)."""
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
    sliding_window: int = 0
    """Keys each query attends back to in a block with sliding-window attention (Mistral-7B v0.1,
    Gemma 2 and 3, GPT-OSS); 0: every block attends to the whole (causal) sequence."""
    full_attention_layers: int = 0
    """With ``sliding_window``: the blocks that attend to the whole sequence all the same (GPT-OSS
    every other one, Gemma 3 one in six); the others attend within the window."""

    def __post_init__(self):
        for name in ("num_layers", "hidden_size", "num_heads", "num_kv_heads",
                     "ffn_hidden_size", "vocab_size", "seq_len"):
            require_number(getattr(self, name), f"model.{name}", lo=0, lo_open=True, hi=MAX_DIMENSION, integer=True)
        require_type(self.name, str, "model.name")
        require_name(self.name, "model.name")
        require_type(self.gated_mlp, bool, "model.gated_mlp")
        require_type(self.tie_embeddings, bool, "model.tie_embeddings")
        require_type(self.layer_norm, bool, "model.layer_norm")
        require_type(self.linear_biases, bool, "model.linear_biases")
        require_number(self.position_embeddings, "model.position_embeddings", lo=0, hi=MAX_DIMENSION, integer=True,
                       fix="the learned position table's rows, or 0 for rotary positions")
        require_type(self.parallel_blocks, bool, "model.parallel_blocks")
        require_type(self.lm_head, bool, "model.lm_head")
        require_type(self.tensor_parallel_blocks, bool, "model.tensor_parallel_blocks")
        require_number(self.rope_theta, "model.rope_theta", lo=0, lo_open=True, hi=1e12, fix="e.g. 10000 or 500000")
        require_number(self.norm_eps, "model.norm_eps", lo=0, lo_open=True, hi=1, fix="e.g. 1e-5")
        require_number(self.attention_head_dim, "model.attention_head_dim", lo=0, hi=MAX_DIMENSION, integer=True,
                       fix="give one head's width, or 0 for hidden_size / num_heads")
        if not self.attention_head_dim and self.hidden_size % self.num_heads:
            raise ConfigError("model.hidden_size", f"{self.hidden_size} is not divisible by "
                              f"num_heads={self.num_heads}", "use a multiple of num_heads, or give attention_head_dim")
        for name in ("num_experts", "experts_per_token", "expert_ffn_hidden_size", "shared_expert_ffn_hidden_size"):
            require_number(getattr(self, name), f"model.{name}", lo=0, hi=MAX_DIMENSION, integer=True)
        if self.num_experts and not 1 <= self.experts_per_token <= self.num_experts:
            raise ConfigError("model.experts_per_token", f"{self.experts_per_token} of {self.num_experts} experts",
                              "give the experts each token is routed to (top-k), at least 1")
        require_number(self.sliding_window, "model.sliding_window", lo=0, hi=MAX_DIMENSION, integer=True)
        require_number(self.full_attention_layers, "model.full_attention_layers", lo=0, hi=self.num_layers,
                       integer=True, fix=f"give how many of the {self.num_layers} blocks attend to the whole sequence")
        if self.experts_per_token and not self.num_experts:
            raise ConfigError("model.experts_per_token", "set without num_experts", "give num_experts, or drop it")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError("model.num_kv_heads", f"{self.num_kv_heads} does not divide "
                              f"num_heads={self.num_heads}", "use a divisor of num_heads")

    @property
    def head_dim(self) -> int:
        return self.attention_head_dim or self.hidden_size // self.num_heads

    @property
    def q_hidden_size(self) -> int:
        """Width of the queries and of the attention output (``hidden_size`` unless ``attention_head_dim``)."""
        return self.num_heads * self.head_dim

    @property
    def kv_hidden_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def attention_params(self) -> int:
        """Wq, Wk, Wv, Wo (no biases)."""
        return 2 * self.hidden_size * (self.q_hidden_size + self.kv_hidden_size)

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
        if not self.num_experts:
            return self._mlp_of(self.ffn_hidden_size)
        return self.hidden_size * self.num_experts + self._mlp_of(self.shared_expert_ffn_hidden_size) + self.expert_params

    @property
    def active_ffn_hidden_size(self) -> int:
        """The MLP width one token runs through: ``ffn_hidden_size``, or its top-k experts' and
        the shared expert's together."""
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
        return (2 if self.layer_norm else 1) * self.hidden_size

    @property
    def bias_params(self) -> int:
        """The biases of one block's linear layers (QKV, output, MLP)."""
        if not self.linear_biases:
            return 0
        mlp = (2 if self.gated_mlp else 1) * self.ffn_hidden_size + self.hidden_size
        return self.q_hidden_size + self.hidden_size + 2 * self.kv_hidden_size + mlp

    @property
    def layer_params(self) -> int:
        """Parameters of one transformer block, its norms (one with parallel blocks, else two) and
        the biases included."""
        norms = 1 if self.parallel_blocks else 2
        return self.attention_params + self.mlp_params + self.bias_params + norms * self.norm_params

    @property
    def word_embedding_params(self) -> int:
        """The token embedding: the weight tied to the head when ``tie_embeddings``."""
        return self.vocab_size * self.hidden_size

    @property
    def embedding_params(self) -> int:
        """What the first stage holds before the blocks: the token and position embeddings."""
        return self.word_embedding_params + self.position_embeddings * self.hidden_size

    @property
    def output_vocab(self) -> int:
        """Logits per token the last stage computes: the vocabulary, none without an LM head."""
        return self.vocab_size if self.lm_head else 0

    @property
    def ties_head(self) -> bool:
        """The output projection is the token embedding's weight."""
        return self.tie_embeddings and self.lm_head

    @property
    def head_params(self) -> int:
        """Final norm plus the output projection (zero extra when tied or without an LM head)."""
        return self.norm_params + (0 if self.ties_head else self.output_vocab * self.hidden_size)

    @property
    def total_params(self) -> int:
        return self.num_layers * self.layer_params + self.embedding_params + self.head_params

    def signature(self) -> str:
        """Short stable hash of the shape; keys profiles, caches and predictors."""
        shape = {k: v for k, v in asdict(self).items()
                 if k not in _NOT_SHAPE and not (k in _KEYED_UNLESS_DEFAULT and v == _KEYED_UNLESS_DEFAULT[k])}
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

    @classmethod
    def from_hf_config(cls, path: str, name: str | None = None) -> "ModelSpec":
        """Read a Hugging Face style ``config.json`` (LLaMA, Mistral, Qwen2 families; GPT-2 style keys)."""
        cfg = load_json(path, "--model", fix="pass a Hugging Face config.json")
        if not isinstance(cfg, dict):
            raise ConfigError(f"model ({path})", "config.json must be a JSON object", "pass a Hugging Face config.json")
        if cfg.get("_name_or_path") is not None:
            require_type(cfg["_name_or_path"], str, f"model ({path})._name_or_path")
        return cls.from_hf_dict(cfg, name or cfg.get("_name_or_path")
                                or os.path.basename(os.path.dirname(os.path.abspath(path))), where=path)

    @classmethod
    def from_hf_dict(cls, cfg: Mapping[str, Any], name: str, where: str = "config") -> "ModelSpec":
        """The shape in a Hugging Face config's dict (``model.config.to_dict()``, or a config.json):
        Llama-style keys, GPT-2's (``n_layer``, ...) or OPT's (``ffn_dim``)."""
        model_type = cfg.get("model_type", "gpt2" if "n_layer" in cfg else "llama")
        require_type(model_type, str, f"model ({where}).model_type")
        # A config naming its architectures names its head: only causal-LM classes have an LM head.
        architectures = cfg.get("architectures") or []
        require_type(architectures, list, f"model ({where}).architectures")
        lm_head = not architectures or any("CausalLM" in str(a) or "LMHead" in str(a) for a in architectures)
        if "ffn_dim" in cfg and "intermediate_size" not in cfg:  # OPT
            cfg = {**cfg, "intermediate_size": cfg["ffn_dim"], "hidden_act": cfg.get("activation_function", "relu")}
        if "n_layer" in cfg:  # GPT-2 style names (GPT-2, GPT-J, ...): GELU MLP, 4x width unless n_inner, tied
            require_number(cfg.get("n_embd"), f"model ({where}).n_embd", lo=0, lo_open=True, hi=MAX_DIMENSION,
                           integer=True, fix="config.json must give it as a positive integer")
            cfg = {"num_hidden_layers": cfg["n_layer"], "hidden_size": cfg.get("n_embd"),
                   "num_attention_heads": cfg.get("n_head"),
                   "intermediate_size": cfg.get("n_inner") or 4 * int(cfg.get("n_embd") or 0),
                   "vocab_size": cfg.get("vocab_size"), "hidden_act": cfg.get("activation_function", "gelu"),
                   "max_position_embeddings": cfg.get("n_positions") or cfg.get("n_ctx") or 1024,
                   "tie_word_embeddings": cfg.get("tie_word_embeddings"),
                   "layer_norm_epsilon": cfg.get("layer_norm_epsilon")}
            cfg = {k: v for k, v in cfg.items() if v is not None}
        missing = [k for k in ("num_hidden_layers", "hidden_size", "num_attention_heads",
                               "intermediate_size", "vocab_size") if k not in cfg]
        if missing:
            raise ConfigError(f"model ({where})", f"config.json lacks {', '.join(missing)}",
                              "use a decoder-only config with these keys (or GPT-2's n_layer, n_embd, n_head)")
        for key in ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size",
                    "num_key_value_heads", "max_position_embeddings"):
            if cfg.get(key) is not None:
                require_number(cfg[key], f"model ({where}).{key}", lo=0, lo_open=True, hi=MAX_DIMENSION, integer=True,
                               fix="config.json must give it as a positive integer")
        if cfg.get("hidden_act") is not None:
            require_type(cfg["hidden_act"], str, f"model ({where}).hidden_act")
        if cfg.get("tie_word_embeddings") is not None:
            require_type(cfg["tie_word_embeddings"], bool, f"model ({where}).tie_word_embeddings")
        act = str(cfg.get("hidden_act", "silu"))
        heads = cfg["num_attention_heads"]
        head_dim = 0
        if cfg.get("head_dim") is not None:
            require_number(cfg["head_dim"], f"model ({where}).head_dim", lo=0, lo_open=True, hi=MAX_DIMENSION,
                           integer=True, fix="config.json must give it as a positive integer")
            head_dim = 0 if cfg["head_dim"] * heads == cfg["hidden_size"] else cfg["head_dim"]
        tied = cfg.get("tie_word_embeddings", model_type in TIED_BY_DEFAULT)
        gpt_style = model_type in GPT_STYLE
        # Learned position tables: GPT-2's n_positions rows, OPT's max_position_embeddings + 2 (its offset).
        positions = {"gpt2": cfg.get("max_position_embeddings") or 1024,
                     "opt": (cfg.get("max_position_embeddings") or 2048) + 2}.get(model_type, 0)
        if cfg.get("enable_bias") is not None:
            require_type(cfg["enable_bias"], bool, f"model ({where}).enable_bias")
        experts = {**_experts_of(cfg, where), **_window_of(cfg, model_type, where)}
        parallel = False
        if model_type in PARALLEL_BLOCK_KEYS:
            key = PARALLEL_BLOCK_KEYS[model_type]
            parallel = True if key is None else cfg.get(key, True)
            require_type(parallel, bool, f"model ({where}).{key}")
        return cls(
            name=name,
            num_layers=cfg["num_hidden_layers"],
            hidden_size=cfg["hidden_size"],
            num_heads=cfg["num_attention_heads"],
            num_kv_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
            ffn_hidden_size=cfg["intermediate_size"],
            vocab_size=cfg["vocab_size"],
            seq_len=min(cfg.get("max_position_embeddings") or 4096, 8192),
            gated_mlp=act in ("silu", "swiglu", "swish") or model_type in GATED_GELU,
            tie_embeddings=bool(tied),
            layer_norm=gpt_style,
            linear_biases=gpt_style and cfg.get("enable_bias", True),
            position_embeddings=positions,
            parallel_blocks=parallel,
            lm_head=lm_head,
            tensor_parallel_blocks=model_type in TP_MODEL_TYPES,
            attention_head_dim=head_dim,
            **experts,
            **{field: cfg[key] for field, key in (("rope_theta", "rope_theta"), ("norm_eps", "rms_norm_eps"),
                                                  ("norm_eps", "layer_norm_epsilon"), ("norm_eps", "layer_norm_eps"))
               if cfg.get(key) is not None},
        )


def _window_of(cfg: Mapping[str, Any], model_type: str, where: str) -> dict:
    """The sliding-window fields of a Hugging Face config: ``sliding_window`` (unless
    ``use_sliding_window`` is off), and which blocks attend to the whole sequence: its
    ``layer_types``, Gemma 3's ``sliding_window_pattern`` (one in that many), Gemma 2's every other
    block; else none (Mistral-7B v0.1)."""
    window = cfg.get("sliding_window")
    if not window or cfg.get("use_sliding_window") is False:
        return {}
    require_number(window, f"model ({where}).sliding_window", lo=0, lo_open=True, hi=MAX_DIMENSION, integer=True,
                   fix="config.json must give it as a positive integer, or null")
    layers, types = cfg["num_hidden_layers"], cfg.get("layer_types")
    if types is not None:
        require_type(types, list, f"model ({where}).layer_types")
        if "sliding_attention" not in types:
            return {}
        full = sum(t != "sliding_attention" for t in types)
    elif cfg.get("sliding_window_pattern"):
        require_number(cfg["sliding_window_pattern"], f"model ({where}).sliding_window_pattern", lo=1,
                       hi=MAX_DIMENSION, integer=True)
        full = layers // cfg["sliding_window_pattern"]
    else:
        full = layers // 2 if model_type == "gemma2" else 0
    return {"sliding_window": window, "full_attention_layers": full}


def _experts_of(cfg: Mapping[str, Any], where: str) -> dict:
    """The mixture-of-experts fields of a Hugging Face config: Mixtral's and GPT-OSS's
    ``num_local_experts``, Qwen's ``num_experts`` and ``moe_intermediate_size`` (Qwen2-MoE's shared
    expert), DeepSeek's ``n_routed_experts`` and ``n_shared_experts``; none in a dense config."""
    experts = cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts") or 0
    if not experts:
        return {}
    for key in ("num_experts", "num_local_experts", "n_routed_experts", "num_experts_per_tok", "experts_per_token",
                "moe_intermediate_size", "shared_expert_intermediate_size", "n_shared_experts"):
        if cfg.get(key) is not None:
            require_number(cfg[key], f"model ({where}).{key}", lo=0, hi=MAX_DIMENSION, integer=True,
                           fix="config.json must give it as a non-negative integer")
    dense = cfg.get("first_k_dense_replace") or cfg.get("mlp_only_layers") or (cfg.get("decoder_sparse_step") or 1) > 1
    if dense:
        raise ConfigError(f"model ({where})", "some of its blocks have a dense MLP beside the expert ones",
                          "memx models every block as a mixture of experts: use a model whose blocks all are")
    expert_ffn = cfg.get("moe_intermediate_size") or 0
    shared = cfg.get("shared_expert_intermediate_size") or (cfg.get("n_shared_experts") or 0) * expert_ffn
    return {"num_experts": experts, "experts_per_token": cfg.get("num_experts_per_tok") or cfg.get("experts_per_token")
            or 0, "expert_ffn_hidden_size": expert_ffn, "shared_expert_ffn_hidden_size": shared}


def _llama(name, layers, hidden, heads, kv, ffn, vocab, seq, rope_theta=10000.0) -> ModelSpec:
    return ModelSpec(name, layers, hidden, heads, kv, ffn, vocab, seq, rope_theta=rope_theta)


def _gpt_style(name, layers, hidden, heads, ffn, vocab, seq, positions) -> ModelSpec:
    return ModelSpec(name, layers, hidden, heads, heads, ffn, vocab, seq, gated_mlp=False, tie_embeddings=True,
                     layer_norm=True, linear_biases=True, position_embeddings=positions)


# Paper Table 4 plus the published FFN and KV-head sizes; the small flavors run on a CPU.
MODEL_CATALOG: dict[str, ModelSpec] = {m.name: m for m in (
    _llama("llama2-7b", 32, 4096, 32, 32, 11008, 32000, 4096),
    _llama("llama2-13b", 40, 5120, 40, 40, 13824, 32000, 4096),
    _llama("llama2-70b", 80, 8192, 64, 8, 28672, 32000, 4096),
    _llama("llama3-8b", 32, 4096, 32, 8, 14336, 128256, 8192, rope_theta=500000.0),
    _llama("llama3-70b", 80, 8192, 64, 8, 28672, 128256, 8192, rope_theta=500000.0),
    _llama("llama-tiny", 8, 128, 4, 2, 352, 512, 64),
    _llama("llama-small", 8, 512, 8, 4, 1376, 2048, 256),
    _llama("tinyllama-1.1b", 22, 2048, 32, 4, 5632, 32000, 2048),  # TinyLlama-1.1B's shape: benchmarks/gpu_check.py
    # Models of the public GPU profiles in shared/peer-data/sailor (GELU MLP, LayerNorm, biases,
    # learned positions: OPT's table has 2 rows more than its context; fp32 there).
    _gpt_style("opt-350m", 24, 1024, 16, 4096, 50272, 2048, positions=2050),
    # GPT-J-6B (EleutherAI): attention and MLP side by side, rotary positions, an untied head.
    ModelSpec("gpt-j-6b", 28, 4096, 16, 16, 16384, 50400, 2048, gated_mlp=False, layer_norm=True,
              linear_biases=True, parallel_blocks=True),
    _gpt_style("gpt-neo-2.7b", 32, 2560, 20, 10240, 50257, 2048, positions=2048),
    _gpt_style("opt-30b", 48, 7168, 56, 28672, 50272, 2048, positions=2050),
    # Mixtures of experts (their Hugging Face configs): Mixtral-8x7B; Qwen3-30B-A3B and
    # Qwen3-235B-A22B, whose 128-wide heads are wider than hidden / heads.
    ModelSpec("mixtral-8x7b", 32, 4096, 32, 8, 14336, 32000, 4096, rope_theta=1e6, num_experts=8,
              experts_per_token=2),
    ModelSpec("qwen3-30b-a3b", 48, 2048, 32, 4, 6144, 151936, 4096, rope_theta=1e6, attention_head_dim=128,
              num_experts=128, experts_per_token=8, expert_ffn_hidden_size=768),
    ModelSpec("qwen3-235b-a22b", 94, 4096, 64, 4, 12288, 151936, 4096, rope_theta=1e6, attention_head_dim=128,
              num_experts=128, experts_per_token=8, expert_ffn_hidden_size=1536),
    # GPT-OSS-120B: every other block attends within 128 tokens (its attention sinks and the
    # biases of its attention and experts, 0.01% of its parameters, are not counted).
    ModelSpec("gpt-oss-120b", 36, 2880, 64, 8, 2880, 201088, 4096, rope_theta=150000.0, attention_head_dim=64,
              num_experts=128, experts_per_token=4, sliding_window=128, full_attention_layers=18),
)}


def get_model(name_or_path: str) -> ModelSpec:
    """A catalog name, or the path of a Hugging Face ``config.json`` (or its folder)."""
    if name_or_path in MODEL_CATALOG:
        return MODEL_CATALOG[name_or_path]
    candidate = name_or_path
    if os.path.isdir(candidate):
        candidate = os.path.join(candidate, "config.json")
    if candidate.endswith(".json") and os.path.exists(candidate):
        return ModelSpec.from_hf_config(candidate)
    close = difflib.get_close_matches(name_or_path, MODEL_CATALOG, n=3, cutoff=0.4)
    hint = f"did you mean {', '.join(close)}?" if close else f"known: {', '.join(MODEL_CATALOG)}"
    raise ConfigError("--model", f"unknown model {name_or_path!r}",
                      f"{hint} (or pass a Hugging Face config.json)")
