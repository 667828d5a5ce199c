//! The gRPC backend against an in-test Baton `Generate` service with known
//! delays: timings, exact token counts from chunks and `Complete`, and
//! in-stream errors counted as failures.

mod common;

use std::pin::Pin;
use std::time::Duration;

use baton_loadtest::{BackendKind, DatasetConfig, RunConfig, run};
use baton_proto::v1::baton_server::{Baton, BatonServer};
use baton_proto::v1::generate_request::Input;
use baton_proto::v1::generate_response::Response;
use baton_proto::v1::*;
use futures::Stream;
use tonic::{Request, Status};

const TTFT_MS: u64 = 40;
const ITL_MS: u64 = 20;

struct Scripted;

type GenStream = Pin<Box<dyn Stream<Item = Result<GenerateResponse, Status>> + Send>>;

fn message(response: Response) -> GenerateResponse {
    GenerateResponse { request_id: "r".into(), response: Some(response) }
}

#[tonic::async_trait]
impl Baton for Scripted {
    type GenerateStream = GenStream;

    async fn generate(&self, request: Request<GenerateRequest>) -> Result<tonic::Response<GenStream>, Status> {
        let arrived = tokio::time::Instant::now();
        let req = request.into_inner();
        let prompt = match req.input {
            Some(Input::Text(t)) => t,
            _ => return Err(Status::invalid_argument("text input expected")),
        };
        let sampling = req.sampling.unwrap_or_default();
        let n = sampling.max_tokens.unwrap_or(4);
        if !sampling.ignore_eos || sampling.min_tokens != Some(n) {
            return Err(Status::invalid_argument("ignore_eos and min_tokens expected"));
        }
        let fail = prompt.contains("w3");
        let mut items: Vec<(Option<tokio::time::Instant>, GenerateResponse)> = Vec::new();
        // An empty chunk first: it carries nothing and must not be timed.
        items.push((None, message(Response::Chunk(Chunk::default()))));
        for k in 0..n {
            let due = arrived + Duration::from_millis(TTFT_MS + u64::from(k) * ITL_MS);
            let chunk = Chunk {
                index: 0,
                token_ids: vec![k + 100],
                text: format!(" t{k}"),
                logprobs: vec![],
                prompt_logprobs: vec![],
            };
            items.push((Some(due), message(Response::Chunk(chunk))));
        }
        let last = if fail {
            Response::Error(Error {
                code: "INTERNAL".into(),
                message: "scripted gRPC failure".into(),
                param: String::new(),
            })
        } else {
            Response::Complete(Complete {
                index: 0,
                finish_reason: "length".into(),
                prompt_tokens: 5,
                completion_tokens: n,
                cached_tokens: 0,
            })
        };
        items.push((None, message(last)));
        let stream = futures::stream::unfold(items.into_iter(), |mut it| async move {
            let (due, msg) = it.next()?;
            if let Some(due) = due {
                tokio::time::sleep_until(due).await;
            }
            Some((Ok(msg), it))
        });
        Ok(tonic::Response::new(Box::pin(stream)))
    }

    async fn abort(&self, _: Request<AbortRequest>) -> Result<tonic::Response<AbortResponse>, Status> {
        Err(Status::unimplemented("abort"))
    }

    async fn health(&self, _: Request<HealthRequest>) -> Result<tonic::Response<HealthResponse>, Status> {
        Ok(tonic::Response::new(HealthResponse { healthy: true, message: String::new() }))
    }

    async fn model_info(&self, _: Request<ModelInfoRequest>) -> Result<tonic::Response<ModelInfoResponse>, Status> {
        Err(Status::unimplemented("model_info"))
    }

    async fn loads(&self, _: Request<LoadsRequest>) -> Result<tonic::Response<LoadsResponse>, Status> {
        Err(Status::unimplemented("loads"))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_backend_measures_and_counts_failures() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let server = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(BatonServer::new(Scripted))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    let dir = tempfile::tempdir().expect("tempdir");
    // Prompts are "w1 w2 wI": only prompt 3 contains "w3" and fails.
    let mut cfg = RunConfig::new(
        BackendKind::Grpc,
        format!("http://{addr}"),
        DatasetConfig::Prompts { path: common::prompts_file(&dir, 8), output_len: 6 },
    );
    cfg.num_prompts = 8;
    cfg.max_concurrency = Some(4);
    let result = run(&cfg).await.expect("run completes");
    server.abort();
    let s = &result.summary;
    assert_eq!((s.completed, s.failed), (7, 1), "errors: {:?}", s.errors);
    assert_eq!(s.errors[0].error, "server error: INTERNAL: scripted gRPC failure");
    assert_eq!(s.total_output_tokens, 42);
    assert_eq!(s.total_input_tokens, 35);
    assert_eq!(s.estimated_output_requests, 0);
    let ttft = TTFT_MS as f64;
    let itl = ITL_MS as f64;
    assert!((ttft..=ttft + 20.0).contains(&s.ttft_ms.median), "TTFT {:?}", s.ttft_ms);
    assert!((itl - 4.0..=itl + 5.0).contains(&s.tpot_ms.mean), "TPOT {:?}", s.tpot_ms);
    assert_eq!(s.itl_ms.count, 7 * 5);
}
