//! Generates the tonic/prost code with the vendored protoc, so no system protoc is needed.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    // SAFETY: build scripts are single-threaded; nothing else reads the environment concurrently.
    unsafe { std::env::set_var("PROTOC", protoc) };
    println!("cargo:rerun-if-changed=proto/baton.proto");
    println!("cargo:rerun-if-changed=proto/worker.proto");
    tonic_prost_build::configure().compile_protos(&["proto/baton.proto", "proto/worker.proto"], &["proto"])?;
    Ok(())
}
