//! Baton's gRPC `Generate` server stream.
//!
//! The stream is zero or more `Chunk`s then exactly one `Complete` or `Error`
//! (see `proto/baton.proto`). A chunk with token ids or text is a content
//! chunk and its token ids are counted exactly; `Complete.completion_tokens`
//! is the authoritative output length. A stream that ends without `Complete`
//! is a failed request.

use baton_proto::v1::baton_client::BatonClient;
use baton_proto::v1::generate_request::Input;
use baton_proto::v1::generate_response::Response;
use baton_proto::v1::{GenerateRequest, SamplingParams};
use tonic::transport::Channel;

use super::RequestError;
use crate::config::RunConfig;
use crate::dataset::RequestSpec;
use crate::error::LoadtestError;
use crate::record::{Stopwatch, Usage};

/// A client of one Baton gRPC endpoint; clones share one HTTP/2 connection.
#[derive(Clone)]
pub struct GrpcBackend {
    client: BatonClient<Channel>,
    ignore_eos: bool,
    temperature: f32,
}

impl GrpcBackend {
    /// Connects to `config.base_url`.
    pub async fn connect(config: &RunConfig) -> Result<Self, LoadtestError> {
        let client = BatonClient::connect(config.base_url.clone())
            .await
            .map_err(|e| LoadtestError::Server(format!("gRPC connect {}: {e}", config.base_url)))?;
        Ok(Self { client, ignore_eos: config.ignore_eos, temperature: config.temperature as f32 })
    }

    fn request(&self, spec: &RequestSpec) -> GenerateRequest {
        let max_tokens = u32::try_from(spec.output_tokens).unwrap_or(u32::MAX);
        GenerateRequest {
            request_id: String::new(),
            input: Some(Input::Text(spec.prompt.clone())),
            sampling: Some(SamplingParams {
                temperature: Some(self.temperature),
                max_tokens: Some(max_tokens),
                min_tokens: self.ignore_eos.then_some(max_tokens),
                ignore_eos: self.ignore_eos,
                ..SamplingParams::default()
            }),
            add_special_tokens: None,
        }
    }

    /// Sends one request and reports its stream to `watch`.
    pub async fn send(&self, spec: &RequestSpec, watch: &mut Stopwatch) -> Result<(), RequestError> {
        let mut client = self.client.clone();
        let mut stream = client.generate(self.request(spec)).await.map_err(|s| status_error(&s))?.into_inner();
        while let Some(msg) = stream.message().await.map_err(|s| status_error(&s))? {
            match msg.response {
                Some(Response::Chunk(chunk)) if !chunk.token_ids.is_empty() || !chunk.text.is_empty() => {
                    watch.content(&chunk.text, Some(chunk.token_ids.len()));
                }
                Some(Response::Complete(done)) => {
                    watch.usage(Usage {
                        prompt_tokens: Some(u64::from(done.prompt_tokens)),
                        completion_tokens: u64::from(done.completion_tokens),
                    });
                    return Ok(());
                }
                Some(Response::Error(err)) => {
                    return Err(RequestError::Server(format!("{}: {}", err.code, err.message)));
                }
                // Empty chunks carry nothing to time.
                Some(Response::Chunk(_)) | None => {}
            }
        }
        Err(RequestError::Stream("gRPC stream ended without Complete".into()))
    }
}

fn status_error(status: &tonic::Status) -> RequestError {
    match status.code() {
        tonic::Code::Unavailable | tonic::Code::Unknown => {
            RequestError::Transport(format!("{:?}: {}", status.code(), status.message()))
        }
        code => RequestError::Server(format!("{code:?}: {}", status.message())),
    }
}
