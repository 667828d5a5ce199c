//! Grammar compilation off the engine thread: a small pool of dedicated threads that turn a
//! request's [`GrammarSpec`] into a [`CompiledGrammar`] before the request is handed to the
//! engine thread.
//!
//! Compiling a grammar can take milliseconds (a large JSON schema, a big Lark grammar) and
//! must never stall the engine loop or an async runtime thread, so the handle queues it
//! here and returns at once; the job's callback then sends the request on to the engine
//! thread, or fails its stream with the compile error.
//!
//! Invariants: at most [`COMPILE_QUEUE`] compiles wait (a full queue refuses the request
//! like a full engine queue); the [`GrammarCompiler`] (a trie over the whole vocabulary,
//! tens of milliseconds) is built on the first constrained request, on a pool thread, so
//! engines that never see one never pay for it; the threads exit when the handle is gone.

use std::sync::mpsc::{Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Mutex, OnceLock};

use baton_core::api::SubmitError;
use baton_core::params::ParamError;
use baton_core::structured::GrammarSpec;
use baton_formats::Tokenizer;
use baton_grammar::{CompiledGrammar, GrammarCompiler, GrammarError};

/// Compile threads: two, so one slow schema does not hold up every other compile.
const COMPILE_THREADS: usize = 2;

/// Compiles that may wait for a thread before submissions are refused.
pub(crate) const COMPILE_QUEUE: usize = 256;

/// What a compile job reports to: the compiled grammar or the submission error.
type Done = Box<dyn FnOnce(Result<CompiledGrammar, SubmitError>) + Send>;

struct Job {
    spec: GrammarSpec,
    done: Done,
}

/// What the pool threads build the compiler from.
struct Source {
    tokenizer: Option<Tokenizer>,
    eos_token_ids: Vec<u32>,
    model_vocab: usize,
    compiler: OnceLock<Result<GrammarCompiler, GrammarError>>,
}

impl Source {
    fn compiler(&self) -> Result<&GrammarCompiler, SubmitError> {
        let unavailable = |m: String| SubmitError::InvalidParams(ParamError::new("structured_outputs", m));
        let built = self.compiler.get_or_init(|| {
            let tokenizer = self.tokenizer.as_ref().ok_or_else(|| {
                GrammarError::Tokenizer("the model has no tokenizer, so it cannot follow a grammar".into())
            })?;
            let started = std::time::Instant::now();
            let c = GrammarCompiler::new(tokenizer, &self.eos_token_ids, self.model_vocab);
            tracing::info!(ms = started.elapsed().as_millis() as u64, ok = c.is_ok(), "grammar compiler built");
            c
        });
        built.as_ref().map_err(|e| unavailable(e.to_string()))
    }
}

/// The compile threads' queue.
pub(crate) struct GrammarPool {
    tx: Mutex<SyncSender<Job>>,
}

impl GrammarPool {
    /// Starts the compile threads for a model with this tokenizer (none: every constrained
    /// request is refused), EOS ids and vocabulary size.
    pub(crate) fn start(
        tokenizer: Option<Tokenizer>,
        eos_token_ids: Vec<u32>,
        model_vocab: usize,
    ) -> std::io::Result<Self> {
        let (tx, rx) = std::sync::mpsc::sync_channel::<Job>(COMPILE_QUEUE);
        let rx = Arc::new(Mutex::new(rx));
        let source = Arc::new(Source { tokenizer, eos_token_ids, model_vocab, compiler: OnceLock::new() });
        for i in 0..COMPILE_THREADS {
            let (rx, source) = (rx.clone(), source.clone());
            std::thread::Builder::new().name(format!("baton-grammar-{i}")).spawn(move || serve(&rx, &source))?;
        }
        Ok(Self { tx: Mutex::new(tx) })
    }

    /// Queues compiling `spec`; `done` gets the result on a compile thread. Refused with
    /// [`SubmitError::QueueFull`] when [`COMPILE_QUEUE`] compiles already wait.
    pub(crate) fn compile(
        &self,
        spec: GrammarSpec,
        done: impl FnOnce(Result<CompiledGrammar, SubmitError>) + Send + 'static,
    ) -> Result<(), SubmitError> {
        let tx = self.tx.lock().map_err(|_| SubmitError::Unavailable("the grammar pool is poisoned".into()))?;
        match tx.try_send(Job { spec, done: Box::new(done) }) {
            Ok(()) => Ok(()),
            Err(TrySendError::Full(_)) => Err(SubmitError::QueueFull { waiting: COMPILE_QUEUE }),
            Err(TrySendError::Disconnected(_)) => Err(SubmitError::Unavailable("the grammar threads stopped".into())),
        }
    }

    /// Compiles `spec` and waits for it (for async callers).
    pub(crate) async fn compiled(&self, spec: GrammarSpec) -> Result<CompiledGrammar, SubmitError> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.compile(spec, move |r| {
            let _ = tx.send(r);
        })?;
        rx.await.map_err(|_| SubmitError::Unavailable("the grammar threads stopped".into()))?
    }
}

/// One compile thread: takes jobs until the pool is dropped.
fn serve(rx: &Mutex<Receiver<Job>>, source: &Source) {
    loop {
        let job = match rx.lock() {
            Ok(rx) => rx.recv(),
            Err(_) => return,
        };
        let Ok(Job { spec, done }) = job else { return };
        let result = source.compiler().and_then(|c| {
            c.compile(&spec).map_err(|e| match e {
                GrammarError::Invalid { kind, message } => SubmitError::InvalidGrammar { kind: kind.into(), message },
                other => SubmitError::InvalidParams(ParamError::new("structured_outputs", other.to_string())),
            })
        });
        done(result);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_model_without_a_tokenizer_refuses_grammars_with_a_clear_error() {
        let pool = GrammarPool::start(None, vec![0], 16).expect("start");
        let (tx, rx) = std::sync::mpsc::channel();
        pool.compile(GrammarSpec::JsonObject, move |r| tx.send(r).expect("send")).expect("queued");
        let err = rx.recv().expect("answer").expect_err("no tokenizer");
        assert!(matches!(&err, SubmitError::InvalidParams(p) if p.param == "structured_outputs"), "{err:?}");
        assert!(err.to_string().contains("no tokenizer"), "{err}");
    }
}
