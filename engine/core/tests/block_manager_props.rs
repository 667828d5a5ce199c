//! Property tests of the KV block pool against a shadow model.
//!
//! Random requests built from a few shared prefixes allocate, "compute" (write their
//! tokens into a shadow copy of every block slot), register full blocks, grow and free,
//! in a pool small enough that cached blocks are evicted all the time. After every
//! operation: the pool's own consistency check, refcounts recomputed from the live
//! tables, sharing only of cached prefix blocks at equal positions, and every prefix hit
//! returns blocks whose shadow content equals the requester's tokens (no stale hits).

use baton_core::api::RequestId;
use baton_core::block_hash::hash_full_blocks;
use baton_core::block_manager::{BlockId, KvBlockManager};
use proptest::prelude::*;
use std::collections::HashMap;

/// splitmix64: a small deterministic generator driven by proptest's seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

struct Live {
    tokens: Vec<u32>,
    computed: usize,
}

struct Harness {
    m: KvBlockManager,
    bs: usize,
    /// Shadow KV: the token written at each (block, offset).
    slots: HashMap<(BlockId, usize), u32>,
    live: HashMap<RequestId, Live>,
}

impl Harness {
    fn write(&mut self, id: RequestId, from: usize, to: usize) {
        let table = self.m.block_table(id).expect("live table").to_vec();
        let live = &self.live[&id];
        for pos in from..to {
            let b = table[pos / self.bs];
            assert!(self.m.ref_count(b) == 1, "writing into shared block {b}");
            self.slots.insert((b, pos % self.bs), live.tokens[pos]);
        }
    }

    fn check(&self) {
        self.m.check_consistency().expect("pool consistent");
        let mut refs: HashMap<BlockId, Vec<(RequestId, usize)>> = HashMap::new();
        for id in self.live.keys() {
            for (i, &b) in self.m.block_table(*id).unwrap_or(&[]).iter().enumerate() {
                refs.entry(b).or_default().push((*id, i));
            }
        }
        let mut held = 0;
        for b in 0..self.m.num_blocks() as BlockId {
            let holders = refs.get(&b).map_or(&[][..], Vec::as_slice);
            assert_eq!(self.m.ref_count(b) as usize, holders.len(), "refcount of block {b}");
            if holders.len() > 1 {
                assert!(self.m.block_hash(b).is_some(), "block {b} shared but not cached");
                assert!(holders.iter().all(|h| h.1 == holders[0].1), "shared block {b} at different positions");
            }
            held += usize::from(!holders.is_empty());
        }
        assert_eq!(self.m.num_free_blocks(), self.m.num_blocks() - held);
        // Every computed token of every live request is in its blocks.
        for (id, l) in &self.live {
            let table = self.m.block_table(*id).unwrap_or(&[]);
            for pos in 0..l.computed {
                let slot = (table[pos / self.bs], pos % self.bs);
                assert_eq!(self.slots.get(&slot), Some(&l.tokens[pos]), "{id} lost KV at position {pos}");
            }
        }
    }
}

fn run(seed: u64, num_blocks: usize, bs: usize, ops: usize, caching: bool) {
    let mut rng = Rng(seed);
    let mut h = Harness {
        m: KvBlockManager::new(num_blocks, bs, caching).expect("valid pool"),
        bs,
        slots: HashMap::new(),
        live: HashMap::new(),
    };
    let prefixes: Vec<Vec<u32>> = (0..3).map(|_| (0..3 * bs).map(|_| 1 + rng.below(20) as u32).collect()).collect();
    let mut next_id = 0u64;
    for _ in 0..ops {
        match rng.below(4) {
            0 | 1 => {
                let mut tokens = prefixes[rng.below(prefixes.len())][..rng.below(3 * bs + 1)].to_vec();
                tokens.extend((0..1 + rng.below(3 * bs)).map(|_| 1 + rng.below(20) as u32));
                let hashes = hash_full_blocks(&tokens, bs);
                let hit = h.m.find_cached_prefix(&hashes, tokens.len());
                assert!(hit.len() * bs < tokens.len(), "a hit must leave the last token to compute");
                assert!(caching || hit.is_empty(), "hit with prefix caching off");
                for (i, &b) in hit.iter().enumerate() {
                    for off in 0..bs {
                        assert_eq!(h.slots.get(&(b, off)), Some(&tokens[i * bs + off]), "stale prefix hit");
                    }
                }
                let id = RequestId(next_id);
                next_id += 1;
                let before = h.m.num_free_blocks();
                if h.m.allocate(id, &hit, tokens.len()).is_ok() {
                    let computed = hit.len() * bs;
                    h.live.insert(id, Live { tokens, computed });
                    h.write(id, computed, h.live[&id].tokens.len());
                    let l = h.live.get_mut(&id).expect("inserted");
                    l.computed = l.tokens.len();
                    let full = l.computed / bs;
                    h.m.cache_full_blocks(id, &hash_full_blocks(&l.tokens, bs), full);
                } else {
                    assert_eq!(h.m.num_free_blocks(), before, "failed allocation changed the pool");
                }
            }
            2 => {
                // Grow a live request by a few generated tokens.
                let Some(&id) = h.live.keys().nth(rng.below(h.live.len())) else {
                    continue;
                };
                let extra: Vec<u32> = (0..1 + rng.below(bs + 1)).map(|_| 1 + rng.below(20) as u32).collect();
                let new_len = h.live[&id].tokens.len() + extra.len();
                if h.m.allocate(id, &[], new_len).is_ok() {
                    let l = h.live.get_mut(&id).expect("live");
                    let from = l.tokens.len();
                    l.tokens.extend(extra);
                    h.write(id, from, new_len);
                    let l = h.live.get_mut(&id).expect("live");
                    l.computed = new_len;
                    h.m.cache_full_blocks(id, &hash_full_blocks(&l.tokens, bs), new_len / bs);
                }
            }
            _ => {
                let Some(&id) = h.live.keys().nth(rng.below(h.live.len())) else {
                    continue;
                };
                h.live.remove(&id);
                assert!(h.m.free(id));
            }
        }
        h.check();
    }
    let ids: Vec<_> = h.live.keys().copied().collect();
    for id in ids {
        h.live.remove(&id);
        h.m.free(id);
    }
    h.check();
    assert_eq!(h.m.num_free_blocks(), num_blocks);
    assert_eq!(h.m.usage(), 0.0);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn pool_matches_shadow_model(
        seed in any::<u64>(),
        num_blocks in 4usize..40,
        bs in 1usize..6,
        ops in 20usize..200,
        caching in proptest::bool::weighted(0.8),
    ) {
        run(seed, num_blocks, bs, ops, caching);
    }
}
