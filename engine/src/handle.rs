//! [`EngineHandle`]: the async world's side of the engine thread.
//!
//! Submissions are validated here (cheap checks that need no engine state),
//! counted against `max_waiting`, and sent over the command channel; the
//! engine thread never blocks on a handle. Dropping a request's
//! [`OutputStream`] aborts it through [`AbortSink`].

use crate::engine_loop::{Command, Shared};
use baton_core::api::{
    AbortSink, EngineClient, EngineInfo, EngineRequest, EngineStats, OutputStream, RequestId, SubmitError,
};
use baton_core::params::ParamError;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};

struct Inner {
    tx: Mutex<Sender<Command>>,
    shared: Arc<Shared>,
    info: EngineInfo,
    max_waiting: usize,
    next_id: AtomicU64,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl Inner {
    fn send(&self, cmd: Command) -> bool {
        match self.tx.lock() {
            Ok(tx) => tx.send(cmd).is_ok(),
            Err(_) => false,
        }
    }
}

impl AbortSink for Inner {
    fn abort(&self, id: RequestId) {
        self.send(Command::Abort(id));
    }
}

/// A cloneable handle to a running engine.
#[derive(Clone)]
pub struct EngineHandle {
    inner: Arc<Inner>,
}

impl EngineHandle {
    pub(crate) fn new(
        tx: Sender<Command>,
        shared: Arc<Shared>,
        info: EngineInfo,
        max_waiting: usize,
        thread: std::thread::JoinHandle<()>,
    ) -> Self {
        Self {
            inner: Arc::new(Inner {
                tx: Mutex::new(tx),
                shared,
                info,
                max_waiting,
                next_id: AtomicU64::new(1),
                thread: Mutex::new(Some(thread)),
            }),
        }
    }

    /// Stops the engine thread (in-flight requests get `EngineError::Shutdown`) and waits for it.
    pub fn shutdown(&self) {
        self.inner.send(Command::Shutdown);
        let thread = self.inner.thread.lock().ok().and_then(|mut t| t.take());
        if let Some(t) = thread {
            let _ = t.join();
        }
    }
}

impl EngineClient for EngineHandle {
    fn submit(&self, request: EngineRequest) -> Result<OutputStream, SubmitError> {
        let info = &self.inner.info;
        if !self.is_healthy() {
            return Err(SubmitError::Unavailable("the engine hit a fatal error".into()));
        }
        if request.params.n != 1 {
            return Err(ParamError::new(
                "n",
                format!("engine requests carry one sequence; got n = {} (the frontend fans out)", request.params.n),
            )
            .into());
        }
        request.params.validate(info.vocab_size)?;
        let prompt_len = request.prompt_token_ids.len();
        if prompt_len == 0 {
            return Err(SubmitError::InvalidPrompt("the prompt is empty".into()));
        }
        if let Some(bad) = request.prompt_token_ids.iter().find(|&&t| t as usize >= info.vocab_size) {
            return Err(SubmitError::InvalidPrompt(format!(
                "token id {bad} is outside the vocabulary (size {})",
                info.vocab_size
            )));
        }
        let wanted = request.params.max_tokens.unwrap_or(1);
        if prompt_len + wanted > info.max_model_len {
            return Err(SubmitError::ContextTooLong {
                prompt_tokens: prompt_len,
                max_tokens: wanted,
                max_model_len: info.max_model_len,
            });
        }
        let waiting = self.stats().num_waiting + self.inner.shared.pending.load(Ordering::SeqCst);
        if waiting >= self.inner.max_waiting {
            return Err(SubmitError::QueueFull { waiting });
        }
        let id = RequestId(self.inner.next_id.fetch_add(1, Ordering::SeqCst));
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        self.inner.shared.pending.fetch_add(1, Ordering::SeqCst);
        if !self.inner.send(Command::Submit { id, request: Box::new(request), tx }) {
            self.inner.shared.pending.fetch_sub(1, Ordering::SeqCst);
            return Err(SubmitError::Unavailable("the engine thread has stopped".into()));
        }
        let sink: Arc<dyn AbortSink> = self.inner.clone();
        Ok(OutputStream::new(id, rx, sink))
    }

    fn abort(&self, id: RequestId) {
        self.inner.send(Command::Abort(id));
    }

    fn info(&self) -> EngineInfo {
        self.inner.info.clone()
    }

    fn stats(&self) -> EngineStats {
        self.inner.shared.stats.lock().map(|s| *s).unwrap_or_default()
    }

    fn is_healthy(&self) -> bool {
        self.inner.shared.healthy.load(Ordering::SeqCst)
    }
}
