"""The Llama family's config.json in and out: Llama, Mistral, Qwen2, Qwen3 and the mixtures of
experts Mixtral, Qwen2-MoE, Qwen3-MoE, all one jaxpar kind (llama) whose options say how a layer
differs from Llama's: q/k/v biases (model.qkv_bias), per-head q/k norms (model.qk_norm), a head
width other than hidden / heads (model.head_dim, Qwen3's), a mixture (model.n_experts ...) with
Qwen2-MoE's gated shared expert (model.shared_expert_gate), in every decoder_sparse_step-th layer
(model.moe_every).

What jaxpar's layer cannot do is refused in one sentence naming the config.json key: biases on
the attention's output, rope scaling, dense layers between the mixtures other than every
decoder_sparse_step-th layer's (mlp_only_layers). A sliding window becomes
model.max_positions, the longest sequence jaxpar then trains or decodes (where a window shorter
than the sequence would change the attention, jaxpar has none).

Out, the architecture is read off the options (`architecture_of`): a mixture with shared experts
is Qwen2-MoE (without the gate jaxpar has, it is written as a zero gate weight, sigmoid(0) = 1/2,
and the shared down projection doubled, which is exact; missing q/k/v biases as zeros).
"""
from __future__ import annotations

from typing import Callable

from jaxpar.config import ConfigError

LLAMA, MISTRAL, MIXTRAL = "LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM"
QWEN2, QWEN2_MOE = "Qwen2ForCausalLM", "Qwen2MoeForCausalLM"
QWEN3, QWEN3_MOE = "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"
ARCHITECTURES = (LLAMA, MISTRAL, MIXTRAL, QWEN2, QWEN2_MOE, QWEN3, QWEN3_MOE)
_MODEL_TYPE = {LLAMA: "llama", MISTRAL: "mistral", MIXTRAL: "mixtral", QWEN2: "qwen2",
               QWEN2_MOE: "qwen2_moe", QWEN3: "qwen3", QWEN3_MOE: "qwen3_moe"}
_QWEN = (QWEN2, QWEN2_MOE, QWEN3, QWEN3_MOE)


def _window(arch: str, hf: dict) -> int | None:
  """The sliding window some layer attends over, or None when every layer sees everything."""
  if arch in (MISTRAL, MIXTRAL):
    return hf.get("sliding_window") or None
  if arch not in _QWEN or not hf.get("sliding_window"):
    return None
  if hf.get("layer_types"):  # transformers 5 spells out each layer's kind
    return hf["sliding_window"] if "sliding_attention" in hf["layer_types"] else None
  slides = hf.get("use_sliding_window") and hf.get("max_window_layers", 0) < hf["num_hidden_layers"]
  return hf["sliding_window"] if slides else None


def model_overrides(arch: str, hf: dict, refuse: Callable) -> dict:
  """The `model.*` keys of a Llama-family config.json; refuse(key, value, want) raises."""
  D, H = hf["hidden_size"], hf["num_attention_heads"]
  rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
  if rope.get("rope_type", rope.get("type", "default")) != "default":
    refuse("rope type", rope.get("rope_type", rope.get("type")), "default")
  if hf.get("hidden_act", "silu") != "silu":
    refuse("hidden_act", hf.get("hidden_act"), "silu")
  for key in ("attention_bias", "mlp_bias"):  # Llama's and Qwen3's attention_bias biases o_proj
    if hf.get(key):
      refuse(key, hf[key], False)
  out = {"kind": "llama", "n_layers": hf["num_hidden_layers"], "d_model": D, "n_heads": H,
         "n_kv_heads": hf.get("num_key_value_heads") or H, "d_ff": hf["intermediate_size"],
         "vocab_size": hf["vocab_size"], "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
         "rope_theta": float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
         "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
         "qkv_bias": arch == QWEN2 or (arch == QWEN2_MOE and hf.get("qkv_bias", True)),
         "qk_norm": arch in (QWEN3, QWEN3_MOE)}
  if hf.get("head_dim") and hf["head_dim"] != D // H:  # Qwen3's: wider or narrower than D / H
    out["head_dim"] = hf["head_dim"]
  window = _window(arch, hf)
  if window:
    out["max_positions"] = int(window)
  if arch == MIXTRAL:
    out.update(n_experts=hf["num_local_experts"], experts_per_token=hf["num_experts_per_tok"],
               router_softmax="after_topk")  # softmax, top-k, renormalise
  elif arch in (QWEN2_MOE, QWEN3_MOE):
    out.update(_qwen_moe(arch, hf, refuse))
  return out


