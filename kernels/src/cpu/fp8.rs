//! FP8 E4M3 ("e4m3fn", OCP FP8) conversions: the storage format of an FP8 KV cache.
//!
//! E4M3 has 1 sign bit, 4 exponent bits (bias 7) and 3 mantissa bits; no infinities, one
//! NaN pattern per sign (`S.1111.111`), largest finite ±448, smallest subnormal 2⁻⁹.
//!
//! Invariants (what the CUDA kernels do with `__nv_cvt_float_to_fp8(x, __NV_SATFINITE,
//! __NV_E4M3)`, i.e. `cvt.rn.satfinite.e4m3x2.f32`, as vLLM's FP8 KV cache uses it):
//! - round to nearest, ties to even;
//! - anything of magnitude above 448 (±inf included) saturates to ±448;
//! - NaN (either sign) becomes the canonical `0x7F`;
//! - magnitudes at or below 2⁻¹⁰ become a zero of the input's sign.
//!
//! A cache value `x` is stored as `e4m3(x / scale)` and read back as `f32(code) × scale`
//! ([`quantize_e4m3`], [`e4m3_to_f32`]), the scale being one f32 per layer and per K/V.
//! No crate on this machine provides the conversion (the `float8` crate is not vendored),
//! hence this small, exhaustively tested one.

/// The largest finite E4M3 value.
pub const E4M3_MAX: f32 = 448.0;

/// The canonical E4M3 NaN code.
pub const E4M3_NAN: u8 = 0x7F;

/// Every code's value, by code.
static DECODE: [f32; 256] = decode_table();

const fn decode_code(code: u8) -> f32 {
    let sign = if code & 0x80 != 0 { -1.0f32 } else { 1.0f32 };
    let exp = ((code >> 3) & 0xF) as u32;
    let man = (code & 0x7) as u32;
    if exp == 0xF && man == 0x7 {
        return f32::NAN;
    }
    let magnitude = if exp == 0 {
        // Subnormal: man × 2⁻⁹ (exact in f32).
        man as f32 / 512.0
    } else {
        // 2^(exp-7) × 1.man: the f32 with that exponent and mantissa.
        f32::from_bits(((exp + 127 - 7) << 23) | (man << 20))
    };
    sign * magnitude
}

const fn decode_table() -> [f32; 256] {
    let mut t = [0.0f32; 256];
    let mut i = 0;
    while i < 256 {
        t[i] = decode_code(i as u8);
        i += 1;
    }
    t
}

/// The value of an E4M3 code (NaN for `0x7F` and `0xFF`).
#[inline]
pub fn e4m3_to_f32(code: u8) -> f32 {
    DECODE[code as usize]
}

/// The E4M3 code nearest `x` (ties to even), saturating to ±448, NaN to `0x7F` (see the
/// module doc).
#[inline]
pub fn e4m3_from_f32(x: f32) -> u8 {
    let bits = x.to_bits();
    let sign = ((bits >> 24) & 0x80) as u8;
    let abs = bits & 0x7FFF_FFFF;
    if abs > 0x7F80_0000 {
        return E4M3_NAN;
    }
    // 464 is the midpoint between 448 and the next (absent) step, 480; at it the tie goes to
    // 448's even mantissa, above it everything saturates: either way 448.
    if abs >= 464.0f32.to_bits() {
        return sign | 0x7E;
    }
    let exp = (abs >> 23) as i32 - 127;
    if exp >= -6 {
        // Normal: keep 3 of the 23 mantissa bits, rounding the 20 dropped ones to nearest even.
        // A carry out of the mantissa correctly bumps the exponent field.
        let man = abs & 0x7F_FFFF;
        let mut code = (((exp + 7) as u32) << 3) | (man >> 20);
        let rest = man & 0xF_FFFF;
        let half = 0x8_0000;
        if rest > half || (rest == half && code & 1 == 1) {
            code += 1;
        }
        sign | code as u8
    } else {
        // Subnormal (or zero): the code is |x| / 2⁻⁹ rounded to an integer, ties to even. The
        // scaling is exact (a power of two that only grows the value); 8 rounds up into the
        // smallest normal, whose code is 0x08 too.
        let steps = (f32::from_bits(abs) * 512.0).round_ties_even() as u8;
        sign | steps
    }
}

