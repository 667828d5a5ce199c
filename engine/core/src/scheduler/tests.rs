//! Unit tests for each scheduling rule. Randomized end-to-end properties live in
//! `engine/core/tests/scheduler_props.rs`.

use super::*;
use crate::block_hash::hash_full_blocks;
use crate::params::SamplingParams;

/// Deterministic pseudo-random token ids (splitmix64), so prompts are not trivial patterns.
fn tokens(seed: u64, n: usize) -> Vec<u32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15).wrapping_add(1);
    (0..n)
        .map(|_| {
            x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            (((z ^ (z >> 31)) % 30_000) + 10) as u32
        })
        .collect()
}

fn cfg(num_blocks: usize, budget: usize) -> SchedulerConfig {
    SchedulerConfig {
        block_size: 4,
        num_blocks,
        max_num_seqs: budget.min(8),
        max_num_batched_tokens: budget,
        max_model_len: 256,
        ..SchedulerConfig::default()
    }
}

fn sched(c: SchedulerConfig) -> Scheduler {
    Scheduler::new(c).expect("valid config")
}

fn req(prompt: Vec<u32>, max_tokens: usize) -> EngineRequest {
    EngineRequest::new(prompt, SamplingParams { max_tokens: Some(max_tokens), ..SamplingParams::greedy() })
}

/// Runs one step, sampling `token` for every row that samples; checks invariants.
fn step(s: &mut Scheduler, token: u32) -> (SchedulerOutput, Vec<RequestUpdate>) {
    let out = s.schedule();
    let sampled: Vec<_> = out.seqs.iter().filter(|q| q.sample).map(|q| (q.id, token)).collect();
    let ups = s.update(&out, &sampled);
    s.check_invariants().expect("invariants hold");
    (out, ups)
}

fn seq_of(out: &SchedulerOutput, id: u64) -> Option<&ScheduledSeq> {
    out.seqs.iter().find(|q| q.id == RequestId(id))
}

#[test]
fn new_rejects_invalid_config() {
    let err = Scheduler::new(SchedulerConfig { max_num_seqs: 0, ..cfg(8, 8) }).expect_err("zero seats");
    assert_eq!(err.field, "max_num_seqs");
}

#[test]
fn add_request_rejects_bad_input_with_clear_errors() {
    let mut s = sched(SchedulerConfig { max_waiting: 2, ..cfg(16, 64) });
    let empty = s.add_request(RequestId(1), req(vec![], 4), &[]);
    assert!(matches!(empty, Err(SubmitError::InvalidPrompt(_))), "{empty:?}");
    let mut two = req(tokens(1, 5), 4);
    two.params.n = 2;
    match s.add_request(RequestId(1), two, &[]) {
        Err(SubmitError::InvalidParams(e)) => assert_eq!(e.param, "n"),
        other => panic!("expected n error, got {other:?}"),
    }
    match s.add_request(RequestId(1), req(tokens(1, 5), 0), &[]) {
        Err(SubmitError::InvalidParams(e)) => assert_eq!(e.param, "max_tokens"),
        other => panic!("expected max_tokens error, got {other:?}"),
    }
    assert_eq!(
        s.add_request(RequestId(1), req(tokens(1, 250), 10), &[]),
        Err(SubmitError::ContextTooLong { prompt_tokens: 250, max_tokens: 10, max_model_len: 256 })
    );
    // 16 blocks of 4 hold 64 tokens, so at most 65 tokens in total (the last is never fed).
    assert_eq!(
        s.add_request(RequestId(1), req(tokens(1, 60), 10), &[]),
        Err(SubmitError::ContextTooLong { prompt_tokens: 60, max_tokens: 10, max_model_len: 65 })
    );
    let open = EngineRequest::new(tokens(1, 70), SamplingParams::greedy());
    assert_eq!(
        s.add_request(RequestId(1), open, &[]),
        Err(SubmitError::ContextTooLong { prompt_tokens: 70, max_tokens: 1, max_model_len: 65 })
    );
    assert_eq!(s.add_request(RequestId(1), req(tokens(1, 60), 5), &[]), Ok(()));
    assert!(matches!(s.add_request(RequestId(1), req(tokens(2, 5), 5), &[]), Err(SubmitError::Unavailable(_))));
    assert_eq!(s.add_request(RequestId(2), req(tokens(2, 5), 5), &[]), Ok(()));
    assert_eq!(s.add_request(RequestId(3), req(tokens(3, 5), 5), &[]), Err(SubmitError::QueueFull { waiting: 2 }));
    assert_eq!(s.num_waiting(), 2);

    let mut whole = sched(SchedulerConfig { enable_chunked_prefill: false, ..cfg(64, 16) });
    let long = whole.add_request(RequestId(1), req(tokens(4, 17), 4), &[]);
    assert!(matches!(long, Err(SubmitError::InvalidPrompt(m)) if m.contains("chunked prefill")));
    assert_eq!(whole.add_request(RequestId(1), req(tokens(4, 16), 4), &[]), Ok(()));
}

