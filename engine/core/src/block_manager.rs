//! The paged KV block pool: block tables per request, reference counts, and the
//! prefix cache.
//!
//! A fixed pool of `num_blocks` blocks of `block_size` tokens. Each request owns an
//! ordered block table; block `i` of a table holds tokens `i*block_size..`.
//! A *full* block may carry its chained [`BlockHash`]; the hash → block map makes it
//! findable by later requests with the same prefix, which then share it by reference.
//!
//! Free blocks sit in one queue. A free block that still holds cached content stays
//! in the hash map and is evicted only when a fresh block is needed, least recently
//! freed first. Blocks without cached content are put at the head of the queue so they
//! are reused before any cached block is evicted.
//!
//! Invariants (checked by [`KvBlockManager::check_consistency`] and the property tests):
//! - a block's refcount equals the number of block tables that hold it;
//! - a block is in the free queue iff its refcount is 0, so with no tables
//!   `num_free_blocks() == num_blocks()`;
//! - a block appears at most once in one table, and in two tables only if it is a
//!   cached (hashed) prefix block;
//! - every hash-map entry points at a block carrying that hash, and vice versa.

use crate::api::RequestId;
use crate::block_hash::BlockHash;
use std::collections::HashMap;

/// Index of a KV block in the pool.
pub type BlockId = u32;

/// Marks the end of the free list.
const NIL: u32 = u32::MAX;

/// Why the pool could not be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BlockManagerError {
    /// `block_size` must be at least one token.
    #[error("block_size must be at least 1")]
    ZeroBlockSize,
    /// The pool must have between 1 and `u32::MAX - 1` blocks.
    #[error("num_blocks must be in [1, {max}], got {0}", max = u32::MAX - 1)]
    BadNumBlocks(usize),
}

/// Why an allocation was refused; the pool is unchanged in every case.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum AllocError {
    /// Not enough free blocks right now.
    #[error("need {needed} free KV blocks, only {available} available")]
    NoFreeBlocks {
        /// Fresh blocks the allocation needed.
        needed: usize,
        /// Blocks that could have been handed out.
        available: usize,
    },
    /// A block offered as a cached prefix is out of range, not cached, or listed twice.
    #[error("block {0} cannot be shared as a cached prefix block")]
    NotCached(BlockId),
    /// A cached prefix can only start a table, not extend one.
    #[error("{0} already holds blocks; a cached prefix can only start its table")]
    PrefixAfterBlocks(RequestId),
}

#[derive(Debug, Clone, Copy)]
struct BlockMeta {
    ref_count: u32,
    hash: Option<BlockHash>,
}

/// Intrusive doubly linked list over block ids: O(1) push, pop and removal from the middle
/// (a prefix hit takes a free cached block out of the queue).
#[derive(Debug, Clone)]
struct FreeQueue {
    prev: Vec<u32>,
    next: Vec<u32>,
    queued: Vec<bool>,
    head: u32,
    tail: u32,
    len: usize,
}

impl FreeQueue {
    /// A queue holding every block, in id order.
    fn full(n: u32) -> Self {
        let mut q = Self {
            prev: vec![NIL; n as usize],
            next: vec![NIL; n as usize],
            queued: vec![false; n as usize],
            head: NIL,
            tail: NIL,
            len: 0,
        };
        for b in 0..n {
            q.push_back(b);
        }
        q
    }

    fn push_back(&mut self, b: u32) {
        let i = b as usize;
        self.prev[i] = self.tail;
        self.next[i] = NIL;
        if self.tail == NIL {
            self.head = b;
        } else {
            self.next[self.tail as usize] = b;
        }
        self.tail = b;
        self.queued[i] = true;
        self.len += 1;
    }

    fn push_front(&mut self, b: u32) {
        let i = b as usize;
        self.next[i] = self.head;
        self.prev[i] = NIL;
        if self.head == NIL {
            self.tail = b;
        } else {
            self.prev[self.head as usize] = b;
        }
        self.head = b;
        self.queued[i] = true;
        self.len += 1;
    }

