//! The weight ring on a device: stacks of mixed-dtype tensors through a ring small enough that
//! every buffer is reused many times, compared bit for bit with the host conversion.

mod common;

use baton_kernels::cuda::{HostDType, HostTensor, WeightUploader, bf16, fill_bf16};
use half::f16;
use rand::Rng;

#[test]
fn gpu_weight_ring_uploads_stacks_bit_exactly() {
    let dev = common::device();
    let mut r = common::rng("gpu_weight_ring_uploads_stacks_bit_exactly");
    let f32s: Vec<f32> = (0..70_001).map(|_| r.random_range(-4.0f32..4.0)).collect();
    let f16s: Vec<f16> = (0..3_333).map(|_| f16::from_f32(r.random_range(-2.0f32..2.0))).collect();
    let bf16s: Vec<bf16> = (0..123_457).map(|_| bf16::from_f32(r.random_range(-1.0f32..1.0))).collect();
    let a: Vec<u8> = f32s.iter().flat_map(|x| x.to_le_bytes()).collect();
    let b: Vec<u8> = f16s.iter().flat_map(|x| x.to_le_bytes()).collect();
    let c: Vec<u8> = bf16s.iter().flat_map(|x| x.to_le_bytes()).collect();
    let stacks: Vec<Vec<HostTensor<'_>>> = vec![
        vec![HostTensor { bytes: &c, dtype: HostDType::Bf16 }],
        vec![
            HostTensor { bytes: &a, dtype: HostDType::F32 },
            HostTensor { bytes: &b, dtype: HostDType::F16 },
            HostTensor { bytes: &c, dtype: HostDType::Bf16 },
        ],
        vec![HostTensor { bytes: &b, dtype: HostDType::F16 }],
    ];
    // 3 buffers of 10,000 elements: the second stack alone takes 20 chunks.
    let mut up = WeightUploader::new(10_000, 3);
    let mut outs = Vec::new();
    for parts in &stacks {
        let total: usize = parts.iter().map(HostTensor::len).sum();
        let mut dst = dev.alloc::<bf16>(total + 7).expect("alloc");
        let poison = vec![bf16::NAN; total + 7];
        dev.upload_into(&poison, &mut dst).expect("poison");
        up.upload(&dev, parts, &mut dst).expect("upload");
        outs.push((dst, total));
    }
    let stats = up.finish(&dev).expect("finish");
    assert_eq!(stats.bytes_read, (2 * c.len() + a.len() + 2 * b.len()) as u64);
    for (parts, (dst, total)) in stacks.iter().zip(&outs) {
        let mut want = vec![bf16::ZERO; *total];
        fill_bf16(parts, 0, &mut want);
        let got = dev.download(dst, total + 7).expect("download");
        assert!(got[..*total].iter().zip(&want).all(|(g, w)| g.to_bits() == w.to_bits()), "stack differs");
        assert!(got[*total..].iter().all(|g| g.is_nan()), "wrote past the stack");
    }
    // A stack larger than its destination is refused before anything is enqueued.
    let mut small = dev.alloc::<bf16>(10).expect("alloc");
    assert!(up.upload(&dev, &stacks[0], &mut small).is_err());
    // A byte count that is not whole elements is refused.
    assert!(up.upload(&dev, &[HostTensor { bytes: &a[..5], dtype: HostDType::F32 }], &mut small).is_err());
}