#[test]
fn unset_max_tokens_resolves_to_what_context_and_pool_leave() {
    let mut s = sched(cfg(1000, 64));
    s.add_request(RequestId(1), EngineRequest::new(tokens(5, 56), SamplingParams::greedy()), &[]).expect("fits");
    assert_eq!(s.request(RequestId(1)).map(Request::max_tokens), Some(200));
}

#[test]
fn chunked_prefill_splits_prompt_and_samples_only_at_the_end() {
    let mut s = sched(cfg(16, 4));
    let prompt = tokens(7, 10);
    s.add_request(RequestId(1), req(prompt.clone(), 3), &[]).expect("accepted");
    let mut fed = Vec::new();
    for (start, len, sample) in [(0, 4, false), (4, 4, false), (8, 2, true)] {
        let (out, ups) = step(&mut s, 42);
        let q = seq_of(&out, 1).expect("scheduled");
        assert_eq!((q.start_pos, q.token_ids.len(), q.sample), (start, len, sample));
        assert!(q.block_table.len() * 4 >= q.end_pos());
        assert_eq!(out.num_batched_tokens, len);
        fed.extend_from_slice(&q.token_ids);
        assert_eq!(ups.len(), usize::from(sample));
    }
    assert_eq!(fed, prompt);
    let (out, ups) = step(&mut s, 43);
    let q = seq_of(&out, 1).expect("decode row");
    assert_eq!((q.start_pos, q.token_ids.as_slice(), q.sample), (10, &[42][..], true));
    assert_eq!(ups[0].new_token, 43);
    assert_eq!(s.request(RequestId(1)).map(|r| r.output_token_ids().to_vec()), Some(vec![42, 43]));
}

#[test]
fn budgets_cap_tokens_and_sequences_and_running_goes_first() {
    let mut s = sched(SchedulerConfig { max_num_seqs: 3, ..cfg(64, 10) });
    for i in 1..=4 {
        s.add_request(RequestId(i), req(tokens(i, 6), 8), &[]).expect("accepted");
    }
    let (out, _) = step(&mut s, 50);
    // 6 + 4 = 10 tokens: request 1 whole, request 2 chunked.
    assert_eq!(out.num_batched_tokens, 10);
    assert_eq!(out.seqs.iter().map(|q| q.token_ids.len()).collect::<Vec<_>>(), vec![6, 4]);
    let (out, _) = step(&mut s, 51);
    // Running first: 1 decodes, 2 finishes its prompt, then 3 gets the remaining 7 tokens' worth.
    let ids: Vec<u64> = out.seqs.iter().map(|q| q.id.0).collect();
    assert_eq!(ids, vec![1, 2, 3]);
    assert_eq!(out.num_batched_tokens, 1 + 2 + 6);
    assert_eq!(s.num_running(), 3, "max_num_seqs keeps request 4 waiting");
    let (out, _) = step(&mut s, 52);
    assert_eq!(out.seqs.len(), 3);
    assert!(seq_of(&out, 4).is_none());
}

#[test]
fn without_chunking_a_prompt_runs_whole_or_waits() {
    let mut s = sched(SchedulerConfig { enable_chunked_prefill: false, ..cfg(64, 8) });
    s.add_request(RequestId(1), req(tokens(1, 6), 4), &[]).expect("accepted");
    s.add_request(RequestId(2), req(tokens(2, 5), 4), &[]).expect("accepted");
    let (out, _) = step(&mut s, 9);
    assert_eq!(out.seqs.len(), 1, "request 2 does not fit whole in the 2 tokens left");
    assert_eq!(out.seqs[0].token_ids.len(), 6);
    let (out, _) = step(&mut s, 9);
    assert_eq!(out.seqs.iter().map(|q| q.token_ids.len()).collect::<Vec<_>>(), vec![1, 5]);
}