    fn remove(&mut self, b: u32) {
        let i = b as usize;
        if !self.queued[i] {
            return;
        }
        let (p, n) = (self.prev[i], self.next[i]);
        if p == NIL {
            self.head = n;
        } else {
            self.next[p as usize] = n;
        }
        if n == NIL {
            self.tail = p;
        } else {
            self.prev[n as usize] = p;
        }
        self.prev[i] = NIL;
        self.next[i] = NIL;
        self.queued[i] = false;
        self.len -= 1;
    }

    fn pop_front(&mut self) -> Option<u32> {
        let b = self.head;
        if b == NIL {
            return None;
        }
        self.remove(b);
        Some(b)
    }

    fn contains(&self, b: u32) -> bool {
        self.queued.get(b as usize).copied().unwrap_or(false)
    }

    /// Block ids from head (next evicted) to tail.
    fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        let mut cur = self.head;
        std::iter::from_fn(move || {
            if cur == NIL {
                return None;
            }
            let b = cur;
            cur = self.next[b as usize];
            Some(b)
        })
    }
}

/// A change to the set of cached block hashes, for a router's prefix index (DESIGN §1:
/// workers report blocks stored and evicted by the shared block hash).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum CacheEvent {
    /// A full block with this hash became findable in the prefix cache.
    Stored(BlockHash),
    /// The block with this hash was evicted (reused for other content or reset).
    Evicted(BlockHash),
}

#[derive(Debug, Clone, Default)]
struct Table {
    blocks: Vec<BlockId>,
    /// Leading blocks already offered to the prefix cache (hit, registered, or duplicates of a cached block).
    num_hashed: usize,
}

/// The KV block pool with prefix caching.
#[derive(Debug, Clone)]
pub struct KvBlockManager {
    block_size: usize,
    blocks: Vec<BlockMeta>,
    free: FreeQueue,
    cached: HashMap<BlockHash, BlockId>,
    tables: HashMap<RequestId, Table>,
    enable_prefix_caching: bool,
    prefix_queries: u64,
    prefix_hits: u64,
    /// `Some` while event recording is on; drained by [`KvBlockManager::take_cache_events`].
    events: Option<Vec<CacheEvent>>,
}

impl KvBlockManager {
    /// A pool of `num_blocks` free blocks of `block_size` tokens.
    pub fn new(num_blocks: usize, block_size: usize, enable_prefix_caching: bool) -> Result<Self, BlockManagerError> {
        if block_size == 0 {
            return Err(BlockManagerError::ZeroBlockSize);
        }
        let n = match u32::try_from(num_blocks) {
            Ok(n) if n > 0 && n != NIL => n,
            _ => return Err(BlockManagerError::BadNumBlocks(num_blocks)),
        };
        Ok(Self {
            block_size,
            blocks: vec![BlockMeta { ref_count: 0, hash: None }; num_blocks],
            free: FreeQueue::full(n),
            cached: HashMap::new(),
            tables: HashMap::new(),
            enable_prefix_caching,
            prefix_queries: 0,
            prefix_hits: 0,
            events: None,
        })
    }

    /// Starts (or stops) recording [`CacheEvent`]s. Off by default, so a worker nobody
    /// drains never accumulates them.
    pub fn record_cache_events(&mut self, on: bool) {
        self.events = if on { Some(self.events.take().unwrap_or_default()) } else { None };
    }

    /// The cache events since the last call, oldest first.
    pub fn take_cache_events(&mut self) -> Vec<CacheEvent> {
        self.events.as_mut().map(std::mem::take).unwrap_or_default()
    }

