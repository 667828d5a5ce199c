//! `baton client grpc`: a small example client of the public gRPC API. It streams one
//! generation, printing text as it arrives, then a summary per sequence on stderr.

use crate::cli::GrpcClientArgs;
use anyhow::{Context, bail};
use baton_proto::v1::baton_client::BatonClient;
use baton_proto::v1::{ChatInput, ChatMessage, GenerateRequest, SamplingParams, generate_request, generate_response};
use std::io::Write;

/// The request `args` describe.
pub fn request(args: &GrpcClientArgs) -> GenerateRequest {
    let input = if args.chat {
        generate_request::Input::Chat(ChatInput {
            messages: vec![ChatMessage { role: "user".into(), content: args.prompt.clone() }],
            add_generation_prompt: true,
        })
    } else {
        generate_request::Input::Text(args.prompt.clone())
    };
    GenerateRequest {
        request_id: args.request_id.clone(),
        input: Some(input),
        sampling: Some(SamplingParams {
            temperature: Some(args.temperature),
            max_tokens: Some(args.max_tokens),
            seed: args.seed,
            ..Default::default()
        }),
        add_special_tokens: None,
    }
}

/// Runs the client.
pub async fn run(args: GrpcClientArgs) -> anyhow::Result<()> {
    let mut client =
        BatonClient::connect(args.addr.clone()).await.with_context(|| format!("cannot connect to {}", args.addr))?;
    let mut call = tonic::Request::new(request(&args));
    if let Some(key) = &args.api_key {
        let value = format!("Bearer {key}").parse().context("the API key must be printable ASCII")?;
        call.metadata_mut().insert("authorization", value);
    }
    let mut stream = client.generate(call).await.context("Generate failed")?.into_inner();
    let mut stdout = std::io::stdout();
    while let Some(message) = stream.message().await.context("stream failed")? {
        match message.response {
            Some(generate_response::Response::Chunk(chunk)) => {
                write!(stdout, "{}", chunk.text)?;
                stdout.flush()?;
            }
            Some(generate_response::Response::Complete(done)) => {
                writeln!(stdout)?;
                eprintln!(
                    "[{}] sequence {}: finish_reason={} prompt_tokens={} completion_tokens={}",
                    message.request_id, done.index, done.finish_reason, done.prompt_tokens, done.completion_tokens
                );
            }
            Some(generate_response::Response::Error(e)) => bail!("server error {}: {}", e.code, e.message),
            None => {}
        }
    }
    Ok(())
}
