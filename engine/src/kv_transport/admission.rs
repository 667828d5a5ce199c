//! Checking a hand-off's handshake against the receiver's reservation, before anything is
//! allocated or written for it.
//!
//! A peer's handshake is untrusted input: its runs, token count and sizes decide how much the
//! receiver allocates and which blocks it writes. [`check_handshake`] accepts it only when
//! the runs map the reservation's logical blocks, in order and without gaps, exactly onto the
//! reservation's own physical blocks (so every write lands inside this request's blocks of
//! this worker's pool, and the runs total the reserved block count), the token count fits the
//! reserved prompt, and the per-layer size is what those blocks hold. Runs are compared block
//! by block against the reservation's table, never expanded on their own, so the work is
//! bounded by the reservation whatever lengths the peer claims; all arithmetic is checked.

use super::Handshake;
use crate::relay::Reservation;
use baton_core::kv_transfer::KvLayout;

/// Why a handshake does not fit its reservation (the sender is told the reason).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HandshakeViolation {
    /// The sender's cache geometry differs from ours.
    #[error(transparent)]
    Layout(#[from] baton_core::kv_transfer::LayoutMismatch),
    /// More tokens than the reserved prompt.
    #[error("the handshake moves {num_tokens} tokens but the reserved prompt has {reserved}")]
    TooManyTokens {
        /// Tokens the handshake claims.
        num_tokens: usize,
        /// The reserved prompt's length.
        reserved: usize,
    },
    /// A run of no blocks.
    #[error("run {run} is empty")]
    EmptyRun {
        /// Index of the run.
        run: usize,
    },
    /// A run that does not start where the previous one ended.
    #[error("run {run} starts at logical block {logical_start}, expected {expected}")]
    OutOfOrder {
        /// Index of the run.
        run: usize,
        /// Where it starts.
        logical_start: usize,
        /// Where the previous run ended.
        expected: usize,
    },
    /// The runs cover more or fewer blocks than were reserved.
    #[error("the runs cover {covered} blocks (at least), the reservation has {reserved}")]
    BlockCount {
        /// Blocks covered (a run past the reservation counts up to its claimed end, saturating).
        covered: usize,
        /// Blocks reserved.
        reserved: usize,
    },
    /// A run's receiver blocks are not the reservation's blocks at those positions.
    #[error(
        "run {run} writes block {claimed} at logical block {logical}, where the reservation holds block {reserved}"
    )]
    OutsideReservation {
        /// Index of the run.
        run: usize,
        /// The logical block.
        logical: usize,
        /// The physical block the run claims.
        claimed: usize,
        /// The reservation's physical block there.
        reserved: u32,
    },
    /// A run's sender-side block numbers do not fit in a block id.
    #[error("run {run} has sender blocks beyond the largest block id")]
    SenderOverflow {
        /// Index of the run.
        run: usize,
    },
    /// The per-layer size is not what the reserved blocks hold.
    #[error("the handshake promises {promised} bytes of K per layer, the reserved blocks hold {needed}")]
    Bytes {
        /// `bytes_per_layer_half` of the handshake.
        promised: usize,
        /// Bytes of K in the reserved blocks of one layer.
        needed: usize,
    },
}