    fn emit(&mut self, e: CacheEvent) {
        if let Some(ev) = self.events.as_mut() {
            ev.push(e);
        }
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks in the pool.
    pub fn num_blocks(&self) -> usize {
        self.blocks.len()
    }

    /// Blocks no request references (including evictable cached ones).
    pub fn num_free_blocks(&self) -> usize {
        self.free.len
    }

    /// Fraction of blocks referenced by some request, in [0, 1].
    pub fn usage(&self) -> f64 {
        1.0 - self.free.len as f64 / self.blocks.len() as f64
    }

    /// Whether lookups and registration of full blocks are on.
    pub fn prefix_caching_enabled(&self) -> bool {
        self.enable_prefix_caching
    }

    /// Prompt tokens looked up in the prefix cache (cumulative, counted on admission).
    pub fn prefix_cache_queries(&self) -> u64 {
        self.prefix_queries
    }

    /// Of those, tokens found in the cache.
    pub fn prefix_cache_hits(&self) -> u64 {
        self.prefix_hits
    }

    /// Blocks needed to hold `num_tokens` tokens.
    pub fn blocks_for(&self, num_tokens: usize) -> usize {
        num_tokens.div_ceil(self.block_size)
    }

    /// The block table of `id`, if it holds blocks.
    pub fn block_table(&self, id: RequestId) -> Option<&[BlockId]> {
        self.tables.get(&id).map(|t| t.blocks.as_slice())
    }

    /// How many tables reference `block` (0 for an unknown id).
    pub fn ref_count(&self, block: BlockId) -> u32 {
        self.blocks.get(block as usize).map_or(0, |m| m.ref_count)
    }

    /// The hash `block` carries while its content is cached.
    pub fn block_hash(&self, block: BlockId) -> Option<BlockHash> {
        self.blocks.get(block as usize).and_then(|m| m.hash)
    }

    /// Number of blocks currently findable by hash (in use or evictable).
    pub fn num_cached_blocks(&self) -> usize {
        self.cached.len()
    }

    /// The longest run of leading full blocks whose hashes are cached, for a sequence of
    /// `num_tokens` tokens whose full-block hashes are `block_hashes`. Takes no references.
    ///
    /// Never covers the whole sequence: the last token is always left to compute, so the
    /// step that computes it produces logits to sample from.
    pub fn find_cached_prefix(&self, block_hashes: &[BlockHash], num_tokens: usize) -> Vec<BlockId> {
        if !self.enable_prefix_caching || num_tokens == 0 {
            return Vec::new();
        }
        let max_blocks = ((num_tokens - 1) / self.block_size).min(block_hashes.len());
        block_hashes[..max_blocks].iter().map_while(|h| self.cached.get(h).copied()).collect()
    }

    /// Fresh blocks an allocation would take from the free queue.
    fn fresh_needed(&self, id: RequestId, cached_prefix: &[BlockId], num_tokens: usize) -> usize {
        let held = self.tables.get(&id).map_or(0, |t| t.blocks.len());
        self.blocks_for(num_tokens).saturating_sub(held + cached_prefix.len())
    }

    /// Grows `id`'s table so it covers `num_tokens` tokens. `cached_prefix` (from
    /// [`Self::find_cached_prefix`], only when `id` holds no blocks yet) is shared first;
    /// fresh blocks follow, evicting the least recently freed cached content if needed.
    ///
    /// All or nothing: on any [`AllocError`] the pool is unchanged. Returns the number of
    /// fresh blocks taken.
    pub fn allocate(
        &mut self,
        id: RequestId,
        cached_prefix: &[BlockId],
        num_tokens: usize,
    ) -> Result<usize, AllocError> {
        let holds_blocks = self.tables.get(&id).is_some_and(|t| !t.blocks.is_empty());
        if holds_blocks && !cached_prefix.is_empty() {
            return Err(AllocError::PrefixAfterBlocks(id));
        }
        let mut seen = std::collections::HashSet::with_capacity(cached_prefix.len());
        for &b in cached_prefix {
            if self.block_hash(b).is_none() || !seen.insert(b) {
                return Err(AllocError::NotCached(b));
            }
        }
        let needed = self.fresh_needed(id, cached_prefix, num_tokens);
        // Hit blocks that are free leave the queue, so they cannot also serve as fresh ones.
        let free_hits = cached_prefix.iter().filter(|&&b| self.free.contains(b)).count();
        let available = self.free.len - free_hits;
        if needed > available {
            return Err(AllocError::NoFreeBlocks { needed, available });
        }
        let table = self.tables.entry(id).or_default();
        for &b in cached_prefix {
            let meta = &mut self.blocks[b as usize];
            if meta.ref_count == 0 {
                self.free.remove(b);
            }
            meta.ref_count += 1;
            table.blocks.push(b);
        }
        if !holds_blocks {
            // Hit blocks already carry their hashes; registration resumes after them.
            table.num_hashed = cached_prefix.len();
        }
        let first_fresh = table.blocks.len();
        for _ in 0..needed {
            let Some(b) = self.free.pop_front() else {
                // Unreachable given the check above; leave a consistent, shorter table.
                break;
            };
            let meta = &mut self.blocks[b as usize];
            if let Some(h) = meta.hash.take()
                && self.cached.get(&h) == Some(&b)
            {
                self.cached.remove(&h);
                if let Some(ev) = self.events.as_mut() {
                    ev.push(CacheEvent::Evicted(h));
                }
            }
            self.blocks[b as usize].ref_count = 1;
            table.blocks.push(b);
        }
        // Tails are freed first, so the queue often holds a freed table backwards; taking a
        // batch in ascending order turns it back into one contiguous run, which a KV hand-off
        // moves with one copy (or one NCCL send) per layer instead of one per block. Which
        // blocks are taken is unchanged, only their order within this fresh batch.
        table.blocks[first_fresh..].sort_unstable();
        Ok(needed)
    }

    /// Counts one admission's prefix lookup: `queried` tokens, of which `hit` were cached.
    pub fn record_prefix_lookup(&mut self, queried: usize, hit: usize) {
        self.prefix_queries += queried as u64;
        self.prefix_hits += hit as u64;
    }

    /// Registers `id`'s first `num_full_blocks` blocks (now computed) under their hashes so
    /// later requests can hit them. A hash already cached in another block keeps that block;
    /// this one stays a private copy.
    pub fn cache_full_blocks(&mut self, id: RequestId, block_hashes: &[BlockHash], num_full_blocks: usize) {
        if !self.enable_prefix_caching {
            return;
        }
        let Some(table) = self.tables.get_mut(&id) else {
            return;
        };
        let upto = num_full_blocks.min(block_hashes.len()).min(table.blocks.len());
        let pending = table.blocks[..upto].iter().zip(block_hashes).skip(table.num_hashed);
        for (&b, &h) in pending {
            let meta = &mut self.blocks[b as usize];
            if meta.hash.is_none() && !self.cached.contains_key(&h) {
                meta.hash = Some(h);
                self.cached.insert(h, b);
                if let Some(ev) = self.events.as_mut() {
                    ev.push(CacheEvent::Stored(h));
                }
            }
        }
        table.num_hashed = table.num_hashed.max(upto);
    }

    /// Releases every block of `id`, tail first, so the tail of a sequence is evicted
    /// before its (more shareable) head. Returns false if `id` held nothing.
    pub fn free(&mut self, id: RequestId) -> bool {
        let Some(table) = self.tables.remove(&id) else {
            return false;
        };
        for &b in table.blocks.iter().rev() {
            let meta = &mut self.blocks[b as usize];
            if meta.ref_count == 0 {
                // Would be a double free; the table invariant makes this unreachable.
                continue;
            }
            meta.ref_count -= 1;
            if meta.ref_count == 0 {
                if meta.hash.is_some() {
                    self.free.push_back(b);
                } else {
                    self.free.push_front(b);
                }
            }
        }
        true
    }

    /// Drops every cached hash of free blocks (e.g. after weights change). Blocks in use keep theirs.
    pub fn reset_prefix_cache(&mut self) {
        let free: Vec<u32> = self.free.iter().collect();
        for b in free {
            if let Some(h) = self.blocks[b as usize].hash.take() {
                self.cached.remove(&h);
                self.emit(CacheEvent::Evicted(h));
            }
        }
    }

    /// Verifies every invariant in the module docs; returns the first violation found.
    pub fn check_consistency(&self) -> Result<(), String> {
        let mut refs = vec![0u32; self.blocks.len()];
        for (id, t) in &self.tables {
            let mut seen = std::collections::HashSet::new();
            for &b in &t.blocks {
                if b as usize >= self.blocks.len() {
                    return Err(format!("{id} holds out-of-range block {b}"));
                }
                if !seen.insert(b) {
                    return Err(format!("{id} holds block {b} twice"));
                }
                refs[b as usize] += 1;
            }
        }
        for (b, (meta, &r)) in self.blocks.iter().zip(&refs).enumerate() {
            if meta.ref_count != r {
                return Err(format!("block {b}: refcount {} but {r} tables hold it", meta.ref_count));
            }
            if r > 1 && meta.hash.is_none() {
                return Err(format!("block {b} is shared by {r} tables but is not a cached block"));
            }
            if (r == 0) != self.free.contains(b as u32) {
                return Err(format!("block {b}: refcount {r} but in free queue = {}", r != 0));
            }
            if let Some(h) = meta.hash
                && self.cached.get(&h) != Some(&(b as u32))
            {
                return Err(format!("block {b} carries a hash the cache map does not point back from"));
            }
        }
        for (h, &b) in &self.cached {
            if self.blocks.get(b as usize).and_then(|m| m.hash) != Some(*h) {
                return Err(format!("cache map entry points at block {b} which does not carry that hash"));
            }
        }
        if self.free.iter().count() != self.free.len {
            return Err("free queue length does not match its links".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::block_hash::hash_full_blocks;

    fn mgr(n: usize, bs: usize) -> KvBlockManager {
        KvBlockManager::new(n, bs, true).expect("valid pool")
    }

    #[test]
    fn cache_events_replay_to_the_cached_set() {
        let mut m = mgr(4, 4);
        let a: Vec<u32> = (10..18).collect(); // 2 full blocks
        let ha = hash_full_blocks(&a, 4);
        // Off by default: nothing accumulates.
        m.allocate(RequestId(9), &[], 4).expect("fits");
        m.cache_full_blocks(RequestId(9), &hash_full_blocks(&[1, 2, 3, 4], 4), 1);
        assert!(m.take_cache_events().is_empty());
        m.free(RequestId(9));
        m.record_cache_events(true);
        m.allocate(RequestId(1), &[], a.len()).expect("fits");
        m.cache_full_blocks(RequestId(1), &ha, 2);
        assert_eq!(m.take_cache_events(), vec![CacheEvent::Stored(ha[0]), CacheEvent::Stored(ha[1])]);
        assert!(m.take_cache_events().is_empty(), "events are drained");
        m.free(RequestId(1));
        // Four fresh blocks: every cached block (the unrecorded one too) gets evicted.
        m.allocate(RequestId(2), &[], 16).expect("fits");
        let ev = m.take_cache_events();
        assert_eq!(ev.len(), 3, "{ev:?}");
        assert!(ev.contains(&CacheEvent::Evicted(ha[0])) && ev.contains(&CacheEvent::Evicted(ha[1])));
        assert_eq!(m.num_cached_blocks(), 0);
        // Replaying Stored/Evicted from an empty index gives the live cached set.
        let b: Vec<u32> = (40..56).collect();
        let hb = hash_full_blocks(&b, 4);
        m.cache_full_blocks(RequestId(2), &hb, 4);
        let mut index = std::collections::HashSet::new();
        for e in m.take_cache_events() {
            match e {
                CacheEvent::Stored(h) => assert!(index.insert(h)),
                CacheEvent::Evicted(h) => assert!(index.remove(&h)),
            }
        }
        assert_eq!(index.len(), m.num_cached_blocks());
        assert!(hb.iter().all(|h| index.contains(h)));
        m.record_cache_events(false);
        m.free(RequestId(2));
        m.reset_prefix_cache();
        assert!(m.take_cache_events().is_empty());
    }

    #[test]
    fn rejects_bad_geometry() {
        assert_eq!(KvBlockManager::new(4, 0, true).err(), Some(BlockManagerError::ZeroBlockSize));
        assert_eq!(KvBlockManager::new(0, 16, true).err(), Some(BlockManagerError::BadNumBlocks(0)));
    }

    #[test]
    fn allocate_is_all_or_nothing_and_free_returns_everything() {
        let mut m = mgr(4, 4);
        assert_eq!(m.allocate(RequestId(1), &[], 9), Ok(3));
        assert_eq!(m.block_table(RequestId(1)).map(<[_]>::len), Some(3));
        let err = m.allocate(RequestId(2), &[], 8).expect_err("only one block left");
        assert_eq!(err, AllocError::NoFreeBlocks { needed: 2, available: 1 });
        assert!(m.block_table(RequestId(2)).is_none_or(<[_]>::is_empty));
        assert!((m.usage() - 0.75).abs() < 1e-9);
        // Growing an existing table only takes the extra blocks.
        assert_eq!(m.allocate(RequestId(1), &[], 13), Ok(1));
        assert_eq!(m.num_free_blocks(), 0);
        m.check_consistency().expect("consistent");
        assert!(m.free(RequestId(1)));
        assert!(!m.free(RequestId(1)), "second free is a no-op");
        assert_eq!(m.num_free_blocks(), 4);
        m.check_consistency().expect("consistent");
    }

    #[test]
    fn prefix_hits_share_blocks_and_never_cover_the_last_token() {
        let mut m = mgr(8, 4);
        let tokens: Vec<u32> = (100..112).collect(); // exactly 3 full blocks
        let hashes = hash_full_blocks(&tokens, 4);
        m.allocate(RequestId(1), &[], tokens.len()).expect("fits");
        m.cache_full_blocks(RequestId(1), &hashes, 3);
        // Same 12 tokens: only 2 blocks may hit, the last token must be computed.
        let hit = m.find_cached_prefix(&hashes, tokens.len());
        assert_eq!(hit.as_slice(), &m.block_table(RequestId(1)).expect("held")[..2]);
        // A longer sequence with the same prefix hits all 3.
        let mut longer = tokens.clone();
        longer.push(7);
        let lh = hash_full_blocks(&longer, 4);
        assert_eq!(m.find_cached_prefix(&lh, longer.len()).len(), 3);
        m.allocate(RequestId(2), &hit, tokens.len()).expect("fits");
        assert_eq!(m.ref_count(hit[0]), 2);
        assert_eq!(m.num_free_blocks(), 8 - 4);
        m.check_consistency().expect("consistent");
        m.free(RequestId(1));
        m.free(RequestId(2));
        assert_eq!(m.num_free_blocks(), 8);
        // Freed cached blocks are still findable.
        assert_eq!(m.find_cached_prefix(&lh, longer.len()).len(), 3);
        m.check_consistency().expect("consistent");
    }

    #[test]
    fn eviction_takes_uncached_first_then_least_recently_freed_tail_first() {
        let mut m = mgr(6, 2);
        let a: Vec<u32> = vec![1, 2, 3, 4];
        let b: Vec<u32> = vec![9, 8, 7, 6];
        let (ha, hb) = (hash_full_blocks(&a, 2), hash_full_blocks(&b, 2));
        m.allocate(RequestId(1), &[], 4).expect("fits");
        m.cache_full_blocks(RequestId(1), &ha, 2);
        m.allocate(RequestId(2), &[], 4).expect("fits");
        m.cache_full_blocks(RequestId(2), &hb, 2);
        m.free(RequestId(1));
        m.free(RequestId(2));
        // Two uncached blocks go first, then A's tail, then A's head, then B's tail.
        m.allocate(RequestId(3), &[], 6).expect("fits");
        assert_eq!(m.find_cached_prefix(&ha, 5).len(), 1, "A's tail block evicted, head kept");
        assert_eq!(m.find_cached_prefix(&hb, 5).len(), 2);
        m.allocate(RequestId(3), &[], 10).expect("fits");
        assert_eq!(m.find_cached_prefix(&ha, 5).len(), 0);
        assert_eq!(m.find_cached_prefix(&hb, 5).len(), 1, "B's tail evicted before its head");
        m.check_consistency().expect("consistent");
    }

    #[test]
    fn free_hit_blocks_do_not_count_as_available_fresh_blocks() {
        let mut m = mgr(3, 2);
        let t = vec![1, 2, 3, 4, 5];
        let h = hash_full_blocks(&t, 2);
        m.allocate(RequestId(1), &[], 4).expect("fits");
        m.cache_full_blocks(RequestId(1), &h, 2);
        m.free(RequestId(1));
        let hit = m.find_cached_prefix(&h, t.len());
        assert_eq!(hit.len(), 2);
        // 3 tokens beyond the hit need 2 fresh blocks but only 1 is not a hit block.
        assert!(m.allocate(RequestId(2), &hit, 8).is_err());
        assert_eq!(m.allocate(RequestId(2), &hit, 6), Ok(1));
        assert_eq!(m.num_free_blocks(), 0);
        m.check_consistency().expect("consistent");
    }

    #[test]
    fn bad_cached_prefixes_are_refused_without_side_effects() {
        let mut m = mgr(6, 2);
        let t = vec![8, 9, 10, 11, 12];
        let h = hash_full_blocks(&t, 2);
        m.allocate(RequestId(1), &[], 5).expect("fits");
        m.cache_full_blocks(RequestId(1), &h, 2);
        let table = m.block_table(RequestId(1)).expect("held").to_vec();
        let free = m.num_free_blocks();
        assert_eq!(m.allocate(RequestId(2), &[table[2]], 5), Err(AllocError::NotCached(table[2])));
        assert_eq!(m.allocate(RequestId(2), &[99], 5), Err(AllocError::NotCached(99)));
        assert_eq!(m.allocate(RequestId(2), &[table[0], table[0]], 5), Err(AllocError::NotCached(table[0])));
        assert_eq!(m.allocate(RequestId(1), &[table[0]], 7), Err(AllocError::PrefixAfterBlocks(RequestId(1))));
        assert_eq!(m.num_free_blocks(), free);
        assert!(m.block_table(RequestId(2)).is_none());
        m.check_consistency().expect("consistent");
    }

    #[test]
    fn duplicate_content_keeps_one_cached_copy() {
        let mut m = mgr(4, 2);
        let t = vec![3, 4, 5];
        let h = hash_full_blocks(&t, 2);
        m.allocate(RequestId(1), &[], 3).expect("fits");
        m.allocate(RequestId(2), &[], 3).expect("fits");
        m.cache_full_blocks(RequestId(1), &h, 1);
        m.cache_full_blocks(RequestId(2), &h, 1);
        assert_eq!(m.num_cached_blocks(), 1);
        m.check_consistency().expect("consistent");
        m.free(RequestId(1));
        m.free(RequestId(2));
        assert_eq!(m.num_free_blocks(), 4);
        m.reset_prefix_cache();
        assert_eq!(m.num_cached_blocks(), 0);
        m.check_consistency().expect("consistent");
    }

    #[test]
    fn disabled_prefix_caching_never_hits() {
        let mut m = KvBlockManager::new(4, 2, false).expect("valid");
        let t = vec![1, 2, 3];
        let h = hash_full_blocks(&t, 2);
        m.allocate(RequestId(1), &[], 3).expect("fits");
        m.cache_full_blocks(RequestId(1), &h, 1);
        assert!(m.find_cached_prefix(&h, 3).is_empty());
        assert_eq!(m.num_cached_blocks(), 0);
    }

    #[test]
    fn a_fresh_batch_is_taken_in_ascending_order_so_a_recycled_table_stays_one_run() {
        let mut m = mgr(8, 4);
        m.allocate(RequestId(1), &[], 32).expect("the whole pool");
        let first = m.block_table(RequestId(1)).expect("table").to_vec();
        let tokens: Vec<u32> = (0..32).collect();
        m.cache_full_blocks(RequestId(1), &crate::block_hash::hash_full_blocks(&tokens, 4), 8);
        m.free(RequestId(1));
        // Cached blocks are freed tail-first to the back of the queue, so they sit there
        // backwards; a new prompt taking them must still get one ascending run.
        m.allocate(RequestId(2), &[], 32).expect("the whole pool");
        let table = m.block_table(RequestId(2)).expect("table").to_vec();
        assert!(table.windows(2).all(|w| w[1] == w[0] + 1), "{table:?} (first table {first:?})");
        m.check_consistency().expect("consistent");
    }
}
