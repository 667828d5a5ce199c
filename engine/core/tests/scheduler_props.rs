//! Property tests of the scheduler driven by a fake model.
//!
//! Random arrivals (random lengths, shared prefixes, priorities, `share_prefix_with`,
//! requests whose prefix arrives "from another worker"), random aborts, and pools small
//! enough to force preemption. The fake model keeps a shadow KV cache: every scheduled
//! chunk must find the request's earlier tokens in its block table (so prefix hits,
//! recomputes and received KV are all checked for content), then writes its own tokens,
//! and samples random tokens (sometimes EOS, sometimes none at all).
//!
//! After every step: the scheduler's invariants, refcounts recomputed from the live
//! requests' tables, token budget and sequence cap, block tables covering their tokens,
//! and each request's output equal to what the model sampled for it. At the end every
//! request has finished or been aborted and the pool is full again.

use baton_core::api::{EngineRequest, FinishReason, RequestId, SubmitError};
use baton_core::block_manager::BlockId;
use baton_core::params::SamplingParams;
use baton_core::request::RequestStatus;
use baton_core::scheduler::{Scheduler, SchedulerConfig, SchedulerOutput, SchedulingPolicy};
use proptest::prelude::*;
use std::collections::{HashMap, HashSet};

const EOS: u32 = 0;

/// splitmix64, seeded by proptest.
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
    fn chance(&mut self, percent: usize) -> bool {
        self.below(100) < percent
    }
    fn token(&mut self) -> u32 {
        1 + self.below(40) as u32
    }
}

#[derive(Debug, Clone)]
struct Shape {
    seed: u64,
    block_size: usize,
    num_blocks: usize,
    max_num_seqs: usize,
    max_num_batched_tokens: usize,
    chunked: bool,
    prefix_caching: bool,
    priority: bool,
    arrivals: usize,
}

fn shapes() -> impl Strategy<Value = Shape> {
    (
        any::<u64>(),
        1usize..6,
        6usize..40,
        1usize..6,
        4usize..48,
        any::<bool>(),
        any::<bool>(),
        any::<bool>(),
        5usize..40,
    )
        .prop_map(|(seed, bs, nb, seqs, budget, chunked, pc, prio, arrivals)| Shape {
            seed,
            block_size: bs,
            num_blocks: nb,
            max_num_seqs: seqs.min(budget),
            max_num_batched_tokens: budget,
            chunked,
            prefix_caching: pc,
            priority: prio,
            arrivals,
        })
}

struct Sim {
    s: Scheduler,
    rng: Rng,
    bs: usize,
    /// Shadow KV: the token whose KV sits at each (block, offset).
    slots: HashMap<(BlockId, usize), u32>,
    /// Outputs the fake model produced for each live request.
    expected_out: HashMap<RequestId, Vec<u32>>,
    /// Requests whose KV is "in transfer", with the steps left before it lands or fails.
    in_transfer: HashMap<RequestId, (usize, bool)>,
    live: HashSet<RequestId>,
    next_id: u64,
    prefixes: Vec<Vec<u32>>,
    finished: usize,
    paths: Paths,
    /// Random aborts only happen while requests still arrive, so the drain phase that
    /// follows proves every remaining request finishes on its own (liveness).
    aborts_enabled: bool,
}

/// How often each interesting path was taken, to show the random load reaches them all.
#[derive(Debug, Clone, Copy, Default)]
struct Paths {
    preempted: usize,
    prefix_hit_tokens: u64,
    transfers_done: usize,
    transfers_failed: usize,
    aborts: usize,
    stopped: usize,
    length_capped: usize,
    shared_prefix: usize,
    siblings: usize,
    missing_samples: usize,
}

impl Paths {
    fn add(&mut self, o: Paths) {
        self.preempted += o.preempted;
        self.prefix_hit_tokens += o.prefix_hit_tokens;
        self.transfers_done += o.transfers_done;
        self.transfers_failed += o.transfers_failed;
        self.aborts += o.aborts;
        self.stopped += o.stopped;
        self.length_capped += o.length_capped;
        self.shared_prefix += o.shared_prefix;
        self.siblings += o.siblings;
        self.missing_samples += o.missing_samples;
    }
}