/// `dst[i] = e4m3(src[i] / scale)`: how a value is written into an FP8 cache with the
/// per-tensor `scale` (vLLM's `scaled_convert`: the value is divided by the scale).
pub fn quantize_e4m3(src: &[f32], scale: f32, dst: &mut [u8]) {
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = e4m3_from_f32(s / scale);
    }
}

/// `dst[i] = f32(src[i]) × scale`: how a value is read from an FP8 cache.
pub fn dequantize_e4m3(src: &[u8], scale: f32, dst: &mut [f32]) {
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = e4m3_to_f32(s) * scale;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng, rngs::StdRng};

    /// `__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3)` as `cuda_fp8.hpp` (CUDA 13)
    /// implements it on the host: the float is widened to double and rounded there, with the
    /// header's constants. Ported line by line, independently of [`e4m3_from_f32`].
    fn nv_cvt_float_to_e4m3_satfinite(x: f32) -> u8 {
        let mut xb = x.to_bits();
        if xb & 0x7FFF_FFFF > 0x7F80_0000 {
            xb = 0x7FFF_FFFF; // canonical NaN
        }
        let xbits = f64::from(f32::from_bits(xb)).to_bits();
        const DP_INF_BITS: u64 = 0x7FF0_0000_0000_0000;
        const EXP_BIAS: u16 = 7;
        const SIG_BITS: u64 = 4;
        const MAN_MASK: u8 = 0x7;
        const MINDENORM_O2: u64 = 0x3F50_0000_0000_0000;
        const OVERFLOW_THRESHOLD: u64 = 0x407D_0000_0000_0000;
        const MAXNORM: u8 = 0x7E;
        const MINNORM: u64 = 0x3F90_0000_0000_0000;
        const HALF_ULP: u64 = 1 << (53 - SIG_BITS - 1);
        let sign = ((xbits >> 63) << 7) as u8;
        let exp = ((((xbits >> 52) as u16) & 0x7FF).wrapping_sub(1023).wrapping_add(EXP_BIAS)) as u8;
        let mut mantissa = (xbits >> (53 - SIG_BITS)) as u8 & MAN_MASK;
        let absx = xbits & 0x7FFF_FFFF_FFFF_FFFF;
        let mut res: u8;
        if absx <= MINDENORM_O2 {
            res = 0;
        } else if absx > DP_INF_BITS {
            res = 0x7F;
        } else if absx > OVERFLOW_THRESHOLD {
            res = MAXNORM;
        } else if absx >= MINNORM {
            res = (exp << (SIG_BITS - 1)) | mantissa;
            let round = xbits & ((HALF_ULP << 1) - 1);
            if round > HALF_ULP || (round == HALF_ULP && mantissa & 1 == 1) {
                res += 1;
            }
        } else {
            let shift = 1u8.wrapping_sub(exp);
            mantissa |= 1 << (SIG_BITS - 1);
            res = mantissa >> shift;
            let round = (xbits | (1u64 << 52)) & ((HALF_ULP << (u64::from(shift) + 1)) - 1);
            if round > (HALF_ULP << shift) || (round == (HALF_ULP << shift) && res & 1 == 1) {
                res += 1;
            }
        }
        res | sign
    }

    #[test]
    fn every_code_decodes_to_the_format_value() {
        // The 256 codes against the format's definition, written out per field.
        for code in 0..=255u8 {
            let s = if code & 0x80 != 0 { -1.0f64 } else { 1.0 };
            let e = i32::from((code >> 3) & 0xF);
            let m = f64::from(code & 7);
            let got = e4m3_to_f32(code);
            if e == 15 && m == 7.0 {
                assert!(got.is_nan(), "code {code:#04x}");
                continue;
            }
            let want = if e == 0 { s * m / 8.0 * 2f64.powi(-6) } else { s * (1.0 + m / 8.0) * 2f64.powi(e - 7) };
            assert_eq!(f64::from(got), want, "code {code:#04x}");
        }
        assert_eq!(e4m3_to_f32(0x7E), E4M3_MAX);
        assert_eq!(e4m3_to_f32(0xFE), -E4M3_MAX);
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9));
        assert_eq!(e4m3_to_f32(0x08), 2f32.powi(-6));
    }

    #[test]
    fn every_finite_code_round_trips() {
        for code in 0..=255u8 {
            if code & 0x7F == 0x7F {
                continue;
            }
            assert_eq!(e4m3_from_f32(e4m3_to_f32(code)), code, "code {code:#04x}");
        }
        assert_eq!(e4m3_from_f32(f32::NAN), E4M3_NAN);
        assert_eq!(e4m3_from_f32(-f32::NAN), E4M3_NAN);
        assert!(e4m3_to_f32(0xFF).is_nan());
    }

    #[test]
    fn saturates_rounds_to_even_and_keeps_the_sign_of_zero() {
        assert_eq!(e4m3_from_f32(448.0), 0x7E);
        assert_eq!(e4m3_from_f32(463.99), 0x7E);
        assert_eq!(e4m3_from_f32(464.0), 0x7E);
        assert_eq!(e4m3_from_f32(1e6), 0x7E);
        assert_eq!(e4m3_from_f32(f32::INFINITY), 0x7E);
        assert_eq!(e4m3_from_f32(f32::NEG_INFINITY), 0xFE);
        assert_eq!(e4m3_from_f32(f32::MAX), 0x7E);
        // 1.0625 is halfway between 1.0 (even mantissa 000) and 1.125 (001): to 1.0.
        assert_eq!(e4m3_to_f32(e4m3_from_f32(1.0625)), 1.0);
        // 1.1875 is halfway between 1.125 (001) and 1.25 (010): to 1.25.
        assert_eq!(e4m3_to_f32(e4m3_from_f32(1.1875)), 1.25);
        // Subnormal ties: 1.5 × 2⁻⁹ → 2 × 2⁻⁹; 0.5 × 2⁻⁹ → 0.
        assert_eq!(e4m3_from_f32(1.5 / 512.0), 0x02);
        assert_eq!(e4m3_from_f32(0.5 / 512.0), 0x00);
        assert_eq!(e4m3_from_f32(-0.5 / 512.0), 0x80);
        assert_eq!(e4m3_from_f32(-0.0), 0x80);
        assert_eq!(e4m3_from_f32(f32::from_bits(1)), 0x00);
        // The largest subnormal's upper tie rounds into the smallest normal.
        assert_eq!(e4m3_from_f32(7.5 / 512.0), 0x08);
    }

    #[test]
    fn matches_the_cuda_header_on_every_boundary_and_random_floats() {
        // Each code's value, the midpoints to its neighbours, and one f32 ulp either side of
        // each: every place a rounding decision changes.
        let mut xs: Vec<f32> = Vec::new();
        for code in 0..=0x7Eu8 {
            let a = e4m3_to_f32(code);
            let b = if code < 0x7E { e4m3_to_f32(code + 1) } else { 480.0 };
            for x in [a, (a + b) / 2.0] {
                xs.extend([x, f32::from_bits(x.to_bits() + 1), f32::from_bits(x.to_bits().saturating_sub(1))]);
            }
        }
        xs.extend([f32::INFINITY, f32::NAN, f32::MAX, f32::MIN_POSITIVE, 0.0, 1e-30, 2f32.powi(-10)]);
        let negated: Vec<f32> = xs.iter().map(|x| -x).collect();
        xs.extend(negated);
        let mut rng = StdRng::seed_from_u64(8);
        // Random bit patterns (every exponent, NaNs included) and values in the cache's range.
        xs.extend((0..2_000_000).map(|_| f32::from_bits(rng.random())));
        xs.extend((0..2_000_000).map(|_| rng.random_range(-600.0f32..600.0)));
        xs.extend((0..1_000_000).map(|_| rng.random_range(-0.02f32..0.02)));
        for x in xs {
            assert_eq!(e4m3_from_f32(x), nv_cvt_float_to_e4m3_satfinite(x), "x = {x:e} ({:#010x})", x.to_bits());
        }
    }

    #[test]
    fn quantize_divides_by_the_scale_and_dequantize_multiplies() {
        let src = [0.0f32, 1.0, -3.0, 900.0, 0.3];
        let mut codes = [0u8; 5];
        quantize_e4m3(&src, 2.0, &mut codes);
        assert_eq!(codes, [0x00, e4m3_from_f32(0.5), e4m3_from_f32(-1.5), 0x7E, e4m3_from_f32(0.15)]);
        let mut back = [0.0f32; 5];
        dequantize_e4m3(&codes, 2.0, &mut back);
        assert_eq!(back[..3], [0.0, 1.0, -3.0]);
        assert_eq!(back[3], 896.0, "saturated at 448 × scale");
        assert!((back[4] - 0.3).abs() <= 0.3 / 16.0, "within half an e4m3 step: {}", back[4]);
    }
}