#[test]
fn prefix_hits_skip_cached_blocks_but_never_the_whole_prompt() {
    let mut s = sched(cfg(32, 64));
    let prompt = tokens(11, 16);
    s.add_request(RequestId(1), req(prompt.clone(), 1), &[]).expect("accepted");
    let (_, ups) = step(&mut s, 5);
    assert_eq!(ups[0].finish_reason, Some(FinishReason::Length));
    assert_eq!(ups[0].num_cached_tokens, 0);
    // Identical 16-token prompt: 3 of 4 blocks hit, the last block is recomputed.
    s.add_request(RequestId(2), req(prompt.clone(), 1), &[]).expect("accepted");
    let (out, ups) = step(&mut s, 5);
    let q = seq_of(&out, 2).expect("scheduled");
    assert_eq!((q.start_pos, q.token_ids.as_slice()), (12, &prompt[12..]));
    assert_eq!(ups[0].num_cached_tokens, 12);
    // A longer prompt with the same head hits all 4 blocks; a different head hits none.
    let mut longer = prompt.clone();
    longer.extend(tokens(12, 3));
    s.add_request(RequestId(3), req(longer, 1), &[]).expect("accepted");
    s.add_request(RequestId(4), req(tokens(13, 16), 1), &[]).expect("accepted");
    let (out, _) = step(&mut s, 5);
    assert_eq!(seq_of(&out, 3).map(|q| q.start_pos), Some(16));
    assert_eq!(seq_of(&out, 4).map(|q| q.start_pos), Some(0));
    let st = s.stats();
    assert_eq!(st.prefix_cache_queries, 16 + 16 + 19 + 16);
    assert_eq!(st.prefix_cache_hits, 12 + 16);
    assert_eq!(s.block_manager().num_free_blocks(), 32);
}

#[test]
fn prompt_logprobs_skip_the_prefix_cache_until_delivered() {
    let mut s = sched(cfg(32, 64));
    let prompt = tokens(21, 16);
    s.add_request(RequestId(1), req(prompt.clone(), 1), &[]).expect("accepted");
    step(&mut s, 5);
    // Cached, but every position needs its logits: computed from position 0.
    let with = |max_tokens| EngineRequest {
        params: SamplingParams { prompt_logprobs: Some(2), ..req(prompt.clone(), max_tokens).params },
        ..req(prompt.clone(), max_tokens)
    };
    s.add_request(RequestId(2), with(3), &[]).expect("accepted");
    let (out, ups) = step(&mut s, 5);
    assert_eq!(seq_of(&out, 2).map(|q| q.start_pos), Some(0));
    assert_eq!(ups[0].num_cached_tokens, 0);
    assert!(s.request(RequestId(2)).is_some_and(|r| !r.needs_prompt_logits()), "delivered with the first token");
    // Refused for a hand-off: the prompt's logits would be on another worker.
    let err = s.reserve_for_transfer(RequestId(3), with(2), &[]).expect_err("refused");
    assert!(err.to_string().contains("prompt logprobs"), "{err}");
}

#[test]
fn generated_tokens_fill_cacheable_blocks() {
    let mut s = sched(cfg(32, 64));
    let prompt = tokens(21, 6);
    s.add_request(RequestId(1), req(prompt.clone(), 6), &[]).expect("accepted");
    let mut outputs = Vec::new();
    for t in [100, 101, 102, 103, 104, 105] {
        let (_, ups) = step(&mut s, t);
        outputs.push(ups[0].new_token);
    }
    assert!(!s.has_unfinished());
    // prompt (6) + first 5 outputs were fed: blocks 0..2 are full and cached.
    let mut all = prompt;
    all.extend(&outputs);
    let hashes = hash_full_blocks(&all, 4);
    assert_eq!(s.block_manager().find_cached_prefix(&hashes, all.len() + 1).len(), 2);
}