impl Sim {
    fn arrive(&mut self) {
        let id = RequestId(self.next_id);
        self.next_id += 1;
        let base = &self.prefixes[self.rng.below(self.prefixes.len())];
        let mut prompt = base[..self.rng.below(base.len() + 1)].to_vec();
        let extra = 1 + self.rng.below(12);
        prompt.extend((0..extra).map(|_| self.rng.token()));
        // The n > 1 pattern: a sibling with the very same prompt that shares its blocks.
        let mut sibling_of = None;
        if self.rng.chance(20)
            && let Some(&first) = self.live.iter().next()
            && let Some(r) = self.s.request(first)
        {
            prompt = r.prompt_token_ids().to_vec();
            sibling_of = Some(first);
            self.paths.siblings += 1;
        }
        let params = SamplingParams {
            max_tokens: Some(1 + self.rng.below(12)),
            min_tokens: self.rng.below(3),
            ignore_eos: self.rng.chance(20),
            stop_token_ids: if self.rng.chance(30) { vec![self.rng.token()] } else { vec![] },
            ..SamplingParams::greedy()
        };
        let params = SamplingParams { min_tokens: params.min_tokens.min(params.max_tokens.unwrap_or(1)), ..params };
        let mut req = EngineRequest::new(prompt.clone(), params);
        req.priority = self.rng.below(4) as i32;
        if sibling_of.is_some() {
            req.share_prefix_with = sibling_of;
        } else if self.rng.chance(15) {
            req.share_prefix_with = self.live.iter().next().copied();
            self.paths.shared_prefix += usize::from(req.share_prefix_with.is_some());
        }
        let result = if self.rng.chance(15) && prompt.len() > 1 {
            let k = 1 + self.rng.below(prompt.len() - 1);
            self.s.add_prefilled_request(id, req, &[EOS], k, None).map(|table| {
                // Blocks are reserved; the "transport" fills them when the transfer lands.
                assert!(table.len() * self.bs >= k);
                let fails = self.rng.chance(30);
                self.in_transfer.insert(id, (self.rng.below(3), fails));
            })
        } else {
            self.s.add_request(id, req, &[EOS])
        };
        match result {
            Ok(()) => {
                self.live.insert(id);
                self.expected_out.insert(id, Vec::new());
            }
            Err(SubmitError::ContextTooLong { .. } | SubmitError::QueueFull { .. } | SubmitError::InvalidPrompt(_)) => {
            }
            Err(e) => panic!("unexpected rejection: {e}"),
        }
    }

    /// Advances in-flight transfers: on landing, writes the prefilled KV into the reserved blocks.
    fn progress_transfers(&mut self) {
        let ids: Vec<RequestId> = self.in_transfer.keys().copied().collect();
        for id in ids {
            let (left, fails) = self.in_transfer[&id];
            if left > 0 {
                self.in_transfer.insert(id, (left - 1, fails));
                continue;
            }
            self.in_transfer.remove(&id);
            let r = self.s.request(id).expect("live while in transfer");
            assert_eq!(r.status(), RequestStatus::WaitingForKv);
            if fails {
                assert!(self.s.fail_kv_transfer(id));
                self.paths.transfers_failed += 1;
                continue;
            }
            let table = self.s.block_manager().block_table(id).expect("reserved").to_vec();
            for pos in 0..r.num_computed_tokens() {
                self.slots.insert((table[pos / self.bs], pos % self.bs), r.all_token_ids()[pos]);
            }
            assert!(self.s.complete_kv_transfer(id));
            self.paths.transfers_done += 1;
        }
    }

    fn abort_some(&mut self) {
        if !self.aborts_enabled || self.live.is_empty() || !self.rng.chance(8) {
            return;
        }
        let victims: Vec<RequestId> = self.live.iter().copied().collect();
        let id = victims[self.rng.below(victims.len())];
        assert!(self.s.abort(id));
        self.paths.aborts += 1;
        self.forget(id);
    }

    fn forget(&mut self, id: RequestId) {
        self.live.remove(&id);
        self.expected_out.remove(&id);
        self.in_transfer.remove(&id);
        self.finished += 1;
    }

