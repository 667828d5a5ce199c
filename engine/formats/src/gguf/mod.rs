//! GGUF support: a bounds-checked reader and a writer for the container, ggml block
//! quantizations, and the mapping of llama.cpp models onto HF names and shapes.

mod gpt_oss;
pub mod model;
pub mod quant;
pub mod reader;
pub mod writer;

pub use model::{
    GgufStore, gemma_attention_scalar, gguf_config, gguf_experts_name, gguf_router_name, gguf_to_hf_name,
    gguf_to_hf_name_for, hf_to_gguf_name, hf_to_gguf_name_for, permute_qk_rows, qk_permute_heads,
};
pub use reader::{GgufFile, GgufTensorInfo, GgufType, GgufValue};
pub use writer::GgufWriter;