#[test]
fn share_prefix_with_waits_for_the_first_prompt_then_hits_it() {
    let mut s = sched(cfg(32, 4));
    let prompt = tokens(31, 13);
    s.add_request(RequestId(1), req(prompt.clone(), 4), &[]).expect("accepted");
    let mut child = req(prompt.clone(), 4);
    child.share_prefix_with = Some(RequestId(1));
    s.add_request(RequestId(2), child, &[]).expect("accepted");
    for _ in 0..4 {
        let (out, _) = step(&mut s, 77);
        assert!(seq_of(&out, 2).is_none(), "child must wait while the prompt is being computed");
    }
    // Parent finished its prompt last step; now the child hits 3 full blocks.
    let (out, ups) = step(&mut s, 77);
    let q = seq_of(&out, 2).expect("child admitted");
    assert_eq!(q.start_pos, 12);
    assert_eq!(&q.block_table[..3], &s.block_manager().block_table(RequestId(1)).expect("held")[..3]);
    assert!(ups.iter().any(|u| u.id == RequestId(2) && u.num_cached_tokens == 12));

    // A child whose parent is gone is admitted at once.
    let mut orphan = req(tokens(32, 5), 2);
    orphan.share_prefix_with = Some(RequestId(99));
    s.add_request(RequestId(3), orphan, &[]).expect("accepted");
    let (out, _) = step(&mut s, 77);
    assert!(seq_of(&out, 3).is_some());
}

#[test]
fn share_prefix_with_does_not_wait_when_prefix_caching_is_off() {
    let mut s = sched(SchedulerConfig { enable_prefix_caching: false, ..cfg(32, 16) });
    let prompt = tokens(33, 9);
    s.add_request(RequestId(1), req(prompt.clone(), 4), &[]).expect("accepted");
    let mut child = req(prompt, 4);
    child.share_prefix_with = Some(RequestId(1));
    s.add_request(RequestId(2), child, &[]).expect("accepted");
    let (out, _) = step(&mut s, 1);
    assert_eq!(
        seq_of(&out, 2).map(|q| (q.start_pos, q.token_ids.len())),
        Some((0, 7)),
        "admitted in the same step as the first, no waiting"
    );
}

#[test]
fn fcfs_preempts_the_last_arrived_and_it_resumes_with_its_tokens() {
    // 6 blocks of 4 = 24 token slots; three 7-token prompts use 6 blocks.
    let mut s = sched(cfg(6, 64));
    for i in 1..=3 {
        s.add_request(RequestId(i), req(tokens(40 + i, 7), 6), &[]).expect("accepted");
    }
    let (out, _) = step(&mut s, 8);
    assert_eq!(out.seqs.len(), 3);
    // 8 tokens each still fit in 2 blocks; at 9 each needs a third, and none is free.
    let (out, _) = step(&mut s, 8);
    assert!(out.preempted.is_empty());
    let (out, _) = step(&mut s, 9);
    assert_eq!(out.preempted, vec![RequestId(3)]);
    assert_eq!(out.seqs.iter().map(|q| q.id.0).collect::<Vec<_>>(), vec![1, 2]);
    assert_eq!(s.waiting_ids().collect::<Vec<_>>(), vec![RequestId(3)]);
    assert_eq!(s.stats().num_preemptions, 1);
    let r3 = s.request(RequestId(3)).expect("alive");
    assert_eq!(
        (r3.status(), r3.num_computed_tokens(), r3.output_token_ids()),
        (RequestStatus::Preempted, 0, &[8, 8][..])
    );
    // Drive to completion; request 3 recomputes prompt + output and then continues.
    let mut guard = 0;
    while s.has_unfinished() && guard < 100 {
        step(&mut s, 10);
        guard += 1;
    }
    assert!(!s.has_unfinished());
    assert_eq!(s.block_manager().num_free_blocks(), 6);
}

