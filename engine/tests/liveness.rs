//! The engine's health is liveness, not a flag: a panicking step leaves an engine that says
//! so (and refuses work) instead of a healthy one that never answers; a step that hangs past
//! the stall timeout reads as stalled until it returns; a recoverable backend error fails only
//! the requests of its step, and the next request runs; a fatal one stops the engine and says
//! why. Faults are injected into one forward pass ([`baton_engine::FaultInjection`]).

mod common;

use baton_core::api::{EngineClient, EngineError, EngineRequest, SubmitError};
use baton_engine::{EngineConfig, EngineHandle, EngineHealth, FaultInjection};
use baton_formats::testing::TinySpec;
use common::*;
use std::time::{Duration, Instant};

fn faulty(m: &TinyModel, fault: &str, cfg: EngineConfig) -> EngineHandle {
    engine(&m.model, EngineConfig { fault: Some(fault.parse::<FaultInjection>().expect("fault")), ..cfg })
}

/// The request's tokens, or the error that ended it (`None`: its stream closed unfinished).
fn outcome(e: &EngineHandle, prompt: &[u32], max_tokens: usize) -> Result<Vec<u32>, Option<EngineError>> {
    let mut s = e.submit(EngineRequest::new(prompt.to_vec(), greedy(max_tokens))).expect("submit");
    let mut toks = Vec::new();
    loop {
        match s.blocking_next() {
            Some(Ok(o)) => {
                toks.extend_from_slice(&o.new_token_ids);
                if o.finish_reason.is_some() {
                    return Ok(toks);
                }
            }
            Some(Err(err)) => return Err(Some(err)),
            None => return Err(None),
        }
    }
}

#[test]
fn a_panicking_step_makes_the_engine_unhealthy_and_refuse_work() {
    let m = tiny(&TinySpec::llama());
    let vocab = m.model.config.vocab_size;
    let e = faulty(&m, "panic@2", EngineConfig::default());
    assert_eq!(outcome(&e, &prompt(1, 20, vocab), 1).map(|t| t.len()), Ok(1), "the first step is fine");
    assert!(e.is_healthy());
    match outcome(&e, &prompt(2, 20, vocab), 4) {
        Err(Some(EngineError::Backend(m))) => assert!(m.contains("panicked"), "{m}"),
        other => panic!("the panicking step's request must get the error, got {other:?}"),
    }
    // Recorded before the request was failed: no window where it reads healthy.
    assert!(matches!(e.health(), EngineHealth::Panicked(m) if m.contains("injected fault")), "{:?}", e.health());
    assert!(!e.is_healthy());
    let refused = e.submit(EngineRequest::new(prompt(3, 5, vocab), greedy(2))).map(|_| ());
    assert!(matches!(&refused, Err(SubmitError::Unavailable(m)) if m.contains("panicked")), "{refused:?}");
    e.shutdown();
}

#[test]
fn a_stalled_step_reads_as_stalled_until_it_returns() {
    let m = tiny(&TinySpec::llama());
    let vocab = m.model.config.vocab_size;
    let reference = engine(&m.model, EngineConfig::default());
    let pr = prompt(4, 20, vocab);
    let want = run(&reference, &pr, greedy(5));
    let e =
        faulty(&m, "stall=2000@1", EngineConfig { stall_timeout: Duration::from_millis(300), ..Default::default() });
    assert_eq!(e.health(), EngineHealth::Healthy, "idle is not stalled");
    let worker = {
        let (e, pr) = (e.clone(), pr.clone());
        std::thread::spawn(move || outcome(&e, &pr, 5))
    };
    let t0 = Instant::now();
    while !matches!(e.health(), EngineHealth::Stalled { .. }) {
        assert!(t0.elapsed() < Duration::from_millis(1800), "never reported the stall: {:?}", e.health());
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(!e.is_healthy());
    assert_eq!(worker.join().expect("join"), Ok(want), "the stalled step's request completes once it returns");
    assert_eq!(e.health(), EngineHealth::Healthy);
    assert_all_blocks_free(&e);
    for h in [e, reference] {
        h.shutdown();
    }
}

#[test]
fn a_recoverable_error_fails_only_its_step_and_the_engine_serves_on() {
    let m = tiny(&TinySpec::llama());
    let vocab = m.model.config.vocab_size;
    let reference = engine(&m.model, EngineConfig::default());
    let (p1, p2) = (prompt(5, 20, vocab), prompt(6, 33, vocab));
    // Forward 1 is a prompt step; with async scheduling forward 3 is a decode step planned
    // while the one before it is in flight. Both fail only their request.
    for (fault, async_scheduling) in [("error@1", true), ("error@3", true), ("error@3", false)] {
        let e = faulty(&m, fault, EngineConfig { async_scheduling, ..Default::default() });
        match outcome(&e, &p1, 6) {
            Err(Some(EngineError::Backend(msg))) => assert!(msg.contains("recoverable"), "{fault}: {msg}"),
            other => panic!("{fault}: the failed step's request must get the error, got {other:?}"),
        }
        assert_eq!(e.health(), EngineHealth::Healthy, "{fault}");
        assert_eq!(outcome(&e, &p2, 6), Ok(run(&reference, &p2, greedy(6))), "{fault}: the next request");
        assert_eq!(outcome(&e, &p1, 6), Ok(run(&reference, &p1, greedy(6))), "{fault}: the failed prompt again");
        assert_all_blocks_free(&e);
        e.shutdown();
    }
    reference.shutdown();
}

#[test]
fn a_fatal_error_stops_the_engine_and_says_why() {
    let m = tiny(&TinySpec::llama());
    let vocab = m.model.config.vocab_size;
    let e = faulty(&m, "fatal@1", EngineConfig::default());
    assert!(matches!(outcome(&e, &prompt(7, 10, vocab), 3), Err(Some(EngineError::Backend(_)))));
    assert!(matches!(e.health(), EngineHealth::Fatal(m) if m.contains("device is lost")), "{:?}", e.health());
    let refused = e.submit(EngineRequest::new(prompt(8, 5, vocab), greedy(2))).map(|_| ());
    assert!(matches!(&refused, Err(SubmitError::Unavailable(m)) if m.contains("fatal")), "{refused:?}");
    e.shutdown();
    assert!(matches!(e.health(), EngineHealth::Fatal(_)), "a shutdown does not hide the fatal error");
}
