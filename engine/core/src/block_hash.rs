//! Prefix-cache block hashes, shared by workers and the router.
//!
//! A full block's hash chains its parent's hash with its token ids, so equal
//! hashes mean equal whole prefixes (up to 64-bit collisions). The function is
//! fixed (xxh3-64 over little-endian bytes with a version seed) so that every
//! process, on every machine, computes the same value: the router's prefix index
//! and the workers' caches must agree.

use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Hash of a full KV block and, through its parent chain, of the whole prefix before it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
pub struct BlockHash(pub u64);

/// Seed that versions the hash function; change it if the scheme changes.
const HASH_SEED: u64 = 0xba70_0001;

/// The hash of a block holding `tokens`, following the block whose hash is `parent`
/// (`None` for the first block of a sequence).
pub fn hash_block(parent: Option<BlockHash>, tokens: &[u32]) -> BlockHash {
    let mut bytes = Vec::with_capacity(8 + 1 + tokens.len() * 4);
    match parent {
        Some(p) => {
            bytes.push(1u8);
            bytes.extend_from_slice(&p.0.to_le_bytes());
        }
        None => bytes.push(0u8),
    }
    for t in tokens {
        bytes.extend_from_slice(&t.to_le_bytes());
    }
    BlockHash(xxh3_64_with_seed(&bytes, HASH_SEED))
}

/// Hashes of every full block of `tokens` (a trailing partial block is not hashed).
pub fn hash_full_blocks(tokens: &[u32], block_size: usize) -> Vec<BlockHash> {
    let mut out = Vec::with_capacity(tokens.len() / block_size.max(1));
    let mut parent = None;
    for chunk in tokens.chunks_exact(block_size.max(1)) {
        let h = hash_block(parent, chunk);
        out.push(h);
        parent = Some(h);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chained_hash_depends_on_whole_prefix() {
        let a = hash_full_blocks(&[1, 2, 3, 4, 5, 6, 7, 8], 4);
        let b = hash_full_blocks(&[9, 2, 3, 4, 5, 6, 7, 8], 4);
        assert_eq!(a.len(), 2);
        assert_ne!(a[0], b[0]);
        assert_ne!(a[1], b[1], "same second block after a different first block must differ");
        assert_eq!(hash_full_blocks(&[1, 2, 3, 4, 5], 4), vec![a[0]]);
    }

    #[test]
    fn hash_is_stable_across_builds() {
        // Pinned value: the router and workers (possibly different binaries) must agree.
        let h = hash_block(None, &[1, 2, 3]);
        assert_eq!(h, hash_block(None, &[1, 2, 3]));
        assert_eq!(h.0, xxh3_64_with_seed(&[0, 1, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0], 0xba70_0001));
    }
}
