//! [`CudaError`]: every failure of the CUDA layer, from the driver, NVRTC, cuBLAS, the kernel
//! cache or a launcher's own checks.
//!
//! Invariant: a launcher that refuses its arguments returns [`CudaError::Shape`] naming the op
//! and the inconsistency, before anything is enqueued; the engine maps it to a kernel error
//! (a bug in the caller), every other variant to a device error.

use std::path::PathBuf;

/// A CUDA failure, from the driver, NVRTC, cuBLAS, the kernel cache or a launcher's checks.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// The driver library (libcuda) could not be loaded: no NVIDIA driver on this machine.
    #[error("the CUDA driver library is not present on this machine")]
    NoDriver,
    /// A CUDA library the backend needs (NVRTC, cuBLAS) could not be loaded.
    #[error("the CUDA library {0} could not be loaded (set LD_LIBRARY_PATH to the toolkit's lib64)")]
    MissingLibrary(&'static str),
    /// A driver call failed (out of memory, launch failure, illegal address...).
    #[error("CUDA driver: {0}")]
    Driver(#[from] cudarc::driver::DriverError),
    /// NVRTC refused the kernel sources.
    #[error("NVRTC: {0}")]
    Compile(String),
    /// cuBLAS failed.
    #[error("cuBLAS: {0}")]
    Blas(#[from] cudarc::cublas::result::CublasError),
    /// cuBLASLt failed, or has no algorithm for a shape.
    #[error("cuBLASLt: {0}")]
    BlasLt(String),
    /// The on-disk kernel cache could not be used.
    #[error("kernel cache {path}: {message}")]
    Cache {
        /// The cache file or directory.
        path: PathBuf,
        /// What went wrong.
        message: String,
    },
    /// A call that must not happen while a CUDA graph is being recorded, or a failed recording.
    #[error("CUDA graph: {0}")]
    Capture(String),
    /// A kernel whose module the device did not load ([`KernelNeeds`](super::KernelNeeds):
    /// it was opened for a model that does not run it).
    #[error("kernel module {module} is not loaded on this device (it was opened without {what})")]
    NotLoaded {
        /// The module's name.
        module: String,
        /// What the device was opened without, e.g. "experts".
        what: &'static str,
    },
    /// A launcher was given inconsistent sizes (a bug in the caller).
    #[error("{op}: {message}")]
    Shape {
        /// The op that refused its arguments.
        op: &'static str,
        /// What was inconsistent.
        message: String,
    },
}
