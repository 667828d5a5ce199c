//! The bottom layer of every launcher: the checks it makes before a launch, the grid it
//! launches, the argument list it passes and the launch itself (in the spirit of cudarc's
//! `result` layer: small functions over plain values, no state).
//!
//! Owns: the size checks ([`shape_check`], [`need`], [`int`]), the grid helpers ([`cfg()`],
//! [`grid_for`], [`per_row`], [`grid_stride`]), the argument builder [`Args`] and
//! [`Args::launch`].
//!
//! Invariants:
//! - a launcher makes every check *before* it enqueues anything, so a refused call leaves the
//!   stream as it was and returns [`CudaError::Shape`] naming the op;
//! - every size a kernel receives as an `int` went through [`int`] (or [`Args::int`]): a value
//!   that does not fit 32 bits is refused, never truncated;
//! - [`Args::launch`] is `unsafe`: its caller vouches that every element the kernel touches is
//!   inside the slices it passed and that index data (token ids, rows, block ids, slots) was
//!   validated on the host. Nothing in this module knows a kernel.

use super::{CudaDevice, CudaError};
use cudarc::driver::{CudaFunction, CudaSlice, DevicePtr, LaunchConfig, sys};
use half::bf16;

/// Threads per CTA of the one-CTA-per-row and grid-stride kernels.
pub(crate) const THREADS: u32 = 256;

/// Most CTAs along the grid's y and z axes (x takes 2^31 - 1).
pub(crate) const MAX_GRID_YZ: usize = 65_535;

/// `Ok` when `ok`, else a [`CudaError::Shape`] of `op` with the message (built only then).
pub(crate) fn shape_check(op: &'static str, ok: bool, message: impl FnOnce() -> String) -> Result<(), CudaError> {
    if ok { Ok(()) } else { Err(shape_error(op, message())) }
}

/// A [`CudaError::Shape`] of `op`.
pub(crate) fn shape_error(op: &'static str, message: impl Into<String>) -> CudaError {
    CudaError::Shape { op, message: message.into() }
}

/// `v` as the kernels' 32-bit `int`; refused when it does not fit.
pub(crate) fn int(op: &'static str, v: usize) -> Result<i32, CudaError> {
    i32::try_from(v).map_err(|_| shape_error(op, format!("{v} does not fit a 32-bit index")))
}

/// Refuses a slice shorter than the `n` elements the launch touches (`what` names it).
/// Slices may be longer: buffers grow and are reused.
pub(crate) fn need<T>(op: &'static str, what: &str, s: &CudaSlice<T>, n: usize) -> Result<(), CudaError> {
    shape_check(op, s.len() >= n, || format!("{what} has {} elements, needs {n}", s.len()))
}

/// A launch shape of `grid` CTAs of `block` threads (x only), no dynamic shared memory.
pub(crate) fn cfg(grid: (u32, u32, u32), block: u32) -> LaunchConfig {
    LaunchConfig { grid_dim: grid, block_dim: (block, 1, 1), shared_mem_bytes: 0 }
}

/// CTAs of [`THREADS`] for a grid-stride loop over `total` elements: one per `THREADS`
/// elements, at least 1, at most 65,535 (enough to fill any current GPU several times over;
/// the kernel's loop covers the rest).
pub(crate) fn grid_for(total: usize) -> u32 {
    total.div_ceil(THREADS as usize).clamp(1, MAX_GRID_YZ) as u32
}

/// The launch of a grid-stride kernel over `total` elements.
pub(crate) fn grid_stride(total: usize) -> LaunchConfig {
    cfg((grid_for(total), 1, 1), THREADS)
}

/// One CTA of `block` threads per row.
pub(crate) fn per_row(op: &'static str, rows: usize, block: u32) -> Result<LaunchConfig, CudaError> {
    Ok(cfg((int(op, rows)? as u32, 1, 1), block))
}

/// Threads for one CTA per row of `dim` elements, `per_thread` each: a multiple of 32
/// between 32 and 1,024 (rows wider than 1,024 · `per_thread` loop inside the kernel).
pub(crate) fn row_threads(dim: usize, per_thread: usize) -> u32 {
    (dim.div_ceil(per_thread.max(1)).next_multiple_of(32)).clamp(32, 1024) as u32
}

/// An element type a kernel takes slices of.
pub(crate) trait Elem: Sized {
    /// The slice as a kernel argument.
    fn arg(s: &CudaSlice<Self>) -> Arg<'_>;
}

macro_rules! elem {
    ($($t:ty => $v:ident),* $(,)?) => {$(
        impl Elem for $t {
            fn arg(s: &CudaSlice<Self>) -> Arg<'_> {
                Arg::$v(s)
            }
        }
    )*};
}