def _qwen_moe(arch: str, hf: dict, refuse: Callable) -> dict:
  """The mixture's keys of a Qwen2-MoE or Qwen3-MoE config.json."""
  E = hf.get("num_experts") or hf.get("num_local_experts")
  if not E:
    refuse("num_experts", E, "a mixture of at least one expert")
  if hf.get("mlp_only_layers"):
    refuse("mlp_only_layers", hf["mlp_only_layers"], "[]: no dense layer between the mixtures")
  F = hf["moe_intermediate_size"]
  out = {"n_experts": E, "experts_per_token": hf["num_experts_per_tok"], "moe_d_ff": F,
         "router_softmax": "after_topk" if hf.get("norm_topk_prob", False) else "before_topk",
         "moe_every": hf.get("decoder_sparse_step", 1)}  # its dense layers' width: d_ff
  Fs = hf.get("shared_expert_intermediate_size", 0) if arch == QWEN2_MOE else 0
  if Fs % F:
    refuse("shared_expert_intermediate_size", Fs,
           f"a multiple of moe_intermediate_size={F} (jaxpar's shared experts are whole experts)")
  if Fs:
    out.update(shared_experts=Fs // F, shared_expert_gate=True)
  return out


def architecture_of(mc) -> str:
  """The Hugging Face architecture that holds jaxpar's llama-kind model `mc` exactly."""
  def refuse(why):
    raise ConfigError(f"this llama-kind model has {why}, which no Hugging Face architecture "
                      f"jaxpar writes (Llama, Mistral, Mixtral, Qwen2, Qwen2-MoE, Qwen3, "
                      f"Qwen3-MoE) holds")
  if mc.qkv_bias and mc.qk_norm:
    refuse("both q/k/v biases and q/k norms")
  if not mc.n_experts:
    return QWEN3 if mc.qk_norm else QWEN2 if mc.qkv_bias else MISTRAL if mc.max_positions else LLAMA
  if mc.shared_experts:
    if mc.qk_norm:
      refuse("shared experts and q/k norms")
    return QWEN2_MOE
  if mc.qk_norm:
    return QWEN3_MOE
  if mc.moe_every > 1:
    refuse(f"a mixture only every {mc.moe_every} layers (model.moe_every) and neither shared "
           "experts nor q/k norms (every layer of Mixtral's is a mixture)")
  if mc.qkv_bias:
    refuse("a mixture without shared experts and with q/k/v biases")
  if mc.router_softmax != "after_topk":
    refuse("a mixture with router_softmax=before_topk and neither shared experts nor q/k norms")
  return MIXTRAL


def hf_config(mc, arch: str) -> dict:
  """config.json's model keys for jaxpar's llama-kind model `mc` written as `arch`."""
  K = mc.head_width()
  out = {"architectures": [arch], "model_type": _MODEL_TYPE[arch],
         "num_hidden_layers": mc.n_layers, "hidden_size": mc.d_model,
         "num_attention_heads": mc.n_heads, "num_key_value_heads": mc.n_kv_heads or mc.n_heads,
         "intermediate_size": mc.d_ff, "head_dim": K,
         "max_position_embeddings": max(mc.seq_len, mc.max_positions),
         "rms_norm_eps": mc.norm_eps, "hidden_act": "silu", "attention_bias": False,
         "mlp_bias": False, "rope_theta": mc.rope_theta,
         "rope_parameters": {"rope_type": "default", "rope_theta": mc.rope_theta}}
  if arch in (MISTRAL, MIXTRAL):
    out["sliding_window"] = mc.max_positions or None
  if arch in _QWEN:  # full attention: within max_positions the same as any window it came with
    out.update(use_sliding_window=False, sliding_window=None, max_window_layers=mc.n_layers,
               layer_types=["full_attention"] * mc.n_layers)
  if arch == MIXTRAL:
    out.update(num_local_experts=mc.n_experts, num_experts_per_tok=mc.experts_per_token,
               intermediate_size=mc.moe_d_ff or mc.d_ff, router_jitter_noise=0.0)
  if arch in (QWEN2_MOE, QWEN3_MOE):
    F = mc.moe_d_ff or mc.d_ff
    out.update(num_experts=mc.n_experts, num_local_experts=mc.n_experts,
               num_experts_per_tok=mc.experts_per_token, moe_intermediate_size=F,
               norm_topk_prob=mc.router_softmax == "after_topk", decoder_sparse_step=mc.moe_every,
               mlp_only_layers=[])
  if arch == QWEN2_MOE:
    out.update(shared_expert_intermediate_size=mc.shared_experts * F, qkv_bias=True)
  return out
