//! GGUF ↔ HF tensor naming and llama.cpp's Q/K row permutation, on random data.

use baton_formats::gguf::{gguf_to_hf_name, hf_to_gguf_name, permute_qk_rows};
use baton_formats::testing::TinySpec;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

#[test]
fn every_hf_tensor_name_maps_to_gguf_and_back() {
    let spec = TinySpec { attention_bias: true, ..TinySpec::llama() };
    let mut seen = std::collections::HashSet::new();
    for (name, _) in spec.config().expected_tensors() {
        let g = hf_to_gguf_name(&name).expect("has a GGUF name");
        assert!(seen.insert(g.clone()), "two tensors map to {g}");
        assert_eq!(gguf_to_hf_name(&g).as_deref(), Some(name.as_str()));
    }
    assert_eq!(hf_to_gguf_name("model.layers.3.self_attn.q_proj.bias").as_deref(), Some("blk.3.attn_q.bias"));
    assert_eq!(gguf_to_hf_name("rope_freqs.weight"), None);
    assert_eq!(gguf_to_hf_name("blk.x.attn_q.weight"), None);
}

#[test]
fn qk_permutation_is_an_inverse_pair_and_moves_rows() {
    let mut rng = StdRng::seed_from_u64(3);
    for (n_head, head_dim, row_bytes) in [(4usize, 16usize, 8usize), (3, 64, 4), (1, 2, 1)] {
        let rows = n_head * head_dim;
        let data: Vec<u8> = (0..rows * row_bytes).map(|_| rng.random()).collect();
        let g = permute_qk_rows(&data, rows, n_head, true).expect("permute");
        assert_eq!(permute_qk_rows(&g, rows, n_head, false).expect("unpermute"), data);
        if head_dim > 2 {
            assert_ne!(g, data);
        }
        // Row 1 of head 0 in GGUF order is HF row head_dim / 2 (the other rotary half).
        assert_eq!(g[row_bytes..2 * row_bytes], data[head_dim / 2 * row_bytes..(head_dim / 2 + 1) * row_bytes]);
    }
    assert!(permute_qk_rows(&[0u8; 30], 10, 4, true).is_none(), "10 rows do not split into 4 heads");
    assert!(permute_qk_rows(&[0u8; 12], 6, 2, true).is_none(), "odd head_dim");
}