/// Checks the request part of `hs` (a hand-off for `res`, not an NCCL link setup) against
/// `res` on a receiver whose cache is `layout`. Ok means the runs are exactly the reservation's
/// blocks in logical order, so the layers are to be written into `res.block_table`.
pub fn check_handshake(hs: &Handshake, layout: &KvLayout, res: &Reservation) -> Result<(), HandshakeViolation> {
    layout.check_compatible(&hs.layout)?;
    let table = &res.block_table;
    if hs.num_tokens > res.num_prompt_tokens {
        return Err(HandshakeViolation::TooManyTokens { num_tokens: hs.num_tokens, reserved: res.num_prompt_tokens });
    }
    let mut next_logical = 0usize;
    for (run, r) in hs.runs.iter().enumerate() {
        if r.len == 0 {
            return Err(HandshakeViolation::EmptyRun { run });
        }
        if r.logical_start != next_logical {
            return Err(HandshakeViolation::OutOfOrder { run, logical_start: r.logical_start, expected: next_logical });
        }
        let end = match r.logical_start.checked_add(r.len) {
            Some(end) if end <= table.len() => end,
            claimed => {
                let covered = claimed.unwrap_or(usize::MAX);
                return Err(HandshakeViolation::BlockCount { covered, reserved: table.len() });
            }
        };
        let sender_fits = u32::try_from(r.len).ok().and_then(|len| r.src_start.checked_add(len)).is_some();
        if !sender_fits {
            return Err(HandshakeViolation::SenderOverflow { run });
        }
        for (j, &reserved) in table[r.logical_start..end].iter().enumerate() {
            // `dst_start + j` cannot overflow usize: j < table.len() and dst_start is a u32.
            let claimed = r.dst_start as usize + j;
            if claimed != reserved as usize {
                return Err(HandshakeViolation::OutsideReservation {
                    run,
                    logical: r.logical_start + j,
                    claimed,
                    reserved,
                });
            }
        }
        next_logical = end;
    }
    if next_logical != table.len() {
        return Err(HandshakeViolation::BlockCount { covered: next_logical, reserved: table.len() });
    }
    // `table.len()` blocks exist in our pool, so their bytes cannot overflow; checked anyway.
    match table.len().checked_mul(layout.bytes_per_block()) {
        Some(needed) if needed == hs.bytes_per_layer_half => Ok(()),
        needed => {
            Err(HandshakeViolation::Bytes { promised: hs.bytes_per_layer_half, needed: needed.unwrap_or(usize::MAX) })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use baton_core::kv_transfer::{BlockRun, KvDtype, plan_transfer};

    fn layout() -> KvLayout {
        KvLayout { num_layers: 2, block_size: 4, num_kv_heads: 1, head_dim: 2, dtype: KvDtype::F32 }
    }

    fn reservation() -> Reservation {
        Reservation { block_table: vec![7, 8, 3], num_prompt_tokens: 10, logprobs: None }
    }

    /// The handshake an honest sender whose prompt sits in blocks 20, 21, 40 makes.
    fn honest() -> Handshake {
        let l = layout();
        let plan = plan_transfer(&l, &[20, 21, 40], &reservation().block_table, 10, 0).expect("plan");
        Handshake {
            layout: l,
            sender: "prefill-0".into(),
            reservation: Some(baton_core::cluster_auth::ReservationToken([1; 16])),
            num_tokens: plan.num_tokens,
            runs: plan.runs,
            bytes_per_layer_half: plan.bytes_per_layer / 2,
            nccl: None,
        }
    }

    fn run(logical_start: usize, src_start: u32, dst_start: u32, len: usize) -> BlockRun {
        BlockRun { logical_start, src_start, dst_start, len }
    }

    #[test]
    fn an_honest_handshake_fits_its_reservation() {
        assert_eq!(check_handshake(&honest(), &layout(), &reservation()), Ok(()));
        let shorter = Handshake { num_tokens: 9, ..honest() };
        assert_eq!(check_handshake(&shorter, &layout(), &reservation()), Ok(()));
    }

    #[test]
    fn hostile_handshakes_are_refused_naming_the_problem() {
        let bpb = layout().bytes_per_block();
        type Expect = fn(&HandshakeViolation) -> bool;
        let cases: Vec<(&str, Handshake, Expect)> = vec![
            (
                "a billion blocks",
                Handshake {
                    runs: vec![run(0, 0, 7, 1_000_000_000)],
                    bytes_per_layer_half: 1_000_000_000 * bpb,
                    ..honest()
                },
                |e| matches!(e, HandshakeViolation::BlockCount { covered: 1_000_000_000, reserved: 3 }),
            ),
            (
                "a run whose end overflows",
                Handshake { runs: vec![run(0, 0, 7, 2), run(2, 0, 3, usize::MAX)], ..honest() },
                |e| matches!(e, HandshakeViolation::BlockCount { covered: usize::MAX, .. }),
            ),
            (
                "too few blocks",
                Handshake { runs: vec![run(0, 20, 7, 2)], bytes_per_layer_half: 2 * bpb, ..honest() },
                |e| matches!(e, HandshakeViolation::BlockCount { covered: 2, reserved: 3 }),
            ),
            ("no runs", Handshake { runs: vec![], ..honest() }, |e| {
                matches!(e, HandshakeViolation::BlockCount { covered: 0, reserved: 3 })
            }),
            ("an empty run", Handshake { runs: vec![run(0, 20, 7, 0)], ..honest() }, |e| {
                matches!(e, HandshakeViolation::EmptyRun { run: 0 })
            }),
            ("a block twice", Handshake { runs: vec![run(0, 20, 7, 2), run(1, 21, 8, 2)], ..honest() }, |e| {
                matches!(e, HandshakeViolation::OutOfOrder { run: 1, logical_start: 1, expected: 2 })
            }),
            (
                "another request's block",
                Handshake { runs: vec![run(0, 20, 7, 2), run(2, 40, 9, 1)], ..honest() },
                |e| matches!(e, HandshakeViolation::OutsideReservation { run: 1, logical: 2, claimed: 9, reserved: 3 }),
            ),
            ("a block outside the pool", Handshake { runs: vec![run(0, 20, u32::MAX, 3)], ..honest() }, |e| {
                matches!(e, HandshakeViolation::OutsideReservation { run: 0, .. })
            }),
            (
                "sender blocks past u32",
                Handshake { runs: vec![run(0, u32::MAX, 7, 2), run(2, 0, 3, 1)], ..honest() },
                |e| matches!(e, HandshakeViolation::SenderOverflow { run: 0 }),
            ),
            ("more tokens than the prompt", Handshake { num_tokens: 11, ..honest() }, |e| {
                matches!(e, HandshakeViolation::TooManyTokens { num_tokens: 11, reserved: 10 })
            }),
            ("a size the blocks do not hold", Handshake { bytes_per_layer_half: 3 * bpb + 1, ..honest() }, |e| {
                matches!(e, HandshakeViolation::Bytes { .. })
            }),
            ("an extra layer", Handshake { layout: KvLayout { num_layers: 3, ..layout() }, ..honest() }, |e| {
                matches!(e, HandshakeViolation::Layout(_))
            }),
        ];
        for (name, hs, want) in cases {
            let err = check_handshake(&hs, &layout(), &reservation()).expect_err(name);
            assert!(want(&err), "{name}: {err:?}");
            assert!(!err.to_string().is_empty());
        }
    }
}
