//! The HF `config.json` Baton writes for a [`ModelConfig`] (`ModelConfig::to_hf_json`: what
//! transformers needs to rebuild the model; used by `export_hf` and the test fixtures). The
//! reading side is `config` and `hf_options`.

use serde_json::{Value, json};

use crate::config::{Architecture, LayerType, ModelConfig, RopeScaling};

impl ModelConfig {
    /// The HF `config.json` transformers needs to build this model (legacy `rope_theta` /
    /// `rope_scaling` keys, which every transformers version reads).
    pub fn to_hf_json(&self) -> Value {
        let rope_scaling = match self.rope_scaling {
            None => Value::Null,
            Some(RopeScaling::Linear { factor }) => {
                json!({"rope_type": "linear", "type": "linear", "factor": f32_json(factor)})
            }
            Some(RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            }) => json!({
                "rope_type": "llama3", "factor": f32_json(factor),
                "low_freq_factor": f32_json(low_freq_factor),
                "high_freq_factor": f32_json(high_freq_factor),
                "original_max_position_embeddings": original_max_position_embeddings
            }),
            Some(RopeScaling::Yarn {
                factor,
                original_max_position_embeddings,
                beta_fast,
                beta_slow,
                truncate,
                attention_factor,
            }) => json!({
                "rope_type": "yarn", "factor": f32_json(factor),
                "original_max_position_embeddings": original_max_position_embeddings,
                "beta_fast": f32_json(beta_fast), "beta_slow": f32_json(beta_slow), "truncate": truncate,
                "attention_factor": attention_factor.map_or(Value::Null, f32_json)
            }),
        };
        let eos: Value = match self.eos_token_ids.as_slice() {
            [] => Value::Null,
            [one] => json!(one),
            many => json!(many),
        };
        let mut v = json!({
            "architectures": [self.architecture.hf_class()],
            "model_type": self.architecture.model_type(),
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": f32_json(self.rms_norm_eps),
            "rope_theta": f32_json(self.rope_theta),
            "rope_scaling": rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
            "torch_dtype": "float32",
            "use_cache": true,
        });
        if let Some(obj) = v.as_object_mut() {
            if let Some(m) = &self.moe {
                obj.insert("num_experts_per_tok".into(), json!(m.experts_per_token));
            }
            match self.architecture {
                Architecture::Llama => {
                    obj.insert("attention_bias".into(), json!(self.attention_bias));
                    obj.insert("mlp_bias".into(), json!(false));
                }
                Architecture::Mistral => {
                    obj.insert("sliding_window".into(), Value::Null);
                }
                Architecture::Qwen3 => {
                    obj.insert("attention_bias".into(), json!(self.attention_bias));
                    obj.insert("use_sliding_window".into(), json!(false));
                    obj.insert("sliding_window".into(), Value::Null);
                    obj.insert("max_window_layers".into(), json!(self.num_hidden_layers));
                }
                Architecture::Qwen3Moe => {
                    obj.insert("attention_bias".into(), json!(self.attention_bias));
                    obj.insert("use_sliding_window".into(), json!(false));
                    obj.insert("sliding_window".into(), Value::Null);
                    obj.insert("max_window_layers".into(), json!(self.num_hidden_layers));
                    if let Some(m) = &self.moe {
                        obj.insert("num_experts".into(), json!(m.num_experts));
                        obj.insert("moe_intermediate_size".into(), json!(m.intermediate_size));
                        obj.insert("norm_topk_prob".into(), json!(m.norm_topk_prob));
                        obj.insert("decoder_sparse_step".into(), json!(m.decoder_sparse_step));
                        obj.insert("mlp_only_layers".into(), json!(m.mlp_only_layers));
                    }
                }
                Architecture::Mixtral => {
                    obj.insert("sliding_window".into(), Value::Null);
                    if let Some(m) = &self.moe {
                        obj.insert("num_local_experts".into(), json!(m.num_experts));
                    }
                }
                Architecture::Qwen2 => {
                    obj.insert("use_sliding_window".into(), json!(false));
                    obj.insert("sliding_window".into(), Value::Null);
                    obj.insert("max_window_layers".into(), json!(self.num_hidden_layers));
                }
                Architecture::Gemma2 | Architecture::Gemma3Text => self.insert_gemma_keys(obj),
                Architecture::GptOss => {
                    obj.insert("attention_bias".into(), json!(self.attention_bias));
                    let types: Vec<&str> = self.layer_types.iter().map(|t| t.hf_name()).collect();
                    obj.insert("layer_types".into(), json!(types));
                    obj.insert("sliding_window".into(), json!(self.sliding_window));
                    if let Some(m) = &self.moe {
                        obj.insert("num_local_experts".into(), json!(m.num_experts));
                    }
                    if let Some(g) = self.gpt_oss {
                        obj.insert("swiglu_alpha".into(), f32_json(g.swiglu_alpha));
                        obj.insert("swiglu_limit".into(), f32_json(g.swiglu_limit));
                    }
                }
                Architecture::Phi3 => {
                    obj.insert("sliding_window".into(), json!(self.sliding_window));
                    obj.insert("partial_rotary_factor".into(), f32_json(self.partial_rotary_factor));
                    if let Some(l) = &self.longrope {
                        let list = |f: &[f32]| f.iter().map(|x| f32_json(*x)).collect::<Vec<_>>();
                        obj.insert(
                            "rope_scaling".into(),
                            json!({"rope_type": "longrope", "type": "longrope",
                                   "short_factor": list(&l.short_factor), "long_factor": list(&l.long_factor),
                                   "original_max_position_embeddings": l.original_max_position_embeddings,
                                   "attention_factor": f32_json(l.attention_factor)}),
                        );
                        obj.insert(
                            "original_max_position_embeddings".into(),
                            json!(l.original_max_position_embeddings),
                        );
                    }
                }
            }
        }
        v
    }

    /// The Gemma keys of [`ModelConfig::to_hf_json`] (transformers 4 names, which 5 reads too).
    fn insert_gemma_keys(&self, obj: &mut serde_json::Map<String, Value>) {
        obj.remove("hidden_act");
        obj.insert("hidden_activation".into(), json!("gelu_pytorch_tanh"));
        obj.insert("attention_bias".into(), json!(self.attention_bias));
        let types: Vec<&str> = self.layer_types.iter().map(|t| t.hf_name()).collect();
        obj.insert("layer_types".into(), json!(types));
        obj.insert("sliding_window".into(), json!(self.sliding_window));
        if self.architecture == Architecture::Gemma3Text {
            let local = self.rope_for(LayerType::Sliding).theta;
            obj.insert("rope_local_base_freq".into(), f32_json(local));
        }
        if let Some(g) = self.gemma {
            let cap = |c: Option<f32>| c.map_or(Value::Null, f32_json);
            obj.insert("query_pre_attn_scalar".into(), f32_json(g.query_pre_attn_scalar));
            obj.insert("attn_logit_softcapping".into(), cap(g.attn_logit_softcapping));
            obj.insert("final_logit_softcapping".into(), cap(g.final_logit_softcapping));
        }
    }
}

/// An f32 as the JSON number with its shortest decimal form (`1e-5`, not `9.99999974e-6`).
fn f32_json(x: f32) -> Value {
    x.to_string().parse::<f64>().map(Value::from).unwrap_or(Value::Null)
}
