//! Turns the scheduler's plain-data output into the backend's token layout.
//!
//! Rows are laid out sequence after sequence in scheduler order; the logits of
//! a sequence's last row are wanted exactly when the scheduler says it samples.

use crate::backend::{BatchLayout, SeqLayout};
use baton_core::scheduler::SchedulerOutput;

/// Builds the layout of one step. `logit_rows[i]` belongs to the i-th sampling sequence.
pub fn layout_for(out: &SchedulerOutput) -> BatchLayout {
    let mut b = BatchLayout::default();
    for s in &out.seqs {
        let row_start = b.tokens.len();
        b.tokens.extend_from_slice(&s.token_ids);
        b.positions.extend(s.start_pos..s.start_pos + s.token_ids.len());
        b.seqs.push(SeqLayout {
            row_start,
            n_tokens: s.token_ids.len(),
            start_pos: s.start_pos,
            block_table: s.block_table.clone(),
        });
        if s.sample && !s.token_ids.is_empty() {
            b.logit_rows.push(row_start + s.token_ids.len() - 1);
        }
    }
    b
}