#[test]
fn priority_policy_admits_and_preempts_by_priority() {
    let c = SchedulerConfig { policy: SchedulingPolicy::Priority, max_num_seqs: 3, ..cfg(6, 14) };
    let mut s = sched(c);
    let add = |s: &mut Scheduler, id: u64, prio: i32, len: usize| {
        let mut r = req(tokens(60 + id, len), 8);
        r.priority = prio;
        s.add_request(RequestId(id), r, &[]).expect("accepted");
    };
    add(&mut s, 1, 5, 7);
    add(&mut s, 2, 1, 7);
    add(&mut s, 3, 3, 7);
    let (out, _) = step(&mut s, 1);
    assert_eq!(out.seqs.iter().map(|q| q.id.0).collect::<Vec<_>>(), vec![2, 3], "lower value first");
    // A more urgent arrival cannot get blocks (4 used, 2 free, needs 3) and preempts priority 3,
    // whose decode row is withdrawn from the step.
    add(&mut s, 4, 0, 9);
    let (out, _) = step(&mut s, 1);
    assert_eq!(out.preempted, vec![RequestId(3)]);
    assert_eq!(out.seqs.iter().map(|q| (q.id.0, q.token_ids.len())).collect::<Vec<_>>(), vec![(2, 1), (4, 9)]);
    assert_eq!(out.num_batched_tokens, 10);
    assert_eq!(s.running_ids(), &[RequestId(4), RequestId(2)]);
    // Request 1 (priority 5) is not admitted ahead of the preempted 3 (priority 3).
    assert_eq!(s.waiting_ids().collect::<Vec<_>>(), vec![RequestId(3), RequestId(1)]);
}

/// Runs two 8-token requests (1 arrives first, 2 second) in a 6-block pool until one is
/// preempted; returns (preempted, scheduled ids) of that step.
fn first_preemption(policy: SchedulingPolicy) -> (Vec<RequestId>, Vec<u64>) {
    let mut s = sched(SchedulerConfig { policy, ..cfg(6, 64) });
    let mut low = req(tokens(80, 8), 8);
    low.priority = 9;
    s.add_request(RequestId(1), low, &[]).expect("accepted");
    step(&mut s, 3);
    let mut high = req(tokens(81, 8), 8);
    high.priority = -1;
    s.add_request(RequestId(2), high, &[]).expect("accepted");
    for _ in 0..10 {
        let (out, _) = step(&mut s, 3);
        if !out.preempted.is_empty() {
            return (out.preempted, out.seqs.iter().map(|q| q.id.0).collect());
        }
    }
    panic!("the pool never ran out");
}

#[test]
fn running_request_out_of_blocks_preempts_by_policy_rank() {
    assert_eq!(first_preemption(SchedulingPolicy::Priority), (vec![RequestId(1)], vec![2]));
    assert_eq!(first_preemption(SchedulingPolicy::Fcfs), (vec![RequestId(2)], vec![1]));
}

#[test]
fn stops_on_eos_stop_tokens_min_tokens_and_length() {
    let mut s = sched(cfg(64, 64));
    let eos = [2u32];
    s.add_request(RequestId(1), req(tokens(90, 5), 10), &eos).expect("accepted");
    let mut p =
        SamplingParams { stop_token_ids: vec![7], min_tokens: 2, max_tokens: Some(10), ..SamplingParams::greedy() };
    s.add_request(RequestId(2), EngineRequest::new(tokens(91, 5), p.clone()), &eos).expect("accepted");
    p.ignore_eos = true;
    p.max_tokens = Some(2);
    s.add_request(RequestId(3), EngineRequest::new(tokens(92, 5), p), &eos).expect("accepted");

    let by_id = |ups: &[RequestUpdate], id: u64| ups.iter().find(|u| u.id == RequestId(id)).copied();
    let (_, ups) = step(&mut s, 2);
    let u1 = by_id(&ups, 1).expect("update");
    assert_eq!((u1.finish_reason, u1.stop_token, u1.num_prompt_tokens), (Some(FinishReason::Stop), Some(2), 5));
    assert_eq!(by_id(&ups, 2).and_then(|u| u.finish_reason), None, "min_tokens holds EOS back");
    assert_eq!(by_id(&ups, 3).and_then(|u| u.finish_reason), None, "ignore_eos");
    assert!(s.request(RequestId(1)).is_none(), "finished requests are dropped at once");
    let (_, ups) = step(&mut s, 7);
    assert_eq!(by_id(&ups, 2).and_then(|u| u.finish_reason), None, "stop token at index 1 < min_tokens");
    assert_eq!(by_id(&ups, 3).map(|u| (u.finish_reason, u.stop_token)), Some((Some(FinishReason::Length), None)));
    let (_, ups) = step(&mut s, 7);
    assert_eq!(by_id(&ups, 2).map(|u| (u.finish_reason, u.stop_token)), Some((Some(FinishReason::Stop), Some(7))));
    assert!(!s.has_unfinished());
    assert_eq!(s.block_manager().num_free_blocks(), 64);
}

