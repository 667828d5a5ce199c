//! The engine loop's side of constrained decoding: starting a request's matcher, advancing
//! it with each applied token, and computing the step's masks.
//!
//! The seam with the loop (see `engine_loop`): a matcher is created when the request is
//! admitted (fed the output it already has: a decode worker's request arrives with the
//! prefill worker's first token) or reserved for a KV hand-off (fed the first token at
//! `import_done`); `finish` advances it with every applied token; `launch_sample` asks it
//! for a mask right before sampling, after the previous step's tokens were applied.
//! Preemption keeps the output tokens and the matcher alike, so there is nothing to undo.
//!
//! Invariants: a matcher has consumed exactly its request's output tokens; a request whose
//! grammar is complete stops with `FinishReason::Stop` on the token that completed it; a
//! token the matcher rejects (only a sampler that ignored the mask could produce one) or a
//! failed mask fails that request with an [`EngineError::Backend`] naming the grammar,
//! never the engine.

use baton_core::api::{EngineError, FinishReason};
use baton_core::structured::TokenMask;
use baton_grammar::{CompiledGrammar, GrammarError, SequenceGrammar};
use rayon::prelude::*;

use baton_core::api::RequestId;

/// A request's matcher on `grammar`, fed the `output` tokens it already has.
pub(crate) fn start(grammar: &CompiledGrammar, output: &[u32]) -> Result<SequenceGrammar, EngineError> {
    let mut m = grammar.matcher();
    m.consume_all(output).map_err(|e| grammar_error(&e))?;
    Ok(m)
}

/// Feeds an applied token to `grammar` (if the request has one) and returns the request's
/// finish reason: the scheduler's, or `Stop` when the grammar is complete after this
/// token. A rejected token is an error unless the request finished anyway.
pub(crate) fn advance(
    grammar: Option<&mut SequenceGrammar>,
    token: u32,
    finish: Option<FinishReason>,
) -> Result<Option<FinishReason>, EngineError> {
    let Some(g) = grammar else { return Ok(finish) };
    match g.consume(token) {
        Ok(()) if finish.is_none() && g.is_finished() => Ok(Some(FinishReason::Stop)),
        Ok(()) => Ok(finish),
        // A length stop may land on any token; nothing follows it, so nothing is wrong.
        Err(_) if finish.is_some() => Ok(finish),
        Err(e) => Err(grammar_error(&e)),
    }
}

/// Every matcher's mask, on `pool` when there are several.
pub(crate) fn masks(
    pool: &rayon::ThreadPool,
    mut grammars: Vec<(RequestId, &mut SequenceGrammar)>,
) -> Vec<(RequestId, Result<TokenMask, EngineError>)> {
    let one = |(id, g): &mut (RequestId, &mut SequenceGrammar)| (*id, g.mask().map_err(|e| grammar_error(&e)));
    if grammars.len() > 1 {
        pool.install(|| grammars.par_iter_mut().map(one).collect())
    } else {
        grammars.iter_mut().map(one).collect()
    }
}

fn grammar_error(e: &GrammarError) -> EngineError {
    EngineError::Backend(format!("structured output: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_without_a_grammar_keeps_the_scheduler_s_verdict() {
        assert_eq!(advance(None, 5, None), Ok(None));
        assert_eq!(advance(None, 5, Some(FinishReason::Length)), Ok(Some(FinishReason::Length)));
    }
}
