//! Embedding gather: row `tokens[i]` of the `vocab × hidden` table into row `i` of `out`.

use super::{KernelError, check};

/// Gathers embedding rows. Token ids outside the table are an error, not a panic.
pub fn embed(tokens: &[u32], table: &[f32], hidden: usize, out: &mut [f32]) -> Result<(), KernelError> {
    check("embed", hidden > 0 && table.len().is_multiple_of(hidden) && out.len() == tokens.len() * hidden, || {
        format!("table {} values, hidden {hidden}, {} tokens, out {} values", table.len(), tokens.len(), out.len())
    })?;
    let vocab = table.len() / hidden;
    for (row, &t) in out.chunks_mut(hidden).zip(tokens) {
        let t = t as usize;
        check("embed", t < vocab, || format!("token id {t} outside the vocabulary of {vocab}"))?;
        row.copy_from_slice(&table[t * hidden..(t + 1) * hidden]);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gathers_rows_and_rejects_bad_ids() {
        let table: Vec<f32> = (0..12).map(|i| i as f32 * 0.5 - 1.0).collect();
        let mut out = vec![f32::NAN; 6];
        embed(&[2, 0], &table, 3, &mut out).unwrap();
        assert_eq!(out, vec![2.0, 2.5, 3.0, -1.0, -0.5, 0.0]);
        assert!(embed(&[4], &table, 3, &mut out[..3]).is_err());
    }
}