#[test]
fn abort_mid_prefill_frees_blocks_and_late_samples_are_ignored() {
    let mut s = sched(cfg(16, 4));
    s.add_request(RequestId(1), req(tokens(95, 12), 4), &[]).expect("accepted");
    step(&mut s, 1);
    assert_eq!(s.block_manager().num_free_blocks(), 15);
    let out = s.schedule();
    assert!(s.abort(RequestId(1)));
    assert!(!s.abort(RequestId(1)), "second abort is a no-op");
    let ups = s.update(&out, &[(RequestId(1), 5)]);
    assert!(ups.is_empty());
    assert_eq!(s.block_manager().num_free_blocks(), 16);
    assert!(!s.has_unfinished());
    s.check_invariants().expect("invariants");
    // Aborting a request that never ran also works.
    s.add_request(RequestId(2), req(tokens(96, 3), 4), &[]).expect("accepted");
    assert!(s.abort(RequestId(2)));
    assert_eq!(s.stats().num_waiting, 0);
}

#[test]
fn a_missing_sample_recomputes_the_last_token() {
    let mut s = sched(cfg(16, 16));
    s.add_request(RequestId(1), req(tokens(97, 5), 4), &[]).expect("accepted");
    let out = s.schedule();
    assert!(s.update(&out, &[]).is_empty());
    let out = s.schedule();
    assert_eq!((out.seqs[0].start_pos, out.seqs[0].token_ids.len(), out.seqs[0].sample), (4, 1, true));
    // Replaying a stale output changes nothing.
    let ups = s.update(&out, &[(RequestId(1), 3)]);
    assert_eq!(ups.len(), 1);
    assert!(s.update(&out, &[(RequestId(1), 3)]).is_empty());
    assert_eq!(s.request(RequestId(1)).map(Request::num_output_tokens), Some(1));
}

#[test]
fn prefilled_request_waits_for_kv_then_decodes() {
    let mut s = sched(cfg(8, 16));
    let prompt = tokens(100, 10);
    let table = s.add_prefilled_request(RequestId(1), req(prompt.clone(), 4), &[], 10, Some(555)).expect("reserved");
    assert_eq!(table.len(), 3, "10 tokens need 3 blocks of 4");
    assert_eq!(s.block_manager().num_free_blocks(), 5);
    assert!(s.schedule().is_empty(), "nothing runs before the KV arrives");
    assert_eq!(s.stats().num_waiting, 1);
    assert!(s.complete_kv_transfer(RequestId(1)));
    assert!(!s.complete_kv_transfer(RequestId(1)));
    let (out, ups) = step(&mut s, 556);
    let q = seq_of(&out, 1).expect("decode row");
    assert_eq!((q.start_pos, q.token_ids.as_slice(), q.sample), (10, &[555][..], true));
    assert_eq!(&q.block_table[..3], table.as_slice());
    assert_eq!(ups[0].num_cached_tokens, 10);
    assert_eq!(s.request(RequestId(1)).map(|r| r.output_token_ids().to_vec()), Some(vec![555, 556]));
    // Its received full blocks are now prefix-cache hits for others.
    let hashes = hash_full_blocks(&prompt, 4);
    assert_eq!(s.block_manager().find_cached_prefix(&hashes, 10).len(), 2);
}

#[test]
fn failed_transfer_recomputes_locally_and_abort_frees_reservations() {
    let mut s = sched(cfg(8, 16));
    s.add_prefilled_request(RequestId(1), req(tokens(101, 9), 4), &[], 8, None).expect("reserved");
    assert!(s.fail_kv_transfer(RequestId(1)));
    assert_eq!(s.block_manager().num_free_blocks(), 8);
    let (out, _) = step(&mut s, 4);
    assert_eq!(seq_of(&out, 1).map(|q| (q.start_pos, q.token_ids.len())), Some((0, 9)));

    s.add_prefilled_request(RequestId(2), req(tokens(102, 9), 4), &[], 4, None).expect("reserved");
    assert!(s.abort(RequestId(2)));
    assert!(!s.fail_kv_transfer(RequestId(2)));
    s.abort(RequestId(1));
    assert_eq!(s.block_manager().num_free_blocks(), 8);
    s.check_invariants().expect("invariants");
}

