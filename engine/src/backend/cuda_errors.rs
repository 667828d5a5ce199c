//! How CUDA failures become backend errors: shape refusals as [`BackendError::Kernel`], the
//! driver errors that poison the context as [`BackendError::DeviceLost`] (the engine then
//! stops the worker instead of failing one request after another), the rest as
//! [`BackendError::Device`].

use super::super::BackendError;
use baton_kernels::cpu::KernelError;
use baton_kernels::cuda::CudaError;

impl From<CudaError> for BackendError {
    fn from(e: CudaError) -> Self {
        match e {
            CudaError::Shape { op, message } => BackendError::Kernel(KernelError { op, message }),
            CudaError::Driver(d) => driver_error(d),
            other => BackendError::Device(other.to_string()),
        }
    }
}

/// A driver error as a backend error: [`BackendError::DeviceLost`] for the errors that leave
/// the context unusable ([`is_sticky`]), [`BackendError::Device`] for the others.
pub fn driver_error(e: cudarc::driver::DriverError) -> BackendError {
    if is_sticky(e.0) { BackendError::DeviceLost(e.to_string()) } else { BackendError::Device(e.to_string()) }
}

/// CUDA errors after which the context is corrupt and every later call fails ("the process
/// must be terminated and relaunched", as the CUDA documentation puts it for these codes),
/// plus a context that is gone. Out of memory, invalid values and the like are not sticky.
pub fn is_sticky(code: cudarc::driver::sys::CUresult) -> bool {
    use cudarc::driver::sys::CUresult as R;
    matches!(
        code,
        R::CUDA_ERROR_ILLEGAL_ADDRESS
            | R::CUDA_ERROR_LAUNCH_FAILED
            | R::CUDA_ERROR_LAUNCH_TIMEOUT
            | R::CUDA_ERROR_HARDWARE_STACK_ERROR
            | R::CUDA_ERROR_ILLEGAL_INSTRUCTION
            | R::CUDA_ERROR_MISALIGNED_ADDRESS
            | R::CUDA_ERROR_INVALID_ADDRESS_SPACE
            | R::CUDA_ERROR_INVALID_PC
            | R::CUDA_ERROR_ASSERT
            | R::CUDA_ERROR_ECC_UNCORRECTABLE
            | R::CUDA_ERROR_CONTEXT_IS_DESTROYED
            | R::CUDA_ERROR_DEINITIALIZED
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_context_poisoning_driver_errors_are_fatal() {
        // Formatting a driver error needs the driver, so this checks the rule itself.
        use cudarc::driver::sys::CUresult as R;
        for code in [R::CUDA_ERROR_ILLEGAL_ADDRESS, R::CUDA_ERROR_LAUNCH_FAILED, R::CUDA_ERROR_ECC_UNCORRECTABLE] {
            assert!(is_sticky(code), "{code:?}");
        }
        for code in [R::CUDA_ERROR_OUT_OF_MEMORY, R::CUDA_ERROR_INVALID_VALUE, R::CUDA_ERROR_NOT_READY] {
            assert!(!is_sticky(code), "{code:?}");
        }
        let shape: BackendError = CudaError::Shape { op: "gemm", message: "m".into() }.into();
        assert!(!shape.is_fatal());
        assert!(BackendError::DeviceLost("illegal address".into()).is_fatal());
        assert!(!BackendError::Device("out of memory".into()).is_fatal());
    }
}