    /// Checks the step against the rules, runs the fake model, applies the update.
    fn step(&mut self) {
        let cfg = self.s.config().clone();
        let out: SchedulerOutput = self.s.schedule();
        assert!(out.seqs.len() <= cfg.max_num_seqs, "seq cap");
        self.paths.preempted += out.preempted.len();
        let total: usize = out.seqs.iter().map(|q| q.token_ids.len()).sum();
        assert_eq!(total, out.num_batched_tokens);
        assert!(total <= cfg.max_num_batched_tokens, "token budget");
        let ids: HashSet<_> = out.seqs.iter().map(|q| q.id).collect();
        assert_eq!(ids.len(), out.seqs.len(), "a request scheduled twice");
        for p in &out.preempted {
            assert!(!ids.contains(p), "{p} both preempted and scheduled");
        }
        self.s.check_invariants().expect("invariants after schedule");
        self.check_refcounts();

        let mut sampled = Vec::new();
        for q in &out.seqs {
            let r = self.s.request(q.id).expect("scheduled requests are live");
            assert_eq!(r.status(), RequestStatus::Running);
            assert_eq!(q.start_pos, r.num_computed_tokens());
            assert!(!q.token_ids.is_empty());
            assert_eq!(q.token_ids.as_slice(), &r.all_token_ids()[q.start_pos..q.end_pos()]);
            assert_eq!(q.sample, q.end_pos() == r.num_tokens());
            assert!(q.block_table.len() * self.bs >= q.end_pos(), "block table too short");
            assert_eq!(Some(q.block_table.as_slice()), self.s.block_manager().block_table(q.id));
            if !cfg.enable_chunked_prefill && q.start_pos < r.num_prompt_tokens() && r.num_output_tokens() == 0 {
                assert_eq!(q.end_pos(), r.num_prompt_tokens(), "prompt split with chunking off");
            }
            // The model reads the KV of every earlier position...
            for pos in 0..q.start_pos {
                let slot = (q.block_table[pos / self.bs], pos % self.bs);
                assert_eq!(self.slots.get(&slot), Some(&r.all_token_ids()[pos]), "{} missing KV at {pos}", q.id);
            }
            // ...and writes its own.
            for (i, &t) in q.token_ids.iter().enumerate() {
                let pos = q.start_pos + i;
                let b = q.block_table[pos / self.bs];
                let prev = self.slots.insert((b, pos % self.bs), t);
                if self.s.block_manager().ref_count(b) > 1 {
                    assert_eq!(prev, Some(t), "overwrote a shared block with different content");
                }
            }
            if q.sample && !self.rng.chance(3) {
                let t = if self.rng.chance(10) { EOS } else { self.rng.token() };
                sampled.push((q.id, t));
            } else if q.sample {
                self.paths.missing_samples += 1;
            }
        }
        // Sometimes a request is aborted between schedule and update.
        if self.aborts_enabled && !out.seqs.is_empty() && self.rng.chance(5) {
            let id = out.seqs[self.rng.below(out.seqs.len())].id;
            assert!(self.s.abort(id));
            self.paths.aborts += 1;
            self.forget(id);
        }
        for u in self.s.update(&out, &sampled) {
            assert!(self.live.contains(&u.id), "update for a dead request");
            let exp = self.expected_out.get_mut(&u.id).expect("tracked");
            exp.push(u.new_token);
            match u.finish_reason {
                Some(reason) => {
                    assert!(self.s.request(u.id).is_none(), "finished request still tracked");
                    assert!(self.s.block_manager().block_table(u.id).is_none(), "finished request holds blocks");
                    if reason == FinishReason::Stop {
                        assert_eq!(u.stop_token, Some(u.new_token));
                        self.paths.stopped += 1;
                    } else {
                        assert_eq!(reason, FinishReason::Length);
                        self.paths.length_capped += 1;
                    }
                    self.forget(u.id);
                }
                None => {
                    let r = self.s.request(u.id).expect("live");
                    assert_eq!(r.output_token_ids(), exp.as_slice());
                    assert!(r.num_output_tokens() < r.max_tokens());
                }
            }
        }
        self.s.check_invariants().expect("invariants after update");
        self.check_refcounts();
    }

    fn check_refcounts(&self) {
        let bm = self.s.block_manager();
        let mut holders: HashMap<BlockId, usize> = HashMap::new();
        for id in &self.live {
            for &b in bm.block_table(*id).unwrap_or(&[]) {
                *holders.entry(b).or_default() += 1;
            }
        }
        for b in 0..bm.num_blocks() as BlockId {
            let n = holders.get(&b).copied().unwrap_or(0);
            assert_eq!(bm.ref_count(b) as usize, n, "refcount of block {b}");
            if n > 1 {
                assert!(bm.block_hash(b).is_some(), "block {b} shared but not a cached prefix block");
            }
        }
        assert_eq!(bm.num_free_blocks() + holders.len(), bm.num_blocks());
    }
}