#[test]
fn prefilled_request_rejects_bad_counts_and_full_pools() {
    let mut s = sched(cfg(4, 16));
    let p = tokens(103, 8);
    for (k, first) in [(0, None), (8, None), (9, Some(1)), (20, Some(1))] {
        let r = s.add_prefilled_request(RequestId(1), req(p.clone(), 4), &[], k, first);
        assert!(matches!(r, Err(SubmitError::InvalidPrompt(_))), "k={k}: {r:?}");
    }
    let r = s.add_prefilled_request(RequestId(1), req(p.clone(), 4), &[2], 8, Some(2));
    assert!(matches!(r, Err(SubmitError::InvalidPrompt(m)) if m.contains("already ends")));
    s.add_prefilled_request(RequestId(1), req(p.clone(), 4), &[], 8, Some(1)).expect("2 blocks");
    s.add_prefilled_request(RequestId(2), req(p.clone(), 4), &[], 7, None).expect("2 blocks");
    let full = s.add_prefilled_request(RequestId(3), req(p, 4), &[], 4, None);
    assert!(matches!(full, Err(SubmitError::QueueFull { .. })), "{full:?}");
    assert!(s.request(RequestId(3)).is_none());
    s.check_invariants().expect("invariants");
}

#[test]
fn reservation_for_a_relay_takes_the_first_token_with_the_kv() {
    let mut s = sched(cfg(8, 16));
    let prompt = tokens(110, 10);
    let table = s.reserve_for_transfer(RequestId(1), req(prompt.clone(), 4), &[2]).expect("reserved");
    assert_eq!(table.len(), 3, "the whole prompt's 10 tokens need 3 blocks of 4");
    assert!(s.schedule().is_empty(), "nothing runs before the KV and the token arrive");
    assert!(!s.complete_kv_transfer(RequestId(1)), "without its first token it could never run");
    s.check_invariants().expect("invariants while waiting");
    let up = s.complete_kv_transfer_with_token(RequestId(1), 777).expect("completes");
    assert_eq!((up.new_token, up.finish_reason, up.num_cached_tokens), (777, None, 10));
    assert!(s.complete_kv_transfer_with_token(RequestId(1), 778).is_none(), "only once");
    let (out, ups) = step(&mut s, 778);
    let q = seq_of(&out, 1).expect("decode row");
    assert_eq!((q.start_pos, q.token_ids.as_slice()), (10, &[777][..]));
    assert_eq!(&q.block_table[..3], table.as_slice());
    assert_eq!(ups[0].new_token, 778);
    assert_eq!(s.request(RequestId(1)).map(|r| r.output_token_ids().to_vec()), Some(vec![777, 778]));
    s.check_invariants().expect("invariants");
}

#[test]
fn a_first_token_that_ends_the_request_finishes_it_and_frees_the_reservation() {
    let mut s = sched(cfg(8, 16));
    s.reserve_for_transfer(RequestId(1), req(tokens(120, 9), 4), &[2]).expect("reserved");
    let up = s.complete_kv_transfer_with_token(RequestId(1), 2).expect("completes");
    assert_eq!((up.finish_reason, up.stop_token), (Some(FinishReason::Stop), Some(2)));
    assert!(s.request(RequestId(1)).is_none());
    assert_eq!(s.block_manager().num_free_blocks(), 8);
    // max_tokens = 1: the first token is the last one.
    s.reserve_for_transfer(RequestId(2), req(tokens(121, 9), 1), &[2]).expect("reserved");
    let up = s.complete_kv_transfer_with_token(RequestId(2), 5).expect("completes");
    assert_eq!(up.finish_reason, Some(FinishReason::Length));
    assert_eq!(s.block_manager().num_free_blocks(), 8);
    // A failed relay recomputes from scratch and samples its own first token.
    s.reserve_for_transfer(RequestId(3), req(tokens(122, 9), 4), &[2]).expect("reserved");
    assert!(s.fail_kv_transfer(RequestId(3)));
    let (out, _) = step(&mut s, 4);
    assert_eq!(seq_of(&out, 3).map(|q| (q.start_pos, q.token_ids.len(), q.sample)), Some((0, 9, true)));
    s.check_invariants().expect("invariants");
}