elem!(bf16 => Bf16s, f32 => F32s, f64 => F64s, i32 => I32s, i64 => I64s, u32 => U32s, u8 => U8s);

/// One kernel argument: a device slice by reference (its device pointer is passed), or a
/// scalar by value.
pub(crate) enum Arg<'a> {
    Bf16s(&'a CudaSlice<bf16>),
    F32s(&'a CudaSlice<f32>),
    F64s(&'a CudaSlice<f64>),
    I32s(&'a CudaSlice<i32>),
    I64s(&'a CudaSlice<i64>),
    U32s(&'a CudaSlice<u32>),
    U8s(&'a CudaSlice<u8>),
    I32(i32),
    U32(u32),
    I64(i64),
    U64(u64),
    F32(f32),
}

/// A kernel's argument list, in the kernel's parameter order, built before the launch, and the
/// launch's own attributes ([`Args::carveout`]).
///
/// The scalars live here until [`Args::launch`] returns (the driver copies the parameters at
/// launch), so a launcher never keeps locals alive for them. Conversions that can fail
/// ([`Args::int`], [`Args::long`]) name the op given to [`Args::new`].
pub(crate) struct Args<'a> {
    op: &'static str,
    list: Vec<Arg<'a>>,
    carveout: Option<u32>,
}

impl<'a> Args<'a> {
    /// An empty list for `op`.
    pub fn new(op: &'static str) -> Self {
        Self { op, list: Vec::with_capacity(16), carveout: None }
    }

    /// This launch's preferred shared-memory carve-out, in percent of the SM's largest (the
    /// launch attribute, over the function's own `PREFERRED_SHARED_MEMORY_CARVEOUT`). An SM
    /// changes its L1/shared split only once it has drained, so a kernel whose carve-out
    /// differs from its neighbours' cannot overlap them (programmatic dependent launch).
    pub fn carveout(mut self, percent: u32) -> Self {
        self.carveout = Some(percent.min(100));
        self
    }

    /// A device slice (the kernel may read or write it: event tracking is off, see
    /// `CudaDevice::open`, so a shared reference passes the same pointer as a unique one).
    pub fn buf<T: Elem>(mut self, s: &'a CudaSlice<T>) -> Self {
        self.list.push(T::arg(s));
        self
    }

    /// A size or index as the kernel's `int`, refused when it does not fit.
    pub fn int(mut self, v: usize) -> Result<Self, CudaError> {
        self.list.push(Arg::I32(int(self.op, v)?));
        Ok(self)
    }

    /// A size as the kernel's `long long`, refused when it does not fit.
    pub fn long(mut self, v: usize) -> Result<Self, CudaError> {
        let v = i64::try_from(v).map_err(|_| shape_error(self.op, format!("{v} does not fit 64 bits")))?;
        self.list.push(Arg::I64(v));
        Ok(self)
    }

    /// An `int` as is.
    pub fn i32(mut self, v: i32) -> Self {
        self.list.push(Arg::I32(v));
        self
    }

    /// An `unsigned int`.
    pub fn u32(mut self, v: u32) -> Self {
        self.list.push(Arg::U32(v));
        self
    }

    /// An `unsigned long long`.
    pub fn u64(mut self, v: u64) -> Self {
        self.list.push(Arg::U64(v));
        self
    }

    /// A `float`.
    pub fn f32(mut self, v: f32) -> Self {
        self.list.push(Arg::F32(v));
        self
    }

    /// Arguments so far.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.list.len()
    }

    /// Enqueues `func` with these arguments on the device's stream; a driver failure is
    /// returned, not panicked on. On a device with programmatic dependent launch on
    /// ([`CudaDevice::pdl`]) the launch carries the programmatic-serialization attribute: the
    /// kernel may start while the one before it finishes, and waits for it with
    /// `griddepcontrol.wait` (every kernel's `PDL_ENTER`, see the prelude).
    ///
    /// # Safety
    ///
    /// The caller checked, for the kernel `func` is, that every element it reads or writes
    /// lies inside the slices given (at the launch shape `cfg`), that the list matches its
    /// parameters in order and type, and that any index data it follows (token ids, rows,
    /// block ids, slots) was validated on the host.
    pub unsafe fn launch(self, dev: &CudaDevice, func: &CudaFunction, cfg: LaunchConfig) -> Result<(), CudaError> {
        let stream = dev.stream();
        stream.context().bind_to_thread()?;
        // Each parameter's value in an 8-byte slot (the driver reads the parameter's size from
        // the slot's address: little-endian, so narrower values sit at its start).
        let mut slots: Vec<u64> = self
            .list
            .iter()
            .map(|a| match a {
                Arg::Bf16s(s) => s.device_ptr(stream).0,
                Arg::F32s(s) => s.device_ptr(stream).0,
                Arg::F64s(s) => s.device_ptr(stream).0,
                Arg::I32s(s) => s.device_ptr(stream).0,
                Arg::I64s(s) => s.device_ptr(stream).0,
                Arg::U32s(s) => s.device_ptr(stream).0,
                Arg::U8s(s) => s.device_ptr(stream).0,
                Arg::I32(v) => u64::from(*v as u32),
                Arg::U32(v) => u64::from(*v),
                Arg::I64(v) => *v as u64,
                Arg::U64(v) => *v,
                Arg::F32(v) => u64::from(v.to_bits()),
            })
            .collect();
        let mut params: Vec<*mut std::ffi::c_void> =
            slots.iter_mut().map(|v| (v as *mut u64).cast::<std::ffi::c_void>()).collect();
        let pdl = sys::CUlaunchAttribute {
            id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
            pad: [0; 4],
            value: sys::CUlaunchAttributeValue { programmaticStreamSerializationAllowed: 1 },
        };
        let carveout = self.carveout.or(dev.carveout_pins().others).map(|percent| sys::CUlaunchAttribute {
            id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
            pad: [0; 4],
            value: sys::CUlaunchAttributeValue { sharedMemCarveout: percent },
        });
        let mut attrs = [pdl; 2];
        let mut n_attrs = usize::from(dev.pdl());
        if let Some(c) = carveout {
            attrs[n_attrs] = c;
            n_attrs += 1;
        }
        let config = sys::CUlaunchConfig {
            gridDimX: cfg.grid_dim.0,
            gridDimY: cfg.grid_dim.1,
            gridDimZ: cfg.grid_dim.2,
            blockDimX: cfg.block_dim.0,
            blockDimY: cfg.block_dim.1,
            blockDimZ: cfg.block_dim.2,
            sharedMemBytes: cfg.shared_mem_bytes,
            hStream: stream.cu_stream(),
            attrs: attrs.as_mut_ptr(),
            numAttrs: n_attrs as u32,
        };
        // SAFETY: the caller's contract above; `params` points at `slots`, which outlive the
        // call (the driver copies the parameters at launch), and `attrs` outlives it too.
        unsafe {
            sys::cuLaunchKernelEx(&config, func.cu_function(), params.as_mut_ptr(), std::ptr::null_mut()).result()
        }?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_that_do_not_fit_are_refused_with_the_op() {
        assert_eq!(int("op", 7).ok(), Some(7));
        assert_eq!(int("op", i32::MAX as usize).ok(), Some(i32::MAX));
        match int("rms_norm", i32::MAX as usize + 1) {
            Err(CudaError::Shape { op, message }) => {
                assert_eq!(op, "rms_norm");
                assert!(message.contains("2147483648"), "{message}");
            }
            other => panic!("{other:?}"),
        }
        let args = Args::new("silu_mul").i32(1).f32(0.5).u32(3);
        assert_eq!(args.len(), 3);
        match args.int(1usize << 40) {
            Err(CudaError::Shape { op, .. }) => assert_eq!(op, "silu_mul"),
            Err(e) => panic!("{e}"),
            Ok(_) => panic!("2^40 accepted as an int"),
        }
        assert_eq!(Args::new("x").long(1usize << 40).map(|a| a.len()).ok(), Some(1));
        assert!(shape_check("x", true, || unreachable!("built only on refusal")).is_ok());
        assert!(matches!(shape_check("x", false, || "bad".into()), Err(CudaError::Shape { op: "x", .. })));
    }

    #[test]
    fn grids_cover_their_work() {
        assert_eq!(grid_for(0), 1, "an empty launch still has a CTA (callers skip it first)");
        assert_eq!(grid_for(1), 1);
        assert_eq!(grid_for(THREADS as usize), 1);
        assert_eq!(grid_for(THREADS as usize + 1), 2);
        assert_eq!(grid_for(usize::MAX / 2), MAX_GRID_YZ as u32, "the grid-stride loop covers the rest");
        let c = grid_stride(10 * THREADS as usize);
        assert_eq!((c.grid_dim, c.block_dim, c.shared_mem_bytes), ((10, 1, 1), (THREADS, 1, 1), 0));
        let r = per_row("rows", 257, 128).expect("rows");
        assert_eq!((r.grid_dim, r.block_dim), ((257, 1, 1), (128, 1, 1)));
        assert!(per_row("rows", 1 << 33, 128).is_err());
    }
}