fn run(shape: Shape) -> Paths {
    let cfg = SchedulerConfig {
        block_size: shape.block_size,
        num_blocks: shape.num_blocks,
        max_num_seqs: shape.max_num_seqs,
        max_num_batched_tokens: shape.max_num_batched_tokens,
        max_model_len: 64,
        enable_chunked_prefill: shape.chunked,
        enable_prefix_caching: shape.prefix_caching,
        policy: if shape.priority { SchedulingPolicy::Priority } else { SchedulingPolicy::Fcfs },
        max_waiting: 16,
    };
    let mut rng = Rng(shape.seed);
    let prefixes = (0..3).map(|_| (0..20).map(|_| rng.token()).collect()).collect();
    let mut sim = Sim {
        s: Scheduler::new(cfg).expect("valid config"),
        rng,
        bs: shape.block_size,
        slots: HashMap::new(),
        expected_out: HashMap::new(),
        in_transfer: HashMap::new(),
        live: HashSet::new(),
        next_id: 0,
        prefixes,
        finished: 0,
        paths: Paths::default(),
        aborts_enabled: true,
    };
    while sim.next_id < shape.arrivals as u64 {
        for _ in 0..sim.rng.below(3) {
            sim.arrive();
        }
        sim.progress_transfers();
        sim.abort_some();
        sim.step();
    }
    // Drain without aborts: each live request needs at most ~64 tokens of work, recomputes
    // included, so a generous bound still catches any request that is stuck.
    sim.aborts_enabled = false;
    let mut steps = 0;
    while sim.s.has_unfinished() {
        sim.progress_transfers();
        sim.step();
        steps += 1;
        assert!(steps < 20_000, "no progress: {} live after {steps} drain steps", sim.live.len());
    }
    assert!(sim.live.is_empty());
    let bm = sim.s.block_manager();
    assert_eq!(bm.num_free_blocks(), bm.num_blocks(), "pool not full again");
    assert_eq!(sim.s.stats().num_used_blocks, 0);
    assert_eq!((sim.s.num_running(), sim.s.num_waiting()), (0, 0));
    let stats = sim.s.stats();
    assert_eq!(stats.num_preemptions as usize, sim.paths.preempted);
    assert!(stats.prefix_cache_hits <= stats.prefix_cache_queries);
    Paths { prefix_hit_tokens: stats.prefix_cache_hits, ..sim.paths }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn scheduler_keeps_invariants_under_random_load(shape in shapes()) {
        run(shape);
    }
}

#[test]
fn random_load_reaches_every_path() {
    // Fixed seeds, so this proves the generator above exercises each path it claims to.
    let mut rng = Rng(0xba70);
    let mut total = Paths::default();
    for _ in 0..64 {
        let shape = Shape {
            seed: rng.next(),
            block_size: 1 + rng.below(5),
            num_blocks: 6 + rng.below(34),
            max_num_seqs: 1 + rng.below(4),
            max_num_batched_tokens: 4 + rng.below(44),
            chunked: rng.chance(50),
            prefix_caching: rng.chance(50),
            priority: rng.chance(50),
            arrivals: 5 + rng.below(35),
        };
        total.add(run(shape));
    }
    let p = total;
    let all = [
        p.preempted,
        p.prefix_hit_tokens as usize,
        p.transfers_done,
        p.transfers_failed,
        p.aborts,
        p.stopped,
        p.length_capped,
        p.shared_prefix,
        p.siblings,
        p.missing_samples,
    ];
    assert!(all.iter().all(|&n| n > 0), "some path never taken: {p:?}");
}

#[test]
fn tight_pool_preempts_and_still_finishes_everything() {
    let mut s = Scheduler::new(SchedulerConfig {
        block_size: 2,
        num_blocks: 10,
        max_num_seqs: 4,
        max_num_batched_tokens: 16,
        max_model_len: 64,
        ..SchedulerConfig::default()
    })
    .expect("valid");
    let mut rng = Rng(7);
    let mut outputs: HashMap<RequestId, usize> = HashMap::new();
    for i in 0..4 {
        let prompt: Vec<u32> = (0..6).map(|_| rng.token()).collect();
        let p = SamplingParams { max_tokens: Some(10), ignore_eos: true, ..SamplingParams::greedy() };
        s.add_request(RequestId(i), EngineRequest::new(prompt, p), &[EOS]).expect("fits");
    }
    let mut guard = 0;
    while s.has_unfinished() {
        let out = s.schedule();
        let sampled: Vec<_> = out.seqs.iter().filter(|q| q.sample).map(|q| (q.id, rng.token())).collect();
        for u in s.update(&out, &sampled) {
            *outputs.entry(u.id).or_default() += 1;
        }
        s.check_invariants().expect("invariants");
        guard += 1;
        assert!(guard < 500);
    }
    // 4 requests needing 15 KV slots each share 20 slots: preemption is unavoidable.
    assert!(s.stats().num_preemptions > 0);
    assert!(outputs.values().all(|&n| n == 10), "every request got all its tokens: {outputs:?}");
    assert_eq!(s.block_manager().num_free_blocks(), 10);
}
